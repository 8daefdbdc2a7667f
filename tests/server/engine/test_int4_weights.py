"""Weights in int4 (engine.quantize, the fast step's int4 products): the quantization's error
bound, torch's kernel against a float64 reference and its row invariance (what exactness
rests on), layers joined side by side in torch's layout, greedy speculation equal to plain
decoding of the same int4 target, and what is refused. torch's int4 kernel runs on any CPU,
so every test runs on the CI's too."""

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
from kenspec.server.engine.forward.products import Product
from kenspec.server.engine.quantize import (
    INT4_GROUP,
    INT4_JOINED_ROWS,
    Int4Linear,
    Int8Linear,
    int4_linear,
    quantize_int4,
    quantize_model,
)
from kenspec.server.engine.target import TargetLoadError, TargetModel
from tests import tiny
from tests.server.engine.quantized_models import (
    biased_qwen2,
    check_float32_decoding_is_generate,
    check_greedy_speculation_is_plain_decoding,
    llama,
)
from tests.tiny_architectures import save_architecture

DTYPES = [torch.float32, torch.bfloat16]
PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu


def _scales_zeros(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's group's scale and offset [out, in], as quantize_int4 keeps them."""
    scales_zeros = quantize_int4(weight, dtype).scales_zeros.float()  # [in/group, out, 2]
    expand = lambda t: t.transpose(0, 1).repeat_interleave(INT4_GROUP, dim=1)  # noqa: E731
    return expand(scales_zeros[..., 0]), expand(scales_zeros[..., 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_weights_are_within_half_a_step(dtype: torch.dtype) -> None:
    """Every weight within half its group's step of the original, plus what rounding the scale
    and offset to the dtype moved them (8 steps' worth of the scale's rounding, the offset's)."""
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.rand(64, 1) + torch.randn(64, 1) * 0.1
    weight[3, :INT4_GROUP] = 0.25  # a constant group: kept exactly (in the dtype)
    int4 = quantize_int4(weight, dtype)
    scales, zeros = _scales_zeros(weight, dtype)
    rounding = torch.finfo(dtype).eps  # relative: one ulp of the scale and of the offset
    bound = scales / 2 + rounding * (8 * scales + zeros.abs()) + 1e-7
    error = (int4.dequantize() - weight).abs()
    assert (error <= bound).all(), (error - bound).max()
    assert torch.equal(int4.dequantize()[3, :INT4_GROUP], torch.full((INT4_GROUP,), 0.25))


def test_the_module_docs_example() -> None:
    """[-0.3, 0.0, 0.2, 1.2] (repeated to a group) -> s = 0.1, z = 0.5, q = [0, 3, 5, 15]."""
    weight = torch.tensor([-0.3, 0.0, 0.2, 1.2]).repeat(16, INT4_GROUP // 4)
    int4 = quantize_int4(weight, torch.float32)
    torch.testing.assert_close(int4.scales_zeros[0, 0], torch.tensor([0.1, 0.5]))
    torch.testing.assert_close(int4.dequantize(), weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (192, 576), (48, 128)])
def test_int4_product_is_the_dequantized_product(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """torch's kernel computes x @ ((q - 8) * s + z)^T, summed in float32 (to a float64
    reference of the dequantized weight: the activations' rounding and float32 sums)."""
    torch.manual_seed(1)
    int4 = quantize_int4(torch.randn(*shape), dtype)
    x = torch.randn(5, shape[1]).to(dtype)
    expected = x.double() @ int4.dequantize(torch.float64).T
    got = int4_linear(x, int4.packed, int4.scales_zeros).double()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (1536, 576), (576, 1536), (32, 96)])
def test_int4_kernel_row_bits_do_not_depend_on_the_row_count(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """What int4 exactness rests on: each row of a pass of 1 to 17 rows (a verify pass) has the
    bits it has alone (a plain decoding step), whatever the other rows hold."""
    torch.manual_seed(2)
    int4 = quantize_int4(torch.randn(*shape), dtype)
    x = torch.randn(17, shape[1]).to(dtype)
    alone = torch.cat(
        [int4_linear(x[i : i + 1], int4.packed, int4.scales_zeros) for i in range(17)]
    )
    for rows in (2, 3, 4, 7, 8, 16, 17):
        together = int4_linear(x[:rows], int4.packed, int4.scales_zeros)
        assert torch.equal(together, alone[:rows]), rows


def test_torchs_layout_keeps_layers_of_whole_blocks_apart() -> None:
    """Joining layers' packed values is sound where each has a multiple of INT4_JOINED_ROWS
    rows: the packing of the rows side by side is the packings side by side."""
    torch.manual_seed(3)
    for rows in [(64, 192), (576, 192, 192), (128, 64)]:
        values = [torch.randint(0, 16, (n, 96), dtype=torch.int32) for n in rows]
        assert all(n % INT4_JOINED_ROWS == 0 for n in rows)
        assert torch.equal(PACK(torch.cat(values), 1), torch.cat([PACK(v, 1) for v in values]))


@pytest.mark.parametrize(
    ("rows", "joined"), [((64, 128, 64), True), ((64, 32, 32), False), ((128,), True)]
)
def test_int4_product_is_its_layers_side_by_side(rows: tuple[int, ...], joined: bool) -> None:
    """q/k/v (or gate/up) as one product: its layers' outputs side by side, bit for bit.
    Layers of whole blocks are joined (each a view of the product's values, nothing held
    twice); others stay parts of the product."""
    torch.manual_seed(4)
    layers = [
        Int4Linear.of(torch.nn.Linear(64, n, bias=i == 0), torch.bfloat16)
        for i, n in enumerate(rows)
    ]
    x = torch.randn(7, 64).to(torch.bfloat16)
    expected = torch.cat([layer(x) for layer in layers], dim=-1)
    product = Product.of(layers)
    assert len(product.int4) == (1 if joined else len(rows))
    assert product.in_features == 64 and product.dtype == torch.bfloat16
    assert torch.equal(product.run(x, "stock", None), expected)
    assert torch.equal(torch.cat([layer(x) for layer in layers], dim=-1), expected)
    if joined:
        for layer in layers:
            assert layer.packed.untyped_storage().data_ptr() == product.weight.data_ptr()


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return tiny.build_byte_tokenizer()


@pytest.fixture(scope="module")
def llama_dir(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama(tmp_path_factory.mktemp("int4"), tokenizer)


@pytest.fixture(scope="module")
def qwen2_dir(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return biased_qwen2(tmp_path_factory.mktemp("int4"), tokenizer, seed=5)


def _served(directory: Path, dtype: str) -> TargetModel:
    """The int4 target through the lean forward, torch's kernels alone (its int8 output layer
    in torch's int8 kernel)."""
    stock = RowPlan.every(Kernel.STOCK)
    options = ExecutionOptions(
        lean=LeanMode.AUTO, decoder=stock, head_kernels=stock, cpu_kernels=False
    )
    return TargetModel.load(directory, device="cpu", dtype=dtype, weights="int4", execution=options)


def test_loading_int4_quantizes_the_decoder_and_keeps_the_output_layer_int8(
    tokenizer, llama_dir: Path, tmp_path: Path
) -> None:
    target = TargetModel.load(llama_dir, device="cpu", dtype="bfloat16", weights="int4")
    assert target.quantized == "int4" and target.weights == "int4"
    assert target.plan.forward is ForwardKind.LEAN
    layer = target.model.base_model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
        assert isinstance(module, Int4Linear)
    assert isinstance(target.model.get_output_embeddings(), Int8Linear)  # untied: int8
    tied = save_architecture(tmp_path / "tied", tokenizer, "llama", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(tied)
    quantize_model(model, torch.float32, "int4")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, torch.nn.Linear) and head.weight is embedding.weight
    lean = LeanWeights(model)
    assert lean.quantized == "int4"
    assert choose.output_product(model, lean).scales is not None  # its own int8 copy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_is_plain_decoding_of_the_int4_target(
    dtype: str, llama_dir: Path, tmp_path: Path
) -> None:
    """Exactness restated for int4: whatever is drafted (always right, never right), greedy
    output equals plain decoding of the same int4 target, token for token."""
    target = _served(llama_dir, dtype)
    check_greedy_speculation_is_plain_decoding(target, tmp_path)


@pytest.mark.parametrize("model", ["llama_dir", "qwen2_dir"])
def test_float32_int4_decoding_is_transformers_generate_of_the_quantized_model(
    model: str, request: pytest.FixtureRequest
) -> None:
    """In float32 the lean forward's int4 products are the quantized model's own (Int4Linear,
    the same kernel): greedy output equals transformers' generate on it."""
    target = _served(request.getfixturevalue(model), "float32")
    check_float32_decoding_is_generate(target)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), "48 inputs are"),
        ({"intermediate_size": 72}, "72 outputs are not a multiple of 16"),
    ],
)
def test_int4_is_refused_at_load_where_torchs_layout_cannot_keep_a_layer(
    config: dict[str, int], reason: str, tokenizer, tmp_path: Path
) -> None:
    directory = save_architecture(tmp_path / "odd", tokenizer, "llama", **config)
    with pytest.raises(TargetLoadError, match=f"--weights int4 cannot keep .*{reason}"):
        TargetModel.load(directory, device="cpu", dtype="float32", weights="int4")


def test_int4_is_refused_in_float16(llama_dir: Path) -> None:
    with pytest.raises(TargetLoadError, match="--weights int4 computes in bfloat16 or float32"):
        TargetModel.load(llama_dir, device="cpu", dtype="float16", weights="int4")


def test_runtime_serves_int4_through_the_lean_forward(base_settings) -> None:
    """--weights int4 is served through the lean forward, its decoder in torch's int4 kernel at
    every row count (the invariant one) and its output layer int8, and reported."""
    from kenspec.server.runtime import load_runtime

    runtime = load_runtime(base_settings.replace(weights="int4"))
    plan = runtime.engine.target.plan
    assert plan.forward is ForwardKind.LEAN and plan.weights == "int4"
    assert runtime.info.weights == "int4"
    assert plan.decoder.kernels == {Kernel.STOCK}
    assert plan.decoder.invariant_below(Kernel.STOCK) > 17
    kernels = load_kernels()
    gemv8 = {Kernel.GEMV} if kernels is not None and kernels.int8 else set()
    assert plan.head_kernels.kernels <= {Kernel.STOCK, Kernel.DEQUANT} | gemv8
    assert plan.describe().startswith("lean; int4;")
