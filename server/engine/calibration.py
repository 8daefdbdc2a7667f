"""Start-up calibration: what the target's packed passes cost, timed by (rows, tokens).

`calibrate` times passes of 1..k+1 tokens (and a few batch sizes) and gives a `Calibration`:
the step's and the verify pass's seconds, the breaker's threshold and the table `PassCosts`
interpolates. The cost model itself (break-even, draft choice) is `costs`, which needs no
target; the table then follows real passes in `live_costs`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from kenspec.server.engine.costs import PassCosts, cheapest_widths, lowest_break_even
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass


@dataclass(frozen=True, slots=True)
class Calibration:
    num_draft_tokens: int
    step_seconds: float  # one token through the target, with a warm KV cache
    verify_seconds: float  # k + 1 tokens in one pass (padded to a cheaper width if there is one)
    threshold: float
    widths: dict[int, int] = field(default_factory=dict)  # pass width -> cheaper padded width
    pass_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens)

    @classmethod
    def from_pass_seconds(cls, k: int, pass_seconds: dict[tuple[int, int], float]) -> Calibration:
        """The calibration a table of (rows, tokens) -> seconds implies (e.g. one from disk)."""
        one_row = {t: s for (r, t), s in pass_seconds.items() if r == 1 and t <= k + 1}
        padded = cheapest_widths(one_row)
        return cls(
            k,
            one_row[1],
            one_row[padded.get(k + 1, k + 1)],
            lowest_break_even(one_row),
            padded,
            dict(pass_seconds),
        )

    @property
    def cost_ratio(self) -> float:
        return self.verify_seconds / self.step_seconds

    @property
    def pass_costs(self) -> PassCosts:
        return PassCosts(self.pass_seconds)


def calibrate(
    target: TargetModel,
    k: int,
    *,
    context_tokens: int = 128,
    repeats: int = 5,
    rows: int = 1,
    long_draft_tokens: int = 0,
) -> Calibration:
    """Time passes of 1..k+1 tokens after a context_tokens prefill (robust_seconds), for
    one row and, when rows > 1, for batches of 2, 4 and `rows` (fewer repeats: those passes
    are longer); with long_draft_tokens > k, also one row's passes of that many drafts and of
    half-way (chains after long exact matches draft that far; widths between interpolate).
    """
    widths = list(range(1, k + 2))
    measured = list(widths)
    if long_draft_tokens > k:
        measured += sorted({(k + long_draft_tokens) // 2 + 1, long_draft_tokens + 1})
    costs = dict(
        zip(measured, measure_pass_seconds(target, measured, context_tokens, repeats), strict=True)
    )
    batch_costs = {(1, width): seconds for width, seconds in costs.items()}
    # Cost is not linear in rows (a pass of 4 rows x 1 token can cost what one row's does, see
    # engine.linear_kernels), so a few row counts are measured and PassCosts interpolates.
    for count in [r for r in (2, 4) if r < rows] + ([rows] if rows > 1 else []):
        batched = measure_pass_seconds(
            target, widths, context_tokens, max(2, repeats // 2), rows=count
        )
        batch_costs.update({(count, count * w): s for w, s in zip(widths, batched, strict=True)})
    return Calibration.from_pass_seconds(k, batch_costs)


def measure_pass_seconds(
    target: TargetModel, widths: list[int], context_tokens: int, repeats: int, rows: int = 1
) -> list[float]:
    vocab = min(target.vocab_size, len(target.tokenizer))
    context = [(7 + 31 * i) % vocab for i in range(min(context_tokens, target.max_context // 2))]
    cache = target.new_cache(rows)
    for row in range(rows):
        target.prefill(cache, row, 0, context)
    samples: dict[int, list[float]] = {width: [] for width in widths}
    for repeat in range(repeats + WARM_UP_ROUNDS):  # the first rounds warm up, not counted
        for width in widths:
            started = time.perf_counter()
            # A pass reads at least one row of logits per sequence; the cache length stays.
            passed = VerifyPass.sequences([len(context)] * rows, [context[:width]] * rows)
            target.forward(cache, passed)[0][0]
            target.synchronize()
            if repeat >= WARM_UP_ROUNDS:
                samples[width].append(time.perf_counter() - started)
    return robust_seconds(samples, widths[0])


# Rounds of every width run before any is timed: a fresh process's first passes pay page
# faults and cold caches that no later pass does.
WARM_UP_ROUNDS = 2


def robust_seconds(samples: dict[int, list[float]], base: int) -> list[float]:
    """Each width's seconds from its samples, taken round by round with the base width's:
    the base's median times the median of each round's ratio to it. A VM's speed drifts
    within seconds; the widths of one round share its phase, so their ratios (what the draft
    choice and the breaker's threshold read) hold where each width's own median or minimum
    mixes phases (one plan's 7-token pass calibrated at 0.99-1.44 steps, then 1.05-1.80, over
    starts).

    Example: base 1, samples {1: [10, 20], 7: [11, 22]} -> [15.0, 16.5] (ratios 1.1, 1.1)."""
    step = statistics.median(samples[base])
    return [
        step * statistics.median(w / b for w, b in zip(samples[width], samples[base], strict=True))
        for width in samples
    ]
