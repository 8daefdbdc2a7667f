"""The AMX-BF16 product (csrc/gemv_amx.c): the product rounded once, in one summation order
whatever the pass and the threads; the plan takes it for the decoder's bf16 products on a CPU
with AMX (by rule, at every width), the whole pass in one call gives the loop's bits through
it, and bf16 speculation through it is plain decoding.

The kernel's tests need a CPU with AMX (Sapphire Rapids and later) and a Linux that grants the
tile state; the rule's tests run anywhere the library loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import structlog
import torch

from kenspec.server.engine.forward import cpu_kernels
from kenspec.server.engine.forward.cpu_kernels import CpuKernels, Isa, load_kernels
from kenspec.server.engine.forward.passes import LeanForward
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ForwardKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import assert_speculation_is_plain_decoding, wide_pass_rows
from tests.server.engine.whole_pass import random_biases, whole_pass_calls
from tests.tiny_architectures import save_architecture

KERNELS = load_kernels()
AMX = KERNELS is not None and KERNELS.amx
needs_amx = pytest.mark.skipif(not AMX, reason="the CPU has no AMX-BF16 (or Linux refused it)")
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3 4 5 6", "Hello world"]
EVERY_AMX = RowPlan.every(Kernel.AMX)
EVERY_GEMV = RowPlan.every(Kernel.GEMV)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    assert KERNELS is not None
    return KERNELS


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bfloat16 steps between a and b, element by element (on one line through zero)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


@needs_amx
@pytest.mark.parametrize(
    ("rows", "k", "out"),
    [(1, 576, 1536), (17, 1536, 576), (5, 64, 301), (3, 1024, 9), (33, 32, 17), (16, 96, 64),
     (40, 160, 100), (2, 32, 1), (1, 2048, 7)],
)  # fmt: skip
def test_each_output_is_the_product_rounded_once(
    kernels: CpuKernels, rows: int, k: int, out: int
) -> None:
    """Against float64 rounded to bf16: one step apart at most wherever float32's summation
    error (its worst case) is below half a step, and almost everywhere in fact; within that
    error plus the rounding everywhere. Outputs that fill no whole tile (out 1, 7, 9, 17,
    301) and passes of one to three row groups (rows 33, 40) included."""
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(out, k, generator=generator).bfloat16()
    exact = x.double() @ w.double().t()
    got = kernels.gemv_amx(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    error = (x.double().abs() @ w.double().abs().t()) * (k + 8) * 2.0**-24  # float32 sums
    close = error < exact.abs() * 2.0**-9
    ulps = _ulps(got, exact.bfloat16())
    assert bool((ulps[close] <= 1).all())
    assert float((ulps <= 1).double().mean()) > 0.99
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 2 * error).all())


@needs_amx
@pytest.mark.parametrize("k", [32, 576, 64])
def test_small_integer_products_are_exact(kernels: CpuKernels, k: int) -> None:
    """Integer inputs whose sums float32 holds exactly: the exact sum rounded to bf16 once,
    for every pass of 1 to 40 rows."""
    generator = torch.Generator().manual_seed(k)
    x = torch.randint(-8, 9, (40, k), generator=generator).bfloat16()
    w = torch.randint(-8, 9, (301, k), generator=generator).bfloat16()
    exact = (x.double() @ w.double().t()).bfloat16()
    for rows in range(1, 41):
        assert torch.equal(kernels.gemv_amx(x[:rows], w), exact[:rows]), rows


@needs_amx
@pytest.mark.parametrize(("out", "k"), [(1536, 576), (301, 64), (13, 1024), (64, 96)])
def test_a_rows_bits_do_not_depend_on_its_pass_or_the_threads(
    kernels: CpuKernels, out: int, k: int
) -> None:
    """Each row of a 40-row product (three row groups: two read together, one alone) is
    bit-identical to the row alone and within passes of 2, 3, 5, 16 and 17 rows, with one
    thread or two: one summation order."""
    generator = torch.Generator().manual_seed(out)
    x = torch.randn(40, k, generator=generator).bfloat16()
    w = torch.randn(out, k, generator=generator).bfloat16()
    alone = torch.cat([kernels.gemv_amx(x[i : i + 1], w) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)  # (the kernel's OpenMP is torch's)
            assert torch.equal(kernels.gemv_amx(x, w), alone), count
            for width in (2, 3, 5, 16, 17):
                passes = [kernels.gemv_amx(x[i : i + width], w) for i in range(0, 40, width)]
                assert torch.equal(torch.cat(passes), alone), (count, width)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_in_features_that_fill_no_whole_tile_are_refused(kernels: CpuKernels) -> None:
    """k = 77: a ValueError naming the rule (the plan keeps such models on the GEMV), not
    weights read past a row's end."""
    x, w = torch.randn(3, 77).bfloat16(), torch.randn(40, 77).bfloat16()
    with pytest.raises(ValueError, match="multiples of 32, not 77"):
        kernels.gemv_amx(x, w)


@needs_amx
def test_a_nan_input_gives_nan_outputs_and_the_rest_stay_finite(kernels: CpuKernels) -> None:
    x = torch.ones(3, 64).bfloat16()
    w = torch.ones(20, 64).bfloat16()
    x[1, 5] = float("nan")
    got = kernels.gemv_amx(x, w)
    assert bool(got[1].isnan().all())
    assert torch.equal(got[[0, 2]], torch.full((2, 20), 64.0).bfloat16())


def test_the_amx_instruction_set_needs_the_tiles_and_avx512_bf16() -> None:
    base = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert Isa.AMX in cpu_kernels.supported_isa(frozenset(base | {"amx_bf16", "amx_tile"}))
    assert Isa.AMX not in cpu_kernels.supported_isa(frozenset(base | {"amx_bf16"}))
    assert Isa.AMX not in cpu_kernels.supported_isa(frozenset({"amx_bf16", "amx_tile"}))


@needs_amx
def test_a_refused_tile_state_leaves_amx_out_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Linux refusing the tile state (an old kernel, a sandbox): the library loads without
    AMX, the rest runs, and the "kernels" line names the refusal."""
    monkeypatch.setattr(cpu_kernels, "grant_amx", lambda library: False)
    load_kernels.cache_clear()
    try:
        with structlog.testing.capture_logs() as logs:
            refused = load_kernels()
    finally:
        load_kernels.cache_clear()
    assert refused is not None and not refused.amx and refused.bf16
    (line,) = [line for line in logs if line["event"] == "kernels"]
    assert "Linux refused amx_bf16's tile state: AMX bf16 products not used" in str(line["reason"])
    assert "amx_bf16" not in line["isa"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny.build_byte_tokenizer()
    directory = tmp_path_factory.mktemp("amx")
    return save_architecture(directory, tokenizer, "llama", **WIDE_HEADS)


def _target(directory: Path, **options: object) -> TargetModel:
    """The tiny bf16 Llama through the lean loop, its plan decided as the server's is."""
    execution = ExecutionOptions(lean=LeanMode.AUTO, **options)  # type: ignore[arg-type]
    return TargetModel.load(directory, device="cpu", dtype="bfloat16", execution=execution)


@pytest.mark.skipif(KERNELS is None or not KERNELS.bf16, reason="the CPU has no avx512_bf16")
def test_the_plan_takes_amx_for_the_decoder_by_rule_where_it_runs(llama_dir: Path) -> None:
    """With AMX: its tiles for every decoder product at every width, the output layer on the
    GEMV (its screen's exact candidates are the GEMV's), every pass row invariant; --no-amx
    (amx=False), or a CPU without it: the GEMV everywhere. Nothing timed either way."""
    gemv = _target(llama_dir, amx=False).plan
    assert gemv.decoder == EVERY_GEMV and gemv.head_kernels == EVERY_GEMV
    plan = _target(llama_dir).plan
    assert plan.forward is ForwardKind.LEAN and plan.row_invariant_below == sys.maxsize
    assert plan.head_kernels == EVERY_GEMV and plan.screen and plan.fused_layer
    assert plan.decoder == (EVERY_AMX if AMX else EVERY_GEMV)
    assert ("decoder 1:amx;" in plan.describe()) == AMX


@needs_amx
def test_a_model_whose_products_fill_no_whole_tile_keeps_the_gemv(tmp_path: Path) -> None:
    """An MLP 72 wide (the down product's in-features): the GEMV for every product."""
    directory = save_architecture(
        tmp_path / "odd", tiny.build_byte_tokenizer(), "llama", **WIDE_HEADS,
        intermediate_size=72,
    )  # fmt: skip
    assert _target(directory).plan.decoder == EVERY_GEMV


@needs_amx
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_whole_pass_in_one_call_gives_the_product_loops_bits(
    model_type: str, tmp_path: Path
) -> None:
    """csrc/step.c with kenspec_gemv_amx passed in for the bf16 products gives the Python
    loop's bits (each product through `gemv_amx`), hidden states and cache, for the prefill
    and passes of 1 and 7 tokens (Qwen2: q/k/v biases)."""
    directory = save_architecture(
        tmp_path / model_type, tiny.build_byte_tokenizer(), model_type, **WIDE_HEADS
    )
    target = _target(directory, screen=False)
    assert target.plan.decoder == EVERY_AMX and isinstance(target.passes, LeanForward)
    random_biases(target)
    assert whole_pass_calls(target, "The quick brown fox jumps over the lazy dog") == [1, 1, 1]


@needs_amx
def test_bf16_speculation_through_amx_is_plain_decoding(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan as the server makes it (AMX for the decoder, the screen, the layer kernels):
    a pass of 7 tokens gives the logits of 7 one-token passes bit for bit, and greedy
    speculation, whatever the draft proposes, is plain decoding token for token."""
    calls = 0
    decoder_pass = CpuKernels.decoder_pass

    def counted(self: CpuKernels, arguments: cpu_kernels.PassArgs) -> None:
        nonlocal calls
        calls += bool(arguments.bf16_product)  # (kenspec_gemv_amx passed in)
        decoder_pass(self, arguments)

    monkeypatch.setattr(CpuKernels, "decoder_pass", counted)
    target = _target(llama_dir)
    assert target.plan.decoder == EVERY_AMX
    one_pass, one_by_one = wide_pass_rows(target, "The quick brown fox jumps over the lazy dog")
    assert calls > 0
    assert torch.equal(one_pass, one_by_one)
    assert_speculation_is_plain_decoding(target, PROMPTS, tmp_path / "never.arpa")
