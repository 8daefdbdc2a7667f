"""A greedy token from half the output layer's bytes, exactly (docs/design.md, "The greedy
token through an int8 screen").

A step reads the output layer (SmolLM2: 49,152 x 576 in bfloat16, 57 MB, a fifth of a step's
bytes) to find one argmax. With the fast step's kernels, the logits of a row are the bf16
GEMV's (csrc/gemv.c: each one a float32 sum of dpbf16 products, one reduce16, rounded to
bfloat16 once). Here a row's logits are first approximated through an int8 copy of the layer
(one scale per output row, engine.quantize; the int8 GEMV reads half the bytes), then every
token whose exact logit could still be the largest is computed exactly, by the same GEMV over
those weight rows only; the argmax of those is the argmax of the exact row, ties to the
earlier token as torch's argmax.

Why no token is missed. For hidden state x and output row j (w_j in bf16; s_j, q_j its int8
scale and values), let G_j be the exact logit and A_j the approximate one. The true sums
differ by |x . (w_j - s_j q_j)| <= |x|_2 e_j (Cauchy-Schwarz, e_j = |w_j - s_j q_j|_2 computed
once, in float64); each float32 sum of 576 products is within 576 * 2^-24 |x|_2 |w_j|_2 of its
true value; each rounding to bfloat16 moves a value by at most 2^-9 of it. So

    |G_j - A_j| <= b_j = 1.01 (|x|_2 (e_j + 1e-4 |w_j|_2) + 2^-8 |A_j|) + 1e-30

and with L = max_k (A_k - b_k), every token with G_j >= G_k for all k has A_j + b_j >= G_j >=
L: the candidates {j : A_j + b_j >= L} hold every maximum of G. On SmolLM2's own hidden states
a median of 3 tokens pass, at most 45 in 4,407 steps.

Only the argmax is screened: rows a request reads whole (sampling, logprobs, penalties,
grammars) are computed exactly, as before; the approximate rows serve the recycled predictions
(drafts only) and the screen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.engine import cpu_gemv
from server.engine.pass_logits import Logits
from server.engine.quantize import quantize

# The widest pass (rows of logits) screened: one row, a plain step. A verify pass's rows are
# computed together in one read of the bf16 layer at about one row's cost (lazy_logits'
# `together`), where an int8 product of 7 rows is bound by its multiply-adds and saved 0.3 ms
# a pass, and the recycled predictions lose by the approximation (2.38 -> 2.29 tokens a round
# on 20 dev prompts).
SCREEN_ROWS = 1
CANDIDATES = 1024  # more than this many candidates: the whole row, exactly


class ScreenedHead:
    """The output layer's exact weight [vocab, hidden] (bf16), an int8 copy and each row's
    error bound; the GEMV both are read with."""

    def __init__(
        self,
        weight: torch.Tensor,
        gemv: cpu_gemv.Gemv,
        kernels: cpu_gemv.LayerKernels | None = None,
    ) -> None:
        """kernels: csrc/layer.c's, whose kenspec_screen finds the candidates in two reads of
        the approximate row (torch's operations otherwise: ~0.3 ms a row)."""
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"the screen takes a bfloat16 output layer, not {weight.dtype}")
        self.exact = weight.detach().contiguous()
        int8 = quantize(self.exact, torch.bfloat16)
        self.values, self.scales = int8.values, int8.scales
        # In float64 a block of rows at a time, not three float64 copies of the whole layer
        # at once (680 MB at start-up for SmolLM2's)
        blocks = [slice(first, first + BLOCK) for first in range(0, self.exact.shape[0], BLOCK)]
        error = torch.cat([_error(self.exact[b], self.values[b], self.scales[b]) for b in blocks])
        # float32, rounded up (the bound may only grow)
        rounded = error.float()
        up = torch.nextafter(rounded, rounded.new_tensor(torch.inf))
        self.error = torch.where(rounded.double() < error, up, rounded)
        self.gemv = gemv
        self.kernels = kernels
        self._found = torch.empty(CANDIDATES, dtype=torch.int32)  # kenspec_screen's output

    def approximate(self, hidden: torch.Tensor) -> torch.Tensor:
        """Approximate logits [rows, vocab] (float32) of bf16 hidden [rows, hidden]."""
        return self.gemv.int8_widened(hidden.contiguous(), self.values, self.scales).float()

    def row(self, x: torch.Tensor) -> torch.Tensor:
        """The exact logits [vocab] (float32) of one hidden state x [hidden]."""
        return self.gemv(x[None].contiguous(), self.exact)[0].float()

    def argmax(self, x: torch.Tensor, approximate: torch.Tensor) -> int:
        """The exact row's argmax (the earlier token among equal logits), from its
        approximation (see the module doc)."""
        norm = float(x.double().norm()) * (1 + 1e-6)
        if self.kernels is not None:
            count = self.kernels.screen(approximate, self.error, norm, self._found)
            if not 0 <= count <= CANDIDATES:  # a non-finite logit, or too many: the whole row
                return int(self.row(x).argmax())
            candidates = self._found[:count].long()
        else:
            bound = self.error * norm
            bound = bound.add_(approximate.abs(), alpha=2.0**-8).mul_(1.01).add_(1e-30)
            low = (approximate - bound).max()
            if not torch.isfinite(low):  # (a non-finite logit: the whole row, exactly)
                return int(self.row(x).argmax())
            candidates = torch.nonzero(approximate + bound >= low).flatten()
        weights = self.exact.index_select(0, candidates)
        exact = self.gemv(x[None].contiguous(), weights)[0].float()
        return int(candidates[int(exact.argmax())])

    def logits(self, hidden: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Logits]:
        """Per span [begin, end) of hidden [positions, hidden], its rows screened: every row's
        approximation now, in one int8 product; argmax and whole rows exact, on access."""
        index = [i for begin, end in spans for i in range(begin, end)]
        rows = hidden[index].contiguous()
        approximate = self.approximate(rows)
        result: list[Logits] = []
        first = 0
        for begin, end in spans:
            count = end - begin
            result.append(
                ScreenedLogits(
                    self, rows[first : first + count], approximate[first : first + count]
                )
            )
            first += count
        return result


BLOCK = 4096  # output rows whose error bound is computed at once


def _error(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """|w_j - s_j q_j|_2 + 1e-4 |w_j|_2 per row of weight [rows, in], in float64."""
    with torch.no_grad():
        exact = weight.double()
        residue = exact - scales.double()[:, None] * values.double()
        error: torch.Tensor = residue.norm(dim=1) + 1e-4 * exact.norm(dim=1)
    return error


class ScreenedLogits(Logits):
    """A pass row's logits through a ScreenedHead: `argmax` and `[i]` exact, `computed` the
    approximations (for recycling: drafts only)."""

    def __init__(self, head: ScreenedHead, hidden: torch.Tensor, approximate: torch.Tensor):
        super().__init__(int(hidden.shape[0]))
        self._screen = head
        self._rows = hidden  # [count, hidden_size], bf16
        self._approximate = approximate  # [count, vocab]
        self._argmax: dict[int, int] = {}

    def __getitem__(self, index: int) -> torch.Tensor:
        self._check(index)
        row = self._lazy.get(index)
        if row is None:
            row = self._lazy[index] = self._screen.row(self._rows[index])
        return row

    def argmax(self, index: int) -> int:
        self._check(index)
        token = self._argmax.get(index)
        if token is None:
            row = self._lazy.get(index)
            if row is not None:
                token = int(row.argmax())
            else:
                token = self._screen.argmax(self._rows[index], self._approximate[index])
            self._argmax[index] = token
        return token

    def computed(self, count: int) -> list[tuple[int, torch.Tensor]]:
        return [(i, self._approximate[i]) for i in range(min(count, self._count))]
