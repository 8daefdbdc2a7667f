"""Twenty tool-use tasks for bench.tool_loop: a question, the functions offered (one to three,
JSON schemas with required fields, enums, numbers, nested objects and arrays), the result each
function returns, and a follow-up question. Written for the benchmark and never tuned on:
no prompt, schema or flag was changed after seeing a model's answers to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


STRING = {"type": "string"}
WEATHER = _function(
    "get_weather",
    "Current weather in a city",
    {"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    ["city"],
)
CONVERT = _function(
    "convert_currency",
    "Convert an amount between currencies",
    {
        "amount": {"type": "number"},
        "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
        "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
    },
    ["amount", "from", "to"],
)
SEARCH = _function(
    "search_web", "Search the web", {"query": STRING, "max_results": {"type": "integer"}}, ["query"]
)
CALENDAR = _function(
    "create_event",
    "Add an event to the calendar",
    {
        "title": STRING,
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "items": STRING},
    },
    ["title", "date"],
)
EMAIL = _function(
    "send_email",
    "Send an email",
    {"to": STRING, "subject": STRING, "body": STRING},
    ["to", "subject", "body"],
)
CALCULATE = _function(
    "calculate", "Evaluate an arithmetic expression", {"expression": STRING}, ["expression"]
)
STOCK = _function("get_stock_price", "Latest price of a stock", {"symbol": STRING}, ["symbol"])
TRANSLATE = _function(
    "translate",
    "Translate text",
    {"text": STRING, "target_language": STRING},
    ["text", "target_language"],
)
FLIGHTS = _function(
    "find_flights",
    "Find flights between two airports",
    {
        "origin": STRING,
        "destination": STRING,
        "date": STRING,
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    ["origin", "destination", "date"],
)
ORDER = _function(
    "get_order_status", "Status of a customer order", {"order_id": STRING}, ["order_id"]
)
TIMER = _function(
    "set_timer",
    "Set a timer",
    {"minutes": {"type": "integer", "minimum": 1}, "label": STRING},
    ["minutes"],
)
RECIPE = _function(
    "find_recipes",
    "Find recipes by ingredients",
    {"ingredients": {"type": "array", "items": STRING}, "vegetarian": {"type": "boolean"}},
    ["ingredients"],
)
LIGHTS = _function(
    "set_lights",
    "Switch the lights of a room",
    {"room": STRING, "on": {"type": "boolean"}, "brightness": {"type": "integer"}},
    ["room", "on"],
)
DISTANCE = _function(
    "get_distance",
    "Driving distance between two places",
    {"origin": STRING, "destination": STRING},
    ["origin", "destination"],
)


@dataclass(frozen=True)
class ToolTask:
    question: str
    tools: list[dict[str, Any]]
    results: dict[str, str]  # a function's name -> what it returns
    follow_up: str
    system: str = ""
    names: list[str] = field(default_factory=list)


TASKS = [
    ToolTask(
        "What's the weather like in Lisbon right now?",
        [WEATHER],
        {"get_weather": '{"temperature": 19, "unit": "celsius", "sky": "sunny"}'},
        "Should I take an umbrella?",
    ),
    ToolTask(
        "How much is 250 US dollars in euros?",
        [CONVERT, CALCULATE],
        {"convert_currency": '{"result": 231.5, "currency": "EUR"}', "calculate": '{"result": 0}'},
        "And in British pounds?",
    ),
    ToolTask(
        "Find me recent news about the James Webb telescope.",
        [SEARCH],
        {
            "search_web": '[{"title": "Webb spots a distant galaxy", "url": "https://example.org/1"}]'
        },
        "Summarize that in one sentence.",
    ),
    ToolTask(
        "Schedule a team lunch on 2026-12-11 with Ana and Ben.",
        [CALENDAR, EMAIL],
        {"create_event": '{"status": "created", "id": "ev-42"}', "send_email": '{"sent": true}'},
        "What did you just schedule?",
    ),
    ToolTask(
        "Email bob@example.com that the report is late, subject 'Report'.",
        [EMAIL],
        {"send_email": '{"sent": true}'},
        "Did it go through?",
    ),
    ToolTask(
        "What is 1234 multiplied by 5678?",
        [CALCULATE],
        {"calculate": '{"result": 7006652}'},
        "Is that more than seven million?",
    ),
    ToolTask(
        "What's Apple's stock price today?",
        [STOCK, SEARCH],
        {"get_stock_price": '{"symbol": "AAPL", "price": 231.17}', "search_web": "[]"},
        "Is that higher than 200?",
    ),
    ToolTask(
        "Translate 'good morning, friends' into Spanish.",
        [TRANSLATE],
        {"translate": '{"translation": "buenos dias, amigos"}'},
        "And how would you say it in French?",
    ),
    ToolTask(
        "Find flights from Boston to Denver on March 3 for two people.",
        [FLIGHTS],
        {"find_flights": '[{"flight": "UA 412", "departs": "08:10", "price": 189}]'},
        "Which one is the cheapest?",
    ),
    ToolTask(
        "Where is my order A-7731?",
        [ORDER],
        {"get_order_status": '{"status": "shipped", "eta": "2026-12-08"}'},
        "When will it arrive?",
    ),
    ToolTask(
        "Set a timer for 12 minutes for the pasta.",
        [TIMER],
        {"set_timer": '{"set": true, "minutes": 12}'},
        "How long was the timer again?",
    ),
    ToolTask(
        "What can I cook with eggs, spinach and cheese? I'm vegetarian.",
        [RECIPE, SEARCH],
        {"find_recipes": '[{"name": "Spinach omelette"}]', "search_web": "[]"},
        "How long does that take?",
    ),
    ToolTask(
        "Turn off the lights in the kitchen.",
        [LIGHTS],
        {"set_lights": '{"room": "kitchen", "on": false}'},
        "Are they off now?",
    ),
    ToolTask(
        "How far is it to drive from Paris to Lyon?",
        [DISTANCE, WEATHER],
        {"get_distance": '{"km": 465, "hours": 4.5}', "get_weather": "{}"},
        "How long would the drive take?",
    ),
    ToolTask(
        "Is it snowing in Montreal?",
        [WEATHER, SEARCH],
        {
            "get_weather": '{"temperature": -6, "unit": "celsius", "sky": "snow"}',
            "search_web": "[]",
        },
        "What should I wear?",
    ),
    ToolTask(
        "Convert 1000 yen to Swiss francs.",
        [CONVERT],
        {"convert_currency": '{"result": 5.72, "currency": "CHF"}'},
        "Is that enough for a coffee in Zurich?",
    ),
    ToolTask(
        "Search for the opening hours of the British Museum.",
        [SEARCH, DISTANCE],
        {
            "search_web": '[{"title": "Opening times", "snippet": "Daily 10:00-17:00"}]',
            "get_distance": "{}",
        },
        "Is it open on Sundays?",
    ),
    ToolTask(
        "Add 'Dentist' to my calendar for 2026-12-15.",
        [CALENDAR],
        {"create_event": '{"status": "created", "id": "ev-77"}'},
        "What is the event id?",
    ),
    ToolTask(
        "Turn the living room lights on at half brightness.",
        [LIGHTS, TIMER],
        {"set_lights": '{"room": "living room", "on": true, "brightness": 50}', "set_timer": "{}"},
        "Can you make them brighter?",
    ),
    ToolTask(
        "What's the square root of 1764?",
        [CALCULATE, SEARCH],
        {"calculate": '{"result": 42}', "search_web": "[]"},
        "Is that an even number?",
    ),
]
