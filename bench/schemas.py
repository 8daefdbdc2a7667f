"""The structured-output workload's schemas: records, tool-call-shaped objects, nested arrays.

Each case is a JSON schema, a chat prompt asking for it, and one valid instance (used to
time grammar engines on a token stream they must accept; bench.grammar_engines). The set
covers required fields, enums, nested objects, arrays (with bounds), numbers (integer,
bounded, float), booleans, nullable fields, string patterns and formats, and anyOf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any  # one instance valid for the schema


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema with every listed property required (unless `required` says)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def _array(items: dict[str, Any], low: int = 0, high: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": low}
    if high is not None:
        schema["maxItems"] = high
    return schema


def _tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call as agents emit it: {"name": <const>, "arguments": {...}}."""
    return _obj({"name": {"const": name}, "arguments": arguments})


CASES: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        _obj({"name": STR, "age": INT, "email": STR}),
        "Give a JSON record for a person named Alice Smith, 34, alice@example.com.",
        {"name": "Alice Smith", "age": 34, "email": "alice@example.com"},
    ),
    SchemaCase(
        "book",
        _obj({"title": STR, "author": STR, "year": INT, "isbn": STR}),
        "Describe the book 'Dune' by Frank Herbert (1965) as JSON, with an ISBN.",
        {"title": "Dune", "author": "Frank Herbert", "year": 1965, "isbn": "978-0441013593"},
    ),
    SchemaCase(
        "product",
        _obj(
            {
                "sku": STR,
                "name": STR,
                "price": {"type": "number", "minimum": 0},
                "in_stock": BOOL,
                "tags": _array(STR, 1, 5),
            }
        ),
        "Write a JSON product entry for a red cotton t-shirt that costs 19.99 dollars.",
        {
            "sku": "TS-RED-M",
            "name": "Red T-shirt",
            "price": 19.99,
            "in_stock": True,
            "tags": ["red"],
        },
    ),
    SchemaCase(
        "weather_tool",
        _tool(
            "get_weather",
            _obj({"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}}),
        ),
        "Call the get_weather tool for Paris in celsius. Answer with the tool call as JSON.",
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    ),
    SchemaCase(
        "search_tool",
        _tool(
            "search",
            _obj(
                {"query": STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
            ),
        ),
        "Call the search tool to find recent papers on speculative decoding, 10 results.",
        {"name": "search", "arguments": {"query": "speculative decoding", "max_results": 10}},
    ),
    SchemaCase(
        "email_tool",
        _tool("send_email", _obj({"to": _array(STR, 1, 3), "subject": STR, "body": STR})),
        "Call send_email to tell bob@example.com that the meeting moved to 3pm.",
        {
            "name": "send_email",
            "arguments": {"to": ["bob@example.com"], "subject": "Meeting", "body": "Now at 3pm."},
        },
    ),
    SchemaCase(
        "calendar_tool",
        _tool(
            "create_event",
            _obj(
                {
                    "title": STR,
                    "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                    "duration_minutes": INT,
                    "attendees": _array(STR, 0, 4),
                }
            ),
        ),
        "Create a calendar event: team lunch on 2025-03-14 for an hour with Ann and Raj.",
        {
            "name": "create_event",
            "arguments": {
                "title": "Team lunch",
                "date": "2025-03-14",
                "duration_minutes": 60,
                "attendees": ["Ann", "Raj"],
            },
        },
    ),
    SchemaCase(
        "sentiment",
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        "Classify the sentiment of 'I loved this movie!' as JSON with a confidence.",
        {"sentiment": "positive", "confidence": 0.95},
    ),
    SchemaCase(
        "address",
        _obj(
            {
                "name": STR,
                "address": _obj(
                    {"street": STR, "city": STR, "zip": STR, "country": STR},
                ),
            }
        ),
        "Give the White House's postal address as JSON.",
        {
            "name": "The White House",
            "address": {
                "street": "1600 Pennsylvania Ave NW",
                "city": "Washington",
                "zip": "20500",
                "country": "USA",
            },
        },
    ),
    SchemaCase(
        "order",
        _obj(
            {
                "order_id": STR,
                "customer": _obj({"name": STR, "vip": BOOL}),
                "items": _array(_obj({"sku": STR, "quantity": INT, "price": NUM}), 1, 4),
                "total": NUM,
            }
        ),
        "Write a JSON order for two coffees at 3.5 each bought by Maria.",
        {
            "order_id": "A100",
            "customer": {"name": "Maria", "vip": False},
            "items": [{"sku": "COFFEE", "quantity": 2, "price": 3.5}],
            "total": 7.0,
        },
    ),
    SchemaCase(
        "matrix",
        _obj({"rows": INT, "cols": INT, "values": _array(_array(INT, 1, 3), 1, 3)}),
        "Give the 2x2 identity matrix as JSON with its rows, cols and values.",
        {"rows": 2, "cols": 2, "values": [[1, 0], [0, 1]]},
    ),
    SchemaCase(
        "team",
        _obj(
            {
                "team": STR,
                "members": _array(
                    _obj({"name": STR, "role": {"enum": ["lead", "engineer", "designer"]}}), 1, 4
                ),
            }
        ),
        "Describe a small software team of three people as JSON.",
        {"team": "Core", "members": [{"name": "Lee", "role": "lead"}]},
    ),
    SchemaCase(
        "recipe",
        _obj(
            {
                "name": STR,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": _array(_obj({"item": STR, "grams": NUM}), 1, 6),
                "steps": _array(STR, 1, 5),
            }
        ),
        "Give a simple pancake recipe as JSON.",
        {
            "name": "Pancakes",
            "servings": 4,
            "ingredients": [{"item": "flour", "grams": 200}],
            "steps": ["Mix.", "Fry."],
        },
    ),
    SchemaCase(
        "point_list",
        _obj({"points": _array(_obj({"x": NUM, "y": NUM}), 2, 4)}),
        "List three points on the line y = 2x as JSON.",
        {"points": [{"x": 0, "y": 0}, {"x": 1, "y": 2}]},
    ),
    SchemaCase(
        "yes_no",
        _obj({"answer": {"enum": ["yes", "no"]}, "reason": STR}),
        "Is the Earth round? Answer as JSON with a short reason.",
        {"answer": "yes", "reason": "It is an oblate spheroid."},
    ),
    SchemaCase(
        "optional_fields",
        _obj(
            {"id": INT, "nickname": STR, "score": NUM, "active": BOOL},
            required=["id", "active"],
        ),
        "Give a JSON user record with id 7 that is active.",
        {"id": 7, "active": True},
    ),
    SchemaCase(
        "nullable",
        _obj({"title": STR, "subtitle": {"type": ["string", "null"]}, "pages": INT}),
        "Describe a report titled 'Q3 results' with 12 pages and no subtitle, as JSON.",
        {"title": "Q3 results", "subtitle": None, "pages": 12},
    ),
    SchemaCase(
        "any_of_shape",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "radius": NUM}),
                        _obj({"kind": {"const": "rect"}, "width": NUM, "height": NUM}),
                    ]
                }
            }
        ),
        "Describe a circle of radius 2 as JSON.",
        {"shape": {"kind": "circle", "radius": 2}},
    ),
    SchemaCase(
        "log_entry",
        _obj(
            {
                "level": {"enum": ["debug", "info", "warning", "error"]},
                "timestamp": {"type": "string", "format": "date-time"},
                "message": STR,
                "code": INT,
            }
        ),
        "Write a JSON log entry for a failed database connection at 2024-05-01T10:00:00Z.",
        {
            "level": "error",
            "timestamp": "2024-05-01T10:00:00Z",
            "message": "db down",
            "code": 503,
        },
    ),
    SchemaCase(
        "config",
        _obj(
            {
                "server": _obj({"host": STR, "port": {"type": "integer", "minimum": 1}}),
                "database": _obj({"url": STR, "pool_size": INT}),
                "debug": BOOL,
            }
        ),
        "Write a JSON config for a web server on localhost:8080 with a Postgres database.",
        {
            "server": {"host": "localhost", "port": 8080},
            "database": {"url": "postgres://db", "pool_size": 5},
            "debug": False,
        },
    ),
    SchemaCase(
        "quiz",
        _obj(
            {
                "question": STR,
                "choices": _array(STR, 2, 4),
                "answer_index": {"type": "integer", "minimum": 0, "maximum": 3},
            }
        ),
        "Write one multiple-choice quiz question about the capital of France as JSON.",
        {"question": "Capital of France?", "choices": ["Paris", "Rome"], "answer_index": 0},
    ),
    SchemaCase(
        "tool_calls",
        _obj(
            {
                "tool_calls": _array(
                    _obj(
                        {
                            "name": {"enum": ["lookup", "calculate"]},
                            "arguments": _obj({"input": STR}),
                        }
                    ),
                    1,
                    3,
                )
            }
        ),
        "Plan tool calls to look up the population of Tokyo and then calculate half of it.",
        {"tool_calls": [{"name": "lookup", "arguments": {"input": "Tokyo population"}}]},
    ),
    SchemaCase(
        "movie_list",
        _obj(
            {
                "movies": _array(
                    _obj(
                        {
                            "title": STR,
                            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                            "genres": _array({"enum": ["drama", "comedy", "action", "sci-fi"]}),
                        }
                    ),
                    1,
                    3,
                )
            }
        ),
        "List two classic science fiction movies as JSON.",
        {"movies": [{"title": "Alien", "year": 1979, "genres": ["sci-fi"]}]},
    ),
    SchemaCase(
        "invoice",
        _obj(
            {
                "invoice_number": STR,
                "currency": {"enum": ["USD", "EUR", "GBP"]},
                "lines": _array(
                    _obj({"description": STR, "amount": NUM, "taxable": BOOL}),
                    1,
                    3,
                ),
                "paid": BOOL,
            }
        ),
        "Write a JSON invoice in EUR for 3 hours of consulting at 100 per hour, unpaid.",
        {
            "invoice_number": "INV-1",
            "currency": "EUR",
            "lines": [{"description": "Consulting", "amount": 300, "taxable": True}],
            "paid": False,
        },
    ),
)
