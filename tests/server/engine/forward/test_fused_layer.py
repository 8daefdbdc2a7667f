"""The lean forward's per-layer kernels (csrc/layer.c, and layer_avx2.c for CPUs without
AVX512-BF16, through forward.cpu_kernels): each the computation of the transformers modules it
replaces, its attention a query's own (the same bits whatever shares its pass, a tree node the
same as its ancestors' sequence), and bf16 speculation through a step of row-independent
kernels equal to plain decoding. The kernel tests run each instruction set's kernels this CPU
runs; the served models take the ones the CPU's flags choose."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.activations import GELUTanh
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kenspec.server.engine.forward.cpu_kernels import CpuKernels, Isa, load_kernels
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ForwardKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.packing import attention_mask
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.kernels import one_isa
from tests.server.engine.drafts import (
    assert_speculation_is_plain_decoding,
    last_rows,
)
from tests.server.engine.whole_pass import random_biases, whole_pass_calls
from tests.tiny_architectures import save_architecture

KERNELS = load_kernels()
LAYER = KERNELS if KERNELS is not None and KERNELS.layer_kernels else None
GEMV = LAYER.gemv if LAYER is not None else None
EVERY_GEMV = RowPlan.every(Kernel.GEMV)
pytestmark = pytest.mark.skipif(
    LAYER is None or GEMV is None, reason="the CPU has no AVX512-BF16 or AVX2 (or no compiler)"
)


@pytest.fixture(params=[Isa.BF16, Isa.AVX2])
def layer(request: pytest.FixtureRequest) -> CpuKernels:
    """The library with one instruction set's layer kernels: layer.c's (AVX512-BF16), or
    layer_avx2.c's (the library as a CPU without AVX512-BF16 sees it)."""
    return one_isa(request.param)


BF16 = torch.bfloat16
# The tiny architectures' heads are 16 wide; the fused attention takes multiples of 32.
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3 4 5 6", "Hello world"]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart a and b are, element by element (same sign assumed)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("n", [576, 64, 40])
def test_add_rmsnorm_is_the_residual_add_and_llamas_rmsnorm(n: int, layer: CpuKernels) -> None:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(n, eps=1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.normal_()
    hidden, delta = torch.randn(5, n).to(BF16), torch.randn(5, n).to(BF16)
    summed = hidden + delta
    with torch.inference_mode():
        expected = norm(summed)
    normed = torch.empty_like(hidden)
    layer.add_rmsnorm(hidden, delta, norm.weight.detach(), normed, 1e-5)
    assert torch.equal(hidden, summed)  # the add, in place, rounded as torch's
    # The mean of squares is summed in another order: at most one bf16 step apart.
    assert int(_ulps(normed, expected).max()) <= 1
    assert (normed == expected).float().mean() > 0.99
    before = hidden.clone()
    layer.add_rmsnorm(hidden, None, norm.weight.detach(), normed, 1e-5)
    assert torch.equal(hidden, before)


@pytest.fixture(params=["norms.c", "avx2"])
def gemma(request: pytest.FixtureRequest) -> CpuKernels:
    """The library with one source's Gemma kernels in use: norms.c's (any CPU; the names the
    AVX512-BF16 layer kernels call: the library seen as that CPU's, only norms.c's called) or
    layer_avx2.c's."""
    if request.param == "avx2":
        return one_isa(Isa.AVX2)
    assert LAYER is not None
    return replace(LAYER, isa=frozenset({Isa.BF16}))


@pytest.mark.parametrize("n", [640, 256, 40])
def test_gemma_add_norm_is_gemmas_sandwich_of_norm_add_norm(n: int, gemma: CpuKernels) -> None:
    """norms.c's and layer_avx2.c's: hidden + post_norm(delta), then the next norm of the
    sum, each as transformers' Gemma3RMSNorm computes it (float32, times 1 + weight)."""
    torch.manual_seed(3)
    post, following = (Gemma3RMSNorm(n, eps=1e-6) for _ in range(2))
    with torch.no_grad():
        for norm in (post, following):
            norm.weight.normal_(0.0, 0.5)
    post, following = post.to(BF16), following.to(BF16)
    hidden, delta = torch.randn(5, n).to(BF16), (torch.randn(5, n) * 3).to(BF16)
    with torch.inference_mode():
        summed = hidden + post(delta)
        expected = following(summed)
    normed = torch.empty_like(hidden)
    weights = post.weight.detach(), following.weight.detach()
    gemma.gemma_add_norm(hidden, delta.clone(), *weights, normed, 1e-6)
    # The mean of squares is summed in another order: at most one bf16 step apart.
    assert int(_ulps(hidden, summed).max()) <= 1 and (hidden == summed).float().mean() > 0.99
    assert int(_ulps(normed, expected).max()) <= 1 and (normed == expected).float().mean() > 0.99
    before = hidden.clone()
    gemma.gemma_add_norm(hidden, None, None, weights[1], normed, 1e-6)
    assert torch.equal(hidden, before)
    assert int(_ulps(normed, following(before).detach()).max()) <= 1


def test_gemma_head_norms_are_q_norm_and_k_norm_in_place(gemma: CpuKernels) -> None:
    torch.manual_seed(4)
    heads, kv_heads, dim, tokens = 4, 1, 256, 3
    q_norm, k_norm = (Gemma3RMSNorm(dim, eps=1e-6) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.normal_(0.0, 0.5)
        k_norm.weight.normal_(0.0, 0.5)
    q_norm, k_norm = q_norm.to(BF16), k_norm.to(BF16)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(BF16)
    split = qkv.view(tokens, heads + 2 * kv_heads, dim)
    with torch.inference_mode():
        expected = torch.cat(
            (q_norm(split[:, :heads]), k_norm(split[:, heads : heads + kv_heads]),
             split[:, heads + kv_heads :]), dim=1,
        ).view(tokens, -1)  # fmt: skip
    gemma.gemma_head_norms(
        qkv, (heads, kv_heads, dim), q_norm.weight.detach(), k_norm.weight.detach(), 1e-6
    )
    assert int(_ulps(qkv, expected).max()) <= 1 and (qkv == expected).float().mean() > 0.99
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], expected[:, (heads + kv_heads) * dim :])


@pytest.mark.parametrize("n", [2048, 40, 13])
def test_gelu_mul_is_gemmas_gelu_with_tanh_times_up(n: int) -> None:
    """layer_avx2.c's gelu_mul: bf16(gelu_tanh(gate)) * up, each rounded to bfloat16, for
    rows not a multiple of its 8 lanes, large, small and infinite gates: within one bf16
    step of the function computed in float64 (0.5 x (1 + tanh(y)) as x sigmoid(2 y), which
    keeps the negative tail where 1 + tanh(y) in floating point is 0: torch's module gives 0
    there, this the value), torch's module's value for gates above -3."""
    kernels = one_isa(Isa.AVX2)
    generator = torch.Generator().manual_seed(n)
    gate = torch.randn(6, n, generator=generator) * 3
    gate[5, :8] = torch.tensor([0.0, -0.0, 40.0, -40.0, 1e-20, float("inf"), float("-inf"), 7.5])
    up = torch.randn(6, n, generator=generator)
    gate_up = torch.cat((gate, up), dim=1).to(BF16)
    gate, up = gate_up.chunk(2, dim=1)
    out = torch.empty(6, n, dtype=BF16)
    kernels.gelu_mul(gate_up, out)
    x = gate.double()
    exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))  # 1 + tanh(y)
    expected = (exact.to(BF16).double() * up.double()).to(BF16)
    finite = expected.isfinite()
    assert torch.equal(out[~finite].isnan(), expected[~finite].isnan())
    close = (out.double() - expected.double()).abs() <= expected.double().abs() * 2**-7 + 1e-30
    assert bool(close[finite].all())
    assert (out == expected)[finite].float().mean() > 0.97
    with torch.inference_mode():
        module = (GELUTanh()(gate) * up)[gate > -3]
    assert int(_ulps(out[gate > -3].abs(), module.abs()).max()) <= 1


def test_rotary_is_transformers_rotary_and_the_cache_gets_keys_and_values(
    layer: CpuKernels,
) -> None:
    torch.manual_seed(1)
    heads, kv_heads, dim, tokens, capacity = 6, 2, 64, 5, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(BF16)
    angles = torch.randn(tokens, dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    k = k.transpose(0, 1)[None]
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).clone()
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    keys = torch.zeros(3, kv_heads, capacity, dim, dtype=BF16)
    values = torch.zeros_like(keys)
    rows = torch.tensor([0, 2, 2, 1, 2])
    positions = torch.tensor([7, 0, 1, 31, 2])
    layer.rotary_cache(qkv, cos, sin, (heads, kv_heads, dim), keys, values, rows, positions)
    rotated = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert torch.equal(rotated, expected_q[0].transpose(0, 1))
    for t in range(tokens):
        row, at = int(rows[t]), int(positions[t])
        assert torch.equal(keys[row, :, at], expected_k[0, :, t])
        assert torch.equal(values[row, :, at], v[t])
    assert int((keys != 0).any(-1).sum()) == tokens * kv_heads  # nothing written elsewhere


def test_silu_mul_is_the_mlps_activation_times_up(layer: CpuKernels) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(3, 2 * 200) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = nn.SiLU()(gate) * up
    out = torch.empty(3, 200, dtype=BF16)
    layer.silu_mul(gate_up, out)
    assert int(_ulps(out, expected).max()) <= 1  # exp by another polynomial
    assert (out == expected).float().mean() > 0.98


def _attention_case(
    kv_lengths: list[int],
    widths: list[int],
    heads: tuple[int, int, int],
    mask_dtype: torch.dtype = BF16,
    seed: int = 3,
) -> tuple[torch.Tensor, ...]:
    """A packed pass: row r has widths[r] new tokens ending at kv_lengths[r]; the cache holds
    random keys and values; the mask is the causal one padded to the widest row."""
    torch.manual_seed(seed)
    query_heads, kv_heads, dim = heads
    rows, width, kv_length = len(widths), max(widths), max(kv_lengths)
    keys = torch.randn(rows + 1, kv_heads, kv_length + 20, dim).to(BF16)
    values = torch.randn_like(keys)
    tokens = sum(widths)
    qkv = torch.randn(tokens, (query_heads + 2 * kv_heads) * dim).to(BF16)
    grid = torch.tensor(
        [
            [length - w + min(i, w - 1) for i in range(width)]
            for length, w in zip(kv_lengths, widths, strict=True)
        ]
    )
    mask = attention_mask(grid, kv_length, mask_dtype).contiguous()
    cache_rows = torch.tensor([r + 1 for r, w in enumerate(widths) for _ in range(w)])
    mask_rows = torch.tensor([r * width + i for r, w in enumerate(widths) for i in range(w)])
    return qkv, keys, values, cache_rows, mask, mask_rows


def _reference(qkv, keys, values, cache_rows, mask, mask_rows, heads, scale) -> torch.Tensor:
    """float64 attention, each token on its own."""
    query_heads, kv_heads, dim = heads
    group = query_heads // kv_heads
    flat = mask.reshape(-1, mask.shape[-1]).double()
    out = torch.empty(qkv.shape[0], query_heads * dim, dtype=torch.float64)
    for t in range(qkv.shape[0]):
        for h in range(query_heads):
            q = qkv[t, h * dim : (h + 1) * dim].double()
            k = keys[int(cache_rows[t]), h // group, : mask.shape[-1]].double()
            v = values[int(cache_rows[t]), h // group, : mask.shape[-1]].double()
            weights = torch.softmax(k @ q * scale + flat[int(mask_rows[t])], dim=0)
            out[t, h * dim : (h + 1) * dim] = weights @ v
    return out


@pytest.mark.parametrize(
    ("kv_lengths", "widths", "heads", "mask_dtype"),
    [
        ([129], [1], (9, 3, 64), BF16),
        ([40, 300, 17], [5, 17, 1], (4, 4, 32), BF16),
        ([1], [1], (8, 2, 128), torch.float32),
        ([77, 16], [3, 2], (6, 1, 96), torch.float32),
        ([60, 33], [7, 3], (8, 2, 128), BF16),  # a row's 28 heads, values read 2 at a time
        ([40], [4], (4, 2, 256), torch.float32),
    ],
)
def test_attention_is_float64_attention_rounded_once(
    kv_lengths: list[int],
    widths: list[int],
    heads: tuple[int, int, int],
    mask_dtype,
    layer: CpuKernels,
) -> None:
    case = _attention_case(kv_lengths, widths, heads, mask_dtype)
    qkv, keys, values, cache_rows, mask, mask_rows = case
    scale = heads[2] ** -0.5
    out = torch.empty(qkv.shape[0], heads[0] * heads[2], dtype=BF16)
    layer.attention(qkv, out, heads, keys, values, cache_rows, mask, mask_rows, scale)
    expected = _reference(*case, heads, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    assert int(_ulps(out, expected.to(BF16)).max()) <= 1  # float32 sums, rounded once


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 2, 96)])
def test_a_querys_bits_do_not_depend_on_its_pass(
    heads: tuple[int, int, int], layer: CpuKernels
) -> None:
    """Alone in a one-token pass, or among 17 in a row beside two other rows (whose values
    are read once for all the row's heads), or a token tree's node: a query over the same
    visible keys gives the same bits."""
    qkv, keys, values, cache_rows, mask, mask_rows = _attention_case(
        [200, 150, 90], [17, 4, 1], heads
    )
    out = torch.empty(qkv.shape[0], heads[0] * heads[2], dtype=BF16)
    layer.attention(qkv, out, heads, keys, values, cache_rows, mask, mask_rows, 0.125)
    for t in range(qkv.shape[0]):
        alone = torch.empty(1, heads[0] * heads[2], dtype=BF16)
        row_mask = mask.reshape(-1, mask.shape[-1])[int(mask_rows[t])][None].contiguous()
        layer.attention(
            qkv[t : t + 1].contiguous(), alone, heads, keys, values, cache_rows[t : t + 1],
            row_mask, torch.zeros(1, dtype=torch.long), 0.125,
        )  # fmt: skip
        assert torch.equal(alone[0], out[t]), t
    # A tree: nodes 1..4 after 100 keys, parents [-1, 0, 0, 2]: node 3 sees node 0 and 2 (its
    # ancestors) and itself, stored in slots 100, 102, 103; as a sequence those are 100-102.
    sequence_keys = keys.clone()
    tree_mask = attention_mask(
        torch.tensor([[100, 101, 101, 102]]), 104, BF16, trees=[(0, 100, [-1, 0, 0, 2])]
    ).contiguous()
    sequence_keys[1, :, 101:103] = keys[1, :, 102:104]
    sequence_values = values.clone()
    sequence_values[1, :, 101:103] = values[1, :, 102:104]
    query = qkv[:1].contiguous()
    in_tree = torch.empty(1, heads[0] * heads[2], dtype=BF16)
    in_sequence = torch.empty_like(in_tree)
    one = torch.tensor([1])
    layer.attention(query, in_tree, heads, keys, values, one, tree_mask, torch.tensor([3]), 0.125)
    causal = attention_mask(torch.tensor([[102]]), 103, BF16).contiguous()
    layer.attention(
        query, in_sequence, heads, sequence_keys, sequence_values, one, causal,
        torch.tensor([0]), 0.125,
    )  # fmt: skip
    assert torch.equal(in_tree, in_sequence)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return tiny.build_byte_tokenizer()


def _served(
    directory: Path, plan: RowPlan | None, fused: bool = True, weights: str = "bf16"
) -> TargetModel:
    """The bf16 target through the lean loop with `plan` for every product and the layer
    kernels where `fused` (None: transformers' forward)."""
    if plan is None:
        return TargetModel.load(directory, device="cpu", dtype="bfloat16")
    options = ExecutionOptions(
        lean=LeanMode.AUTO, decoder=plan, head_kernels=plan, fused_layer=fused, screen=False
    )
    target = TargetModel.load(
        directory, device="cpu", dtype="bfloat16", weights=weights, execution=options
    )
    assert target.plan.forward is ForwardKind.LEAN and target.plan.fused_layer == fused
    return target


# The families the layer kernels take: Qwen2's biases, Qwen3's head norms, Phi-3's fused
# projections, Mistral's window on every layer and Qwen2's on some (windows of 16 positions,
# shorter than the prompt), Gemma 3's norms (csrc/norms.c), head norms and windowed layers
FUSED_FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "mistral", "qwen2-windowed", "gemma3_text"]


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_fused_pass_logits_match_transformers_layers(
    model_type: str, tokenizer, tmp_path: Path
) -> None:
    """A bf16 pass of 1, 7 and 40 tokens (after a prefill of the rest, csrc/layer.c's
    attention for every width) through the fused step gives transformers' bf16 logits up to
    bf16 rounding, and the same argmax wherever transformers' top two are further apart than
    that rounding (a nearer tie may go either way: two kernels sum in two orders)."""
    directory = save_architecture(
        tmp_path / model_type, tokenizer, model_type, random_norms=True, **WIDE_HEADS, head_dim=32
    )
    stock, fast = _served(directory, None), _served(directory, EVERY_GEMV)
    ids = stock.encode_prompt("The quick brown fox jumps over the lazy dog, twice: " * 3)
    compared = 0
    for width in (1, 7, 40):
        rows = [last_rows(target, ids, width) for target in (stock, fast)]
        torch.testing.assert_close(rows[1], rows[0], rtol=0.05, atol=0.05)
        top = rows[0].topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 0.1  # two tolerances apart
        assert torch.equal(rows[1].argmax(-1)[clear], rows[0].argmax(-1)[clear])
        compared += int(clear.sum())
    assert compared >= 24  # most of the 48 rows are compared


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral", "gemma3_text"])
def test_bf16_speculation_through_row_independent_kernels_is_plain_decoding(
    model_type: str, tokenizer, tmp_path: Path
) -> None:
    """With the GEMV for every product (a row's sums independent of the pass) and the fused
    attention, bf16 greedy speculation is plain decoding token for token, whatever the
    draft proposes: always right, never right, or token trees partly right (Qwen3: head
    norms between the kernels; Mistral: a window; Gemma 3: norms.c's norms)."""
    directory = save_architecture(
        tmp_path / model_type, tokenizer, model_type, random_norms=True, **WIDE_HEADS, head_dim=32
    )
    target = _served(directory, EVERY_GEMV)
    assert_speculation_is_plain_decoding(target, PROMPTS, tmp_path / "never.arpa")


def test_runtime_serves_bf16_through_the_fused_layer(
    base_settings, tokenizer, tmp_path: Path
) -> None:
    from kenspec.server.runtime import load_runtime

    directory = save_architecture(tmp_path / "llama", tokenizer, "llama", **WIDE_HEADS)
    settings = base_settings.replace(
        model=str(directory), draft="none", draft_context=False, dtype="bfloat16"
    )
    plan = load_runtime(settings).engine.target.plan
    assert LAYER is not None and plan.forward is ForwardKind.LEAN and plan.fused_layer
    assert plan.kernel_build == LAYER.path.parent.name  # the build it runs, in its key
    assert "; fused;" in plan.describe() and LAYER.path.parent.name in plan.describe()


def test_models_whose_modules_it_does_not_compute_keep_the_torch_loop(
    tokenizer, tmp_path: Path
) -> None:
    """float32 activations, another activation function, heads it does not take (16 wide):
    the lean loop without it."""
    directory = save_architecture(tmp_path / "llama", tokenizer, "llama", **WIDE_HEADS)
    lean = ExecutionOptions(lean=LeanMode.ALWAYS, decoder=EVERY_GEMV, head_kernels=EVERY_GEMV)

    def fused(directory: Path, dtype: str) -> bool:
        target = TargetModel.load(directory, device="cpu", dtype=dtype, execution=lean)
        assert target.plan.forward is ForwardKind.LEAN
        return target.plan.fused_layer

    assert fused(directory, "bfloat16")
    assert not fused(directory, "float32")
    for name, overrides in (("gelu", {**WIDE_HEADS, "hidden_act": "gelu"}), ("narrow", {})):
        other = save_architecture(tmp_path / name, tokenizer, "llama", **overrides)
        assert not fused(other, "bfloat16")


@pytest.mark.parametrize(
    ("model_type", "shape"),
    [
        ("llama", {}), ("qwen2", {}), ("llama", {"head_dim": 64, "intermediate_size": 96}),
        ("gemma3_text", {"head_dim": 32}),
    ],
    ids=["llama", "qwen2", "llama-heads-wider-than-hidden", "gemma3"],
)  # fmt: skip
@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_whole_pass_in_one_call_gives_the_layer_loops_bits(
    model_type: str, shape: dict, weights: str, threads: int, tokenizer, tmp_path: Path
) -> None:
    """csrc/step.c's pass (every product on the GEMV) calls the kernels the Python loop calls,
    in its order: the same hidden states bit for bit, and the same cache, for 1 and 7 tokens
    (Qwen2: q/k/v biases; int8: the widened int8 GEMV; heads x head_dim 256 against a hidden
    size of 128 and an MLP of 96; Gemma 3: its norms, head norms, GELU, two rotary bases and
    a window shorter than the text), on 1 and 3 threads (AVX2's pass: one parallel region
    whose threads share each product)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_whole_pass(model_type, shape, weights, tokenizer, tmp_path)
    finally:
        torch.set_num_threads(before)


def _check_whole_pass(
    model_type: str, shape: dict, weights: str, tokenizer, tmp_path: Path
) -> None:
    directory = save_architecture(
        tmp_path / model_type, tokenizer, model_type, random_norms=True, **{**WIDE_HEADS, **shape}
    )
    target = _served(directory, EVERY_GEMV, weights=weights)
    random_biases(target)
    calls = whole_pass_calls(target, "The quick brown fox jumps over the lazy dog")
    # the prefill, 1- and 7-token passes; the loop's passes none (AVX2's pass: bf16 weights;
    # Gemma's layers: AVX2's pass only)
    assert LAYER is not None
    if model_type == "gemma3_text":
        assert calls == ([1, 1, 1] if not LAYER.bf16 and weights == "bf16" else [])
    else:
        assert calls == ([1, 1, 1] if LAYER.bf16 or weights == "bf16" else [])


@pytest.mark.parametrize("vocab", [5, 49, 1000])
def test_top_probs_are_torchs_top_k_of_the_softmax(layer: CpuKernels, vocab: int) -> None:
    """kenspec_top_probs (layer.c's, layer_avx2.c's; the recycled predictions' rows): the ids
    torch.topk picks, best first and the earlier among equal logits, with softmax
    probabilities, for vocabularies that are not a multiple of its 16 or 8 lanes; a row of
    fewer finite logits than asked leaves -1 and 0 where it cannot fill."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=generator) * 4
    logits[1, vocab // 2] = logits[1, vocab - 1] = 50.0  # a tie at the top: the earlier first
    width = min(8, vocab)
    ids, probs = layer.top_probs(logits, width)
    top = torch.topk(logits, width, dim=-1)
    assert torch.equal(logits.gather(-1, ids.long()), top.values)  # the same logits, in order
    assert torch.equal(ids[[0, 2, 3]].long(), top.indices[[0, 2, 3]])  # (torch orders ties
    assert ids[1, :2].tolist() == [vocab // 2, vocab - 1]  # as it likes)
    expected = torch.softmax(logits.double(), dim=-1).gather(-1, ids.long()).float()
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    sparse = torch.full((1, vocab), float("-inf"))
    sparse[0, vocab - 2] = 1.0
    ids, probs = layer.top_probs(sparse, width)
    assert ids[0].tolist() == [vocab - 2] + [-1] * (width - 1)
    assert probs[0].tolist() == [1.0] + [0.0] * (width - 1)


def test_the_recycled_table_keeps_the_same_predictions_through_the_kernel(
    layer: CpuKernels,
) -> None:
    """RecycledPredictions with top_probs (as the server builds it on these CPUs) keeps what
    it keeps with torch's top-k: the same next tokens, probabilities within float error; and
    rows recorded one at a time (a plain round's, written straight into the table) the same
    bits as all at once."""
    generator = torch.Generator().manual_seed(0)
    rows = [(i, torch.randn(300, generator=generator) * 3) for i in range(5)]
    tokens = [11, 12, 13, 11, 14]  # a token seen twice keeps its later row
    plain, kernel = RecycledPredictions(300), RecycledPredictions(300, top_probs=layer.top_probs)
    plain.record(tokens, rows)
    kernel.record(tokens, rows)
    for token in (11, 12, 13, 14, 15):
        kept, expected = kernel.next_tokens(token), plain.next_tokens(token)
        assert [t for t, _ in kept] == [t for t, _ in expected]
        assert [p for _, p in kept] == pytest.approx([p for _, p in expected], rel=1e-5)
    assert kernel.chain(11, 3)[0] == plain.chain(11, 3)[0]
    one = RecycledPredictions(300, top_probs=layer.top_probs)
    for token, (_, row) in zip(tokens, rows, strict=True):
        one.record([token], [(0, row)])
    for token in (11, 12, 13, 14, 15):
        assert one.next_tokens(token) == kernel.next_tokens(token)
        assert one.chain(token, 3) == kernel.chain(token, 3)
    ids, probs = torch.zeros(8, dtype=torch.int32), torch.zeros(8)
    assert layer.top_probs(rows[1][1].view(1, -1), 8, (ids, probs))[0] is ids  # token 12's
    assert ids.tolist() == [t for t, _ in plain.next_tokens(12)]
    with pytest.raises(ValueError, match="contiguous int32 and float32"):
        layer.top_probs(rows[1][1].view(1, -1), 8, (probs, ids))
