"""A greedy token from half the output layer's bytes, exactly (docs/design.md, "The greedy
token through an int8 screen").

A step reads the output layer (SmolLM2: 49,152 x 576 in bfloat16, 57 MB, a fifth of a step's
bytes) to find one argmax. With the lean forward's kernels, the logits of a row are the bf16
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
L: the candidates {j : A_j + b_j >= L} hold every maximum of G. On the default model's own
hidden states a handful of tokens pass (bench/results/peers-2026-12-03-screened).

Verify passes (2 to WIDE_SCREEN_ROWS rows, CPUs with AVX512-VNNI) quantize the rows as well:
x ~= t p with p = round(x / t) in [-127, 127] (csrc/gemv_u8s8.c), so the product is integer
multiply-adds, 64 a vpdpbusd where dpbf16 does 32. Then A_j = s_j t (p . q_j), and

    |x . w_j - s_j t (p . q_j)| <= |x . (w_j - s_j q_j)| + |(x - t p) . s_j q_j|
                                <= |x|_2 e_j + |x - t p|_2 |s_j q_j|_2

so the bound gains the term d |s_j q_j|_2 (d = |x - t p|_2 per row, from the kernel in
float64; |s_j q_j|_2 once, in float64), inside the same 1.01. Looser (hidden states have a
few channels ~10x the rest, which set t): dozens of candidates a row rather than a handful.
The candidates' exact logits are written back into the approximate row, so a row the walk
read recycles the exact best token.

Only the argmax is screened: rows a request reads whole (sampling, logprobs, penalties,
grammars) are computed exactly, as before; the approximate rows serve the recycled predictions
(drafts only) and the screen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kenspec.server.engine.forward.cpu_kernels import CpuKernels
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.quantize import quantize

# The widest pass (rows of logits) screened with the int8 copy alone: one row, a plain step.
# A verify pass's rows are computed together in one read of the bf16 layer at about one row's
# cost (lazy_logits' `together`), where an int8 product of several rows with its weights
# widened to bf16 is bound by its multiply-adds and saves little.
SCREEN_ROWS = 1
# ... and with the rows quantized too (csrc/gemv_u8s8.c, AVX512-VNNI: half dpbf16's
# instructions a weight), up to this many rows.
WIDE_SCREEN_ROWS = 64
CANDIDATES = 4096  # more than this many candidates: the whole row, exactly


class ScreenedHead:
    """The output layer's exact weight [vocab, hidden] (bf16), an int8 copy and each row's
    error bound; the GEMV both are read with."""

    def __init__(
        self, weight: torch.Tensor, kernels: CpuKernels, *, in_c: bool = True, wide: bool = True
    ) -> None:
        """kernels: kenspec's (AVX512-BF16: the GEMV). in_c: layer.c's kenspec_screen finds
        the candidates in two reads of the approximate row (else torch's operations: ~0.3 ms
        a row). wide: passes of 2 to WIDE_SCREEN_ROWS rows quantize the rows too, where the
        CPU has AVX512-VNNI (`rows`)."""
        if not kernels.bf16:
            raise ValueError("the screen reads the output layer with the bf16 GEMV (AVX512-BF16)")
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"the screen takes a bfloat16 output layer, not {weight.dtype}")
        self.exact = weight.detach().contiguous()
        int8 = quantize(self.exact, torch.bfloat16)
        self.values, self.scales = int8.values, int8.scales
        # In float64 a block of rows at a time, not three float64 copies of the whole layer
        # at once (680 MB at start-up for SmolLM2's)
        blocks = [slice(first, first + BLOCK) for first in range(0, self.exact.shape[0], BLOCK)]
        bounds = [_error(self.exact[b], self.values[b], self.scales[b]) for b in blocks]
        self.error = _rounded_up(torch.cat([error for error, _ in bounds]))
        # |s_j q_j|_2: the quantized rows' residues' weight in the bound
        self.weight = _rounded_up(torch.cat([weight for _, weight in bounds]))
        self.kernels = kernels
        self.in_c = in_c
        self.wide = wide and kernels.vnni
        if self.wide:
            self.u8s8_scale, self.u8s8_offset = kernels.u8s8_prepare(self.values, self.scales)
        # the widest pass screened (forward.head)
        self.rows = WIDE_SCREEN_ROWS if self.wide else SCREEN_ROWS
        self._found = torch.empty(CANDIDATES, dtype=torch.int32)  # kenspec_screen's output

    def approximate(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Approximate logits [rows, vocab] (float32) of bf16 hidden [rows, hidden], and the
        rows' quantization residues (float64 [rows]; None: the rows were not quantized)."""
        if hidden.dtype != torch.bfloat16:
            raise ValueError(f"the screen takes bfloat16 hidden states, not {hidden.dtype}")
        hidden = hidden.contiguous()
        if self.wide and hidden.shape[0] > 1:
            return self.kernels.u8s8(hidden, self.values, self.u8s8_scale, self.u8s8_offset)
        return self.kernels.widened(hidden, self.values, self.scales).float(), None

    def row(self, x: torch.Tensor) -> torch.Tensor:
        """The exact logits [vocab] (float32) of one hidden state x [hidden]."""
        return self.kernels.gemv(x[None].contiguous(), self.exact)[0].float()

    def argmax(
        self, x: torch.Tensor, approximate: torch.Tensor, residue: float | None = None
    ) -> int:
        """The exact row's argmax (the earlier token among equal logits), from its
        approximation and, where x was quantized for it, x's residue (see the module doc).
        Writes the candidates' exact logits into approximate (its largest is then exact)."""
        norm = float(x.double().norm()) * (1 + 1e-6)
        weight = None if residue is None else self.weight
        if self.in_c:
            count = self.kernels.screen(
                approximate, self.error, norm, self._found, weight, residue or 0.0
            )
            if not 0 <= count <= CANDIDATES:  # a non-finite logit, or too many: the whole row
                return int(self.exact_row(x, approximate).argmax())
            # The candidates' exact logits, written into the approximate row (as below), and
            # their best, in one call.
            found = self._found[:count]
            best = self.kernels.exact_candidates(x.contiguous(), self.exact, found, approximate)
            if best < 0:  # (no candidate: a bound cannot leave none; the whole row if it did)
                return int(self.exact_row(x, approximate).argmax())
            return best
        bound = self.error * norm
        if residue is not None:
            bound.add_(self.weight, alpha=residue)
        bound = bound.add_(approximate.abs(), alpha=2.0**-8).mul_(1.01).add_(1e-30)
        low = (approximate - bound).max()
        if not torch.isfinite(low):  # (a non-finite logit: the whole row, exactly)
            return int(self.exact_row(x, approximate).argmax())
        candidates = torch.nonzero(approximate + bound >= low).flatten()
        if len(candidates) > CANDIDATES:
            return int(self.exact_row(x, approximate).argmax())
        weights = self.exact.index_select(0, candidates)
        exact = self.kernels.gemv(x[None].contiguous(), weights)[0].float()
        # The candidates' exact logits into the approximate row, so the row's recycled
        # predictions (drafts) start from the exact best token: every other token's A_j is
        # below L, which no exact maximum is below.
        with torch.inference_mode():  # (the pass made approximate under it)
            approximate.index_copy_(0, candidates, exact)
        return int(candidates[int(exact.argmax())])

    def exact_row(self, x: torch.Tensor, approximate: torch.Tensor) -> torch.Tensor:
        """x's exact row, computed whole, and written over its approximation (what recycling
        reads)."""
        row = self.row(x)
        with torch.inference_mode():  # (the pass made approximate under it)
            approximate.copy_(row)
        return row

    def logits(self, hidden: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Logits]:
        """Per span [begin, end) of hidden [positions, hidden], its rows screened: every row's
        approximation now, in one int8 product; argmax and whole rows exact, on access."""
        index = [i for begin, end in spans for i in range(begin, end)]
        rows = hidden[index].contiguous()
        approximate, residues = self.approximate(rows)
        residue = residues.tolist() if residues is not None else [None] * len(index)
        result: list[Logits] = []
        first = 0
        for begin, end in spans:
            last = first + end - begin
            result.append(
                ScreenedLogits(self, rows[first:last], approximate[first:last], residue[first:last])
            )
            first = last
        return result


BLOCK = 4096  # output rows whose error bound is computed at once


def _error(
    weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """|w_j - s_j q_j|_2 + 1e-4 |w_j|_2 and |s_j q_j|_2 per row of weight [rows, in], in
    float64."""
    with torch.no_grad():
        exact = weight.double()
        quantized = scales.double()[:, None] * values.double()
        error = (exact - quantized).norm(dim=1) + 1e-4 * exact.norm(dim=1)
        return error, quantized.norm(dim=1)


def _rounded_up(bound: torch.Tensor) -> torch.Tensor:
    """float64 bound as float32, rounded up (a bound may only grow)."""
    rounded = bound.float()
    up = torch.nextafter(rounded, rounded.new_tensor(torch.inf))
    return torch.where(rounded.double() < bound, up, rounded)


class ScreenedLogits(Logits):
    """A pass row's logits through a ScreenedHead: `argmax` and `[i]` exact, `computed` the
    approximations (for recycling: drafts only)."""

    def __init__(
        self,
        head: ScreenedHead,
        hidden: torch.Tensor,
        approximate: torch.Tensor,
        residues: Sequence[float | None] | None = None,
    ):
        super().__init__(int(hidden.shape[0]))
        self._screen = head
        self._rows = hidden  # [count, hidden_size], bf16
        self._approximate = approximate  # [count, vocab]
        self._residues = residues if residues is not None else [None] * self._count
        self._argmax: dict[int, int] = {}

    def __getitem__(self, index: int) -> torch.Tensor:
        self._check(index)
        row = self._lazy.get(index)
        if row is None:
            row = self._screen.exact_row(self._rows[index], self._approximate[index])
            self._lazy[index] = row
        return row

    def argmax(self, index: int) -> int:
        self._check(index)
        token = self._argmax.get(index)
        if token is None:
            row = self._lazy.get(index)
            if row is not None:
                token = int(row.argmax())
            else:
                token = self._screen.argmax(
                    self._rows[index], self._approximate[index], self._residues[index]
                )
            self._argmax[index] = token
        return token

    def computed(self, count: int) -> list[tuple[int, torch.Tensor]]:
        return [(i, self._approximate[i]) for i in range(min(count, self._count))]
