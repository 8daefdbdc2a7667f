"""The AVX2 bf16 GEMV (csrc/gemv_avx2.c): the product rounded once, in one summation order
whatever the pass; and a CPU with AVX2 but no AVX512-BF16 (the flags faked, the kernels run for
real) gets it for every product at every width and layer_avx2.c's layer kernels and whole
pass, so bf16 speculation there is plain decoding."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
import torch
from gguf import GGMLQuantizationType

from kenspec.server.engine import target as target_module
from kenspec.server.engine.forward import choose, cpu_kernels
from kenspec.server.engine.forward.cpu_kernels import (
    CpuKernels,
    Isa,
    KernelUnavailable,
    load_kernels,
)
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ExecutionPlan,
    ForwardKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.quantize import GroupedLinear
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.gguf_files import tiny_llama, write_llama_gguf, write_quantized_llama_gguf
from tests.server.engine.drafts import assert_speculation_is_plain_decoding, wide_pass_rows
from tests.tiny_architectures import save_architecture

pytestmark = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_kernels.cpu_flags(),
    reason="the CPU has no AVX2, FMA and F16C",
)
AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c"})  # e.g. an AMD Zen 2 or 3
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3 4 5 6", "Hello world"]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    """The library as this CPU loads it (gemv_avx2 is called directly: it runs on any CPU
    with AVX2, the AVX512-BF16 ones too)."""
    loaded = load_kernels()
    assert loaded is not None and Isa.AVX2 in loaded.isa
    return loaded


@pytest.fixture
def avx2_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, object]]]:
    """load_kernels as on a CPU with AVX2 and FMA and no AVX-512 (for this test, and for the
    targets it loads); yields the "kernels" log lines of its load."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX2_ONLY)
    load_kernels.cache_clear()
    with structlog.testing.capture_logs() as logs:
        load_kernels()
    yield [dict(line) for line in logs if line["event"] == "kernels"]
    load_kernels.cache_clear()


def record_calls(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the library's functions called from now on (filled as they are)."""
    called: set[str] = set()
    call = CpuKernels._call

    def recorded(self: CpuKernels, name: str, *arguments: object) -> object:
        called.add(name)
        return call(self, name, *arguments)

    monkeypatch.setattr(CpuKernels, "_call", recorded)
    return called


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bfloat16 steps between a and b, element by element (on one line through zero)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize(
    ("rows", "k", "out"),
    [(1, 576, 1536), (17, 1536, 576), (5, 77, 301), (3, 1000, 9), (2, 15, 17), (9, 16, 8),
     (13, 33, 100), (7, 1, 3), (4, 40, 1), (1, 31, 7)],
)  # fmt: skip
def test_each_output_is_the_product_rounded_once(
    kernels: CpuKernels, rows: int, k: int, out: int
) -> None:
    """Against float64 rounded to bf16: one step apart at most wherever float32's summation
    error (its worst case) is below half a step, and almost everywhere in fact; within that
    error plus the rounding everywhere."""
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(out, k, generator=generator).bfloat16()
    exact = x.double() @ w.double().t()
    got = kernels.gemv_avx2(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    error = (x.double().abs() @ w.double().abs().t()) * (k + 8) * 2.0**-24  # float32 sums
    close = error < exact.abs() * 2.0**-9
    ulps = _ulps(got, exact.bfloat16())
    assert bool((ulps[close] <= 1).all())
    assert float((ulps <= 1).double().mean()) > 0.99
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 2 * error).all())


@pytest.mark.parametrize("k", [576, 77, 1, 16, 47])
def test_small_integer_products_are_exact(kernels: CpuKernels, k: int) -> None:
    """Integer inputs whose sums float32 holds exactly: the exact sum rounded to bf16 once."""
    generator = torch.Generator().manual_seed(k)
    x = torch.randint(-8, 9, (17, k), generator=generator).bfloat16()
    w = torch.randint(-8, 9, (301, k), generator=generator).bfloat16()
    exact = (x.double() @ w.double().t()).bfloat16()
    for rows in range(1, 18):
        assert torch.equal(kernels.gemv_avx2(x[:rows], w), exact[:rows])


def test_infinities_and_nans_are_ieees_and_the_padding_adds_none(kernels: CpuKernels) -> None:
    """An infinity in the zero-padded last chunk (k = 21) gives an infinity (the padding's
    zeros are multiplied by zeros, never by it); 0 * inf and inf - inf give NaN; a NaN input
    a NaN output, as float64 does."""
    x = torch.ones(3, 21).bfloat16()
    w = torch.ones(5, 21).bfloat16()
    x[0, 20] = float("inf")
    x[1, 3] = float("nan")
    w[2, 20] = 0.0  # 0 * inf
    w[3, 20] = -1.0  # -inf
    x[2, 19], w[4, 19] = float("inf"), 1.0
    w[4, 20], x[2, 20] = -1.0, float("inf")  # row 2, output 4: inf - inf
    got = kernels.gemv_avx2(x, w).double()
    exact = x.double() @ w.double().t()
    assert torch.equal(got.isnan(), exact.isnan()) and bool(got.isnan().any())
    finite = ~exact.isnan()
    assert torch.equal(got[finite], exact[finite].bfloat16().double())


@pytest.mark.parametrize(("out", "k"), [(1536, 576), (301, 77), (13, 1000)])
def test_a_rows_bits_do_not_depend_on_its_pass_or_the_threads(
    kernels: CpuKernels, out: int, k: int
) -> None:
    """Each row of a 17-row product is bit-identical to the row alone and within passes of 2,
    3 and 5 rows (other blocks of outputs and rows, one-row blocks of 8, single-output
    tails), with one thread or two: one summation order."""
    generator = torch.Generator().manual_seed(out)
    x = torch.randn(17, k, generator=generator).bfloat16()
    w = torch.randn(out, k, generator=generator).bfloat16()
    alone = torch.cat([kernels.gemv_avx2(x[i : i + 1], w) for i in range(17)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)  # (the kernel's OpenMP is torch's)
            assert torch.equal(kernels.gemv_avx2(x, w), alone), count
            for width in (2, 3, 5):
                passes = [kernels.gemv_avx2(x[i : i + width], w) for i in range(0, 17, width)]
                assert torch.equal(torch.cat(passes), alone), (count, width)
    finally:
        torch.set_num_threads(threads)


def test_an_avx2_only_cpu_gets_the_avx2_gemv_and_nothing_else(
    avx2_only: list[dict[str, object]], kernels: CpuKernels
) -> None:
    """The library loads (before: no kernel at all without AVX-512); `gemv` and the layer
    kernels run AVX2's, AVX-512's refuse; the log line says what runs and what does not."""
    faked = load_kernels()
    assert faked is not None and faked.isa == {Isa.AVX2}
    assert faked.gemv_bf16 and faked.layer_kernels
    assert not faked.bf16 and not faked.int8 and not faked.vnni
    x, w = torch.randn(3, 77).bfloat16(), torch.randn(40, 77).bfloat16()
    assert torch.equal(faked.gemv(x, w), kernels.gemv_avx2(x, w))
    gate_up, out = torch.randn(2, 64).bfloat16(), torch.zeros(2, 32).bfloat16()
    faked.silu_mul(gate_up, out)  # layer_avx2.c's
    expected = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(KernelUnavailable, match="avx512_bf16, which this CPU lacks"):
        faked.widened(x, torch.zeros(4, 77, dtype=torch.int8), torch.ones(4).bfloat16())
    ids, _ = faked.top_probs(torch.arange(20.0).unsqueeze(0), 4)  # layer_avx2.c's
    assert ids[0].tolist() == [19, 18, 17, 16]
    with pytest.raises(KernelUnavailable, match="avx512, which this CPU lacks"):
        faked.gemv_int8(x, torch.zeros(4, 77, dtype=torch.int8), torch.ones(4).bfloat16())
    (line,) = avx2_only
    assert line["isa"] == ["avx2"] and line["log_level"] == "info"
    reason = str(line["reason"])
    assert "AVX2 bf16 and grouped GEMV and layer kernels; CPU lacks amx_bf16: AMX" in reason
    assert "CPU lacks avx512: int8 GEMV not used" in reason
    assert "CPU lacks avx512_bf16: int8 screen not" in reason


def test_no_avx2_and_no_avx512_is_still_no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    load_kernels.cache_clear()
    try:
        with structlog.testing.capture_logs() as logs:
            assert load_kernels() is None
    finally:
        load_kernels.cache_clear()
    (line,) = [line for line in logs if line["event"] == "kernels"]
    assert str(line["reason"]).startswith("CPU lacks AVX-512")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny.build_byte_tokenizer()
    directory = tmp_path_factory.mktemp("avx2")
    return save_architecture(directory, tokenizer, "llama", **WIDE_HEADS)


def _avx2_target(directory: Path) -> TargetModel:
    """The tiny bf16 Llama as an AVX2-only CPU serves it: the options' defaults (the layer
    kernels and the screen asked for), the plan decided by rule."""
    options = ExecutionOptions(lean=LeanMode.AUTO)
    return TargetModel.load(directory, device="cpu", dtype="bfloat16", execution=options)


def test_the_plan_takes_the_gemv_everywhere_and_the_layer_kernels_without_screen(
    avx2_only: list[dict[str, object]], llama_dir: Path
) -> None:
    """By rule, nothing timed: the GEMV for every product at every width (every pass row
    invariant) and AVX2's layer kernels; the screen, asked for, left out (AVX512-BF16's)."""
    plan = _avx2_target(llama_dir).plan
    every = RowPlan.every(Kernel.GEMV)
    assert plan.forward is ForwardKind.LEAN
    assert plan.decoder == every and plan.head_kernels == every
    assert not plan.screen and plan.fused_layer
    assert plan.together == choose.AVX2_GEMV_TOGETHER  # (FMA-bound past a few rows)
    assert plan.row_invariant_below == sys.maxsize and plan.kernel_build


def test_bf16_speculation_on_the_avx2_gemv_is_plain_decoding(
    avx2_only: list[dict[str, object]],
    llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the AVX2 kernels (layer_avx2.c's whole pass, the output layer's rows by the
    AVX2 GEMV): a pass of 7 tokens gives the logits of 7 one-token passes bit for bit, and
    greedy speculation, whatever the draft proposes, is plain decoding token for token."""
    called = record_calls(monkeypatch)
    target = _avx2_target(llama_dir)
    one_pass, one_by_one = wide_pass_rows(target, "The quick brown fox jumps over the lazy dog")
    assert called == {"kenspec_decoder_pass_avx2", "kenspec_gemv_bf16_avx2"}
    assert torch.equal(one_pass, one_by_one)
    assert_speculation_is_plain_decoding(target, PROMPTS, tmp_path / "never.arpa")


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda t: t.name
)
def test_a_gguf_files_own_groups_on_avx2_are_served_and_speculation_is_plain_decoding(
    avx2_only: list[dict[str, object]],
    qtype: GGMLQuantizationType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--weights auto on an AVX2-only CPU serves a quantized GGUF file as the file keeps it,
    through gemv_grouped_avx2.c inside layer_avx2.c's whole pass (the decoder) and on its own
    (the file's Q8_0 output layer), the GEMV at every width by rule, its scales and offsets in
    float16 (each the file's own float16 number): a pass of 7 tokens gives 7 one-token passes'
    logits bit for bit, and greedy speculation is plain decoding."""
    tokenizer = tiny.build_byte_tokenizer()
    model = tiny_llama(tokenizer, hidden=256, intermediate=512)  # (heads 64 wide)
    path = write_quantized_llama_gguf(
        tmp_path / "tiny.gguf", model, tokenizer, qtype, GGMLQuantizationType.Q8_0
    )
    target = TargetModel.load(
        path, device="cpu", dtype="bfloat16", gguf_cache=tmp_path / "cache",
        execution=ExecutionOptions(lean=LeanMode.AUTO),
    )  # fmt: skip
    assert target.weights == f"gguf {qtype.name} (14 layers), output Q8_0"
    assert target.file_weights is not None and target.file_weights.output is not None
    grouped = [m for m in target.model.modules() if isinstance(m, GroupedLinear)]
    assert len(grouped) == 14 and target.file_weights.output.half
    assert all(m.scales.dtype == torch.float16 for m in grouped)
    plan: ExecutionPlan = target.plan
    assert plan.forward is ForwardKind.LEAN and plan.fused_layer
    assert plan.decoder == RowPlan.every(Kernel.GEMV) and plan.row_invariant_below == sys.maxsize
    called = record_calls(monkeypatch)
    one_pass, one_by_one = wide_pass_rows(target, "The quick brown fox jumps over the lazy dog")
    assert called == {"kenspec_decoder_pass_avx2", "kenspec_gemv_grouped_avx2"}
    assert torch.equal(one_pass, one_by_one)
    assert_speculation_is_plain_decoding(target, PROMPTS, tmp_path / "never.arpa")


def test_auto_dtype_is_bf16_where_the_avx2_kernels_compute_the_step(
    avx2_only: list[dict[str, object]],
    llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--dtype auto on a CPU without native bf16: bfloat16 where the AVX2 kernels run the
    lean forward's step (a Llama), float32 where they would not (the lean forward off, no
    kernels asked for, a model family it does not serve); a sliding window is served."""
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: False)
    lean = ExecutionOptions(lean=LeanMode.AUTO)

    def dtype(directory: Path, options: ExecutionOptions) -> torch.dtype:
        return TargetModel.load(directory, device="cpu", execution=options).dtype

    assert dtype(llama_dir, lean) is torch.bfloat16
    assert dtype(llama_dir, ExecutionOptions()) is torch.float32  # (lean forward off)
    assert dtype(llama_dir, replace(lean, cpu_kernels=False)) is torch.float32
    tokenizer = tiny.build_byte_tokenizer()
    other = save_architecture(tmp_path / "gpt2", tokenizer, "gpt2")
    assert dtype(other, lean) is torch.float32
    windowed = save_architecture(tmp_path / "mistral", tokenizer, "mistral", sliding_window=8)
    served = TargetModel.load(windowed, device="cpu", execution=lean)
    assert served.dtype is torch.bfloat16 and served.plan.forward is ForwardKind.LEAN
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(tokenizer), tokenizer)
    loaded = TargetModel.load(gguf, device="cpu", execution=lean, gguf_cache=tmp_path / "cache")
    assert loaded.dtype is torch.bfloat16  # (a GGUF file: its header's architecture)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
    load_kernels.cache_clear()
    assert dtype(llama_dir, lean) is torch.float32  # (no kernel runs)
