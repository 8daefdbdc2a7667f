"""Logits of a pass on an accelerator, read by acceptance with one device-to-host copy per pass.

On a CPU, acceptance reads a logits row where it lies and `LazyLogits` computes only the rows
it reads. On a GPU every read that turns into a Python int (`int(row.argmax())`) waits for the
device and copies: a batch of 8 sequences accepting 3 drafts each would pay ~30 waits per
pass, each one an idle GPU. There, all rows of the pass are computed in one product (a few
dozen rows of the output layer cost the GPU what one does) and the greedy token of every row
of the pass is copied to the host once, the first time any sequence asks: an int per position,
not a vocabulary row. Sampled rows are still drawn one by one on the device (each draw is one
small copy): their generator is keyed by output position (sampling.PositionalGenerator).

Example: a pass of rows [pending, d1, d2] and [pending]: `argmax_ids()` on either sequence runs
one argmax over the 4 rows and one copy of 4 ints; the other sequence's call copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class _PassArgmax:
    """The argmax of every row of one pass's logits, copied to the host on first use."""

    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits  # [rows the pass's sequences read, vocab], on the device
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self._logits.argmax(dim=-1).tolist()  # the pass's one copy
        return self._ids


class PassLogits:
    """One sequence's next-token logits in a pass ([positions, vocab] float32 on the device),
    indexed like a tensor, with its rows' greedy tokens read through the pass's one copy."""

    def __init__(self, logits: torch.Tensor, begin: int, end: int, argmax: _PassArgmax) -> None:
        self._logits = logits  # the whole pass's rows; this sequence's are [begin, end)
        self._begin, self._end = begin, end
        self._argmax = argmax

    def __len__(self) -> int:
        return self._end - self._begin

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a {len(self)}-position pass")
        return self._logits[self._begin + index]

    def argmax_ids(self) -> list[int]:
        """The greedy token after each position (the pass's one device-to-host copy)."""
        return self._argmax.ids()[self._begin : self._end]

    def computed(self) -> dict[int, torch.Tensor]:
        """Every row (for recycling the target's predictions): the pass computed them all."""
        return {index: self[index] for index in range(len(self))}


def split_pass(logits: torch.Tensor, lengths: Sequence[int]) -> list[PassLogits]:
    """PassLogits for consecutive sequences of `lengths` rows of `logits` [sum(lengths), vocab],
    sharing one argmax copy."""
    argmax = _PassArgmax(logits)
    result, begin = [], 0
    for length in lengths:
        result.append(PassLogits(logits, begin, begin + length, argmax))
        begin += length
    return result
