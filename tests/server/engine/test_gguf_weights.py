"""A GGUF file served in its own quantization (--weights auto/gguf: engine.gguf_weights): the
grouped GEMV (csrc/gemv_grouped.c, and gemv_grouped_avx2.c for CPUs without AVX512-BF16)
against a float64 reference and its row invariance, layers
joined side by side, each quantization type's tensors served as the file holds them (the
weights equal the file's dequantization; float32 greedy output equals transformers' generate
on the dequantized file), greedy speculation equal to plain decoding of the same target
through the fast step, and what auto and gguf do with what they cannot serve."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from transformers import PreTrainedTokenizerFast

from kenspec.server import default_model
from kenspec.server.engine import gguf_model
from kenspec.server.engine.forward.cpu_kernels import CpuKernels, load_kernels
from kenspec.server.engine.forward.kernel_build import Isa
from kenspec.server.engine.forward.passes import LeanForward
from kenspec.server.engine.forward.plan import ExecutionOptions, ForwardKind, LeanMode
from kenspec.server.engine.gguf_quants import READABLE
from kenspec.server.engine.params import Weights
from kenspec.server.engine.quantize import (
    GroupedLinear,
    GroupedWeight,
    exact_grouped_products,
    join_grouped,
)
from kenspec.server.engine.target import TargetLoadError, TargetModel
from tests import tiny
from tests.gguf_files import tiny_llama, write_quantized_llama_gguf
from tests.kernels import one_isa
from tests.server.engine.drafts import last_rows
from tests.server.engine.quantized_models import (
    check_float32_decoding_is_generate,
    check_greedy_speculation_is_plain_decoding,
)
from tests.server.engine.whole_pass import random_biases, whole_pass_calls

Q = GGMLQuantizationType
KERNELS = load_kernels()
GROUPED = KERNELS is not None and KERNELS.grouped
needs_grouped = pytest.mark.skipif(
    not GROUPED, reason="the CPU has neither avx512_bf16 nor avx2 (or no compiler)"
)
# Every type the reader takes that a tiny model's rows (256 and 512 weights) can hold
TYPES = sorted((t for t in READABLE if t not in (Q.F32, Q.F16, Q.BF16)), key=lambda t: t.name)
LEAN = ExecutionOptions(lean=LeanMode.AUTO)


def _grouped(
    out: int,
    k: int,
    bits: int,
    group: int,
    offsets: bool,
    seed: int,
    half: bool = False,
    quads: bool = False,
) -> GroupedWeight:
    """A random weight of the kind a file holds: 4-bit values 0..15, or int8; scales and
    offsets float16 numbers (a simple type's), kept in float16 where `half`; 4-bit values in
    quads where `quads` (the AVX2 kernel's layout)."""
    generator = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (out, k), generator=generator).to(torch.int8)
    scales = (torch.rand(out, k // group, generator=generator) * 0.01).half().float()
    mins = (torch.randn(out, k // group, generator=generator) * 0.05).half().float()
    return GroupedWeight.of(
        q, scales, mins if offsets else None, group, bits, half=half, quads=quads
    )


def test_tiles_give_back_the_rows_they_were_laid_out_from() -> None:
    """Tiles of 16 rows (the last padded), pairs of weights side by side: rows() is the
    layout's inverse, for 4-bit and int8 values, groups of 16 and 32, rows not filling a tile."""
    for bits, group, quads in ((4, 32, False), (4, 16, False), (8, 32, False), (8, 16, False),
                               (4, 32, True), (4, 16, True), (8, 32, True)):  # fmt: skip
        weight = _grouped(37, 64, bits, group, True, seed=8, quads=quads)
        assert weight.quads is (quads and bits == 4)  # int8 values: pairs either way
        blocks = -(-37 // 16)
        assert weight.scales.shape == (blocks, 64 // group, 16)
        pairs = group // 2
        if weight.quads:
            assert weight.values.shape == (blocks, 64 // group, group // 4, 32)
        else:
            assert weight.values.shape == (blocks, 64 // group, pairs, 16 if bits == 4 else 32)
        q, scales, mins = weight.rows()
        again = GroupedWeight.of(q, scales, mins, group, bits, quads=quads)
        assert torch.equal(again.values, weight.values) and torch.equal(again.scales, weight.scales)
        assert q.shape == (37, 64) and scales.shape == (37, 64 // group)
        assert torch.equal(q, _grouped(37, 64, bits, group, True, seed=8).rows()[0])
    # row 0's first pair (k = 0, 1) in byte 0 of its group's first pair: k = 0 low, k = 1 high
    q = torch.zeros(16, 32, dtype=torch.int8)
    q[0, 0], q[0, 1], q[3, 0] = 5, 9, 7
    tiled = GroupedWeight.of(q, torch.ones(16, 1), None, 32, 4)
    assert tiled.values[0, 0, 0, 0] == 5 | 9 << 4 and tiled.values[0, 0, 0, 3] == 7
    wide = GroupedWeight.of(q, torch.ones(16, 1), None, 32, 8)
    assert wide.values[0, 0, 0, :2].tolist() == [5, 9] and wide.values[0, 0, 0, 6] == 7
    # in quads: row r's k = 4j + c in byte 4r + c of quad j, row r + 8's in its high nibble
    q[9, 2], q[1, 5] = 11, 3
    quad = GroupedWeight.of(q, torch.ones(16, 1), None, 32, 4, quads=True)
    assert quad.values[0, 0, 0, :2].tolist() == [5, 9] and quad.values[0, 0, 0, 12] == 7
    assert quad.values[0, 0, 0, 6] == 11 << 4 and quad.values[0, 0, 1, 5] == 3


def _as_8_bits(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as gemv_grouped_avx2.c reads it for 4-bit weights: per group of a row, p * d with
    d = max |x| / 127 and p = x / d rounded to nearest even, both in float32 (float64)."""
    rows, k = x.shape
    groups = x.float().reshape(rows, k // group, group)
    d = groups.abs().amax(dim=-1, keepdim=True) / 127
    p = torch.where(d > 0, torch.round(groups / d), torch.zeros(()))
    return (p.double() * d.double()).reshape(rows, k)


KINDS = [(4, 32, True), (4, 32, False), (8, 32, False), (8, 32, True), (8, 16, False)]
KINDS.append((8, 16, True))
KIND_IDS = [f"{bits}bit-g{group}-{'offsets' if o else 'scales'}" for bits, group, o in KINDS]


@pytest.fixture(params=[Isa.BF16, Isa.AVX2])
def grouped(request: pytest.FixtureRequest) -> CpuKernels:
    """The library with one instruction set's grouped GEMV: gemv_grouped.c's (AVX512-BF16), or
    gemv_grouped_avx2.c's (the library as a CPU without AVX512-BF16 sees it)."""
    return one_isa(request.param)


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("shape", [(64, 64), (96, 576), (33, 256), (7, 32)], ids=str)
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_the_grouped_gemv_is_the_files_weights_product(
    grouped: CpuKernels, bits: int, group: int, offsets: bool, shape: tuple[int, int], half: bool
) -> None:
    """x @ (q * s + m)^T against float64: within the bf16 rounding of the output (the sums are
    float32; q and x products exact) and, for AVX2's int16 x, each x's rounding (at most half
    of 2^-14 of its group's largest |x|, weighted by |w|); AVX2's 4-bit products against x as
    it reads it (_as_8_bits); rows from 1 to past a row block, outputs not filling a tile (33:
    one row past two; 7: less than half of one); scales and offsets kept in float32, or
    float16 (AVX2's kernel reads them; AVX512-BF16's refuses them)."""
    weight = _grouped(*shape, bits, group, offsets, seed=1, half=half, quads=grouped.grouped_quads)
    assert weight.half is half
    if half and grouped.bf16:
        with pytest.raises(ValueError, match="takes float32 scales, not float16"):
            grouped.gemv_grouped(torch.zeros(1, shape[1], dtype=torch.bfloat16), weight)
        return
    w = weight.dequantize(torch.float64)
    generator = torch.Generator().manual_seed(len(KINDS) * shape[0] + bits + group)
    for rows in (1, 5, 11):
        x = torch.randn(rows, shape[1], generator=generator).bfloat16()
        read = x.double() if grouped.bf16 or bits == 8 else _as_8_bits(x, group)
        expected = read @ w.T
        got = grouped.gemv_grouped(x, weight).double()
        assert got.shape == expected.shape
        rounding = torch.zeros(())
        if not grouped.bf16 and bits == 8:
            largest = x.double().abs().reshape(rows, -1, group).amax(dim=-1)
            rounding = (largest.repeat_interleave(group, dim=1) * 2**-15) @ w.abs().T
        bound = 2**-8 * expected.abs() + rounding + 1e-6 * shape[1]
        assert ((got - expected).abs() <= bound).all()


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_grouped_gemv_rows_bits_do_not_depend_on_the_row_count(
    grouped: CpuKernels, bits: int, group: int, offsets: bool, threads: int
) -> None:
    """What exactness rests on: each row of a pass of 1 to 17 rows has the bits it has alone
    (AVX2's: with float16 scales, the same bits as with float32 ones)."""
    weight = _grouped(100, 576, bits, group, offsets, seed=2, quads=grouped.grouped_quads)
    x = torch.randn(17, 576).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([grouped.gemv_grouped(x[i : i + 1], weight) for i in range(17)])
        for rows in (2, 3, 4, 5, 8, 9, 16, 17):
            assert torch.equal(grouped.gemv_grouped(x[:rows], weight), alone[:rows]), rows
        if not grouped.bf16:
            narrow = _grouped(100, 576, bits, group, offsets, seed=2, half=True, quads=True)
            assert narrow.half and torch.equal(grouped.gemv_grouped(x, narrow), alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("bits", "group", "offsets"), KINDS, ids=KIND_IDS)
def test_avx2s_integer_products_scale_with_x_and_keep_a_groups_small_values(
    bits: int, group: int, offsets: bool
) -> None:
    """gemv_grouped_avx2.c writes each group of a row's x as integers times a scale taken
    from the group's largest |x| (int16 times a power of two for int8 weights; for 4-bit ones
    int8 times largest / 127, as llama.cpp's 8-bit activations): so x times 2^j gives y times
    2^j bit for bit (a scale not taken per group would round differently). With int8 weights
    a group's values far below its largest (here 2^-12 of it) still count (within 2^-16 of
    the largest each); with 4-bit ones, values under half of 1/127 of it round to zero, and
    the output is what x so rounded gives."""
    avx2 = one_isa(Isa.AVX2)
    weight = _grouped(48, 256, bits, group, offsets, seed=5, quads=True)
    x = torch.randn(5, 256).bfloat16()
    y = avx2.gemv_grouped(x, weight)
    for j in (-20, -3, 1, 9):
        assert torch.equal(avx2.gemv_grouped(x * 2.0**j, weight), y * 2.0**j), j
    # each group: one value 1.0, the others tiny; and a second x with the tiny ones zeroed
    tiny = torch.full((1, 256), 2.0**-12) * torch.randn(1, 256).sign()
    tiny[0, ::group] = 1.0
    zeroed = torch.where(tiny.abs() == 1.0, tiny, torch.zeros(()))
    w = weight.dequantize(torch.float64)
    for values in (tiny, zeroed):
        read = values.double() if bits == 8 else _as_8_bits(values, group)
        expected = read @ w.T
        got = avx2.gemv_grouped(values.bfloat16(), weight).double()
        assert ((got - expected).abs() <= 2**-8 * expected.abs() + 1e-6).all()
    with_tiny = avx2.gemv_grouped(tiny.bfloat16(), weight)
    without = avx2.gemv_grouped(zeroed.bfloat16(), weight)
    if bits == 4:  # 2^-12 of the largest rounds to 0 in 8 bits: the same x, the same bits
        assert torch.equal(with_tiny, without)
        return
    # the tiny values' share is there (w's rows sum to well over bf16's step of it)
    shares = (tiny - zeroed).double() @ w.T
    differs = with_tiny != without
    assert differs[shares.abs() > 2**-7 * (zeroed.double() @ w.T).abs()].all()


def test_avx2s_rows_with_an_infinity_or_nan_give_nan_and_leave_the_others_alone() -> None:
    """A row of x holding inf or NaN has no integer form: its outputs are all NaN; the pass's
    other rows keep the bits they have alone."""
    avx2 = one_isa(Isa.AVX2)
    for bits, group, offsets in KINDS:
        weight = _grouped(40, 128, bits, group, offsets, seed=6, quads=True)
        x = torch.randn(3, 128).bfloat16()
        alone = avx2.gemv_grouped(x[2:], weight)
        for bad in (float("inf"), float("-inf"), float("nan")):
            x[1, 70] = bad
            y = avx2.gemv_grouped(x, weight)
            assert y[1].isnan().all()
            assert not y[0].isnan().any() and torch.equal(y[2:], alone)


def test_the_grouped_gemv_refuses_what_it_does_not_take(grouped: CpuKernels) -> None:
    weight = _grouped(16, 64, 8, 32, True, seed=3)
    with pytest.raises(ValueError, match="8-bit groups of 32 over 48 inputs"):
        grouped.gemv_grouped(torch.zeros(1, 48, dtype=torch.bfloat16), weight)
    other = _grouped(16, 64, 4, 32, True, seed=3, quads=not grouped.grouped_quads)
    layout = "quads" if grouped.grouped_quads else "pairs"
    with pytest.raises(ValueError, match=f"takes 4-bit weights laid out in {layout} of k"):
        grouped.gemv_grouped(torch.zeros(1, 64, dtype=torch.bfloat16), other)


def test_scales_are_kept_in_float16_only_where_each_is_one_exactly() -> None:
    """half: float16 storage where every scale and offset is a float16 (a simple type's d and
    m), float32 where one is not (a K-quant's d * sc); rows() gives float32 either way; parts
    joined keep float16 only where all are."""
    narrow = _grouped(32, 64, 4, 32, True, seed=9, half=True)
    assert narrow.half and narrow.mins is not None
    assert narrow.scales.dtype == narrow.mins.dtype == torch.float16
    assert torch.equal(narrow.dequantize(), _grouped(32, 64, 4, 32, True, seed=9).dequantize())
    q, scales, mins = narrow.rows()
    assert scales.dtype == torch.float32 and mins is not None and mins.dtype == torch.float32
    scales[3, 1] = 1 + 2**-12  # not a float16
    wide = GroupedWeight.of(q, scales, mins, 32, 4, half=True)
    assert not wide.half and wide.scales.dtype == torch.float32
    assert wide.rows()[1][3, 1] == 1 + 2**-12
    for parts in ([narrow, wide], [wide, narrow]):
        joined = join_grouped(parts)
        assert not joined.half
        assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    both = join_grouped([narrow, narrow])
    assert both.half and torch.equal(both.dequantize()[32:], narrow.dequantize())
    odd = _grouped(24, 64, 4, 32, True, seed=9, half=True)  # not whole tiles: laid out anew
    assert join_grouped([odd, narrow]).half and not join_grouped([odd, wide]).half


def test_layers_joined_side_by_side_keep_each_ones_weights() -> None:
    """4-bit and int8 parts, groups of 16 and 32, with and without offsets: the joined weight's
    rows are each part's, exactly."""
    parts = [
        _grouped(32, 256, 4, 32, True, seed=4),
        _grouped(16, 256, 8, 32, False, seed=5),
        _grouped(48, 256, 8, 16, True, seed=6),
    ]
    joined = join_grouped(parts)
    assert joined.bits == 8 and joined.group == 16 and joined.mins is not None
    expected = torch.cat([part.dequantize() for part in parts])
    assert torch.equal(joined.dequantize(), expected)
    same = join_grouped(parts[:1] * 2)
    assert same.bits == 4 and same.group == 32  # alike parts are kept as they are
    quads = [_grouped(n, 256, 4, 32, True, seed=4, quads=True) for n in (32, 24)]
    for together in (quads[:1] * 2, quads, [quads[0], parts[0]], [quads[0], *parts[1:]]):
        joined = join_grouped(together)  # tiles side by side; laid out anew; widened
        assert joined.quads is (joined.bits == 4 and together[-1].quads)
        assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in together]))


def test_the_fallback_product_is_the_dequantized_product_in_float32() -> None:
    """Where the GEMV does not run (float32 activations): the file's weights in float32,
    F.linear's bits exactly."""
    layer = GroupedLinear(_grouped(48, 256, 4, 32, True, seed=7), bias=None)
    x = torch.randn(3, 256)
    weight = layer.weight_groups.dequantize(torch.float32)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))


@needs_grouped
def test_the_load_time_check_multiplies_the_files_weights_in_float32() -> None:
    """exact_grouped_products (around the check of packed attention): within it a model's
    GroupedLinear layers give the dequantized product in float32 rounded to bf16, not the
    GEMV's (8-bit x on AVX2); after it, and after an error inside it, the GEMV's again."""
    assert KERNELS is not None
    model = torch.nn.Sequential(
        GroupedLinear(_grouped(48, 256, 4, 32, True, seed=7, quads=KERNELS.grouped_quads),
                      bias=None, kernels=KERNELS),
        GroupedLinear(_grouped(32, 48, 8, 16, False, seed=8), bias=None, kernels=KERNELS),
    )  # fmt: skip
    x = torch.randn(3, 256).bfloat16()
    gemv = model(x)
    with exact_grouped_products(model):
        first = torch.nn.functional.linear(x.float(), model[0].weight_groups.dequantize())
        exact = torch.nn.functional.linear(
            first.bfloat16().float(), model[1].weight_groups.dequantize()
        ).bfloat16()
        assert torch.equal(model(x), exact)
    assert torch.equal(model(x), gemv)
    if KERNELS.grouped_quads:  # AVX2's 8-bit x: never the float32 product's bits here
        assert not torch.equal(gemv, exact)
    with pytest.raises(RuntimeError), exact_grouped_products(model):
        raise RuntimeError("the check failed")
    assert all(layer.kernels is KERNELS for layer in model)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny.build_byte_tokenizer()


def _file(
    folder: Path,
    tokenizer: PreTrainedTokenizerFast,
    qtype: GGMLQuantizationType,
    *,
    tied: bool = True,
    output: GGMLQuantizationType | None = Q.Q8_0,
    float_layers: frozenset[str] = frozenset(),
) -> Path:
    path = folder / f"{qtype.name}-{tied}-{output}-{len(float_layers)}.gguf"
    # rows of 256 and 512 weights: whole blocks of every type (the K-quants' are 256)
    model = tiny_llama(tokenizer, hidden=256, intermediate=512, tied=tied)
    return write_quantized_llama_gguf(path, model, tokenizer, qtype, output, float_layers)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_is_served_as_the_file_holds_it(
    qtype: GGMLQuantizationType, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """Every decoder layer is the file's tensor (its weights the dequantized file's, bit for
    bit in float32), and float32 greedy output equals transformers' generate on the file
    dequantized."""
    path = _file(tmp_path, tokenizer, qtype)
    cache = tmp_path / "cache"
    served = TargetModel.load(path, device="cpu", dtype="float32", gguf_cache=cache, weights="gguf")
    plain = TargetModel.load(path, device="cpu", dtype="float32", gguf_cache=cache)  # auto
    assert plain.file_weights is None  # auto: float32 is served as loaded
    assert served.quantized is Weights.GGUF and plain.quantized is Weights.BF16
    assert served.weights == f"gguf {qtype.name} (14 layers), output Q8_0"
    assert served.file_weights is not None and served.file_weights.output is not None
    layers = dict(served.model.named_modules())
    for name, module in plain.model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            grouped = layers[name]
            assert isinstance(grouped, GroupedLinear) and grouped.kind == qtype.name, name
            assert torch.equal(grouped.weight_groups.dequantize(), module.weight), name
    embedding = plain.model.get_input_embeddings().weight
    assert torch.equal(served.file_weights.output.dequantize(), embedding)
    check_float32_decoding_is_generate(served)
    for prompt in tiny.PROMPTS[:3]:  # the same answers as the dequantized file's
        ids = served.encode_prompt(prompt)
        greedy = [
            target.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=12,
            )[0].tolist()
            for target in (served, plain)
        ]  # fmt: skip
        assert greedy[0] == greedy[1]


@needs_grouped
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_speculation_on_the_files_own_weights_is_plain_decoding(
    qtype: GGMLQuantizationType, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """bfloat16 through the fast step (the grouped GEMV, the whole pass in one call): greedy
    output with drafts that always and never match equals plain decoding of the same target;
    every verify width computes each row as a one-row pass does."""
    path = _file(tmp_path, tokenizer, qtype)
    target = TargetModel.load(
        path, device="cpu", dtype="bfloat16", gguf_cache=tmp_path / "cache", execution=LEAN
    )
    assert target.plan.forward is ForwardKind.LEAN
    assert target.quantized is Weights.GGUF
    assert "gguf" in target.plan.describe()
    assert target.plan.row_invariant_below == sys.maxsize  # every width: the GEMV
    check_greedy_speculation_is_plain_decoding(target, tmp_path)


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's (and so the kernels') thread count for one test (the suite runs on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_grouped
@pytest.mark.parametrize("threads", [2, 3], indirect=True)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_the_whole_pass_over_the_files_groups_gives_the_layer_loops_bits(
    qtype: GGMLQuantizationType, threads: int, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """The whole pass in one call over a file's own groups (on AVX2 one parallel region whose
    threads share each product: layer_avx2.c's team) calls the kernels the Python loop calls,
    in its order: for a prefill and passes of 1 and 7 tokens, the same hidden states bit for
    bit and the same cache, with biases on q/k/v and the attention's output (Qwen2's), 4-bit
    weights (8-bit x) and 8-bit ones (16-bit x), on 2 and 3 threads."""
    path = _file(tmp_path, tokenizer, qtype)
    target = TargetModel.load(
        path, device="cpu", dtype="bfloat16", gguf_cache=tmp_path / "cache", execution=LEAN
    )
    assert isinstance(target.passes, LeanForward)
    assert all(layer.qkv.bias is None for layer in target.passes.decoder.weights.layers)
    random_biases(target, every=True)
    calls = whole_pass_calls(target, "The quick brown fox jumps over the lazy dog, twice")
    assert calls == [1, 1, 1]  # the prefill, the 1- and 7-token passes; the loop's none


@needs_grouped
def test_the_fast_step_computes_what_the_models_own_layers_do(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """A bf16 pass of 1 and of 7 tokens through the fast step over the file's groups (an
    untied output layer the file keeps in Q6_K) gives transformers' logits through the same
    GroupedLinear layers up to bf16 rounding, and the same argmax."""
    path = _file(tmp_path, tokenizer, Q.Q4_K, tied=False, output=Q.Q6_K)
    cache = tmp_path / "cache"
    stock = TargetModel.load(path, device="cpu", dtype="bfloat16", gguf_cache=cache)
    fast = TargetModel.load(path, device="cpu", dtype="bfloat16", gguf_cache=cache, execution=LEAN)
    assert stock.plan.forward is ForwardKind.EAGER and fast.plan.forward is ForwardKind.LEAN
    assert fast.file_weights is not None and fast.file_weights.output is not None
    assert fast.weights == "gguf Q4_K (14 layers), output Q6_K"
    ids = stock.encode_prompt("The quick brown fox jumps over")
    for width in (1, 7):
        rows = [last_rows(target, ids, width) for target in (stock, fast)]
        torch.testing.assert_close(rows[1], rows[0], rtol=0.05, atol=0.05)
        assert torch.equal(rows[1].argmax(-1), rows[0].argmax(-1))


def test_layers_the_file_keeps_in_float_stay_as_loaded(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """F32 layers among quantized ones: those stay linear layers (served by transformers'
    modules, float32 exact), the others are the file's."""
    path = _file(tmp_path, tokenizer, Q.Q4_0, float_layers=frozenset({"ffn_down.weight"}))
    target = TargetModel.load(
        path, device="cpu", dtype="float32", gguf_cache=tmp_path / "c", weights="gguf"
    )
    assert target.weights == "gguf F32 (2 layers), Q4_0 (12 layers), output Q8_0"
    kinds = {type(layer.mlp.down_proj) for layer in target.model.model.layers}
    assert kinds == {torch.nn.Linear}
    check_float32_decoding_is_generate(target)


def test_auto_serves_the_files_own_only_where_the_grouped_gemv_computes_it(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """auto: a GGUF file in bfloat16 on a CPU with AVX512-BF16 or AVX2 is served as the file
    keeps it;
    float32 (every product would dequantize), a folder, a CPU without the kernel: as loaded."""
    path = _file(tmp_path, tokenizer, Q.Q4_0, output=None)  # decoder Q4_0, embedding F32
    cache = tmp_path / "c"
    bf16 = TargetModel.load(path, device="cpu", dtype="bfloat16", gguf_cache=cache)
    assert bf16.quantized is (Weights.GGUF if GROUPED else Weights.BF16)
    if GROUPED:
        assert bf16.weights == "gguf Q4_0 (14 layers), output F32"
        assert bf16.file_weights is not None and bf16.file_weights.output is None
    without = TargetModel.load(
        path, device="cpu", dtype="bfloat16", gguf_cache=cache,
        execution=ExecutionOptions(cpu_kernels=False),
    )  # fmt: skip
    assert without.quantized is Weights.BF16
    fp32 = TargetModel.load(path, device="cpu", dtype="float32", gguf_cache=cache)
    assert fp32.quantized is Weights.BF16 and fp32.weights == "float32"
    folder = TargetModel.load(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert folder.quantized is Weights.BF16 and folder.file_weights is None


def test_gguf_weights_are_refused_where_they_cannot_be_served(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(TargetLoadError, match="not a GGUF file"):
        TargetModel.load(tiny_model_dir, device="cpu", dtype="float32", weights="gguf")
    path = _file(tmp_path, tokenizer, Q.Q8_0)
    with pytest.raises(TargetLoadError, match="bfloat16 or float32, not float16"):
        TargetModel.load(path, device="cpu", dtype="float16", weights="gguf")
    half = TargetModel.load(path, device="cpu", dtype="float16", gguf_cache=tmp_path / "c")
    assert half.quantized is Weights.BF16  # auto: as loaded
    with pytest.raises(TargetLoadError, match="batch-invariant"):
        TargetModel.load(
            path, device="cpu", dtype="float32", weights="gguf", gguf_cache=tmp_path / "c",
            execution=ExecutionOptions(batch_invariant=True),
        )  # fmt: skip


def test_a_type_the_reader_does_not_take_is_refused_naming_it(tmp_path: Path) -> None:
    from kenspec.server.engine.gguf_weights import FileWeightsError, _grouped

    class Tensor:
        name = "blk.0.ffn_up.weight"
        data = np.zeros((4, 32), dtype=np.uint8)

    with pytest.raises(FileWeightsError, match="IQ4_NL, which kenspec does not serve"):
        _grouped(Tensor(), Q.IQ4_NL, None, torch.zeros(4, 64), "model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("rows", [(32, 16, 48), (24, 40)], ids=["whole tiles", "part tiles"])
def test_a_product_of_layers_side_by_side_is_their_outputs_side_by_side(
    rows: tuple[int, ...],
) -> None:
    """q/k/v or gate/up as one product: its output is each layer's, and each layer still
    computes its own (a view of the joined tiles where they fill whole tiles)."""
    from kenspec.server.engine.forward.plan import Kernel
    from kenspec.server.engine.forward.products import Product

    layers = [
        GroupedLinear(_grouped(n, 64, 4, 32, True, seed=10 + i), bias=None)
        for i, n in enumerate(rows)
    ]
    x = torch.randn(3, 64)
    alone = [layer(x) for layer in layers]
    product = Product.of(layers)
    assert torch.equal(product.run(x, Kernel.GEMV, None), torch.cat(alone, dim=1))
    for layer, expected in zip(layers, alone, strict=True):
        assert torch.equal(layer(x), expected)
    shared = {layer.values.untyped_storage().data_ptr() for layer in layers}
    assert (shared == {product.weight.untyped_storage().data_ptr()}) == (rows[0] % 16 == 0)


def test_a_file_read_in_the_wrong_row_order_is_refused_at_load(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load-time check against the loaded model's rows: q and k taken in the file's own
    (llama.cpp's rotary) order instead of the model's are found and refused, naming the layer."""
    from kenspec.server.engine import gguf_weights

    path = _file(tmp_path, tokenizer, Q.Q8_0)
    monkeypatch.setattr(gguf_weights, "_row_order", lambda processor, name, rows: np.arange(rows))
    with pytest.raises(TargetLoadError, match=r"q_proj\.weight: the file.s weights read as kept"):
        TargetModel.load(
            path, device="cpu", dtype="float32", gguf_cache=tmp_path / "c", weights="gguf"
        )


def test_a_folder_keeping_its_gguf_file_is_served_as_the_file_keeps_it(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model's folder (server.default_model: the file converted, then kept in the
    folder and named in its manifest) is served as the GGUF file itself is: auto keeps the
    file's groups wherever the grouped GEMV computes them, with the same products; float32
    and --weights bf16 serve the folder as loaded; a file that is not the folder's source is
    refused at load."""
    path = _file(tmp_path, tokenizer, Q.Q4_1)
    convert = gguf_model.load_gguf  # the real dequantization, the tiny tokenizer kept
    monkeypatch.setattr(
        gguf_model, "load_gguf", lambda gguf, dtype: (convert(gguf, dtype)[0], tokenizer)
    )
    folder = tmp_path / "default"
    source = replace(default_model.DEFAULT_SOURCE, gguf_member=f"pkg/{path.name}")
    default_model.convert(source, path, folder, verify_tokens=4)
    assert default_model.is_up_to_date(folder, source)
    assert gguf_model.kept_source(folder) == folder / path.name
    assert gguf_model.kept_source(tmp_path) is None  # no manifest

    direct = TargetModel.load(
        path, device="cpu", dtype="bfloat16", gguf_cache=tmp_path / "c", execution=LEAN
    )
    served = TargetModel.load(folder, device="cpu", dtype="bfloat16", execution=LEAN)
    assert served.quantized is direct.quantized is (Weights.GGUF if GROUPED else Weights.BF16)
    if GROUPED:
        assert served.weights == direct.weights == "gguf Q4_1 (14 layers), output Q8_0"
    ids = served.encode_prompt("The quick brown fox jumps over")
    for width in (1, 5):
        assert torch.equal(last_rows(served, ids, width), last_rows(direct, ids, width))

    fp32 = TargetModel.load(folder, device="cpu", dtype="float32")
    loaded = TargetModel.load(folder, device="cpu", dtype="bfloat16", weights="bf16")
    assert fp32.file_weights is None and loaded.file_weights is None
    kept = TargetModel.load(folder, device="cpu", dtype="float32", weights="gguf")
    assert kept.weights == "gguf Q4_1 (14 layers), output Q8_0"
    check_float32_decoding_is_generate(kept)

    (folder / path.name).unlink()  # another model's file in its place
    _file(tmp_path, tokenizer, Q.Q8_0).rename(folder / path.name)
    with pytest.raises(TargetLoadError, match="differ from the loaded model's"):
        TargetModel.load(folder, device="cpu", dtype="float32", weights="gguf")


def test_the_tensor_table_is_read_as_the_gguf_package_reads_it(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """gguf_model.read_tensors (the header's keys skipped, not parsed) gives every tensor's
    name, type and bytes as GGUFReader does, and the architecture; a cut file is refused."""
    path = _file(tmp_path, tokenizer, Q.Q4_K, tied=False, output=Q.Q6_K)
    architecture, tensors = gguf_model.read_tensors(path)
    reader = GGUFReader(path)
    assert architecture == "llama" == gguf_model.read_architecture(path)
    assert list(tensors) == [tensor.name for tensor in reader.tensors]
    for theirs in reader.tensors:
        mine = tensors[theirs.name]
        assert mine.tensor_type == theirs.tensor_type, theirs.name
        assert mine.data.tobytes() == np.asarray(theirs.data).tobytes(), theirs.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 64])
    with pytest.raises(ValueError, match="does not fit the file"):
        gguf_model.read_tensors(cut)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_model.read_tensors(tmp_path / "text.gguf")
