"""Linear layers for passes of a few tokens: W @ x^T where that is timed faster than x @ W^T.

A verification pass of one sequence and a handful of drafts, or of a few sequences, feeds
each linear layer an input of 2-5 rows. On some CPUs (AVX2 with MKL among them) `F.linear`
(x @ W^T) at such row counts costs well over its single-row GEMV, while the same product
computed as (W @ x^T)^T costs about one GEMV: a verify pass then costs about one decoding
step. The win depends on the CPU and the row count, so `measure_skinny_rows` times both on the
model's own weights at start-up and `use_skinny` switches only the row counts where W @ x^T
won. Only 2-5 rows are candidates; see docs/design.md for the measurements.

Both are the same product in float32, summed in a different order: results differ in the
last bits, as any two GEMM kernels (or batch sizes) do.

GPT-2's Conv1D layers are linear layers with the weight stored transposed ([in, out]: x @ W);
they are timed and switched the same way, W^T @ x^T read from the stored weight.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D


class SkinnyLinear(nn.Linear):
    """An nn.Linear that computes inputs of `skinny_rows` rows as (W @ x^T)^T."""

    skinny_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in self.skinny_rows:
            return F.linear(x, self.weight, self.bias)
        out = _skinny(self.weight, x.reshape(rows, x.shape[-1]))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class SkinnyConv1D(Conv1D):
    """A Conv1D (x @ W + b, W [in, out]) that computes inputs of `skinny_rows` rows as
    (W^T @ x^T)^T."""

    skinny_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in self.skinny_rows:
            stock: torch.Tensor = super().forward(x)  # type: ignore[no-untyped-call]
            return stock
        out: torch.Tensor = _skinny(self.weight.t(), x.reshape(rows, x.shape[-1])) + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


_SKINNY = {nn.Linear: SkinnyLinear, Conv1D: SkinnyConv1D}  # stock class -> its skinny class
_STOCK = {skinny: stock for stock, skinny in _SKINNY.items()}


Linear = nn.Linear | Conv1D  # a linear layer, either way its weight is stored


def _linear_weight(layer: Linear) -> torch.Tensor:
    """The layer's weight as F.linear takes it, [out, in] (a view for Conv1D)."""
    weight: torch.Tensor = layer.weight
    return weight.t() if isinstance(layer, Conv1D) else weight


def _skinny(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for a [rows, in] x, computed as (weight @ x^T)^T, contiguous."""
    return (weight @ x.t()).t().contiguous()


def decoder_linears(model: nn.Module) -> list[Linear]:
    """The model's linear layers (nn.Linear or Conv1D) but its output layer, in forward order."""
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    return [m for m in model.modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not head]


def use_skinny(model: nn.Module, rows: Iterable[int]) -> None:
    """Compute inputs of these row counts as W @ x^T in every decoder linear (none: undo)."""
    chosen = frozenset(rows)
    for layer in decoder_linears(model):
        stock = _STOCK.get(type(layer), type(layer))
        if chosen and stock in _SKINNY:
            layer.__class__ = _SKINNY[stock]
            if isinstance(layer, SkinnyLinear | SkinnyConv1D):
                layer.skinny_rows = chosen
        elif isinstance(layer, SkinnyLinear | SkinnyConv1D):
            layer.__class__ = stock
            del layer.skinny_rows


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[None]:
    """Plain nn.Linear everywhere inside the block (e.g. to time transformers as shipped)."""
    skinny = [
        layer for layer in decoder_linears(model) if isinstance(layer, SkinnyLinear | SkinnyConv1D)
    ]
    rows = skinny[0].skinny_rows if skinny else frozenset()
    use_skinny(model, ())
    try:
        yield
    finally:
        use_skinny(model, rows)


@torch.inference_mode()
def measure_skinny_rows(
    model: nn.Module,
    candidates: Iterable[int] = range(2, 6),
    *,
    repeats: int = 3,
    margin: float = 0.05,
) -> tuple[frozenset[int], dict[int, tuple[float, float]]]:
    """The row counts where W @ x^T ran the decoder's linear stack at least `margin` faster.

    Each candidate feeds every decoder linear, in order, an input of that many rows with
    either kernel, alternating; medians of `repeats`. The stack's weights do not fit in the
    CPU caches, so this streams them from memory as a forward pass does.
    Returns the chosen rows and {rows: (F.linear seconds, W @ x^T seconds)}.
    """
    layers = decoder_linears(model)
    if not layers:
        return frozenset(), {}
    weights: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (_linear_weight(layer), layer.bias) for layer in layers
    ]
    timings: dict[int, tuple[float, float]] = {}
    for rows in candidates:
        inputs = {
            size: torch.randn(rows, size, dtype=weights[0][0].dtype, device=weights[0][0].device)
            for size in {w.shape[1] for w, _ in weights}
        }

        def stack(skinny: bool, inputs: dict[int, torch.Tensor] = inputs) -> float:
            started = time.perf_counter()
            for weight, bias in weights:
                x = inputs[weight.shape[1]]
                if skinny:
                    _skinny(weight, x)
                else:
                    F.linear(x, weight, bias)
            if x.is_cuda:  # the kernels, not their launches (chosen on CPUs only, see runtime)
                torch.cuda.synchronize(x.device)
            return time.perf_counter() - started

        samples: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(repeats + 1):  # the first of each warms up and is dropped
            for skinny in (False, True) if repeat % 2 else (True, False):
                samples[skinny].append(stack(skinny))
        timings[rows] = (
            statistics.median(samples[False][1:]),
            statistics.median(samples[True][1:]),
        )
    chosen = frozenset(r for r, (plain, skinny) in timings.items() if skinny < plain * (1 - margin))
    return chosen, timings
