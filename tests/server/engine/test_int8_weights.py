"""Weights in int8 (engine.quantize, the fast step's int8 products): the quantization's error
bound, both kernels against a float64 reference, the AVX-512 kernel's row invariance, greedy
speculation equal to plain decoding of the same quantized target, and what is refused.

Every test but the AVX-512 kernel's own runs on any CPU: torch's kernel (`stock`) is the one
a CPU without AVX-512 (the CI's) serves with, and each is run with the AVX-512 kernel made
unavailable too (`kernels` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kenspec.server.engine.forward import choose
from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.lean import LeanWeights
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ForwardKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.forward.products import Product, candidates
from kenspec.server.engine.quantize import Int8Linear, int8_linear, quantize, quantize_model
from kenspec.server.engine.target import TargetLoadError, TargetModel
from tests import tiny
from tests.server.engine.quantized_models import (
    biased_qwen2,
    check_float32_decoding_is_generate,
    check_greedy_speculation_is_plain_decoding,
    llama,
)
from tests.tiny_architectures import save_architecture

KERNELS = load_kernels()
GEMV8 = KERNELS.gemv_int8 if KERNELS is not None and KERNELS.int8 else None
NO_GEMV8 = pytest.mark.skipif(GEMV8 is None, reason="the CPU has no AVX-512 F/BW/VL/DQ")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["stock", "dequant", pytest.param("gemv", marks=NO_GEMV8)])
def kernel(request: pytest.FixtureRequest) -> Kernel:
    """The int8 kernel a test's products take: torch's int8 GEMV or its GEMM on the widened
    weight (every CPU), or the AVX-512 one."""
    return Kernel(request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_weights_are_within_half_a_scale(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.rand(64, 1) * 3
    weight[5] = 0.0  # a row of zeros keeps a usable scale
    int8 = quantize(weight.to(dtype), dtype)
    assert int8.values.dtype == torch.int8 and int8.scales.dtype == dtype
    assert int8.values.shape == weight.shape and int8.scales.shape == (64,)
    assert int(int8.values.abs().max()) <= 127
    assert bool((int8.values.abs().amax(dim=1)[torch.arange(64) != 5] >= 126).all())
    source = weight.to(dtype).double()
    error = (int8.dequantize(torch.float64) - source).abs()
    assert bool((error <= int8.scales.double()[:, None] * (0.5 + 1e-6)).all())
    assert not bool(int8.dequantize()[5].any())


def test_the_module_docs_example() -> None:
    int8 = quantize(torch.tensor([[0.5, -1.27, 0.01]]), torch.float32)
    assert int8.values.tolist() == [[50, -127, 1]]
    assert float(int8.scales[0]) == pytest.approx(0.01)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [576, 77, 64, 1])
def test_int8_product_is_the_dequantized_product(
    kernel: Kernel, dtype: torch.dtype, k: int
) -> None:
    """Each output is (x @ q^T) * s of the dequantized weight in float64, up to float32 sums
    (and, in bf16, one rounding of the result; two for dequant, which rounds before scaling):
    every kernel, any k (77: not one torch's int8 kernel takes, so a float32 product)."""
    torch.manual_seed(k)
    int8 = quantize(torch.randn(300, k), dtype)
    x = torch.randn(9, k).to(dtype)
    exact = x.double() @ int8.dequantize(torch.float64).t()
    product = Product(int8.values, scales=int8.scales)
    got = product.run(x, kernel, KERNELS).double()
    bound = (x.double().abs() @ int8.dequantize(torch.float64).abs().t()) * k * 2.0**-23
    if dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0 ** (-7 if kernel == "dequant" else -8)  # bf16 steps
    assert bool(((got - exact).abs() <= bound + 1e-6).all())


def test_int8_product_without_torchs_kernel_is_the_dequantized_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without _weight_int8pack_mm: the dequantized product, same values."""
    torch.manual_seed(2)
    int8 = quantize(torch.randn(40, 64), torch.float32)
    x = torch.randn(3, 64)
    expected = int8_linear(x, int8.values, int8.scales)
    monkeypatch.delattr(torch.ops.aten, "_weight_int8pack_mm", raising=False)
    torch.testing.assert_close(int8_linear(x, int8.values, int8.scales), expected)


@NO_GEMV8
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("out", "k"), [(1536, 576), (301, 77)])
def test_avx512_kernel_row_bits_do_not_depend_on_the_row_count(
    dtype: torch.dtype, out: int, k: int
) -> None:
    """A row's outputs are bit-identical alone or among 1..17 rows: one summation order (for
    bfloat16 on AVX512-BF16 CPUs, the widened kernel: in registers up to 4 rows, from a
    widened block past them)."""
    assert GEMV8 is not None
    torch.manual_seed(1)
    int8 = quantize(torch.randn(out, k), dtype)
    x = torch.randn(17, k).to(dtype)
    alone = torch.cat([GEMV8(x[i : i + 1], int8.values, int8.scales) for i in range(17)])
    for rows in (2, 3, 4, 5, 7, 8, 13, 17):
        assert torch.equal(GEMV8(x[:rows], int8.values, int8.scales), alone[:rows])


def test_without_avx512_only_torchs_kernel_is_a_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU (the CI's) runs no int8 kernel (its library: the bf16 GEMV alone);
    int8 products plan torch's only."""
    from kenspec.server.engine.forward import cpu_kernels

    load_kernels.cache_clear()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    try:
        avx2 = load_kernels()
    finally:
        load_kernels.cache_clear()
    assert avx2 is None or not avx2.int8  # (None: no compiler)
    products = [Product.quantized(torch.randn(8, 32), torch.float32)]
    assert candidates(products, avx2) == (Kernel.STOCK, Kernel.DEQUANT)
    assert candidates(products, None) == (Kernel.STOCK, Kernel.DEQUANT)
    gemv = (Kernel.GEMV,) if GEMV8 else ()
    assert candidates(products, KERNELS) == (Kernel.STOCK, Kernel.DEQUANT, *gemv)


def test_fused_int8_product_is_its_layers_side_by_side() -> None:
    """q/k/v as one product: its layers' outputs side by side, the layers views of its rows."""
    torch.manual_seed(3)
    layers = [
        Int8Linear.of(torch.nn.Linear(32, n, bias=b), torch.float32)
        for n, b in ((16, True), (8, False), (8, True))
    ]
    x = torch.randn(5, 32)
    expected = torch.cat([layer(x) for layer in layers], dim=-1)
    product = Product.of(layers)
    torch.testing.assert_close(product.run(x, Kernel.STOCK, None), expected)
    assert torch.equal(torch.cat([layer(x) for layer in layers], dim=-1), expected)
    for layer in layers:
        assert layer.values.untyped_storage().data_ptr() == product.weight.data_ptr()


def test_one_int8_layers_product_holds_its_values_not_a_copy() -> None:
    """o and down (one layer each) compute from the layer's own int8 values and scales, as the
    bf16 products do from the layer's weight: no weight is held twice."""
    layer = Int8Linear.of(torch.nn.Linear(32, 16, bias=True), torch.bfloat16)
    product = Product.of([layer])
    assert product.weight.data_ptr() == layer.values.data_ptr()
    assert product.scales is not None and product.scales.data_ptr() == layer.scales.data_ptr()
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(product.run(x, Kernel.STOCK, None), layer(x))


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return tiny.build_byte_tokenizer()


@pytest.fixture(scope="module")
def llama_dir(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama(tmp_path_factory.mktemp("int8"), tokenizer)


@pytest.fixture(scope="module")
def qwen2_dir(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return biased_qwen2(tmp_path_factory.mktemp("int8"), tokenizer, seed=4)


def _served(directory: Path, dtype: str, kernel: Kernel) -> TargetModel:
    """The int8 target through the lean forward, every product in `kernel`."""
    every = RowPlan.every(kernel)
    options = ExecutionOptions(
        lean=LeanMode.AUTO, decoder=every, head_kernels=every, fused_layer=False, screen=False
    )
    return TargetModel.load(directory, device="cpu", dtype=dtype, weights="int8", execution=options)


def test_loading_int8_quantizes_the_layers_and_keeps_a_tied_embedding(
    tokenizer, llama_dir: Path, tmp_path: Path
) -> None:
    target = TargetModel.load(llama_dir, device="cpu", dtype="float32", weights="int8")
    assert target.quantized == "int8" and target.weights == "int8"
    assert target.plan.forward is ForwardKind.LEAN  # (only it computes int8 at speed)
    layer = target.model.base_model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, Int8Linear)
    assert isinstance(target.model.get_output_embeddings(), Int8Linear)  # untied: int8
    tied = save_architecture(tmp_path / "tied", tokenizer, "llama", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(tied)
    quantize_model(model, torch.float32)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, torch.nn.Linear) and head.weight is embedding.weight
    output = choose.output_product(model, LeanWeights(model))
    assert output.scales is not None  # its own int8 copy
    assert output.weight.data_ptr() != embedding.weight.data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_is_plain_decoding_of_the_quantized_target(
    kernel: str, dtype: str, llama_dir: Path, tmp_path: Path
) -> None:
    """Exactness restated for int8: whatever is drafted (always right, never right), greedy
    output equals plain decoding of the same int8 target, token for token."""
    target = _served(llama_dir, dtype, kernel)
    check_greedy_speculation_is_plain_decoding(target, tmp_path)


@pytest.mark.parametrize("model", ["llama_dir", "qwen2_dir"])
def test_float32_int8_decoding_is_transformers_generate_of_the_quantized_model(
    kernel: str, model: str, request: pytest.FixtureRequest
) -> None:
    """In float32 the lean forward's int8 products are the quantized model's own (Int8Linear)
    up to summation order: greedy output equals transformers' generate on it."""
    target = _served(request.getfixturevalue(model), "float32", kernel)
    check_float32_decoding_is_generate(target)


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "gemma3_text"])
def test_float32_int8_decoding_of_the_other_families_is_transformers_generate(
    kernel: str, model_type: str, tokenizer, tmp_path: Path
) -> None:
    """The same for the families whose layers differ from Llama's (Qwen3's head norms,
    Phi-3's q/k/v and gate/up kept as one layer each, Gemma 3's norms and windows): every
    decoder layer int8 (Phi-3's joined ones too), through the lean forward."""
    directory = save_architecture(tmp_path / model_type, tokenizer, model_type)
    target = _served(directory, "float32", kernel)
    assert target.plan.forward is ForwardKind.LEAN
    layer = target.model.base_model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and isinstance(layer.mlp.down_proj, Int8Linear)
    check_float32_decoding_is_generate(target)


@pytest.mark.parametrize(
    ("model_type", "dtype", "reason"),
    [
        ("llama", "float16", "bfloat16 or float32"),
        ("gpt2", "float32", "does not serve this model: model type 'gpt2'"),
        ("phi", "float32", "does not serve this model: model type 'phi'"),
    ],
)
def test_int8_is_refused_at_load_where_the_lean_forward_cannot_serve_it(
    model_type: str, dtype: str, reason: str, tokenizer, tmp_path: Path
) -> None:
    directory = save_architecture(tmp_path / model_type, tokenizer, model_type)
    with pytest.raises(TargetLoadError, match=reason):
        TargetModel.load(directory, device="cpu", dtype=dtype, weights="int8")


def test_int8_is_refused_off_a_cpu(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On any other device (here meta, standing in for CUDA) the load says it needs a CPU."""
    from kenspec.server.engine import target as target_module

    monkeypatch.setattr(target_module, "resolve_device", lambda device: torch.device("meta"))
    monkeypatch.setattr(target_module, "check_packed_passes", lambda *args: {})
    with pytest.raises(TargetLoadError, match="on a CPU only, not meta"):
        TargetModel.load(llama_dir, device="cuda", dtype="float32", weights="int8")


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2-only"])
def test_runtime_serves_int8_through_the_lean_forward(
    avx512: bool, base_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--weights int8 is served through the lean forward, in float32 too, its plan measured at
    start-up among the kernels this CPU has (an AVX2-only CPU: torch's only), calibrated and
    warmed up with the draft, and reported."""
    from kenspec.server.runtime import load_runtime

    if not avx512:
        monkeypatch.setattr(choose, "load_kernels", lambda: None)
    settings = base_settings.replace(weights="int8")
    runtime = load_runtime(settings)
    plan = runtime.engine.target.plan
    assert plan.forward is ForwardKind.LEAN and plan.weights == "int8"
    assert runtime.info.weights == "int8" and runtime.info.dtype == "float32"
    kernels = plan.decoder.kernels | plan.head_kernels.kernels
    allowed = {Kernel.STOCK, Kernel.DEQUANT} | ({Kernel.GEMV} if avx512 and GEMV8 else set())
    assert kernels <= allowed
    assert plan.describe().startswith("lean; int8;")  # the calibration cache's key tells
