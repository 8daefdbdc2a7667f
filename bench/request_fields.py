"""`python -m bench.request_fields`: logprobs, penalties and n choices on a real model.

- `exact`: the server's engine in float32 (default flags: speculation with trees and every
  draft source) on real prompts. Per prompt: every generated token's logprob and top-5
  alternatives against transformers' own log-softmax for the same context (largest difference
  reported; 1e-4 is the bar); greedy output with presence, frequency and repetition penalties
  and a logit_bias, speculation on against off (identical); and with repetition_penalty and
  logit_bias against transformers `generate` with `repetition_penalty` and `sequence_bias`
  (identical). Exits 1 on any difference.
- `speed`: the same engine at the server's dtype, greedy, one prompt at a time, modes in
  rotating order per prompt: plain, logprobs (top 5), penalties, and n=4 choices sampled
  (against 4 single requests of the same seeds), without the prefix cache and the suffix index
  (so a prompt's later modes neither skip its prefill nor recall its earlier answers). Median
  tokens/s and the prefill tokens n choices computed.

    python -m bench.request_fields exact --prompts prompts/dev.txt --limit 20
    python -m bench.request_fields speed --prompts prompts/dev.txt --limit 12 --out fields.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.machine import machine
from bench.suite import read_prompts

PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": ((28, 2.0), (30, -5.0)),  # SmolLM2: "=" up, "." down
}
TOP = 5


def _engine(flags: Sequence[str], dtype: str | None):  # type: ignore[no-untyped-def]
    from kenspec.server.runtime import load_runtime
    from kenspec.server.settings import parse_settings

    extra = ["--dtype", dtype] if dtype else []
    settings = parse_settings([*extra, "--calibration-cache", "none", *flags])
    return load_runtime(settings).engine, settings


def _ids(engine, prompt: str) -> list[int]:  # type: ignore[no-untyped-def]
    target = engine.target
    if target.tokenizer.chat_template:
        return target.encode_chat([{"role": "user", "content": prompt}])
    return target.encode_prompt(prompt)


def _run(engine, ids, *, speculation, max_new_tokens, **options):  # type: ignore[no-untyped-def]
    from kenspec.server.engine.params import SamplingParams, StoppingParams

    generation = engine.start(
        ids,
        sampling=options.pop("sampling", SamplingParams()),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        speculation=speculation,
        **options,
    )
    rounds = list(engine.batch.rounds(generation))
    return generation, rounds


def check_exact(prompts: Path, limit: int, max_new_tokens: int, flags: Sequence[str]) -> dict:
    from dataclasses import replace

    from kenspec.server.engine.params import ProcessorParams

    engine, settings = _engine(flags, "float32")
    model = engine.target.model
    on = settings.speculation.request_defaults
    off = replace(on, enabled=False)
    penalties = ProcessorParams(**PENALTIES)
    hf_like = ProcessorParams(
        repetition_penalty=PENALTIES["repetition_penalty"], logit_bias=PENALTIES["logit_bias"]
    )
    worst, tokens, same_on_off, same_hf, changed, accepted = 0.0, 0, 0, 0, 0, 0
    texts = read_prompts(prompts, limit)
    for prompt in texts:
        ids = _ids(engine, prompt)
        generation, rounds = _run(
            engine, ids, speculation=on, max_new_tokens=max_new_tokens, top_logprobs=TOP
        )
        output = generation.output_ids
        accepted += sum(r.accepted for r in rounds)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + output])).logits[0].float()
        reference = torch.log_softmax(logits[len(ids) - 1 : len(ids) + len(output) - 1], -1)
        logprobs = [lp for r in rounds for lp in r.logprobs or ()]
        for position, logprob in enumerate(logprobs):
            row = reference[position]
            worst = max(worst, abs(logprob.logprob - row[logprob.token_id].item()))
            for token_id, value in logprob.top:
                worst = max(worst, abs(value - row[token_id].item()))
        tokens += len(logprobs)
        with_on, _ = _run(
            engine, ids, speculation=on, max_new_tokens=max_new_tokens, processing=penalties
        )
        with_off, _ = _run(
            engine, ids, speculation=off, max_new_tokens=max_new_tokens, processing=penalties
        )
        same_on_off += with_on.output_ids == with_off.output_ids
        changed += with_on.output_ids != output
        served, _ = _run(
            engine, ids, speculation=on, max_new_tokens=max_new_tokens, processing=hf_like
        )
        with torch.inference_mode():
            plain = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                repetition_penalty=PENALTIES["repetition_penalty"],
                sequence_bias={(t,): b for t, b in PENALTIES["logit_bias"]},
            )[0, len(ids) :].tolist()
        same_hf += served.output_ids == plain
    result = {
        "prompts": len(texts),
        "logprob_tokens": tokens,
        "logprob_max_abs_diff": worst,
        "accepted_drafts": accepted,
        "penalties_on_equals_off": same_on_off,
        "penalties_changed_the_answer": changed,
        "repetition_and_bias_equal_transformers": same_hf,
        "machine": machine(),
    }
    print(json.dumps(result), flush=True)
    return result


def measure_speed(prompts: Path, limit: int, max_new_tokens: int, flags: Sequence[str]) -> dict:
    from kenspec.server.engine.params import ProcessorParams

    # No prefix cache and no suffix index: a prompt computed before must make neither the later
    # modes' prefill free nor their answers recalled from the earlier modes' answers.
    engine, settings = _engine(["--prefix-cache-mb", "0", "--no-suffix-index", *flags], None)
    modes = ["plain", "logprobs", "penalties"]
    rates: dict[str, list[float]] = {mode: [] for mode in [*modes, "n4", "n4_singles"]}
    prefill = {"n4": 0, "n4_singles": 0}
    for index, prompt in enumerate(read_prompts(prompts, limit)):
        ids = _ids(engine, prompt)
        order = modes[index % 3 :] + modes[: index % 3]  # drift spread over the modes
        for mode in order:
            options = {"logprobs": {"top_logprobs": TOP}, "penalties": {}}.get(mode, {})
            if mode == "penalties":
                options = {"processing": ProcessorParams(**PENALTIES)}
            started = time.perf_counter()
            generation, _ = _run(
                engine,
                ids,
                speculation=settings.speculation.request_defaults,
                max_new_tokens=max_new_tokens,
                **options,
            )
            rates[mode].append(len(generation.output_ids) / (time.perf_counter() - started))
        for mode in ("n4", "n4_singles") if index % 2 else ("n4_singles", "n4"):
            before = engine.batch.stats.prefill_tokens
            started = time.perf_counter()
            produced = _choices(engine, ids, settings, max_new_tokens, together=mode == "n4")
            rates[mode].append(produced / (time.perf_counter() - started))
            prefill[mode] += engine.batch.stats.prefill_tokens - before
    result = {
        "tokens_per_s": {mode: statistics.median(values) for mode, values in rates.items()},
        "prefill_tokens": prefill,
        "prompts": len(rates["plain"]),
        "dtype": str(engine.target.dtype).removeprefix("torch."),
        "machine": machine(),
    }
    print(json.dumps(result), flush=True)
    return result


def _choices(engine, ids, settings, max_new_tokens: int, *, together: bool) -> int:  # type: ignore[no-untyped-def]
    """4 sampled choices of one prompt (seeds 0-3): one request sharing its prefill, or four
    requests one after another; the tokens produced."""
    from kenspec.server.engine.params import SamplingParams, StoppingParams

    generations = [
        engine.start(
            ids,
            sampling=SamplingParams(temperature=0.8, seed=seed),
            stopping=StoppingParams(max_new_tokens=max_new_tokens),
            speculation=settings.speculation.request_defaults,
            choice=seed,
        )
        for seed in range(4)
    ]
    if not together:
        return sum(len(_drain(engine, g)) for g in generations)
    failures: list[BaseException] = []

    def deliver(item: object) -> None:
        if isinstance(item, BaseException):
            failures.append(item)

    for index, generation in enumerate(generations):
        engine.batch.add(generation, deliver, follows=generations[0] if index else None)
    engine.batch.run_until_idle()
    if failures:
        raise failures[0]
    return sum(len(g.output_ids) for g in generations)


def _drain(engine, generation) -> list[int]:  # type: ignore[no-untyped-def]
    list(engine.batch.rounds(generation))
    return generation.output_ids


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_fields", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("exact", "speed"):
        command = commands.add_parser(name)
        command.add_argument("--prompts", type=Path, default=Path("prompts/dev.txt"))
        command.add_argument("--limit", type=int, default=20 if name == "exact" else 12)
        command.add_argument("--max-new-tokens", type=int, default=96)
        command.add_argument("--out", type=Path, help="write the result as JSON here")
        command.add_argument("flags", nargs="*", help="server flags after --")
    args = parser.parse_args(argv)
    run = check_exact if args.command == "exact" else measure_speed
    result = run(args.prompts, args.limit, args.max_new_tokens, args.flags)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.command == "exact":
        whole = result["prompts"]
        ok = result["logprob_max_abs_diff"] <= 1e-4 and result["penalties_on_equals_off"] == whole
        return 0 if ok and result["repetition_and_bias_equal_transformers"] == whole else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
