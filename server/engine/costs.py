"""What a pass costs, and which drafts are worth it: break-even, the cost tables, draft choice.

A round with per-token acceptance alpha and k drafts emits E = (1 - alpha^(k+1)) / (1 - alpha)
tokens (Leviathan et al. 2023, eq. 1) for the price of one pass over k+1 tokens; decoding
autoregressively emits one token per single-token pass.

- `Costs`: what a packed pass of (rows, tokens) costs, as the draft choice asks it. Two tables
  answer: `PassCosts`, the seconds `calibration.calibrate` timed at start-up, and
  `live_costs.LiveCosts`, the same table corrected by every pass since.
- `choose_drafts` picks, for each pass, how many of its drafts every row verifies, for the most
  expected tokens per measured second.
- The breaker's threshold is the lowest alpha at which some draft length pays for itself in one
  row, E(alpha) > cost(k+1) / cost(1): below it, no choice of drafts can pay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# A wider pass is never taken to cost less than this many steps: on a busy CPU a 2-token pass
# can time below a 1-token one, which would set the threshold to 0 and never open a breaker.
_MIN_RATIO = 1.05


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
    return solve_acceptance(lambda alpha: expected_tokens_per_round(alpha, k), tokens_per_round)


def solve_acceptance(expected: Callable[[float], float], tokens: float) -> float:
    """The alpha in [0, 1] at which expected(alpha), increasing in alpha, equals tokens: 0 when
    tokens <= expected(0), 1 when tokens >= expected(1)."""
    if tokens <= expected(0.0):
        return 0.0
    if tokens >= expected(1.0):
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(40):  # bisection to 1e-12, well below float32 noise
        middle = (low + high) / 2
        if expected(middle) < tokens:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def one_row_steps(pass_seconds: Mapping[tuple[int, int], float]) -> dict[int, float]:
    """One row's measured passes in steps (their seconds over one token's), by width, rounded
    for logs: {1: 1.0, 2: 0.98, ..., 17: 1.38}; {} without a one-token pass."""
    step = pass_seconds.get((1, 1))
    if not step:
        return {}
    return {t: round(s / step, 2) for (r, t), s in sorted(pass_seconds.items()) if r == 1}


def lowest_break_even(one_row: dict[int, float]) -> float:
    """The breaker's threshold from one row's pass seconds by width (1 .. k + 1).

    The breaker guards against speculation that cannot pay at any length the batch may choose:
    the lowest break-even over draft lengths, each width at its cheapest padding (with W @ x^T
    kernels a 2-token pass can cost about one step, so one draft pays at nearly any acceptance;
    see engine.linear_kernels).
    """
    padded = cheapest_widths(one_row)
    return min(
        break_even_acceptance(max(one_row[padded.get(w, w)] / one_row[1], _MIN_RATIO), w - 1)
        for w in sorted(one_row)
        if w > 1
    )


def cheapest_widths(costs: dict[int, float], margin: float = 0.05) -> dict[int, int]:
    """For each multi-token width, a wider one that costs at least `margin` less, if any.

    Small GEMMs are not monotonic in M on every CPU (3 tokens can cost more than 5), so
    padding a pass with tokens that are scored and then cropped can be free.

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


class Costs(Protocol):
    """A packed forward pass's cost in seconds, by its shape: what the draft choice reads."""

    def cost(self, rows: int, tokens: int) -> float:
        """Seconds of one pass over `rows` rows with `tokens` tokens in all."""
        ...

    def pass_tokens(self, tokens: int, limit: int) -> int:
        """For a one-row pass of `tokens`, the cheapest token count to pad it to (<= limit)."""
        ...


@dataclass(frozen=True, slots=True)
class PassCosts:
    """Measured seconds of a packed forward pass by (rows, tokens), to choose drafts by.

    Token counts and row counts between the measured ones are interpolated linearly; passes
    of more tokens than measured are extrapolated in proportion to the most measured.
    """

    seconds: dict[tuple[int, int], float]  # (rows, tokens in the pass) -> seconds
    # The measured token counts of each measured row count, both sorted: a live table updates
    # its seconds, never its shapes.
    tokens_by_rows: dict[int, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shapes: dict[int, list[int]] = {}
        for rows, tokens in sorted(self.seconds):
            shapes.setdefault(rows, []).append(tokens)
        object.__setattr__(self, "tokens_by_rows", shapes)

    def cost(self, rows: int, tokens: int) -> float:
        measured_rows = list(self.tokens_by_rows)
        below = max((r for r in measured_rows if r <= rows), default=measured_rows[0])
        above = min((r for r in measured_rows if r >= rows), default=measured_rows[-1])
        low, high = self._at(below, tokens), self._at(above, tokens)
        if above == below:
            return low
        return low + (high - low) * (rows - below) / (above - below)

    def _at(self, rows: int, tokens: int) -> float:
        counts = self.tokens_by_rows[rows]
        lower = max((t for t in counts if t <= tokens), default=counts[0])
        upper = min((t for t in counts if t >= tokens), default=None)
        if upper is None:
            return self.seconds[rows, lower] * tokens / lower
        if upper == lower:
            return self.seconds[rows, lower]
        low, high = self.seconds[rows, lower], self.seconds[rows, upper]
        return low + (high - low) * (tokens - lower) / (upper - lower)

    def pass_tokens(self, tokens: int, limit: int) -> int:
        """For a one-row pass, the cheapest measured token count >= tokens (and <= limit):
        padding can make a pass cheaper (small GEMMs are not monotonic in M on every CPU)."""
        candidates = [t for r, t in self.seconds if r == 1 and tokens <= t <= limit] or [tokens]
        return min(candidates, key=lambda t: (self._at(1, t), t))


def choose_drafts(
    gains: Sequence[Sequence[float]],
    costs: Costs | None,
    base_tokens: int | None = None,
    *,
    tokens: int | None = None,
    row_work: float = 0.0,
    token_work: float = 0.0,
) -> list[int]:
    """How many of its proposed drafts each row verifies, to maximise the pass's expected
    tokens per second.

    gains[r][i]: the expected accepted tokens draft i of row r adds (for a chain with per-token
    acceptance a, a^(i+1): E(a, i + 1) - E(a, i), Leviathan et al. 2023, eq. 1; for a token
    tree, node i's path probability); non-increasing within a row, so that a row's first n
    drafts are a chain's prefix or a tree's best n nodes, parents first. A packed pass costs
    cost(rows, tokens), every row paying only for its own tokens, so for any token budget the
    best drafts are the budget's highest gains over all rows; the budget chosen is the one
    with the best (rows + gains) / cost. base_tokens: the pass's tokens without drafts (one
    per row, plus prompt tails prefilled in it).

    Example (cost 1.0 for 1 token, 2.0 for 7): one row, k=6, a=0.8 -> 6 drafts (3.6 tokens
    per 2.0 s beats 1 per 1.0 s); eight rows where only one speculates well -> that row's
    drafts, the others' none. tokens: the pass's size asked for (live costs measuring a
    stale shape): the best drafts up to that many tokens, whatever they are worth. row_work:
    the seconds a row's round takes past a plain row's once it verifies any draft (walking
    and learning its tree), charged with its first draft; token_work: the seconds of a round's
    own work each token it emits costs (a row of logits read, the token delivered), charged
    for the tokens the drafts are expected to add.
    """
    rows = len(gains)
    if (costs is None and tokens is None) or not any(gains):
        return [len(row) for row in gains]
    base = rows if base_tokens is None else base_tokens
    # Gains in order, a row's i-th draft before its (i + 1)-th (equal gains included).
    ranked = sorted(
        (
            (gain, -i, row)
            for row, row_gains in enumerate(gains)
            for i, gain in enumerate(row_gains)
        ),
        reverse=True,
    )
    if tokens is not None:
        best = max(0, min(len(ranked), tokens - base))
    else:
        assert costs is not None
        best, best_rate, expected = 0, rows / costs.cost(rows, base), float(rows)
        drafting: set[int] = set()
        for taken, (gain, _, row) in enumerate(ranked, start=1):
            expected += gain
            drafting.add(row)
            work = row_work * len(drafting) + token_work * (expected - rows)
            rate = expected / (costs.cost(rows, base + taken) + work)
            if rate > best_rate:
                best, best_rate = taken, rate
    counts = [0] * rows
    for _, _, row in ranked[:best]:
        counts[row] += 1
    return counts


def chain_gains(length: int, acceptance: float) -> list[float]:
    """The gains of a chain's drafts at per-token acceptance a: a, a^2, ..., a^length."""
    return [acceptance**j for j in range(1, length + 1)]
