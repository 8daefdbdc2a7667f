"""The structured-output workload: its schemas are varied and compile, their examples are
valid and in the grammar, and its summary counts what it says."""

from __future__ import annotations

import json

import jsonschema

from bench.schemas import CASES
from bench.structured_output import summarize
from kenspec.server.engine.draft_tree import DraftTree, Source
from kenspec.server.engine.grammar import GrammarCompiler, GrammarSpec, schema_text


def _keywords(schema: object) -> set[str]:
    if isinstance(schema, dict):
        return set(schema) | {k for value in schema.values() for k in _keywords(value)}
    if isinstance(schema, list):
        return {k for value in schema for k in _keywords(value)}
    return set()


def test_at_least_20_varied_schemas_whose_examples_are_valid() -> None:
    assert len(CASES) >= 20 and len({case.name for case in CASES}) == len(CASES)
    used = set().union(*(_keywords(case.schema) for case in CASES))
    assert {"required", "enum", "items", "minimum", "anyOf", "pattern", "const"} <= used
    for case in CASES:
        jsonschema.validate(case.example, case.schema)


def test_every_schema_compiles_and_its_example_is_a_whole_match(tiny_target) -> None:
    compiler = GrammarCompiler(
        tiny_target.tokenizer, sorted(tiny_target.eos_token_ids), tiny_target.vocab_size
    )
    for case in CASES:
        state = compiler.start(GrammarSpec("json_schema", schema_text(case.schema)))
        text = json.dumps(case.example, separators=(", ", ": "))  # as the grammar writes JSON
        ids = tiny_target.tokenizer.encode(text, add_special_tokens=False)
        chain = DraftTree.chain(ids, [1.0] * len(ids), Source("example"))
        assert len(state.prune(chain)) == len(ids), case.name
        state.advance(ids)
        assert state.accepting, case.name


def test_summary_compares_on_and_off_per_schema() -> None:
    def row(schema: str, mode: str, seconds: float, rounds: int, valid: bool) -> dict:
        return {
            "schema": schema,
            "mode": mode,
            "temperature": 0.0,
            "tokens": 20,
            "rounds": rounds,
            "tokens_per_round": 20 / rounds,
            "seconds": seconds,
            "tokens_per_s": 20 / seconds,
            "finish": "eos",
            "valid": valid,
            "grammar_share": 0.01,
            "grammar_us_per_token": 50.0,
            "pruned": 3,
            "forced": 4,
            "text": "{}",
        }

    rows = [
        row("a", "on", 1.0, 5, True),
        row("a", "off", 2.0, 20, True),
        row("b", "on", 1.0, 10, True),
        row("b", "off", 4.0, 20, False),
    ]
    summary = summarize(rows)
    assert summary["schemas"] == 2 and summary["same_output_on_off"] == 2
    assert summary["speedup_median"] == 3.0 and summary["speedup_of_totals"] == 3.0
    assert summary["tokens_per_round_on_total"] == round(40 / 15, 3)
    assert summary["valid_of_finished"] == "3/4"
