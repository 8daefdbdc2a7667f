"""The break-even acceptance rate, from the measured cost of a verification pass.

A round with per-token acceptance alpha and k drafts emits E = (1 - alpha^(k+1)) / (1 - alpha)
tokens (Leviathan et al. 2023, eq. 1) for the price of one pass over k+1 tokens; decoding
autoregressively emits one token per single-token pass. Speculation with k drafts pays while
E(alpha) > cost(k+1) / cost(1); the breaker's threshold is the lowest alpha where that holds
for some k up to the maximum (the batch then chooses each row's drafts, see batch.choose_drafts).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from server.engine.target import TargetModel

# A wider pass is never taken to cost less than this many steps: on a busy CPU a 2-token pass
# can time below a 1-token one, which would set the threshold to 0 and never open a breaker.
_MIN_RATIO = 1.05


@dataclass(frozen=True, slots=True)
class Calibration:
    num_draft_tokens: int
    step_seconds: float  # one token through the target, with a warm KV cache
    verify_seconds: float  # k + 1 tokens in one pass (padded to a cheaper width if there is one)
    threshold: float
    widths: dict[int, int] = field(default_factory=dict)  # pass width -> cheaper padded width
    pass_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens)

    @property
    def cost_ratio(self) -> float:
        return self.verify_seconds / self.step_seconds


def expected_tokens_per_round(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even_acceptance(cost_ratio: float, k: int) -> float:
    """The alpha where E(alpha) equals cost_ratio: 0 if verifying is free, 1 if it never pays."""
    return implied_acceptance(cost_ratio, k)


def implied_acceptance(tokens_per_round: float, k: int) -> float:
    """The per-token acceptance alpha whose E(alpha) is tokens_per_round (0 at 1, 1 at k + 1).

    Rounds are compared with the break-even this way, through the tokens they really emitted,
    because acceptance is far from independent per position: a context match is accepted as a
    whole span or not at all, and a round then yields more than E(accepted / drafted).
    """
    if tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):  # E is increasing in alpha; bisection to well below float32 noise
        middle = (low + high) / 2
        if expected_tokens_per_round(middle, k) < tokens_per_round:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def calibrate(
    target: TargetModel, k: int, *, context_tokens: int = 128, repeats: int = 7, rows: int = 1
) -> Calibration:
    """Time passes of 1..k+1 tokens after a context_tokens prefill (medians of repeats), for
    one row and, when rows > 1, for batches of 2, 4 and `rows` (fewer repeats: those passes
    are longer).
    """
    widths = list(range(1, k + 2))
    costs = dict(
        zip(widths, measure_pass_seconds(target, widths, context_tokens, repeats), strict=True)
    )
    padded = cheapest_widths(costs)
    verify = costs[padded.get(k + 1, k + 1)]
    batch_costs = {(1, width): seconds for width, seconds in costs.items()}
    # Cost is not linear in rows (a pass of 4 rows x 1 token can cost what one row's does, see
    # engine.linear_kernels), so a few row counts are measured and PassCosts interpolates.
    for count in [r for r in (2, 4) if r < rows] + ([rows] if rows > 1 else []):
        batched = measure_pass_seconds(
            target, widths, context_tokens, max(2, repeats // 2), rows=count
        )
        batch_costs.update({(count, count * w): s for w, s in zip(widths, batched, strict=True)})
    # The breaker guards against speculation that cannot pay at any length the batch may choose:
    # the lowest break-even over draft lengths (with W @ x^T kernels a 2-token pass can cost
    # about one step, so one draft pays at nearly any acceptance; see engine.linear_kernels).
    threshold = min(
        break_even_acceptance(max(costs[padded.get(w, w)] / costs[1], _MIN_RATIO), w - 1)
        for w in widths[1:]
    )
    return Calibration(k, costs[1], verify, threshold, padded, batch_costs)


def cheapest_widths(costs: dict[int, float], margin: float = 0.05) -> dict[int, int]:
    """For each multi-token width, a wider one that costs at least `margin` less, if any.

    Small GEMMs are not monotonic in M on every CPU (measured on an AVX2 EPYC: 3 tokens cost
    more than 5), so padding a pass with tokens that are scored and then cropped can be free.

    Example: {1: 40, 2: 66, 3: 79, 4: 72, 5: 67} -> {3: 5, 4: 5}
    """
    padded = {}
    for width in sorted(costs):
        if width == 1:
            continue  # autoregressive steps are never padded
        best = min((w for w in costs if w >= width), key=lambda w: (costs[w], w))
        if costs[best] < costs[width] * (1 - margin):
            padded[width] = best
    return padded


def measure_pass_seconds(
    target: TargetModel, widths: list[int], context_tokens: int, repeats: int, rows: int = 1
) -> list[float]:
    vocab = min(target.vocab_size, len(target.tokenizer))
    context = [(7 + 31 * i) % vocab for i in range(min(context_tokens, target.max_context // 2))]
    cache = target.new_cache(rows)
    for row in range(rows):
        target.prefill(cache, row, 0, context)
    samples: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(repeats + 1):  # the first pass of each width warms up and is dropped
        for width in widths:
            started = time.perf_counter()
            # A pass reads at least one row of logits per sequence; the cache length stays.
            target.forward(cache, [len(context)] * rows, [context[:width]] * rows)[0][0]
            samples[width].append(time.perf_counter() - started)
    return [statistics.median(samples[width][1:]) for width in widths]
