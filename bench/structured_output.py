"""`python -m bench.structured_output`: JSON by schema, speculation on against off.

Every schema of bench.schemas (records, tool calls, nested arrays: required fields, enums,
nested objects, arrays, numbers) is asked for with its prompt in the chat template, greedy,
through the server's engine built from the server's own flags (default model and draft,
then any flags after `--`): speculation on (forced tokens, learned drafts and trees), then
off, both with the same grammar; after every schema's pair, one sampled request (temperature
0.8) per schema with speculation on. Speculation on goes first for each schema: the suffix
index learns every answer, and an answer learned from the same prompt's OFF run would make
ON's drafts exact. Earlier schemas' answers are learned, as in service.

Per request: tokens, rounds, tokens per round, seconds, tokens/s, finish reason, whether the
output is valid for the schema (jsonschema) when it finished by EOS, and the grammar's work:
its CPU seconds (forced tokens, pruning, masks, advancing; per token, and as a share of
the request's CPU seconds, all threads: on a shared machine wall time mostly measures
waits), draft nodes pruned and forced tokens offered. The summary: medians over schemas of
the speed-up on/off (tokens/s), tokens per round, the grammar's share, and the share of
valid outputs. Timings are noisy on a shared machine (run it under `nice`); tokens per round
and validity are deterministic.

    nice -n 19 python -m bench.structured_output --out bench/results/structured-output/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema

from bench.machine import machine
from bench.schemas import CASES, SchemaCase
from kenspec.api.outputs import FinishReason
from kenspec.server.engine.grammar import GrammarSpec, schema_text
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.speculative_engine import SpeculativeEngine

SYSTEM = "You answer with one JSON object and nothing else."


def run_one(
    engine: SpeculativeEngine,
    case: SchemaCase,
    *,
    speculation: bool,
    temperature: float,
    max_new_tokens: int,
    defaults: SpeculationParams,
) -> dict[str, Any]:
    prompt_ids = engine.target.encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case.prompt}]
    )
    generation = engine.start(
        prompt_ids,
        sampling=SamplingParams(temperature=temperature, seed=0),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        speculation=SpeculationParams(
            enabled=speculation,
            num_draft_tokens=defaults.num_draft_tokens,
            chain_tokens=defaults.chain_tokens,
            adaptive=defaults.adaptive,
        ),
        grammar=GrammarSpec("json_schema", schema_text(case.schema)),
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    rounds = drafted = accepted = forced_rounds = 0
    finish: FinishReason | None = None
    for round_ in engine.batch.rounds(generation):
        rounds += 1
        drafted += round_.drafted
        accepted += round_.accepted
        forced_rounds += round_.source == "grammar"
        finish = round_.finish_reason
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started  # every thread's: torch's too
    tokens = len(generation.output_ids)
    assert generation.grammar is not None
    counters = generation.grammar.counters
    return {
        "schema": case.name,
        "mode": "on" if speculation else "off",
        "temperature": temperature,
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_round": round(tokens / rounds, 3),
        "drafted": drafted,
        "accepted": accepted,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "finish": finish.name.lower() if finish is not None else None,
        "valid": _valid(generation.text, case.schema) if finish == FinishReason.EOS else None,
        "grammar_seconds": round(counters.seconds, 5),
        "cpu_seconds": round(cpu_seconds, 4),
        # the grammar's CPU (the engine thread's, GrammarCounters) over the request's
        "grammar_share": round(counters.seconds / cpu_seconds, 4),
        "grammar_us_per_token": round(1e6 * counters.seconds / max(tokens, 1), 1),
        "masks": counters.masks,
        "pruned": counters.pruned,
        "forced": counters.forced,
        "forced_only_rounds": forced_rounds,
        "text": generation.text,
    }


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    greedy = [row for row in rows if row["temperature"] == 0]
    on = {row["schema"]: row for row in greedy if row["mode"] == "on"}
    off = {row["schema"]: row for row in greedy if row["mode"] == "off"}
    names = [name for name in on if name in off]
    ended = [row for row in rows if row["finish"] == "eos"]
    return {
        "schemas": len(names),
        "same_output_on_off": sum(on[n]["text"] == off[n]["text"] for n in names),
        "speedup_median": _median([on[n]["tokens_per_s"] / off[n]["tokens_per_s"] for n in names]),
        "speedup_of_totals": round(
            sum(off[n]["seconds"] for n in names) / sum(on[n]["seconds"] for n in names), 3
        ),
        "tokens_per_round_on_median": _median([on[n]["tokens_per_round"] for n in names]),
        "tokens_per_round_on_total": round(
            sum(on[n]["tokens"] for n in names) / sum(on[n]["rounds"] for n in names), 3
        ),
        "grammar_share_on_median": _median([on[n]["grammar_share"] for n in names]),
        "grammar_share_off_median": _median([off[n]["grammar_share"] for n in names]),
        "grammar_us_per_token_on_median": _median([on[n]["grammar_us_per_token"] for n in names]),
        "finished_by_eos": f"{len(ended)}/{len(rows)}",
        "valid_of_finished": f"{sum(bool(row['valid']) for row in ended)}/{len(ended)}",
        "finish_reasons": dict(sorted(_count(row["finish"] for row in rows).items())),
        "pruned_on_total": sum(on[n]["pruned"] for n in names),
        "forced_on_total": sum(on[n]["forced"] for n in names),
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=len(CASES), help="the first N schemas")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines, one per request")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=["on", "off", "sampled"],
        default=["on", "off", "sampled"],
        help="which requests per schema (on and off are greedy; sampled has speculation on)",
    )
    parser.add_argument("--reverse", action="store_true", help="the schemas last to first")
    parser.add_argument("server_args", nargs="*", help="server flags (after --)")
    args = parser.parse_args()

    from kenspec.server.runtime import load_runtime
    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL, parse_settings

    settings = parse_settings(
        ["--model", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT), *args.server_args]
    )
    runtime = load_runtime(settings)
    engine = runtime.engine
    defaults = SpeculationParams(
        num_draft_tokens=runtime.defaults.num_draft_tokens,
        chain_tokens=runtime.defaults.chain_tokens,
        adaptive=runtime.defaults.adaptive,
    )
    # The tokenizer's grammar view is built on the first grammar request: not measured.
    warm = SchemaCase("warm-up", {"type": "object"}, "Say hi in JSON.", {})
    run_one(engine, warm, speculation=False, temperature=0, max_new_tokens=8, defaults=defaults)
    rows = []
    out = args.out.open("w") if args.out is not None else None
    # Greedy on and off for every schema first, then the sampled ones: a run cut short still
    # compares on and off on as many schemas as it reached.
    cases = CASES[: args.limit][:: -1 if args.reverse else 1]
    greedy = [(mode == "on", 0.0) for mode in ("on", "off") if mode in args.runs]
    runs = [(case, speculation, temp) for case in cases for speculation, temp in greedy]
    if "sampled" in args.runs:
        runs += [(case, True, 0.8) for case in cases]
    for case, speculation, temperature in runs:
        row = run_one(
            engine,
            case,
            speculation=speculation,
            temperature=temperature,
            max_new_tokens=args.max_new_tokens,
            defaults=defaults,
        )
        rows.append(row)
        shown = {k: v for k, v in row.items() if k != "text"}
        print(json.dumps(shown), flush=True)
        if out is not None:  # as it goes: a long run cut short keeps what it measured
            out.write(json.dumps(row) + "\n")
            out.flush()
    summary = {"machine": machine(), "settings": args.server_args, **summarize(rows)}
    print(json.dumps(summary, indent=1))
    if out is not None:
        out.write(json.dumps({"summary": summary}) + "\n")
        out.close()


if __name__ == "__main__":
    main()
