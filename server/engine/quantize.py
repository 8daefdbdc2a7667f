"""Weights in int8 or int4: weight-only quantization of a model's linear layers.

int8: symmetric, one scale per output row.

Row o of a weight W [out, in] is kept as int8 values q[o] and one scale s[o] in the
activations' dtype, W[o] ~ q[o] * s[o], with s[o] = max |W[o]| / 127 (rounded up to the dtype,
so no value needs clamping) and q = round(W / s): every weight within s[o] / 2 of the original.
A layer computes y = (x @ q^T) * s (+ bias), summed in float32 (`int8_linear`; the lean
forward's kernels, engine.forward). The embedding lookup keeps the model's dtype: with tied weights
only the output layer's product is int8 (the lean forward quantizes its own copy).

Example: W[o] = [0.5, -1.27, 0.01] -> s[o] = 0.01, q[o] = [50, -127, 1].

int4: asymmetric, one scale and one offset per group of INT4_GROUP weights of a row (GGUF's
Q4_1 blocks): W[o, g] ~ (q - 8) * s + z with q in 0..15, s = (max - min) / 15 and z = min + 8s
(both rounded to the activations' dtype, q taken against the rounded ones), kept in torch's own
CPU layout for its int4 kernel (`_weight_int4pack_mm_for_cpu`), which computes every product.
The decoder's layers only: the output layer is int8 (as GGUF files keep it wider than Q4), an
untied one here and a tied one as the lean forward's own copy.

Example (a group of 4 for brevity): [-0.3, 0.0, 0.2, 1.2] -> s = 1.5 / 15 = 0.1,
z = -0.3 + 0.8 = 0.5, q = round((W - z) / s) + 8 = [0, 3, 5, 15] (exact here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

if TYPE_CHECKING:  # (the kernels' module reads GroupedWeight: no import at run time)
    from kenspec.server.engine.forward.cpu_kernels import CpuKernels

TORCH_INT8_K = 32  # torch's int8 kernel takes rows of a multiple of this many weights
# (Phi-3 keeps q/k/v as one layer, qkv_proj, and gate/up as one, gate_up_proj)
DECODER_LINEARS = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
    "down_proj",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Int8Weight:
    values: torch.Tensor  # [out, in] int8, contiguous
    scales: torch.Tensor  # [out], the activations' dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scales [out, in] (exact in float32 and float64)."""
        return self.values.to(dtype) * self.scales.to(dtype)[:, None]


def quantize(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """weight [out, in] as int8 with one `dtype` scale per row (see the module's doc)."""
    with torch.no_grad():
        exact = weight.detach().float()
        absmax = exact.abs().amax(dim=1)
        scales = (absmax / 127).to(dtype)
        short = scales.float() * 127 < absmax  # rounded down by the dtype: one step up
        scales = torch.where(short, torch.nextafter(scales, scales.new_tensor(torch.inf)), scales)
        scales = torch.where(absmax > 0, scales, torch.ones_like(scales))  # all-zero rows
        values = torch.round(exact / scales.float()[:, None]).clamp_(-127, 127)
        return Int8Weight(values.to(torch.int8).contiguous(), scales.contiguous())


def int8_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(x @ values^T) * scales (+ bias) for x [rows, in] in scales' dtype: torch's int8 kernel
    (any CPU), or a dequantized product where torch has none or would not take the shape."""
    kernel = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    # torch 2.13's bfloat16 kernel reads past rows whose length is no multiple of 16 (a crash)
    if kernel is not None and x.device.type == "cpu" and x.shape[1] % TORCH_INT8_K == 0:
        out: torch.Tensor = kernel(x, values, scales)
    else:
        out = (F.linear(x.float(), values.float()) * scales.float()).to(x.dtype)  # one rounding
    return out if bias is None else out.add_(bias)


class Int8Linear(nn.Module):
    """A linear layer whose weight is kept as int8 and per-row scales (see the module's doc)."""

    values: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.values.shape
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, layer: nn.Linear, dtype: torch.dtype) -> Int8Linear:
        return cls(quantize(layer.weight, dtype), layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = int8_linear(rows, self.values, self.scales, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


INT4_GROUP = 32  # weights of a row sharing one scale and offset
INT4_ROWS = 16  # torch's int4 layout takes layers of a multiple of this many output rows
# Layers laid side by side (q/k/v, gate/up) keep torch's layout where each has a multiple of
# this many rows: its rows then sit in their own blocks of it (tested).
INT4_JOINED_ROWS = 64


@dataclass(frozen=True, slots=True)
class Int4Weight:
    packed: torch.Tensor  # [out, in / 2] uint8: torch's CPU int4 layout of q
    scales_zeros: torch.Tensor  # [in / INT4_GROUP, out, 2]: (s, z), the activations' dtype

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the weight it stands for."""
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(q - 8) * s + z [out, in] as torch's kernel takes each weight: its product with an
        identity in float32 (a reference for tests; it costs a product of in x in rows)."""
        identity = torch.eye(self.shape[1], dtype=torch.float32)
        return int4_linear(identity, self.packed, self.scales_zeros.float()).T.to(dtype)


def int4_unfit(out_features: int, in_features: int) -> str | None:
    """Why torch's int4 layout cannot take a weight [out, in]; None where it can."""
    if in_features % INT4_GROUP:
        return f"{in_features} inputs are not a multiple of the int4 group ({INT4_GROUP})"
    if out_features % INT4_ROWS:
        return f"{out_features} outputs are not a multiple of {INT4_ROWS} (torch's int4 layout)"
    return None


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """weight [out, in] as int4 with a `dtype` scale and offset per group (module's doc)."""
    out, k = weight.shape
    if (unfit := int4_unfit(out, k)) is not None:
        raise ValueError(unfit)
    with torch.no_grad():
        groups = weight.detach().float().reshape(out, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        constant = high == low  # q = 8 stands for z = low itself
        scales = torch.where(constant, 1.0, (high - low) / 15).to(dtype)
        zeros = torch.where(constant, low, low + 8 * scales.float()).to(dtype)
        steps = (groups - zeros.float()[..., None]) / scales.float()[..., None]
        values = (torch.round(steps) + 8).clamp_(0, 15).to(torch.int32).reshape(out, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        return Int4Weight(packed, scales_zeros)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] times the int4 weight transposed (+ bias), x in scales_zeros' dtype:
    torch's CPU int4 kernel, whose rows' bits do not depend on the row count (tested)."""
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), packed, INT4_GROUP, scales_zeros.contiguous()
    )
    return out if bias is None else out.add_(bias)


class Int4Linear(nn.Module):
    """A linear layer whose weight is kept as int4 (see the module's doc)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales_zeros", weight.scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, layer: nn.Linear, dtype: torch.dtype) -> Int4Linear:
        return cls(quantize_int4(layer.weight, dtype), layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = int4_linear(rows, self.packed, self.scales_zeros, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def tied_head(model: PreTrainedModel) -> bool:
    """Whether the output layer shares its weight with the embedding."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embedding.weight


def decoder_linears(model: PreTrainedModel) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, layer) for each of the decoder's DECODER_LINEARS (base_model.layers)."""
    decoder = model.base_model.get_submodule("layers")
    assert isinstance(decoder, nn.ModuleList)
    for layer in decoder:
        for parent in (layer.get_submodule("self_attn"), layer.get_submodule("mlp")):
            for name in DECODER_LINEARS:
                linear = getattr(parent, name, None)
                if linear is not None:
                    yield parent, name, linear


def int4_refusal(model: PreTrainedModel) -> str | None:
    """Why the decoder's layers cannot be int4 (int4_unfit of the first that does not fit)."""
    for _, name, linear in decoder_linears(model):
        if isinstance(linear, nn.Linear):
            unfit = int4_unfit(linear.out_features, linear.in_features)
            if unfit is not None:
                return f"{name}: {unfit}"
    return None


def quantize_model(model: PreTrainedModel, dtype: torch.dtype, weights: str = "int8") -> None:
    """Replace every decoder linear layer with its Int8Linear (`weights` int8) or Int4Linear
    (int4), and an untied output layer with its Int8Linear; their weights are freed."""
    quantized = Int8Linear.of if weights == "int8" else Int4Linear.of
    for parent, name, linear in list(decoder_linears(model)):
        if isinstance(linear, nn.Linear):
            setattr(parent, name, quantized(linear, dtype))
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and not tied_head(model):
        model.set_output_embeddings(Int8Linear.of(head, dtype))


# A GGUF file's own quantization, served as the file holds it (engine.gguf_quants reads it):
# integers with a float32 scale and offset per group of a row's weights, W = q * s + m.
TILE = 16  # output rows a tile holds: the grouped GEMV's lanes (csrc/gemv_grouped.c)


@dataclass(frozen=True, slots=True)
class GroupedWeight:
    """A weight [out, in] as a GGUF file keeps it, W = q * s + m per group of `group` weights
    of a row, laid out in tiles for the grouped GEMV: the rows in blocks of TILE (the last
    padded with zeros), each block's groups in order, each group's weights in pairs (k = 2i,
    2i + 1) and each pair's TILE rows side by side. values: int8 [blocks, groups, group / 2,
    2 * TILE] (pair i of row o at 2o, 2o + 1), or for 4-bit values (0..15) uint8 [blocks, groups,
    group / 2, TILE] (row o's pair in byte o: low nibble k = 2i, high 2i + 1); or, 4-bit in
    `quads` (the AVX2 kernel's layout: CpuKernels.grouped_quads), uint8 [blocks, groups,
    group / 4, 2 * TILE], quad j's byte 4r + c holding row r's weight k = 4j + c in its low
    nibble and row r + 8's in its high one. scales and offsets (None: none) float32 [blocks,
    groups, TILE], or float16 where asked for and every one is a float16 exactly (`half`).
    `kind` names the file's types it came from, e.g. "Q4_1" (for the log). `of` lays it out;
    `rows` gives it back row by row."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    bits: int  # 4 or 8: how values are kept
    out: int  # rows of the weight (the tiles may hold a few more, zeros)
    kind: str = ""
    quads: bool = False  # 4-bit values in quads of k (see above); never for int8

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group: int,
        bits: int,
        kind: str = "",
        half: bool = False,
        quads: bool = False,
    ) -> GroupedWeight:
        """q [out, in] (int8; 0..15 where bits is 4), scales and offsets [out, in / group];
        with `half`, scales and offsets kept in float16 where each is one exactly (a simple
        type's d and m: the file's own float16 numbers), else float32; with `quads`, 4-bit
        values laid out in quads of k (int8 ones in pairs either way)."""
        out, k = q.shape
        groups, pairs = k // group, group // 2
        blocks = -(-out // TILE)

        def padded(t: torch.Tensor) -> torch.Tensor:
            extra = blocks * TILE - out
            return t if not extra else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

        quads = quads and bits == 4
        tiles = padded(q).reshape(blocks, TILE, groups, pairs, 2).permute(0, 2, 3, 1, 4)
        if quads:  # [block, group, quad, row of 8, k of 4, half]
            shape = (blocks, 2, TILE // 2, groups, group // 4, 4)
            nibbles = padded(q).to(torch.uint8).reshape(shape).permute(0, 3, 4, 2, 5, 1)
            values = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(
                blocks, groups, group // 4, 2 * TILE
            )
        elif bits == 4:
            nibbles = tiles.to(torch.uint8)
            values = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous()
        else:
            values = tiles.reshape(blocks, groups, pairs, 2 * TILE).to(torch.int8).contiguous()

        factors = (t.float() for t in (scales, mins) if t is not None)  # (read only if half)
        narrow = half and all(torch.equal(t.half().float(), t) for t in factors)
        dtype = torch.float16 if narrow else torch.float32

        def per_tile(t: torch.Tensor) -> torch.Tensor:
            tiled = padded(t.float()).reshape(blocks, TILE, groups).permute(0, 2, 1)
            return tiled.to(dtype).contiguous()

        return cls(values.contiguous(), per_tile(scales), None if mins is None else
                   per_tile(mins), group, bits, out, kind, quads)  # fmt: skip

    @property
    def half(self) -> bool:
        """Whether scales and offsets are kept in float16 (each one exactly)."""
        return self.scales.dtype == torch.float16

    @property
    def shape(self) -> tuple[int, int]:
        return self.out, self.scales.shape[1] * self.group

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [out, in] (int8), scales and offsets [out, in / group] (float32): the weight row
        by row."""
        blocks, groups = self.scales.shape[:2]
        pairs = self.group // 2
        if self.quads:
            halves = torch.stack([self.values & 15, self.values >> 4], dim=-1)
            rows = halves.reshape(blocks, groups, self.group // 4, TILE // 2, 4, 2)
            q = rows.permute(0, 5, 3, 1, 2, 4).reshape(blocks * TILE, -1)[: self.out]
            return q.to(torch.int8), *self._factors()
        if self.bits == 4:
            tiles = torch.stack([self.values & 15, self.values >> 4], dim=-1)
        else:
            tiles = self.values.reshape(blocks, groups, pairs, TILE, 2)
        q = tiles.permute(0, 3, 1, 2, 4).reshape(blocks * TILE, -1)[: self.out].to(torch.int8)
        return q, *self._factors()

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scales and offsets [out, in / group] (float32), row by row."""
        blocks, groups = self.scales.shape[:2]

        def untiled(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(blocks * TILE, groups)[: self.out].float()

        return untiled(self.scales), None if self.mins is None else untiled(self.mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * s + m [out, in] in float32 (as the file's dequantization computes each weight),
        then in `dtype`."""
        q, scales, mins = self.rows()
        weight = q.float() * scales.repeat_interleave(self.group, dim=1)
        if mins is not None:
            weight += mins.repeat_interleave(self.group, dim=1)
        return weight.to(dtype)

    def blocks(self, rows: slice) -> GroupedWeight:
        """The weight's rows `rows` (whole tiles: start and stop multiples of TILE) as views."""
        assert rows.start % TILE == 0 and (rows.stop % TILE == 0 or rows.stop == self.out)
        tiles = slice(rows.start // TILE, -(-rows.stop // TILE))
        mins = None if self.mins is None else self.mins[tiles]
        out = rows.stop - rows.start
        return GroupedWeight(self.values[tiles], self.scales[tiles], mins, self.group,
                             self.bits, out, self.kind, self.quads)  # fmt: skip


def join_grouped(parts: Sequence[GroupedWeight]) -> GroupedWeight:
    """Weights side by side (rows of the first, then the next...). Parts alike (bits, group,
    scales' width) whose rows fill whole tiles: their tiles side by side (offsets zero where a
    part has none); else laid out anew from their rows (4-bit ones widened to int8, groups of
    32 as two of 16 where another part has 16: exact either way; float16 scales only where
    every part had them)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    kinds = "+".join(sorted({part.kind for part in parts if part.kind}))
    offsets = any(part.mins is not None for part in parts)
    alike = all((p.bits, p.group, p.quads) == (first.bits, first.group, first.quads) for p in parts)
    half = all(part.half for part in parts)
    if alike and all(part.out % TILE == 0 for part in parts) and len({p.half for p in parts}) == 1:
        mins = torch.cat([_offsets(part) for part in parts]) if offsets else None
        values = torch.cat([part.values for part in parts])
        scales = torch.cat([part.scales for part in parts])
        out = sum(part.out for part in parts)
        return GroupedWeight(values, scales, mins, first.group, first.bits, out, kinds, first.quads)
    group = min(part.group for part in parts)
    rows = [part.rows() for part in parts]
    repeat = [part.group // group for part in parts]  # a group of 32 as two of 16

    def side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.repeat_interleave(n, 1) for p, n in zip(parts, repeat, strict=True)])

    q = torch.cat([r[0] for r in rows])
    scales = side_by_side([r[1] for r in rows])
    mins = None
    if offsets:
        mins = side_by_side([torch.zeros_like(r[1]) if r[2] is None else r[2] for r in rows])
    bits = first.bits if alike else 8
    return GroupedWeight.of(q, scales, mins, group, bits, kinds, half, first.quads)


def _offsets(part: GroupedWeight) -> torch.Tensor:
    return torch.zeros_like(part.scales) if part.mins is None else part.mins


def grouped_linear(
    x: torch.Tensor, weight: GroupedWeight, kernels: CpuKernels | None = None
) -> torch.Tensor:
    """x [rows, in] @ weight^T: kenspec's grouped GEMV for bf16 x where it runs (`kernels`),
    else the file's weights dequantized in float32 (exact), summed in float32 and rounded once
    to x's dtype."""
    if kernels is not None and kernels.grouped and x.dtype == torch.bfloat16:
        return kernels.gemv_grouped(x, weight)
    return F.linear(x.float(), weight.dequantize(torch.float32)).to(x.dtype)


@contextmanager
def exact_grouped_products(model: nn.Module) -> Iterator[None]:
    """Within: the model's GroupedLinear layers multiply by the file's weights dequantized in
    float32 (grouped_linear without kernels), as they would without the grouped GEMV. For the
    load-time check of packed passes, which compares two ways of running attention: the AVX2
    GEMV's 8-bit activations round each group's x to 1/127 of its largest, so the two ways' last
    bits would differ by far more than attention's own rounding (the products have tests of
    their own)."""
    layers = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    kept = [layer.kernels for layer in layers]
    for layer in layers:
        layer.kernels = None
    try:
        yield
    finally:
        for layer, kernels in zip(layers, kept, strict=True):
            layer.kernels = kernels


class GroupedLinear(nn.Module):
    """A linear layer whose weight is a GGUF file's own quantized tensor (GroupedWeight)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(
        self, weight: GroupedWeight, bias: torch.Tensor | None, kernels: CpuKernels | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group, self.bits, self.kind = weight.group, weight.bits, weight.kind
        self.quads = weight.quads
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels = kernels  # CpuKernels where the grouped GEMV runs (bf16 activations)

    @property
    def weight_groups(self) -> GroupedWeight:
        return GroupedWeight(
            self.values, self.scales, self.mins, self.group, self.bits, self.out_features,
            self.kind, self.quads,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = grouped_linear(rows, self.weight_groups, self.kernels)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
