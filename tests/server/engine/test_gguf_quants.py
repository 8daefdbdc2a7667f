"""engine.gguf_quants: a GGUF tensor's blocks read as the file's integers, scales and offsets.
Each type's reading dequantizes to gguf's own dequantization of the same bytes (random blocks
and gguf-quantized matrices), the integers are the file's (ranges, a hand-written block, 4-bit
values packed back into the file's own bytes), and what is not read is refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kenspec.server.engine.gguf_quants import FOUR_BIT, READABLE, read_blocks

Q = GGMLQuantizationType
ROWS, COLS = 8, 512

# type -> (byte offsets of its f16 fields d/dmin in a block (ggml's block structs), group,
# bits, values' range, whether it has offsets)
LAYOUT: dict[GGMLQuantizationType, tuple[tuple[int, ...], int, int, tuple[int, int], bool]] = {
    Q.Q8_0: ((0,), 32, 8, (-128, 127), False),
    Q.Q4_0: ((0,), 32, 4, (0, 15), True),
    Q.Q4_1: ((0, 2), 32, 4, (0, 15), True),
    Q.Q5_0: ((0,), 32, 5, (-16, 15), False),
    Q.Q5_1: ((0, 2), 32, 5, (0, 31), True),
    Q.Q2_K: ((80, 82), 16, 2, (0, 3), True),
    Q.Q3_K: ((108,), 16, 3, (-4, 3), False),
    Q.Q4_K: ((0, 2), 32, 4, (0, 15), True),
    Q.Q5_K: ((0, 2), 32, 5, (0, 31), True),
    Q.Q6_K: ((208,), 16, 6, (-32, 31), False),
}
TYPES = sorted(LAYOUT, key=lambda t: t.name)
IDS = [t.name for t in TYPES]


def _random_blocks(qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random bytes [ROWS, bytes per row] whose f16 fields are finite values in [-0.1, 0.1]."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = COLS // block_size
    data = rng.integers(0, 256, (ROWS, n, type_size), dtype=np.uint8)
    for at in LAYOUT[qtype][0]:
        halves = rng.uniform(-0.1, 0.1, (ROWS, n)).astype(np.float16)
        data[:, :, at : at + 2] = halves.view(np.uint8).reshape(ROWS, n, 2)
    return data.reshape(ROWS, n * type_size)


def _gguf(data: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(data, qtype).reshape(data.shape[0], cols)


def _same_bits_but_zeros(mine: np.ndarray, ref: np.ndarray) -> bool:
    """Bit for bit equal wherever the weight is not zero (+0.0 and -0.0 both zero)."""
    differ = mine.view(np.uint32) != ref.view(np.uint32)
    return not np.any(differ & (ref != 0))


def test_readable_types() -> None:
    assert set(READABLE) == set(LAYOUT)
    assert {Q.Q4_0, Q.Q4_1, Q.Q4_K} == set(FOUR_BIT)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_random_blocks_dequantize_as_gguf(qtype: GGMLQuantizationType) -> None:
    data = _random_blocks(qtype, seed=int(qtype))
    blocks = read_blocks(data, qtype, COLS)
    _, group, bits, (low, high), offsets = LAYOUT[qtype]
    assert (blocks.group, blocks.bits) == (group, bits)
    assert blocks.values.dtype == np.int8 and blocks.values.shape == (ROWS, COLS)
    assert blocks.scales.dtype == np.float32 and blocks.scales.shape == (ROWS, COLS // group)
    if offsets:
        assert blocks.mins is not None
        assert blocks.mins.dtype == np.float32 and blocks.mins.shape == (ROWS, COLS // group)
    else:
        assert blocks.mins is None
    # random bytes reach every integer the type can hold, and none other
    assert (int(blocks.values.min()), int(blocks.values.max())) == (low, high)

    mine = blocks.dequantize()
    ref = _gguf(data, qtype, COLS)
    assert mine.dtype == np.float32 and mine.shape == (ROWS, COLS)
    assert np.all(np.isfinite(ref))
    assert np.array_equal(mine, ref)
    assert _same_bits_but_zeros(mine, ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_gguf_quantized_matrix(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(7)
    weight = rng.normal(0.0, 0.02, (6, 256)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero group
    data = gguf.quants.quantize(weight, qtype)
    blocks = read_blocks(data, qtype, 256)
    mine = blocks.dequantize()
    assert np.array_equal(mine, _gguf(data, qtype, 256))
    step = np.abs(blocks.scales).repeat(blocks.group, axis=1)
    assert np.all(np.abs(mine - weight) <= step + 1e-6)  # the file holds the matrix


def test_hand_written_q4_0_block() -> None:
    """The module's example: d = 0.5, first byte 0x93 -> weight 0 = -2.5, weight 16 = 0.5."""
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2] = 0x93
    blocks = read_blocks(block.reshape(1, 18), Q.Q4_0, 32)
    assert blocks.values[0, 0] == 3 and blocks.values[0, 16] == 9
    assert blocks.values[0, 1] == 0 and blocks.values[0, 17] == 0
    assert blocks.scales[0, 0] == 0.5
    assert blocks.mins is not None and blocks.mins[0, 0] == -4.0
    weights = blocks.dequantize()
    assert weights[0, 0] == -2.5 and weights[0, 16] == 0.5 and weights[0, 1] == -4.0


def test_hand_written_q8_0_block() -> None:
    block = np.zeros(34, dtype=np.uint8)
    block[:2] = np.array([0.25], dtype=np.float16).view(np.uint8)
    block[2:5] = [0xFF, 0x80, 0x7F]  # -1, -128, 127
    blocks = read_blocks(block.reshape(1, 34), Q.Q8_0, 32)
    assert blocks.values[0, :3].tolist() == [-1, -128, 127]
    assert blocks.dequantize()[0, :3].tolist() == [-0.25, -32.0, 31.75]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.IQ4_NL, Q.TQ1_0], ids=lambda t: t.name)
def test_refuses_types_not_read(qtype: GGMLQuantizationType) -> None:
    data = np.zeros((1, 64), dtype=np.uint8)
    with pytest.raises(ValueError, match=qtype.name):
        read_blocks(data, qtype, 32)


def test_refuses_bytes_that_do_not_fit() -> None:
    data = _random_blocks(Q.Q4_K, seed=1)
    with pytest.raises(ValueError, match="Q4_K"):
        read_blocks(data, Q.Q4_K, COLS * 2)  # twice the bytes a row needs
    with pytest.raises(ValueError, match="Q4_K"):
        read_blocks(data, Q.Q4_K, 100)  # not whole blocks
