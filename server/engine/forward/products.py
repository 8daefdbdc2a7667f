"""The lean forward's products: x @ W^T for one linear layer or several side by side, through
the kernel a `RowPlan` names for the pass's row count, and the measurement that chooses it.

Kernels (plan.Kernel): `gemv`, kenspec's (csrc/gemv.c, or csrc/gemv_avx2.c where the CPU has
AVX2 but not AVX512-BF16; int8 weights: csrc/gemv_int8.c, or gemv.c's sums over the weights
widened to bf16 where the CPU has AVX512-BF16), one summation order whatever the row count,
so a verify pass computes each row as a one-token step does;
`packed`, oneDNN with the weights laid out once for it (AMX where present); `stock`, torch's
`F.linear` (int8: torch's int8 kernel, a GEMV whose cost grows with the rows; int4: torch's
int4 kernel, the only one); `dequant`, int8 weights widened to the activations' dtype for
torch's GEMM (wide passes: a prompt's prefill).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kenspec.server.engine.forward.cpu_kernels import CpuKernels
from kenspec.server.engine.forward.plan import Kernel, RowPlan
from kenspec.server.engine.quantize import (
    INT4_JOINED_ROWS,
    TILE,
    GroupedLinear,
    GroupedWeight,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    grouped_linear,
    int4_linear,
    int8_linear,
    join_grouped,
    quantize,
)

MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 17, 24, 34, 64, 136)  # rows a pass's products take
# Rows of logits computed in one product where it costs at most this much more than one row's.
# Computed lazily instead, a walk pays a second product whenever it reads past row 0: about
# half its rounds, so one product of every row pays up to about 1.5 rows' cost (docs/design.md,
# "Lazy logits rows").
TOGETHER_SLACK = 0.5

Linear = nn.Linear | Int8Linear | Int4Linear | GroupedLinear


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out and multiplies `dtype` weights on this CPU (its bf16 path
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere it refuses at the reorder)."""
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 32, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, 32, dtype=dtype), probe, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    return True


@dataclass(eq=False)
class Product:
    """x @ weight^T (+ bias) for x [rows, in]: one linear layer, or several side by side.
    With `scales`, weight is int8 and the product (x @ weight^T) * scales; with `int4`, the
    product is torch's int4 kernel's over those parts, side by side, and weight is the first
    part's packed values (engine.quantize); with `grouped`, a GGUF file's own quantized
    tensor (csrc/gemv_grouped.c) and weight its values."""

    weight: torch.Tensor  # [out, in], contiguous
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's layout of weight, where a plan uses it
    scales: torch.Tensor | None = None  # [out], the activations' dtype: weight is int8
    int4: tuple[Int4Weight, ...] = ()  # one part where the layers' rows could be joined
    grouped: GroupedWeight | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        if self.grouped is not None:
            return torch.bfloat16
        if self.int4:
            return self.int4[0].scales_zeros.dtype
        return self.weight.dtype if self.scales is None else self.scales.dtype

    @property
    def in_features(self) -> int:
        if self.grouped is not None:
            return self.grouped.shape[1]
        return self.int4[0].shape[1] if self.int4 else self.weight.shape[1]

    @classmethod
    def of(cls, layers: Sequence[Linear]) -> Product:
        """The layers' product. One layer's weight is used as it is; several are laid side by
        side once and each layer's weight becomes a view of its rows, so the model's own
        forward still computes what it did and no weight is held twice."""
        int8 = [layer for layer in layers if isinstance(layer, Int8Linear)]
        int4 = [layer for layer in layers if isinstance(layer, Int4Linear)]
        grouped = [layer for layer in layers if isinstance(layer, GroupedLinear)]
        if grouped:
            assert len(grouped) == len(layers)  # lean.check: one kind
            return cls._of_grouped(grouped)
        if int8 or int4:
            assert len(int8) == len(layers) or len(int4) == len(layers)  # lean.check: one kind
            return cls._of_int8(int8) if int8 else cls._of_int4(int4)
        return cls._of_linear([layer for layer in layers if isinstance(layer, nn.Linear)])

    @classmethod
    def _of_linear(cls, layers: Sequence[nn.Linear]) -> Product:
        with torch.no_grad():
            if len(layers) == 1:
                weight = layers[0].weight.detach().contiguous()
            else:
                weight = torch.cat([layer.weight.detach() for layer in layers])
                for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                    grad = layer.weight.requires_grad
                    layer.weight = nn.Parameter(weight[rows], requires_grad=grad)
            return cls(weight, _joined_bias(layers, weight))

    @classmethod
    def _of_int8(cls, layers: Sequence[Int8Linear]) -> Product:
        """As `of`, for int8 layers: one layer's values and scales as they are (quantize made
        them contiguous); several side by side, each layer's a view of their rows."""
        if len(layers) == 1:
            values, scales = layers[0].values, layers[0].scales
        else:
            values = torch.cat([layer.values for layer in layers])
            scales = torch.cat([layer.scales for layer in layers])
            for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                layer.values, layer.scales = values[rows], scales[rows]
        return cls(values, _joined_bias(layers, scales), scales=scales)

    @classmethod
    def _of_int4(cls, layers: Sequence[Int4Linear]) -> Product:
        """As `of`, for int4 layers: torch's layout keeps rows in blocks of INT4_JOINED_ROWS,
        so layers of a multiple of that many rows are joined (each layer's packed values and
        scales a view of theirs); others stay parts, each its own product."""
        parts = [Int4Weight(layer.packed, layer.scales_zeros) for layer in layers]
        if len(layers) > 1 and all(layer.out_features % INT4_JOINED_ROWS == 0 for layer in layers):
            packed = torch.cat([part.packed for part in parts])
            scales_zeros = torch.cat([part.scales_zeros for part in parts], dim=1)
            for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                layer.packed, layer.scales_zeros = packed[rows], scales_zeros[:, rows]
            parts = [Int4Weight(packed, scales_zeros)]
        bias = _joined_bias(layers, parts[0].scales_zeros.new_empty(0))
        return cls(parts[0].packed, bias, int4=tuple(parts))

    @classmethod
    def _of_grouped(cls, layers: Sequence[GroupedLinear]) -> Product:
        """As `of`, for a GGUF file's own tensors: joined (engine.quantize.join_grouped); where
        the parts' tiles were laid side by side, each layer's a view of the joined tiles."""
        joined = join_grouped([layer.weight_groups for layer in layers])
        side_by_side = all(
            layer.out_features % TILE == 0
            and (layer.bits, layer.group, layer.quads) == (joined.bits, joined.group, joined.quads)
            for layer in layers
        )  # else laid out anew: the layers keep their own
        if len(layers) > 1 and side_by_side:
            for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                view = joined.blocks(rows)
                layer.values, layer.scales = view.values, view.scales
                layer.mins = None if layer.mins is None else view.mins
        bias = _joined_bias(layers, joined.scales.new_empty(0, dtype=torch.bfloat16))
        return cls(joined.values, bias, grouped=joined)

    @classmethod
    def of_file(cls, weight: GroupedWeight) -> Product:
        """A GGUF file's own tensor as a product (an output layer the file keeps quantized)."""
        return cls(weight.values, grouped=weight)

    @classmethod
    def quantized(cls, weight: torch.Tensor, dtype: torch.dtype) -> Product:
        """An int8 copy of weight [out, in] (an output layer tied to the embedding, which keeps
        its own dtype for the lookup)."""
        int8 = quantize(weight, dtype)
        return cls(int8.values, scales=int8.scales)

    def pack(self) -> None:
        """oneDNN's layout of a bf16 weight, made once (a plan that takes `packed` reads it)."""
        if self.packed is None and self.scales is None and not self.int4 and self.grouped is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def run(self, x: torch.Tensor, kernel: Kernel, kernels: CpuKernels | None) -> torch.Tensor:
        """The product of x [rows, in] through `kernel` (where it cannot run: torch's)."""
        if self.grouped is not None:  # the GEMV; else the file's weights in float32, exact
            gemv = kernel is Kernel.GEMV and kernels is not None and kernels.grouped
            out = grouped_linear(x, self.grouped, kernels if gemv else None)
            return out if self.bias is None else out.add_(self.bias.to(out.dtype))
        if self.int4:  # one kernel: torch's
            if len(self.int4) == 1:
                return int4_linear(x, self.weight, self.int4[0].scales_zeros, self.bias)
            parts = [int4_linear(x, part.packed, part.scales_zeros) for part in self.int4]
            return self._biased(torch.cat(parts, dim=1))
        if self.scales is not None:
            if kernel is Kernel.GEMV and kernels is not None and kernels.int8:
                return self._biased(kernels.gemv_int8(x, self.weight, self.scales))
            if kernel is Kernel.DEQUANT:  # a GEMM for wide passes: int8 values are exact in bf16
                return self._biased(F.linear(x, self.weight.to(x.dtype)).mul_(self.scales))
            return int8_linear(x, self.weight, self.scales, self.bias)
        if kernel is Kernel.GEMV and kernels is not None and kernels.gemv_bf16:
            return self._biased(kernels.gemv(x, self.weight))
        if kernel is Kernel.AMX and kernels is not None and kernels.amx:
            return self._biased(kernels.gemv_amx(x, self.weight))
        if kernel is Kernel.PACKED and self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            assert isinstance(out, torch.Tensor)
            return out
        return F.linear(x, self.weight, self.bias)

    def _biased(self, out: torch.Tensor) -> torch.Tensor:
        """A kernel's product without bias, the bias added in place."""
        return out if self.bias is None else out.add_(self.bias)


def lay_out(products: Sequence[Product], plan: RowPlan) -> None:
    """oneDNN's copy of each weight where the plan takes oneDNN, none where it does not (a
    measurement laid them all out)."""
    for product in products:
        if Kernel.PACKED in plan.kernels:
            product.pack()
        else:
            product.packed = None


def _row_ranges(layers: Sequence[Linear]) -> list[slice]:
    """Each layer's rows among the layers' rows side by side."""
    ends = list(itertools.accumulate(layer.out_features for layer in layers))
    return [slice(end - layer.out_features, end) for layer, end in zip(layers, ends, strict=True)]


def _joined_bias(layers: Sequence[Linear], like: torch.Tensor) -> torch.Tensor | None:
    """The layers' biases side by side (zeros for a layer without one, in `like`'s dtype);
    None where no layer has one."""
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat(
        [
            layer.bias.detach() if layer.bias is not None else like.new_zeros(layer.out_features)
            for layer in layers
        ]
    )


def quantized_kind(products: Sequence[Product]) -> str:
    """The products' weights: "int8", "int4", "gguf" (a file's own), or "" (the model's
    dtype)."""
    if any(product.grouped is not None for product in products):
        return "gguf"
    if any(product.scales is not None for product in products):
        return "int8"
    return "int4" if any(product.int4 for product in products) else ""


def candidates(products: Sequence[Product], kernels: CpuKernels | None) -> tuple[Kernel, ...]:
    """Kernels this machine can run for these products on a CPU: for int8 weights stock,
    dequant and kenspec's GEMV where it runs; for bf16 ones stock, oneDNN's and the GEMV."""
    kind = quantized_kind(products)
    if kind == "int4":
        return (Kernel.STOCK,)
    if kind == "gguf":
        return (Kernel.STOCK,) + ((Kernel.GEMV,) if kernels is not None and kernels.grouped else ())
    if kind == "int8":
        gemv = kernels is not None and kernels.int8
        return (Kernel.STOCK, Kernel.DEQUANT) + ((Kernel.GEMV,) if gemv else ())
    found = [Kernel.STOCK]
    if onednn_packs(torch.bfloat16):
        found.append(Kernel.PACKED)
    if kernels is not None and kernels.gemv_bf16:
        found.append(Kernel.GEMV)
    return tuple(found)


def invariant_kernel(products: Sequence[Product]) -> Kernel:
    """The kernel whose rows' bits do not depend on the row count: torch's for int4."""
    return Kernel.STOCK if quantized_kind(products) == "int4" else Kernel.GEMV


@torch.inference_mode()
def time_products(
    products: Sequence[Product],
    kernels: CpuKernels | None,
    rows: Iterable[int] = MEASURED_ROWS,
    *,
    repeats: int = 3,
) -> dict[int, dict[Kernel, float]]:
    """{rows: {kernel: seconds}}: every candidate kernel over the whole stack of products
    (which streams the weights from memory, as a step does) at each row count, alternating.

    Each kernel's time is its fastest repeat: a neighbour's burst (another process streaming
    memory, a page fault) only ever adds time, and one noisy repeat in three moved medians far
    enough to flip a plan between kernels from one row count to the next."""
    names = candidates(products, kernels)
    if Kernel.PACKED in names:
        for product in products:
            product.pack()
    timings: dict[int, dict[Kernel, float]] = {}
    for count in rows:
        inputs = {
            size: torch.randn(count, size, dtype=products[0].dtype)
            for size in {p.in_features for p in products}
        }
        samples: dict[Kernel, list[float]] = {name: [] for name in names}
        for repeat in range(repeats + 1):  # the first of each warms up and is dropped
            for name in names if repeat % 2 else reversed(names):
                started = time.perf_counter()
                for product in products:
                    product.run(inputs[product.in_features], name, kernels)
                samples[name].append(time.perf_counter() - started)
        timings[count] = {name: min(s[1:]) for name, s in samples.items()}
    return timings


def fastest_plan(
    timings: dict[int, dict[Kernel, float]],
    margin: float = 0.03,
    *,
    invariant: Kernel | None = None,
    invariant_rows: int = 0,
    invariant_margin: float = 0.05,
) -> RowPlan:
    """The plan taking, at each measured row count, the fastest kernel (stock unless another
    is `margin` faster). timings: {rows: {kernel: seconds}}, stock included.

    invariant: a kernel whose rows' bits do not depend on the row count (the GEMVs). It takes
    every measured count up to `invariant_rows` from the first on, as long as it is within
    `invariant_margin` of the fastest there: a pass of fewer rows than the first count it
    leaves then computes each row as a one-row pass would, so a verify pass gives plain
    decoding's bits (docs/design.md, "One kernel for every width")."""
    choices: list[tuple[int, Kernel]] = []
    prefix = invariant  # None once the invariant kernel's first rows have ended
    for count in sorted(timings):
        seconds = timings[count]
        best = min(seconds, key=seconds.__getitem__)
        if (
            prefix is not None
            and prefix in seconds
            and count <= invariant_rows
            and seconds[prefix] <= seconds[best] * (1 + invariant_margin)
        ):
            if not choices:
                choices.append((count, prefix))
            continue
        prefix = None
        if seconds[best] > seconds[Kernel.STOCK] * (1 - margin):
            best = Kernel.STOCK
        if not choices or choices[-1][1] != best:
            choices.append((count, best))
    return RowPlan(tuple(choices))


def rows_at_one_rows_cost(
    timings: dict[int, dict[Kernel, float]], plan: RowPlan, slack: float = TOGETHER_SLACK
) -> int:
    """The most rows, among the measured counts, whose product through `plan` costs at most
    `slack` more than one row's (1 where one row was not measured). The largest such count,
    not the last before the first count over: one noisy timing at 4 or 8 rows must not cut a
    dozen rows' single read into a read per block (docs/design.md, "Lazy logits rows")."""
    if 1 not in timings:
        return 1
    one = timings[1][plan.kernel(1)]
    within = [count for count in timings if timings[count][plan.kernel(count)] <= one * (1 + slack)]
    return max(within, default=1)
