"""The lean decoder loop (engine.forward.lean), its products and their kernels: the same
function as transformers' layers, the GEMV's sums independent of the row count, kernel plans
by row count, and the models and machines it is refused for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kenspec.server.engine.forward import cpu_kernels, products
from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.lean import LeanWeights, Unsupported
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ForwardKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.forward.products import Product, candidates, fastest_plan, onednn_packs
from kenspec.server.engine.kenlm_draft import KenLMDraft
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import generate, last_rows
from tests.tiny_architectures import WINDOW, save_architecture

KERNELS = load_kernels()
GEMV = KERNELS.gemv if KERNELS is not None and KERNELS.gemv_bf16 else None  # either ISA's
NO_GEMV = pytest.mark.skipif(GEMV is None, reason="the CPU has no AVX2 (or no compiler)")
STOCK, PACKED, GEMV_ = Kernel.STOCK, Kernel.PACKED, Kernel.GEMV
NO_BF16_PACKING = pytest.mark.skipif(
    not onednn_packs(torch.bfloat16),
    reason="oneDNN packs no bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)",
)
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3", "Hello world"]


def test_row_plan_takes_the_kernel_measured_at_or_below() -> None:
    plan = RowPlan(((1, GEMV_), (2, PACKED), (34, STOCK)))
    assert [plan.kernel(rows) for rows in (1, 2, 17, 33, 34, 500)] == [
        GEMV_, PACKED, PACKED, PACKED, STOCK, STOCK
    ]  # fmt: skip
    assert RowPlan().kernel(7) is STOCK
    assert RowPlan(((4, PACKED),)).kernel(3) is STOCK  # below the first measured count
    assert plan.describe() == "1:gemv 2:packed 34:stock"


def test_plan_is_the_fastest_kernel_by_row_count() -> None:
    timings = {
        1: {STOCK: 20.0, PACKED: 13.0, GEMV_: 11.0},
        2: {STOCK: 20.0, PACKED: 13.0, GEMV_: 15.0},
        8: {STOCK: 20.0, PACKED: 13.5, GEMV_: 27.0},
        64: {STOCK: 25.0, PACKED: 24.9, GEMV_: 130.0},  # within the margin: stock
    }
    assert fastest_plan(timings).describe() == "1:gemv 2:packed 64:stock"


def test_an_invariant_kernel_keeps_every_row_count_from_one_while_within_its_margin() -> None:
    """The GEMV (a row's bits independent of the row count) takes each count from the first
    while within 5% of the fastest, up to invariant_rows; past that the fastest rule."""
    timings = {
        1: {STOCK: 20.0, PACKED: 13.0, GEMV_: 11.0},
        2: {STOCK: 20.0, PACKED: 13.0, GEMV_: 13.5},  # 3.8% slower: still the GEMV
        8: {STOCK: 20.0, PACKED: 13.0, GEMV_: 14.0},  # 7.7% slower: packed from here
        17: {STOCK: 20.0, PACKED: 15.0, GEMV_: 12.0},  # the prefix ended: fastest rule
    }
    plan = fastest_plan(timings, invariant=GEMV_, invariant_rows=65)
    assert plan.describe() == "1:gemv 8:packed 17:gemv"
    assert plan.invariant_below() == 8
    assert fastest_plan(timings).describe() == "1:gemv 2:packed 17:gemv"
    assert fastest_plan(timings).invariant_below() == 2
    capped = fastest_plan(timings, invariant=GEMV_, invariant_rows=2)
    assert capped.describe() == "1:gemv 8:packed 17:gemv" and capped.invariant_below() == 8
    everywhere = {rows: {STOCK: 9.0, GEMV_: 9.2} for rows in (1, 4)}
    assert fastest_plan(everywhere, invariant=GEMV_, invariant_rows=65).describe() == "1:gemv"
    slow = {1: {STOCK: 9.0, GEMV_: 10.0}, 4: {STOCK: 9.0, GEMV_: 9.0}}
    assert fastest_plan(slow, invariant=GEMV_, invariant_rows=65).describe() == "1:stock"
    assert fastest_plan(slow, invariant=GEMV_).invariant_below() == 0


def test_fused_product_is_its_layers_side_by_side() -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, n, bias=b) for n, b in ((16, True), (8, False), (8, True))]
    product = Product.of(layers)
    x = torch.randn(5, 24)
    expected = torch.cat([layer(x) for layer in layers], dim=-1)
    torch.testing.assert_close(product.run(x, STOCK, None), expected)
    product.pack()
    torch.testing.assert_close(product.run(x, PACKED, None), expected, rtol=1e-5, atol=1e-5)


@NO_GEMV
@pytest.mark.parametrize("k", [576, 77, 32, 1])
def test_gemv_is_the_product_rounded_once(k: int) -> None:
    """Each output is the exact dot product (float64) up to float32 summation, rounded to
    bf16 once: within one bf16 step of the float64 result."""
    assert GEMV is not None
    torch.manual_seed(k)
    x, w = torch.randn(9, k).bfloat16(), torch.randn(300, k).bfloat16()
    exact = x.double() @ w.double().t()
    got = GEMV(x, w).double()
    step = exact.abs().clamp(min=1e-30) * 2.0**-7  # a bf16 step (8 significant bits)
    assert bool(((got - exact).abs() <= step + 1e-6 * k).all())


@NO_GEMV
@pytest.mark.parametrize(("out", "k"), [(1536, 576), (301, 77)])
def test_gemv_row_bits_do_not_depend_on_the_row_count(out: int, k: int) -> None:
    """A row's outputs are bit-identical alone or among 1..17 rows, whatever block of outputs
    and rows they fall in (one-row blocks of 16, 4 x 4 blocks, single-output tails) and with
    one thread or two: one summation order."""
    assert GEMV is not None
    torch.manual_seed(1)
    x, w = torch.randn(17, k).bfloat16(), torch.randn(out, k).bfloat16()
    alone = torch.cat([GEMV(x[i : i + 1], w) for i in range(17)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)  # (the kernel's OpenMP is torch's)
            for rows in (1, 2, 3, 4, 5, 7, 8, 13, 17):
                assert torch.equal(GEMV(x[:rows], w), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_kernels_the_cpu_cannot_run_raise_instead_of_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without avx512_bf16 the library holds the int8 GEMV (AVX-512 F/BW/VL/DQ) and AVX2's
    bf16 GEMV and layer kernels: AVX512-BF16's kernels (widened here) refuse with a reason
    instead of an illegal instruction, `gemv` runs AVX2's, and the int8 GEMV of bf16
    activations takes its float32 sums (none widened to bf16)."""
    # (the int8 GEMV runs below only where this CPU really has AVX-512: an AVX2-only one
    # would execute an illegal instruction, whatever the faked flags say)
    runs_avx512 = cpu_kernels.Isa.AVX512 in cpu_kernels.supported_isa(cpu_kernels.cpu_flags())
    load_kernels.cache_clear()
    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    try:
        kernels = load_kernels()
        if kernels is None:
            pytest.skip("no compiler here")
        assert kernels.int8 and not kernels.bf16 and not kernels.vnni and kernels.gemv_bf16
        x = torch.randn(2, 64).bfloat16()
        with pytest.raises(cpu_kernels.KernelUnavailable, match="avx512_bf16"):
            kernels.widened(x, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4).bfloat16())
        assert kernels.layer_kernels  # (AVX2's)
        weight = torch.randn(8, 64).bfloat16()
        assert torch.equal(kernels.gemv(x, weight), kernels.gemv_avx2(x, weight))
        values, scales = torch.randint(-9, 9, (8, 64), dtype=torch.int8), torch.ones(8).bfloat16()
        expected = (x.float() @ values.float().t()).bfloat16()
        if runs_avx512:
            torch.testing.assert_close(kernels.gemv_int8(x, values, scales), expected)
    finally:
        load_kernels.cache_clear()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
    try:
        assert load_kernels() is None  # neither AVX-512 nor AVX2: nothing of it runs here
    finally:
        load_kernels.cache_clear()


def test_a_failed_build_leaves_torchs_kernels_not_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler that fails leaves the server on torch's kernels (load_kernels() is None)."""
    load_kernels.cache_clear()
    failing = tmp_path / "cc"
    failing.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\nexit 1\n')
    failing.chmod(0o755)
    monkeypatch.setattr(cpu_kernels, "CACHE", tmp_path / "kernels")
    monkeypatch.setenv("CC", str(failing))
    try:
        assert load_kernels() is None
    finally:
        load_kernels.cache_clear()


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return tiny.build_byte_tokenizer()


def _served(directory: Path, dtype: str, plan: RowPlan | None) -> TargetModel:
    """The target through the lean loop with `plan` for every product (None: transformers')."""
    if plan is None:
        return TargetModel.load(directory, device="cpu", dtype=dtype)
    options = ExecutionOptions(
        lean=LeanMode.ALWAYS, decoder=plan, head_kernels=plan, fused_layer=False, screen=False
    )
    served = TargetModel.load(directory, device="cpu", dtype=dtype, execution=options)
    assert served.plan.forward is ForwardKind.LEAN and served.plan.decoder == plan
    return served


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("plan", [RowPlan(), RowPlan.every(PACKED)], ids=["stock", "packed"])
def test_float32_greedy_with_speculation_is_transformers_generate(
    model_type: str, plan: RowPlan, tokenizer, tmp_path: Path
) -> None:
    """Through the lean loop (fused products, its own kernels), speculation with a partly
    matching draft gives transformers' own greedy output, token for token (float32)."""
    directory = save_architecture(tmp_path / model_type, tokenizer, model_type)
    _assert_speculation_is_generate(directory, plan, 20, tokenizer, tmp_path)


def _assert_speculation_is_generate(
    directory: Path, plan: RowPlan, new: int, tokenizer, tmp_path: Path
) -> None:
    """The float32 model at `directory` through the lean loop with `plan`: greedy output with
    speculation (a draft trained on the first half of each reference, token trees) equals
    transformers' `generate` on the model as shipped, `new` tokens for each of PROMPTS."""
    shipped = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    served = _served(directory, "float32", plan)
    references = []
    for prompt in PROMPTS:
        ids = served.encode_prompt(prompt)
        output = shipped.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=new,
        )  # fmt: skip
        references.append((ids, output[0, len(ids) :].tolist()))
    arpa = tiny.train_arpa(
        tmp_path / "draft.arpa",
        [continuation[: new // 2] for _, continuation in references],
        range(len(tokenizer)),
        order=3,
    )
    draft = KenLMDraft.load(arpa, vocab_size=served.vocab_size)
    for ids, expected in references:
        generation = generate(served, draft, ids, max_new_tokens=new, k=4, tree_budget=8)
        for _ in generation:
            pass
        assert generation.output_ids == expected


# Families whose layers differ from Llama's (tests/tiny_architectures: each feature on, at a
# size these prompts and answers reach): Qwen3's head norms; Phi-3's fused projections and
# window, and rotary over half a head (as Phi-4-mini's over 3/4); Mistral's window on every
# layer, Qwen2's on some; Gemma 2's norms around attention and the MLP, soft-capped scores and
# logits; Gemma 3's head norms, rotary base per layer type and an attention scale of its own
# (query_pre_attn_scalar, not the head dim).
FAMILIES = pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("qwen3", {}), ("phi3", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("mistral", {}),
        ("qwen2-windowed", {}), ("gemma2", {}), ("gemma3_text", {"query_pre_attn_scalar": 40}),
    ],
    ids=["qwen3", "phi3", "phi3-partial-rotary", "mistral", "qwen2-windowed", "gemma2", "gemma3"],
)  # fmt: skip


@FAMILIES
def test_float32_greedy_of_each_family_is_transformers_generate(
    model_type: str, overrides: dict, tokenizer, tmp_path: Path
) -> None:
    """Through the lean loop, each family's float32 greedy output with speculation (a partly
    matching draft, token trees) is transformers' own, token for token, past its windows."""
    directory = save_architecture(
        tmp_path / model_type, tokenizer, model_type, random_norms=True, **overrides
    )
    assert len(tokenizer(PROMPTS[0])["input_ids"]) + 24 > WINDOW  # past the windows
    _assert_speculation_is_generate(directory, RowPlan(), 24, tokenizer, tmp_path)


@FAMILIES
def test_a_pass_of_each_family_gives_its_own_forwards_logits(
    model_type: str, overrides: dict, tokenizer, tmp_path: Path
) -> None:
    """A float32 prefill and passes of 1 and 7 tokens through the lean loop give the logits of
    transformers' own forward on the whole sequence (the lean loop replaces every layer; a
    feature it missed shows as a difference far past float32 summation order)."""
    directory = save_architecture(
        tmp_path / model_type, tokenizer, model_type, random_norms=True, **overrides
    )
    shipped = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    served = _served(directory, "float32", RowPlan())
    ids = served.encode_prompt("The quick brown fox jumps over the lazy dog")
    with torch.inference_mode():
        expected = shipped(torch.tensor([ids])).logits[0]
    for width in (1, 7):
        rows = last_rows(served, ids, width)
        torch.testing.assert_close(rows, expected[-width:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(RowPlan.every(PACKED), marks=NO_BF16_PACKING),
        pytest.param(RowPlan.every(GEMV_), marks=NO_GEMV),
    ],
    ids=["packed", "gemv"],
)
def test_bfloat16_pass_logits_match_transformers_layers(
    plan: RowPlan, tokenizer, tmp_path: Path
) -> None:
    """A bf16 pass of 1 and of 7 tokens through the lean loop gives transformers' bf16 logits
    up to bf16 rounding (other kernels sum in another order), and the same argmax."""
    directory = save_architecture(tmp_path / "llama", tokenizer, "llama")
    stock = _served(directory, "bfloat16", None)
    fast = _served(directory, "bfloat16", plan)
    ids = stock.encode_prompt("The quick brown fox jumps over")
    for width in (1, 7):
        rows = [last_rows(target, ids, width) for target in (stock, fast)]
        torch.testing.assert_close(rows[1], rows[0], rtol=0.05, atol=0.05)
        assert torch.equal(rows[1].argmax(-1), rows[0].argmax(-1))


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [("gpt_neox", "model type 'gpt_neox'"), ("phi", "model type 'phi'"), ("gpt2", "gpt2")],
)
def test_models_it_does_not_reproduce_are_refused(
    model_type: str, reason: str, tokenizer, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        save_architecture(tmp_path / model_type, tokenizer, model_type)
    )
    with pytest.raises(Unsupported, match=reason):
        LeanWeights(model)


def test_runtime_serves_bf16_llama_through_it_and_not_float32(base_settings) -> None:
    """The served bf16 target runs the lean loop (a plan measured at start-up, whatever it
    chose); float32 and --no-fast-step keep transformers' forward."""
    from kenspec.server.runtime import load_runtime

    settings = base_settings.replace(draft="none", draft_context=False)
    bf16 = load_runtime(settings.replace(dtype="bfloat16")).engine.target
    assert bf16.plan.forward is ForwardKind.LEAN
    assert bf16.plan.decoder.choices[0][0] == 1
    float32 = load_runtime(settings).engine.target
    assert float32.plan.forward is ForwardKind.EAGER
    off = load_runtime(settings.replace(dtype="bfloat16", fast_step=False))
    assert off.engine.target.plan.forward is ForwardKind.EAGER


def test_fused_layers_become_views_of_their_product_and_keep_their_output(
    tokenizer, tmp_path: Path
) -> None:
    """The lean forward holds no second copy of a weight: single layers are used as they are,
    fused ones become views of the fused rows, and the model's own forward is unchanged."""
    directory = save_architecture(tmp_path / "qwen2", tokenizer, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer("The quick brown fox")["input_ids"]])
    with torch.inference_mode():
        before = model(ids).logits
    lean = LeanWeights(model)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    layer, attention = lean.layers[0], model.base_model.layers[0].self_attn
    assert layer.out.weight.data_ptr() == attention.o_proj.weight.data_ptr()
    fused = layer.qkv.weight.untyped_storage().data_ptr()
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(attention, name).weight.untyped_storage().data_ptr() == fused


def test_a_cpu_whose_onednn_packs_no_bf16_is_never_planned_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On such a CPU (AVX2 only: oneDNN's bf16 reorder refuses) the candidates are stock and
    the GEMV where it builds, never `packed`; where it packs, `packed` is measured too."""
    bf16 = [Product(torch.zeros(4, 4, dtype=torch.bfloat16))]
    monkeypatch.setattr(products, "onednn_packs", lambda dtype: False)
    assert candidates(bf16, KERNELS) == (STOCK,) + ((GEMV_,) if GEMV else ())
    monkeypatch.setattr(products, "onednn_packs", lambda dtype: True)
    assert PACKED in candidates(bf16, KERNELS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_rotary_table_is_the_models_own_rotary(dtype: torch.dtype, head_dim: int) -> None:
    """RotaryTable's cos and sin, value for value, against the model's module: positions in any
    order and count, past a block's end, after the table grew, at the model's last position."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kenspec.server.engine.forward.lean import ROTARY_TABLE_TOKENS, RotaryTable

    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=1000,
        rope_theta=10000.0,
    )  # fmt: skip
    module = LlamaRotaryEmbedding(config)
    table = RotaryTable.of(module, config)
    assert table is not None
    generator = torch.Generator().manual_seed(0)
    hidden = torch.zeros(1, ROTARY_TABLE_TOKENS, config.hidden_size, dtype=dtype)
    cases = [[0], [5, 6, 7], [63, 64], [999], list(range(200, 217)), list(range(488, 1000))]
    cases += [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (1, 9, 300)]
    for positions in cases:
        ids = torch.tensor([positions])
        x = hidden[:, : len(positions)]
        for got, want in zip(table(x, ids), module(x, ids), strict=True):
            assert got.dtype == want.dtype == dtype
            assert torch.equal(got, want), positions


def test_a_rope_that_rescales_with_the_length_has_no_table() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kenspec.server.engine.forward.lean import RotaryTable

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=dynamic)
    assert RotaryTable.of(LlamaRotaryEmbedding(config), config) is None
