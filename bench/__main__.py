"""`python -m bench`: kenspec against transformers, side by side, on the default model and draft.

Writes results.json, results.md and PNG plots to --out. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.concurrency import concurrency_sweep
from bench.machine import machine
from bench.report import write_report
from bench.runners import Mode, context_only
from bench.suite import greedy_agreement, read_prompts, run_case, summarize
from kenspec.draft_tools.replay import replay
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.params import DRAFT_TOKENS, SpeculationParams
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL, REPO_ROOT, Settings


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--prompts-dir", type=Path, default=REPO_ROOT / "prompts")
    parser.add_argument("--sets", nargs="+", default=["dev", "ood"], help="prompt files")
    parser.add_argument(
        "--draft-sets",
        nargs="*",
        default=["dev", "ood", "grounded"],
        help="prompt files for the draft comparison (greedy)",
    )
    parser.add_argument("--limit", type=int, default=12, help="prompts per set (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--dtypes", nargs="+", default=["auto"], help="auto, float32, bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--k", type=int, default=6, help="draft tokens (and lookup tokens)")
    parser.add_argument("--k-sweep", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--k-sweep-limit", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument(
        "--concurrency-repeats", type=int, default=1, help="alternating runs per level (medians)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args(argv)


def modes(k: int) -> list[Mode]:
    return [
        Mode("hf_generate", "hf"),
        Mode("hf_prompt_lookup", "hf_lookup", k=k),
        Mode("kenspec_ar", "kenspec", k=0),
        Mode("kenspec_spec_fixed", "kenspec", k=k, adaptive=False),
        Mode("kenspec_spec_adaptive", "kenspec", k=k, adaptive=True),
    ]


def draft_modes(k: int) -> list[Mode]:
    """Which draft: KenLM alone, the request's context alone, both (issue: context draft)."""
    return [
        Mode("kenspec_ar", "kenspec", k=0),
        Mode("kenlm_only", "kenspec", k=k, adaptive=True, draft_context=False),
        Mode("context_only", "kenspec", k=k, adaptive=True, draft_context=True, static=False),
        Mode("kenlm+context", "kenspec", k=k, adaptive=True, draft_context=True),
        Mode("hf_prompt_lookup", "hf_lookup", k=k),
    ]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = {name: read_prompts(args.prompts_dir / f"{name}.txt", args.limit) for name in args.sets}
    results: dict = {"machine": machine(), "args": _jsonable(vars(args)), "cases": []}
    engine_ttft = {}
    for dtype in args.dtypes:
        runtime = load_runtime(
            Settings.of(
                model=args.model,
                draft=args.draft,
                dtype=dtype,
                device=args.device,
                num_draft_tokens=max(args.k, DRAFT_TOKENS),  # chains of k under the cap
                chain_tokens=args.k,
                calibration_cache="none",  # measured now, as the log quotes it
            )
        )
        engine = runtime.engine
        resolved = runtime.info.dtype
        results["calibration_threshold_" + resolved] = runtime.info.breaker.threshold
        log(
            f"loaded {runtime.info.model} ({resolved}); breaker threshold "
            f"{runtime.info.breaker.threshold:.3f}"
        )
        prompt_ids = {
            name: [engine.target.encode_chat([{"role": "user", "content": p}]) for p in prompts]
            for name, prompts in texts.items()
        }
        for name, prompts in prompt_ids.items():
            for temperature in args.temperatures:
                log(f"{name} t={temperature} {resolved}: {len(prompts)} prompts x 5 modes")
                runs = run_case(
                    engine,
                    modes(args.k),
                    prompts,
                    max_new_tokens=args.max_new_tokens,
                    temperature=temperature,
                    progress=log,
                )
                case = {
                    "prompt_set": name,
                    "temperature": temperature,
                    "dtype": resolved,
                    "summary": summarize(runs),
                }
                if temperature == 0:
                    case["greedy_agreement_with_hf"] = greedy_agreement(runs, "hf_generate")
                    if name == args.sets[0]:
                        # The server's default is fixed k with the breaker: the same mode.
                        engine_ttft[resolved] = case["summary"]["kenspec_spec_fixed"][
                            "ttft_ms_median"
                        ]
                results["cases"].append(case)
        if args.k_sweep:
            results.setdefault("k_sweep", {})[resolved] = k_sweep(
                engine, prompt_ids[args.sets[0]][: args.k_sweep_limit], args
            )
        for name in args.draft_sets:
            prompts = [
                engine.target.encode_chat([{"role": "user", "content": p}])
                for p in read_prompts(args.prompts_dir / f"{name}.txt", args.limit)
            ]
            log(f"draft comparison on {name} ({resolved}): {len(prompts)} prompts")
            runs = run_case(
                engine,
                draft_modes(args.k),
                prompts,
                max_new_tokens=args.max_new_tokens,
                temperature=0.0,
                progress=log,
            )
            results.setdefault("drafts", []).append(
                {
                    "prompt_set": name,
                    "dtype": resolved,
                    "summary": summarize(runs),
                    "replayed": replay_drafts(engine, prompts, runs, args.k),
                }
            )
    if args.concurrency:
        log(f"concurrency sweep {args.concurrency} through gRPC")
        server_args = [
            "--model",
            args.model,
            "--draft",
            args.draft,
            "--dtype",
            args.dtypes[0],
            "--device",
            args.device,
            "--num-draft-tokens",
            str(max(args.k, DRAFT_TOKENS)),
            "--chain-tokens",
            str(args.k),
            "--max-concurrent-streams",
            str(max(args.concurrency)),
        ]
        sweep = concurrency_sweep(
            server_args,
            texts[args.sets[0]],
            args.concurrency,
            requests_per_stream=args.requests_per_stream,
            max_new_tokens=args.max_new_tokens,
            repeats=args.concurrency_repeats,
        )
        results["concurrency"] = sweep
        first = next(iter(engine_ttft.values()), None)
        if first is not None and sweep and sweep[0]["streams"] == 1:
            results["grpc_ttft_overhead_ms"] = sweep[0]["ttft_ms_p50"] - first
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.out)
    log(f"wrote {args.out}/results.json, results.md and plots")
    return 0


def k_sweep(engine, prompts, args: argparse.Namespace) -> list[dict]:  # type: ignore[no-untyped-def]
    """Greedy tokens/s of fixed-k speculation for each k, against AR, on the first prompt set."""
    sweep_modes = [Mode("kenspec_ar", "kenspec", k=0)]
    sweep_modes += [Mode(f"k={k}", "kenspec", k=k, adaptive=False) for k in args.k_sweep]
    log(f"k sweep {args.k_sweep} on {len(prompts)} prompts")
    runs = run_case(
        engine,
        sweep_modes,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        progress=log,
    )
    summary = summarize(runs)
    return [
        {"k": 0 if mode.k == 0 else mode.k, "mode": mode.name, **summary[mode.name]}
        for mode in sweep_modes
    ]


def replay_drafts(engine, prompts, runs, k: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Each draft's tokens per round at a fixed k with every round speculating (no breaker,
    no width choice): its greedy rounds replayed exactly against the target's own greedy
    answers (those of the autoregressive runs), see draft_tools.replay."""
    answers = {r.prompt_index: r.tokens for r in runs if r.mode == "kenspec_ar"}
    # KenLM and the request's context, as named: not the engine's suffix index, which learned
    # these very answers while the runs above served them (each would be drafted whole).
    kenlm_and_context = ContextDraft(
        engine.static_draft,
        min_match=engine.context.min_match,
        max_match=engine.context.max_match,
        long_draft_tokens=engine.context.long_draft_tokens,
    )
    drafts = {
        "kenlm_only": engine.static_draft,
        "context_only": context_only(engine).context_draft,
        "kenlm+context": kenlm_and_context,
    }
    params = SpeculationParams(num_draft_tokens=max(k, DRAFT_TOKENS), chain_tokens=k, adaptive=True)
    ordered = [answers[index] for index in range(len(prompts))]
    return {
        name: replay(draft, prompts, ordered, params).tokens_per_round
        for name, draft in drafts.items()
        if draft is not None
    }


def _jsonable(values: dict) -> dict:
    return {key: str(value) if isinstance(value, Path) else value for key, value in values.items()}


if __name__ == "__main__":
    sys.exit(main())
