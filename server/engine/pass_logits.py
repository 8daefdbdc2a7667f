"""A pass row's next-token logits: the one logits type acceptance and recycling read.

Row i of a `Logits` is the target's next-token distribution (float32 logits) after the row's
i-th scored token (see verify_pass). Its operations: `argmax(i)` (a greedy walk), `[i]` (a row
to sample from), `computed(count)` (the rows already computed, for recycling). Where its rows
come from depends on the device:

- On a CPU with a plain output layer (`lazy_logits`), rows are computed only when read. (With
  the lean forward's GEMV, which reads the layer once for a dozen rows at one row's cost, a pass
  of at most `OutputLayer.together` rows has them all computed at once instead.) A
  verification reads row i only if drafts 1..i were all accepted, so on average it needs
  "tokens per round" rows, not k+1: with a 49k vocabulary the output layer is the biggest
  matrix of a small model. Row 0 is read by every sequence of a batched pass, so it is
  computed for all of them in one GEMM (one read of the output layer instead of one per
  sequence). A row past 0 is computed with the next BLOCK - 1 rows: a verification that reads
  row 1 usually reads more, and one product of the output layer with a few rows costs about
  what a single-row GEMV does, so a fully accepted 6-token draft reads the layer 3 times
  instead of 7.
- Otherwise (`computed_logits`) every row is computed already: a generic model's logits, or,
  on an accelerator, all rows of the pass in one product (a few dozen rows of the output layer
  cost a GPU what one does). There every read that turns into a Python int waits for the
  device and copies: a batch of 8 sequences accepting 3 drafts each would pay ~30 waits per
  pass. So the greedy token of every row of the pass is copied to the host once, the first
  time any sequence asks (`one_copy`): an int per position, not a vocabulary row. Sampled
  rows are still drawn one by one on the device (each draw one small copy), their generator
  keyed by output position (sampling.PositionalGenerator).

Example: an accelerator's pass of rows [pending, d1, d2] and [pending]: `argmax(0)` on either
sequence runs one argmax over the 4 rows and one copy of 4 ints; the other's copies nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

BLOCK = 4  # lazy rows computed together past row 0


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logits in float32, soft-capped to (-softcap, softcap) as Gemma 2's output layer does."""
    if softcap is None:
        return logits.float()
    return torch.tanh(logits / softcap).mul_(softcap).float()


# Row dtypes whose argmax numpy takes (it has no bfloat16): 49,152 float32 logits in ~6 us
# on the benchmark VM, torch's argmax 50-150 us (its threads woken for one row).
_NUMPY_ARGMAX = frozenset({torch.float32, torch.float64, torch.float16})


@dataclass(frozen=True, slots=True)
class OutputLayer:
    """A plain output layer, for rows computed from hidden states."""

    weight: torch.Tensor | None  # [vocab, hidden_size] (None: product)
    transposed: torch.Tensor | None  # [hidden_size, vocab]: for one-row GEMVs (None: product)
    softcap: float | None = None  # final_logit_softcapping
    # hidden [rows, hidden_size] -> logits through the lean forward's kernels (forward.head);
    # given, it computes every row and `transposed` may be None
    product: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a pass with at most this many rows to score has them all computed in one product, at
    # about one row's cost (the lean forward's GEMV reads the layer once for up to ~12 rows)
    together: int = 1

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of hidden [rows, hidden_size]: a GEMV for one row, else
        weight @ hidden^T (for a wide head and a few rows, far cheaper than hidden @ weight^T
        on CPUs; docs/design.md)."""
        with torch.inference_mode():
            if self.product is not None:
                return capped(self.product(hidden), self.softcap)
            if hidden.shape[0] == 1:
                assert self.transposed is not None  # one of the two is given (target.py)
                return capped(hidden @ self.transposed, self.softcap)
            assert self.weight is not None
            return capped((self.weight @ hidden.t()).t(), self.softcap)

    def row(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] of one hidden state [hidden_size]: a GEMV."""
        with torch.inference_mode():
            if self.product is not None:
                return capped(self.product(hidden[None]), self.softcap)[0]
            assert self.transposed is not None  # one of the two is given (target.py)
            return capped(hidden @ self.transposed, self.softcap)


class _PassArgmax:
    """The argmax of every row of one pass's logits, copied to the host on first use."""

    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits  # [rows the pass's sequences read, vocab], on the device
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self._logits.argmax(dim=-1).tolist()  # the pass's one copy
        return self._ids


class Logits:
    """One pass row's next-token logits, by scored position (see the module doc)."""

    def __init__(
        self,
        count: int,
        *,
        rows: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        head: OutputLayer | None = None,
        first: torch.Tensor | None = None,
        pass_argmax: _PassArgmax | None = None,
        offset: int = 0,
    ) -> None:
        self._count = count
        self._all = rows  # [count, vocab] when every row is computed already
        self._hidden = hidden  # [count, hidden_size] for rows computed on access
        self._head = head
        self._lazy: dict[int, torch.Tensor] = {0: first} if first is not None else {}
        self._pass_argmax = pass_argmax  # the pass's greedy tokens, in one copy
        self._offset = offset  # this row's first in the pass's argmax
        self._ahead: torch.Tensor | None = None  # rows computed ahead, handed out as read
        # the target's final hidden states [count, hidden_size] the rows were computed from,
        # where the forward has them (a learned draft head reads one: engine.draft_head)
        self.features: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: torch.Tensor) -> Logits:
        """Logits of rows [positions, vocab] already computed."""
        return cls(int(rows.shape[0]), rows=rows)

    @classmethod
    def ahead(cls, rows: torch.Tensor) -> Logits:
        """Rows [positions, vocab] computed ahead of reading (lazy_logits' `together`): read
        as lazy rows are; `computed` lists them all, read or not (recycling keeps them)."""
        logits = cls(int(rows.shape[0]))
        logits._ahead = rows
        return logits

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> torch.Tensor:
        """Row `index` [vocab], float32 (a row to sample from)."""
        self._check(index)
        if self._all is not None:
            return self._all[index]
        row = self._lazy.get(index)
        if row is None:
            if self._ahead is not None:
                row = self._lazy[index] = self._ahead[index]
                return row
            self._compute(index)
            row = self._lazy[index]
        return row

    def argmax(self, index: int) -> int:
        """The greedy token after scored position `index`."""
        if self._pass_argmax is not None:
            self._check(index)
            return self._pass_argmax.ids()[self._offset + index]
        row = self[index]
        if row.device.type == "cpu" and row.dtype in _NUMPY_ARGMAX:  # ~6 us, torch's 50-150
            return int(row.detach().numpy().argmax())  # (both: the first largest, or NaN)
        return int(row.argmax())

    def computed(self, count: int) -> list[tuple[int, torch.Tensor]]:
        """(index, row) of the rows among the first `count` computed so far (for recycling
        the target's predictions): all for rows computed already or ahead, those a walk read
        for lazy ones."""
        every = self._all if self._all is not None else self._ahead
        if every is not None:
            return [(i, every[i]) for i in range(min(count, self._count))]
        return [(i, row) for i, row in sorted(self._lazy.items()) if i < count]

    def _check(self, index: int) -> None:
        if not 0 <= index < self._count:
            raise IndexError(f"row {index} of a {self._count}-position pass")

    def _compute(self, index: int) -> None:
        """Row `index` and the next BLOCK - 1 not yet computed, in one product."""
        assert self._hidden is not None and self._head is not None
        end = min(index + BLOCK, self._count)
        while end - 1 in self._lazy:
            end -= 1
        if end - index == 1:
            self._lazy[index] = self._head.row(self._hidden[index])
            return
        block = self._head.rows(self._hidden[index:end])  # [end - index, vocab]
        self._lazy.update(zip(range(index, end), block, strict=True))


def lazy_logits(
    hidden: torch.Tensor, spans: Sequence[tuple[int, int]], head: OutputLayer
) -> list[Logits]:
    """Per span [begin, end) of hidden [positions, hidden_size], its rows on access; every
    span's row 0 now, in one product (every sequence reads one). A pass of at most
    `head.together` rows has them all computed now, in that one product."""
    if sum(end - begin for begin, end in spans) <= head.together:
        rows = head.rows(_rows_of(hidden, spans))
        return [Logits.ahead(block) for block in rows.split([end - b for b, end in spans])]
    firsts = head.rows(hidden[[begin for begin, _ in spans]])  # [spans, vocab]
    return [
        Logits(end - begin, hidden=hidden[begin:end], head=head, first=firsts[i])
        for i, (begin, end) in enumerate(spans)
    ]


def _rows_of(hidden: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """hidden's rows of the spans, in order: a slice where each span ends where the next
    begins (a one-row pass's: no gather), else gathered."""
    if spans and all(end == following for (_, end), (following, _) in pairwise(spans)):
        return hidden[spans[0][0] : spans[-1][1]]
    return hidden[[i for begin, end in spans for i in range(begin, end)]]


def computed_logits(
    logits: torch.Tensor, lengths: Sequence[int], *, one_copy: bool = False
) -> list[Logits]:
    """Logits of consecutive sequences of `lengths` rows of logits [sum(lengths), vocab];
    one_copy: their greedy tokens come to the host in one copy for them all (accelerators)."""
    argmax = _PassArgmax(logits) if one_copy else None
    result, begin = [], 0
    for length in lengths:
        rows = logits[begin : begin + length]
        result.append(Logits(length, rows=rows, pass_argmax=argmax, offset=begin))
        begin += length
    return result
