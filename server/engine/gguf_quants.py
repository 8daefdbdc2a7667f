"""A GGUF file's quantized tensor as the file holds it: integers, scales and offsets.

`read_blocks` takes a tensor's raw blocks (`GGUFReader(...).tensors[i].data`: uint8 [rows,
bytes per row]) and unpacks them into `FileBlocks`: the file's integers (int8 [rows, cols]) with
one float32 scale and offset per group of `group` consecutive weights of a row, so that
weight = value * scale + min. Nothing is re-derived: the integers are the file's, the scales
and offsets are the products gguf's own dequantizer forms from the block's fields (d * sc,
dmin * m, all exact in float32), and `FileBlocks.dequantize` equals `gguf.quants.dequantize`
of the same bytes (every weight; Q4_0's zeros may differ in sign, -0.0 there and +0.0 here).

Signed types keep their integers signed (Q8_0's q, Q5_0's q - 16, Q3_K's q - 4, Q6_K's q - 32:
no offsets); the 4-bit types keep them unsigned 0..15 with an offset (Q4_0's -8 * d becomes
the offset, Q4_1's m, Q4_K's -dmin * m), so that they can be kept two to a byte
(engine.quantize.GroupedWeight).

Example: a Q4_0 block (32 weights) whose d is 0.5 (f16 bytes 00 38) and whose first byte of
nibbles is 0x93 holds weight 0 = (3 - 8) * 0.5 = -2.5 and weight 16 = (9 - 8) * 0.5 = 0.5;
read, it is values[0] = 3, values[16] = 9, scale 0.5 and offset -4.0 (3 * 0.5 - 4.0 = -2.5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
U8 = npt.NDArray[np.uint8]
I8 = npt.NDArray[np.int8]
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class FileBlocks:
    """A quantized tensor [rows, cols] as the file holds it: weight = values * scales + mins
    (mins absent: weight = values * scales), per group of `group` consecutive weights of a row."""

    values: I8  # [rows, cols]: the file's integers (signed types' signed, 4-bit ones' 0..15)
    scales: F32  # [rows, cols // group]
    mins: F32 | None  # [rows, cols // group]
    group: int  # 16 or 32
    bits: int  # bits of each value in the file (8, 6, 5, 4, 3, 2)

    def dequantize(self) -> F32:
        """values * scales (+ mins) [rows, cols] in float32: gguf's dequantization."""
        rows, cols = self.values.shape
        grouped = self.values.reshape(rows, cols // self.group, self.group).astype(np.float32)
        grouped *= self.scales[:, :, None]
        if self.mins is not None:
            grouped += self.mins[:, :, None]
        return grouped.reshape(rows, cols)


# One type's blocks [n, type size] -> values [n, block size] (any integer dtype holding the
# file's integers), scales and mins (None: none) float32 [n, block size // group].
_Unpacked = tuple[npt.NDArray[np.integer], F32, F32 | None]


def _f16(blocks: U8, at: int) -> F32:
    """The f16 field at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: U8, width: int) -> U8:
    """Runs of `width` bytes -> their low nibbles, then their high ones: [n, 2 * bytes]."""
    n = packed.shape[0]
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    halves = packed.reshape(n, -1, 1, width) >> shifts
    return (halves & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: U8, width: int, shifts: list[int], mask: int) -> U8:
    """Runs of `width` bytes -> each shift's field of them in turn: [n, len(shifts) * bytes]."""
    n = packed.shape[0]
    shifted = packed.reshape(n, -1, 1, width) >> np.array(shifts, dtype=np.uint8).reshape(
        1, 1, -1, 1
    )
    return (shifted & np.uint8(mask)).reshape(n, -1)


def _high_bits32(blocks: U8, at: int) -> U8:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 at byte `at`): [n, 32] of 0 or 1."""
    qh = blocks[:, at : at + 4].view(np.uint32)
    shifted = qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (shifted & np.uint32(1)).astype(np.uint8)


def _q8_0(blocks: U8) -> _Unpacked:
    return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None


def _q4_0(blocks: U8) -> _Unpacked:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, np.float32(-8) * d


def _q4_1(blocks: U8) -> _Unpacked:
    return _nibbles(blocks[:, 4:], 16), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks: U8) -> _Unpacked:
    q = _nibbles(blocks[:, 6:], 16) | (_high_bits32(blocks, 2) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(blocks, 0), None


def _q5_1(blocks: U8) -> _Unpacked:
    q = _nibbles(blocks[:, 8:], 16) | (_high_bits32(blocks, 4) << np.uint8(4))
    return q, _f16(blocks, 0), _f16(blocks, 2)


def _q2_k(blocks: U8) -> _Unpacked:
    # scales[16] (low nibble: sc, high: m), qs[64], d, dmin
    sc = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scales = d * (sc & np.uint8(0x0F)).astype(np.float32)
    mins = -(dmin * (sc >> np.uint8(4)).astype(np.float32))
    return _bits(blocks[:, 16:80], 32, [0, 2, 4, 6], 3), scales, mins


def _q3_k(blocks: U8) -> _Unpacked:
    # hmask[32], qs[64], scales[12] (16 6-bit scales, offset 32), d
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    low = _bits(packed[:, :8], 8, [0, 4], 0x0F)
    high = _bits(packed[:, 8:], 4, [0, 2, 4, 6], 0x03)
    sc = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = _f16(blocks, 108) * sc.astype(np.float32)
    ql = _bits(blocks[:, 32:96], 32, [0, 2, 4, 6], 3)
    hmask = _bits(blocks[:, :32], 32, list(range(8)), 1) ^ np.uint8(1)  # bit clear: minus 4
    q = ql.astype(np.int8) - (hmask << np.uint8(2)).astype(np.int8)
    return q.reshape(n, -1), scales, None


def _k_scales(blocks: U8) -> tuple[F32, F32]:
    """Q4_K/Q5_K's 8 scales d * sc and offsets -dmin * m (6-bit sc and m packed in 12 bytes)."""
    n = blocks.shape[0]
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    sc6, m6, low = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([sc6 & 0x3F, (low & 0x0F) | ((sc6 >> 2) & 0x30)], axis=-1)
    m = np.concatenate([m6 & 0x3F, (low >> 4) | ((m6 >> 2) & 0x30)], axis=-1)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks: U8) -> _Unpacked:
    # d, dmin, scales[12], qs[128]
    scales, mins = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], 32), scales, mins


def _q5_k(blocks: U8) -> _Unpacked:
    # d, dmin, scales[12], qh[32], qs[128]
    scales, mins = _k_scales(blocks)
    qh = _bits(blocks[:, 16:48], 32, list(range(8)), 1)
    return _nibbles(blocks[:, 48:], 32) | (qh << np.uint8(4)), scales, mins


def _q6_k(blocks: U8) -> _Unpacked:
    # ql[128], qh[64], scales[16] (int8), d
    ql = _nibbles(blocks[:, :128], 64)
    qh = _bits(blocks[:, 128:192], 32, [0, 2, 4, 6], 3)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, scales, None


# type -> (its unpacker, the weights per scale, the bits per value)
_READERS: dict[GGMLQuantizationType, tuple[Callable[[U8], _Unpacked], int, int]] = {
    Q.Q8_0: (_q8_0, 32, 8),
    Q.Q4_0: (_q4_0, 32, 4),
    Q.Q4_1: (_q4_1, 32, 4),
    Q.Q5_0: (_q5_0, 32, 5),
    Q.Q5_1: (_q5_1, 32, 5),
    Q.Q2_K: (_q2_k, 16, 2),
    Q.Q3_K: (_q3_k, 16, 3),
    Q.Q4_K: (_q4_k, 32, 4),
    Q.Q5_K: (_q5_k, 32, 5),
    Q.Q6_K: (_q6_k, 16, 6),
}
READABLE: frozenset[GGMLQuantizationType] = frozenset(_READERS)
# The types whose values are unsigned 0..15 (each group's offset carries the rest)
FOUR_BIT: frozenset[GGMLQuantizationType] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})


def read_blocks(data: npt.NDArray[np.uint8], qtype: GGMLQuantizationType, cols: int) -> FileBlocks:
    """A tensor's raw blocks (uint8 [..., bytes per row]; leading axes are rows) of `qtype`,
    `cols` weights a row, as FileBlocks [rows, cols]; ValueError for a type not read (the
    float types included: those are the caller's) or bytes that do not fit `cols`."""
    reader = _READERS.get(qtype)
    if reader is None:
        name = getattr(qtype, "name", str(qtype))
        raise ValueError(f"gguf_quants does not read {name} tensors")
    unpack, group, bits = reader
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols <= 0 or cols % block_size:
        raise ValueError(
            f"{qtype.name}: a row of {cols} weights is not whole blocks of {block_size}"
        )
    row_bytes = cols // block_size * type_size
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] != row_bytes:
        raise ValueError(
            f"{qtype.name}: expected uint8 rows of {row_bytes} bytes for {cols} weights, "
            f"got {data.dtype} {data.shape}"
        )
    rows = data.size // row_bytes
    blocks = np.ascontiguousarray(data).reshape(rows * (cols // block_size), type_size)
    values, scales, mins = unpack(blocks)
    return FileBlocks(
        values=np.ascontiguousarray(values.reshape(rows, cols), dtype=np.int8),
        scales=np.ascontiguousarray(scales.reshape(rows, cols // group), dtype=np.float32),
        mins=None
        if mins is None
        else np.ascontiguousarray(mins.reshape(rows, cols // group), dtype=np.float32),
        group=group,
        bits=bits,
    )
