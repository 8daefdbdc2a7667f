"""Side-by-side runs: every mode on every prompt, modes alternating per prompt, then medians."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.runners import Mode, RunResult, run
from kenspec.server.engine.speculative_engine import SpeculativeEngine


@dataclass(frozen=True, slots=True)
class Case:
    prompt_set: str
    temperature: float
    dtype: str


def run_case(
    engine: SpeculativeEngine,
    modes: Sequence[Mode],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    progress: Callable[[str], None] = lambda _: None,
) -> list[RunResult]:
    """Each prompt through every mode; the order rotates per prompt (A B C, B C A, ...) so drift
    of the machine (thermal, other load) spreads over all modes instead of biasing one."""
    results = []
    for index, prompt_ids in enumerate(prompts):
        shift = index % len(modes)
        for mode in [*modes[shift:], *modes[:shift]]:
            result = run(
                engine,
                mode,
                prompt_ids,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=1000 + index,
                index=index,
            )
            results.append(result)
        progress(f"prompt {index + 1}/{len(prompts)}")
    return results


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: Sequence[RunResult], k_max: int = 8) -> dict[str, dict]:
    """Per mode: median tokens/s, tokens per round, per-position acceptance, TTFT, latencies."""
    by_mode: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_mode[result.mode].append(result)
    summary = {}
    for mode, runs in by_mode.items():
        tokens = sum(len(r.tokens) for r in runs)
        rounds = sum(r.rounds for r in runs)
        inter = [gap for r in runs for gap in r.inter_round]
        # What the draft yields where it was used (the breakers and the width choice decide
        # how often that is): emitted tokens per round that verified at least one draft.
        speculative = [
            a + 1
            for r in runs
            for d, a in zip(r.drafted_per_round, r.accepted_per_round, strict=True)
            if d
        ]
        drafted_at, accepted_at = [0] * k_max, [0] * k_max
        for r in runs:
            for drafted, accepted in zip(r.drafted_per_round, r.accepted_per_round, strict=True):
                for j in range(min(drafted, k_max)):
                    drafted_at[j] += 1
                    accepted_at[j] += j < accepted
        summary[mode] = {
            "runs": len(runs),
            "tokens": tokens,
            "tokens_per_s_median": statistics.median(r.tokens_per_second for r in runs),
            "tokens_per_round": tokens / rounds if rounds else 0.0,
            "tokens_per_speculative_round": (statistics.fmean(speculative) if speculative else 0.0),
            "speculative_rounds": len(speculative),
            "ttft_ms_median": 1000 * statistics.median(r.ttft for r in runs),
            "inter_round_ms_p50": 1000 * percentile(inter, 0.5),
            "inter_round_ms_p95": 1000 * percentile(inter, 0.95),
            "acceptance_by_position": [
                a / d if d else None for a, d in zip(accepted_at, drafted_at, strict=True)
            ],
            "drafted": sum(sum(r.drafted_per_round) for r in runs),
            "accepted": sum(sum(r.accepted_per_round) for r in runs),
            "breaker_opened_runs": sum(r.breaker_opened for r in runs),
        }
    return summary


def speedups(summary: dict[str, dict], baseline: str) -> dict[str, float]:
    """Each mode's median tokens/s over the baseline's."""
    base = summary[baseline]["tokens_per_s_median"]
    return {mode: values["tokens_per_s_median"] / base for mode, values in summary.items()}


def greedy_agreement(results: Sequence[RunResult], reference_mode: str) -> dict[str, float]:
    """Share of prompts whose greedy output equals the reference mode's, per mode."""
    reference = {r.prompt_index: r.tokens for r in results if r.mode == reference_mode}
    counts: dict[str, list[bool]] = defaultdict(list)
    for result in results:
        if result.mode != reference_mode:
            counts[result.mode].append(result.tokens == reference[result.prompt_index])
    return {mode: sum(same) / len(same) for mode, same in counts.items()}


def read_prompts(path: Path, limit: int) -> list[str]:
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts
