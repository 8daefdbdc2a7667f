"""`python -m bench.workloads`: speculation on against off, request by request, through gRPC.

Workloads, each served in order by one `kenspec serve` (so drafts that learn from earlier
answers, the suffix index, learn as they would in service):
- `sequence`: the prompts of --prompts once each;
- `repeat`: the prompts once (to learn them), then again: the second pass is measured;
- `templated`: prompts/templated.txt, a few task templates with different parameters; the
  first --warm prompts are served (learned) unmeasured, the rest measured.

Each measured prompt is sent (as a chat user message; `--raw`: as a raw prompt, for a base
model) with speculation on (server defaults) and then off, greedy, so both give the same
answer; the figures are per prompt (tokens/s, tokens per round) and their medians, with the
ratio on/off per prompt. Extra arguments after `--` go to the server.

Rounds are also split by the draft source the server names for each (`kenlm`, `context`,
`suffix`, `recycled`, `none` when nothing was drafted): per prompt the rounds, tokens, drafted,
accepted and seconds (wall time since the previous round, the first from the request's start)
of each source; in the summary each source's share of rounds, tokens per round, acceptance and
tokens/s over all measured prompts (speculation on).

Then, with the server stopped (`--no-prompt-lookup` skips it), the same model through
transformers as shipped, at the dtype and on the device the server logged: each measured prompt,
rendered with the chat template as the server renders it, through greedy `generate` with
`prompt_lookup_num_tokens` (transformers' n-gram speculation) and without (plain).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.machine import machine
from bench.suite import read_prompts
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient

_SOURCE_FIELDS = ("rounds", "tokens", "drafted", "accepted", "seconds")


def source_family(draft_source: str) -> str:
    """A round's draft source without its match-length bucket ("context:8" -> "context");
    "" (nothing drafted) -> "none"."""
    return draft_source.split(":", 1)[0] or "none"


async def measure_request(
    client: AsyncClient, prompt: str, max_new_tokens: int, speculation: str, raw: bool = False
) -> dict:
    """One greedy chat request (`raw`: the prompt as it is), streamed: tokens, rounds, drafted,
    accepted, seconds, tokens/s, tokens per round, the rounds split by draft source, and a
    digest of the answer's token ids (two answers to one prompt are the same answer)."""
    started = time.perf_counter()
    previous = started
    rounds = tokens = drafted = accepted = 0
    digest = hashlib.blake2b(digest_size=8)
    sources: dict[str, dict] = {}
    request = {"prompt": prompt} if raw else {"messages": [("user", prompt)]}
    async for round_ in client.generate(
        **request,
        max_new_tokens=max_new_tokens,
        speculation=speculation,
        timeout=600,
    ):
        now = time.perf_counter()
        rounds += 1
        tokens += len(round_.token_ids)
        digest.update(b"".join(t.to_bytes(4, "little") for t in round_.token_ids))
        drafted += round_.drafted
        accepted += round_.accepted
        family = sources.setdefault(
            source_family(round_.draft_source), dict.fromkeys(_SOURCE_FIELDS, 0)
        )
        family["rounds"] += 1
        family["tokens"] += len(round_.token_ids)
        family["drafted"] += round_.drafted
        family["accepted"] += round_.accepted
        family["seconds"] += now - previous  # the first round's: since the request started
        previous = now
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_round": tokens / rounds if rounds else 0.0,
        "sources": sources,
        "answer": digest.hexdigest(),
    }


async def run_workload(
    address: str,
    warm: Sequence[str],
    measured: Sequence[str],
    max_new_tokens: int,
    raw: bool = False,
) -> list[dict]:
    """Serve `warm` (speculation on, unmeasured), then each of `measured` on and off."""
    async with AsyncClient(address) as client:
        for prompt in warm:
            await measure_request(client, prompt, max_new_tokens, "auto", raw)
        results = []
        for prompt in measured:
            on = await measure_request(client, prompt, max_new_tokens, "auto", raw)
            off = await measure_request(client, prompt, max_new_tokens, "off", raw)
            results.append({"prompt": prompt, "on": on, "off": off})
        return results


_one = measure_request  # the name bench.recovery and the tests import


def summarize(results: list[dict]) -> dict:
    ratios = [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in results]
    summary = {
        "prompts": len(results),
        "tokens_per_round_median": statistics.median(r["on"]["tokens_per_round"] for r in results),
        "on_tokens_per_s_median": statistics.median(r["on"]["tokens_per_s"] for r in results),
        "off_tokens_per_s_median": statistics.median(r["off"]["tokens_per_s"] for r in results),
        "speedup_median": statistics.median(ratios),
        "below_1_2x": sum(ratio < 1.2 for ratio in ratios) / len(ratios),
        "same_tokens": all(r["on"]["tokens"] == r["off"]["tokens"] for r in results),
        "sources": summarize_sources([r["on"].get("sources", {}) for r in results]),
    }
    lookup = [r for r in results if "prompt_lookup" in r and "hf_plain" in r]
    if lookup:
        summary["prompt_lookup_tokens_per_s_median"] = statistics.median(
            r["prompt_lookup"]["tokens_per_s"] for r in lookup
        )
        summary["hf_plain_tokens_per_s_median"] = statistics.median(
            r["hf_plain"]["tokens_per_s"] for r in lookup
        )
        summary["prompt_lookup_speedup_median"] = statistics.median(
            r["prompt_lookup"]["tokens_per_s"] / r["hf_plain"]["tokens_per_s"] for r in lookup
        )
    return summary


def summarize_sources(per_prompt: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """Per draft-source family, over all prompts: its share of all rounds, tokens per round,
    acceptance (accepted / drafted; None if it drafted nothing) and tokens/s (its tokens over
    the wall time of its rounds)."""
    totals: dict[str, dict] = {}
    for sources in per_prompt:
        for family, counts in sources.items():
            total = totals.setdefault(family, dict.fromkeys(_SOURCE_FIELDS, 0))
            for name in _SOURCE_FIELDS:
                total[name] += counts[name]
    all_rounds = sum(total["rounds"] for total in totals.values())
    return {
        family: {
            "share_of_rounds": total["rounds"] / all_rounds if all_rounds else 0.0,
            "tokens_per_round": total["tokens"] / total["rounds"] if total["rounds"] else 0.0,
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else None,
            "tokens_per_s": total["tokens"] / total["seconds"] if total["seconds"] else None,
        }
        for family, total in sorted(totals.items())
    }


def run_prompt_lookup(
    model: str,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    threads: int = 0,
    lookup_tokens: int = 10,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Per prompt, greedy transformers `generate` with prompt lookup and plain: {"prompt_lookup":
    {tokens, seconds, tokens_per_s}, "hf_plain": {...}}. The model as shipped (stock layers and
    attention), the prompts rendered with its chat template as the server renders a chat. One
    unmeasured short call of each first; the order of the two alternates per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads > 0:  # as the server does with --threads
        torch.set_num_threads(threads)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id  # what generate falls back to, without its warning

    def encode(prompt: str) -> torch.Tensor:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor([ids], device=device)

    def generate(input_ids: torch.Tensor, new_tokens: int, lookup: bool) -> dict:
        extra = {"prompt_lookup_num_tokens": lookup_tokens} if lookup else {}
        started = time.perf_counter()
        with torch.inference_mode():
            output = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id,
                **extra,
            )
        seconds = time.perf_counter() - started
        tokens = int(output.shape[1] - input_ids.shape[1])
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    encoded = [encode(prompt) for prompt in prompts]
    if encoded:  # warm-up: first-call overheads measured in neither column
        for lookup in (True, False):
            generate(encoded[0], min(8, max_new_tokens), lookup)
    results = []
    for index, input_ids in enumerate(encoded):
        runs = {}
        for lookup in (True, False) if index % 2 == 0 else (False, True):
            runs["prompt_lookup" if lookup else "hf_plain"] = generate(
                input_ids, max_new_tokens, lookup
            )
        results.append({"prompt_lookup": runs["prompt_lookup"], "hf_plain": runs["hf_plain"]})
        if progress is not None:
            progress(f"prompt lookup {index + 1}/{len(encoded)}")
    return results


def prompt_file(workload: str, directory: Path = REPO / "prompts") -> Path:
    """A workload's default prompts: templated.txt for `templated`, else dev.txt."""
    return directory / ("templated.txt" if workload == "templated" else "dev.txt")


def plan(workload: str, prompts: list[str], warm: int) -> tuple[list[str], list[str]]:
    """(warm-up prompts, measured prompts) of a workload."""
    if workload == "repeat":
        return prompts, prompts
    if workload == "templated":
        return prompts[:warm], prompts[warm:]
    return [], prompts


def main(argv: Sequence[str] | None = None) -> int:
    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL, parse_settings

    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__)
    parser.add_argument("--workload", choices=["sequence", "repeat", "templated"], required=True)
    parser.add_argument("--prompts", type=Path, help="default: dev.txt, or templated.txt")
    parser.add_argument("--limit", type=int, default=12, help="prompts read (0: all)")
    parser.add_argument("--warm", type=int, default=12, help="templated: unmeasured first ones")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--label", default="kenspec")
    parser.add_argument(
        "--raw", action="store_true", help="send raw prompts, not chat messages (a base model)"
    )
    parser.add_argument("--out", type=Path, help="append the result as one JSON line here")
    parser.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the server: transformers generate with prompt lookup and plain, per prompt",
    )
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10)
    parser.add_argument("server_args", nargs="*", help="after --: arguments for the server")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts or prompt_file(args.workload), args.limit)
    warm, measured = plan(args.workload, prompts, args.warm)
    # The per-source breakdown reads each round's draft source: an operator's flag.
    server_args = ["--model", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT)]
    server_args.append("--report-draft-source")
    server = ServerProcess([*server_args, *args.server_args])
    try:
        calibrated = server.logged("calibrated")
        loaded = server.logged("model_loaded") or {}
        print(f"server calibrated: {json.dumps(calibrated)}", file=sys.stderr, flush=True)
        results = asyncio.run(
            run_workload(server.address, warm, measured, args.max_new_tokens, args.raw)
        )
    finally:
        server.stop()
    lookup_setup = None
    if args.prompt_lookup:
        settings = parse_settings([*server_args, *args.server_args])
        lookup_setup = {
            "model": loaded.get("model", settings.model.model),
            "device": loaded.get("device", "cpu"),
            "dtype": loaded.get("dtype", "auto"),  # "auto": the server did not log its dtype
            "threads": settings.kernels.threads,
            "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
        }
        print(f"prompt lookup: {json.dumps(lookup_setup)}", file=sys.stderr, flush=True)
        columns = run_prompt_lookup(
            lookup_setup["model"],
            measured,
            args.max_new_tokens,
            device=lookup_setup["device"],
            dtype=lookup_setup["dtype"],
            threads=lookup_setup["threads"],
            lookup_tokens=args.prompt_lookup_tokens,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        for result, column in zip(results, columns, strict=True):
            result.update(column)
    summary = summarize(results)
    print(
        f"{args.label} {args.workload}: " + json.dumps({k: _round(v) for k, v in summary.items()})
    )
    if args.out is not None:
        record = {
            "label": args.label,
            "workload": args.workload,
            "machine": machine(),
            "server_args": [*server_args, *args.server_args],
            "calibrated": calibrated,
            "prompt_lookup_setup": lookup_setup,
            "summary": summary,
            "results": results,
        }
        with args.out.open("a") as file:
            file.write(json.dumps(record) + "\n")
    return 0


def _round(value: object) -> object:
    if isinstance(value, dict):
        return {key: _round(item) for key, item in value.items()}
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    raise SystemExit(main())
