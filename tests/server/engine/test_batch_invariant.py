"""Batch-invariant mode (engine.invariant): a token's logits are bit-identical whatever shares
its pass, so greedy output is identical with speculation on or OFF, alone or in a batch, with
or without the prefix cache, in bfloat16 as in float32.

The model is a tiny Llama whose MLP is as wide as SmolLM2's (1536): the widths at which the
CPU's kernels change their summation order with the number of rows (bench.invariance finds
them layer by layer on a real model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.invariance import LAYOUTS, compare, run_layout, tree_with_siblings
from kenspec.server.engine import attention
from kenspec.server.engine.batch import Batch
from kenspec.server.engine.forward.plan import ExecutionOptions, HeadKind
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.invariant import (
    CANDIDATES,
    InvariantLinear,
    choose_padding,
    invariant_under,
    use_padding,
    value_block,
)
from kenspec.server.engine.kernels import Padding
from kenspec.server.engine.target import TargetModel, cpu_has_native_bf16
from kenspec.server.engine.verify_pass import PassRow, VerifyPass
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import Settings
from tests import tiny
from tests.server.engine.drafts import Branching, Collector, OracleDraft, reference_greedy, start

PROMPTS = ("The quick brown fox", "def add(a, b):", "Once upon a time there", "1, 2, 3, 4,")
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wide-llama")
    tokenizer = tiny.build_byte_tokenizer()
    return tiny.save_tiny_model(
        directory, tokenizer, seed=3, hidden_size=128, intermediate_size=1536
    )


INVARIANT = ExecutionOptions(batch_invariant=True)


def _invariant(directory: Path, dtype: str) -> TargetModel:
    """The model loaded in the mode (its plan measured; its layers padded)."""
    target = TargetModel.load(directory, device="cpu", dtype=dtype, execution=INVARIANT)
    assert target.plan.invariance is not None and target.plan.head is HeadKind.MODEL
    return target


@pytest.fixture(params=["bfloat16", "float32"])
def invariant_target(request, wide_model_dir) -> TargetModel:
    """The wide model in the mode."""
    return _invariant(wide_model_dir, request.param)


def test_logits_and_every_layer_are_bit_identical_in_every_layout(invariant_target) -> None:
    target = invariant_target
    prompt = target.encode_prompt(PROMPTS[0])
    others = [target.encode_prompt(p) for p in PROMPTS[1:3]]
    tokens = [
        int(t) for t in torch.randint(3, 200, (8,), generator=torch.Generator().manual_seed(1))
    ]
    steps, steps_logits = run_layout(target, prompt, tokens, "steps", others)
    assert steps, "no module output was captured: the comparison would be empty"
    assert "tree" in LAYOUTS  # a token tree's branch at every other slot
    for layout in LAYOUTS:
        outputs, logits = run_layout(target, prompt, tokens, layout, others)
        assert compare(steps, outputs) == [], layout
        assert torch.equal(logits, steps_logits), layout


def _long_prompt(target: TargetModel, length: int) -> list[int]:
    ids = target.encode_prompt("A long prompt, one word after another. " * (length // 8 + 8))
    assert len(ids) >= length
    return ids[:length]


def test_a_tree_summed_across_a_block_of_keys_differs_which_is_why_the_batch_cuts_it(
    wide_model_dir,
) -> None:
    """Attention adds up a block of keys at a time (value_block, measured): a tree node whose
    slot lies past a block's end while its position does not is summed in another order than
    a decode step sums it. Placed so that the branch's nodes straddle the boundary, the tree
    layout differs; placed before it, it does not; and the batch's cut keeps only the nodes
    before such a straddle (PassRow.nodes_in_key_blocks). In float32: the tiny model's bf16
    layer outputs round such differences away."""
    _check_block_boundary(_invariant(wide_model_dir, "float32"))


def _measured_block(target: TargetModel) -> int:
    """The mode's block of summed keys, or a skip where this BLAS gives none to cross."""
    block = target.tree_key_block
    measured = value_block(target.device, target.attention_shape[2])
    assert block == (measured or 1)
    if not measured or not 64 <= block < 1024:
        pytest.skip(f"this BLAS's block of summed keys ({measured}) has no boundary to test")
    return block


def _check_block_boundary(target: TargetModel) -> None:
    block = _measured_block(target)
    tokens = [
        int(t) for t in torch.randint(3, 200, (8,), generator=torch.Generator().manual_seed(2))
    ]
    differs = {}
    for length in (block - 20, block - 6):  # the branch's slots: length + 0, 2, .., 14
        prompt = _long_prompt(target, length)
        steps, steps_logits = run_layout(target, prompt, tokens, "steps", [])
        tree, tree_logits = run_layout(target, prompt, tokens, "tree", [])
        differs[length] = bool(compare(steps, tree)) or not torch.equal(tree_logits, steps_logits)
    assert differs == {block - 20: False, block - 6: True}
    # What the batch keeps of the straddling tree, drafted after the prompt's last token (the
    # pending one), scored in a pass of its own: on the branch, the decode steps' bits.
    nodes, parents = tree_with_siblings(tokens, target.vocab_size)
    prompt = _long_prompt(target, block - 6)
    row = PassRow(len(prompt) - 1, prompt[-1], tuple(nodes), tuple(parents))
    kept = row.nodes_in_key_blocks(block)
    assert 0 < kept < len(nodes)
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:-1])
    (logits,) = target.forward(cache, VerifyPass((row.prefix(kept),)))
    on_branch = range(0, kept, 2)  # tokens[j] is node 2j, fed at 1 + 2j
    got = torch.stack([logits[1 + node] for node in on_branch])
    assert torch.equal(got, steps_logits[: len(on_branch)])


def _greedy(
    target: TargetModel, prompt: list[int], draft, *, enabled: bool, rounds=False, **options
):
    """The greedy answer's tokens (or its rounds), run alone."""
    _, generation = start(
        target, draft, prompt, max_new_tokens=NEW_TOKENS, k=5, enabled=enabled, **options
    )
    collector = Collector()
    batch = Batch(target, BatchSettings(prefix_cache_bytes=0))
    batch.add(generation, collector)
    batch.run_until_idle()
    assert collector.error is None
    return collector.rounds if rounds else collector.tokens


def test_greedy_output_is_identical_off_auto_batched_and_cached(invariant_target) -> None:
    target = invariant_target
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    plain = [_greedy(target, p, None, enabled=False) for p in prompts]
    assert all(len(tokens) == NEW_TOKENS for tokens in plain)
    for prompt, expected in zip(prompts, plain, strict=True):
        # a draft right for a while, then wrong: wide passes, partly accepted
        half = OracleDraft(expected[:6] + [(t + 1) % 250 for t in expected[6:]])
        assert _greedy(target, prompt, half, enabled=True) == expected
    # every prompt at once, in one batch, sharing each pass; then again from the prefix cache
    batch = Batch(target, BatchSettings(max_rows=4, prefix_cache_bytes=1 << 24))
    reused = []
    for _ in range(2):
        collectors = []
        for prompt, expected in zip(prompts, plain, strict=True):
            _, generation = start(
                target, OracleDraft(expected[:9]), prompt, max_new_tokens=NEW_TOKENS, k=3
            )
            collectors.append(Collector())
            batch.add(generation, collectors[-1])
        batch.run_until_idle()
        assert [c.tokens for c in collectors] == plain
        reused.append(batch.stats.reused_tokens)
    assert reused[1] > reused[0], "the second round did not reuse the prefix cache"


def test_greedy_output_with_token_trees_is_identical_to_off_across_key_blocks(
    invariant_target,
) -> None:
    """Trees whose right branch is the second one (its nodes at every other slot), on prompts
    whose answers cross a block of summed keys, alone and four in a batch: the answers are
    OFF's, and the right branches were taken."""
    target = invariant_target
    block = _measured_block(target)
    prompts = [_long_prompt(target, length) for length in (20, block - 9, block - 5, 2 * block - 7)]
    plain = [_greedy(target, p, None, enabled=False) for p in prompts]
    for prompt, expected in zip(prompts, plain, strict=True):
        branching = Branching(expected, target.vocab_size)
        rounds = _greedy(target, prompt, branching, enabled=True, tree_budget=8, rounds=True)
        assert [t for r in rounds for t in r.token_ids] == expected
        assert sum(r.accepted for r in rounds) > len(rounds) // 2  # the right branch taken
    batch = Batch(target, BatchSettings(max_rows=4, prefix_cache_bytes=0))
    collectors = []
    for prompt, expected in zip(prompts, plain, strict=True):
        _, generation = start(
            target,
            Branching(expected, target.vocab_size),
            prompt,
            max_new_tokens=NEW_TOKENS,
            k=4,
            tree_budget=6,
        )
        collectors.append(Collector())
        batch.add(generation, collectors[-1])
    batch.run_until_idle()
    assert [c.tokens for c in collectors] == plain


@pytest.mark.skipif(
    not cpu_has_native_bf16(),
    reason="this CPU has no native bf16: its bf16 products are emulated, and whether they "
    "vary with the row count is not what this test is about",
)
def test_without_the_mode_some_logits_depend_on_the_pass(wide_model_dir) -> None:
    """What the mode is for: the stock kernels give some token other bits in another pass.
    The wide pass has 40 tokens: some CPUs' kernels agree from 1 to 32 rows (oneDNN on AMX)."""
    target = TargetModel.load(wide_model_dir, device="cpu", dtype="bfloat16")
    assert target.plan.invariance is None
    differing = 0
    for prompt_text in PROMPTS:
        prompt = target.encode_prompt(prompt_text)
        tokens = list(range(40, 80))
        steps, steps_logits = run_layout(target, prompt, tokens, "steps", [])
        for layout in ("wide", "chunked"):
            outputs, logits = run_layout(target, prompt, tokens, layout, [])
            differing += len(compare(steps, outputs)) + (not torch.equal(logits, steps_logits))
    assert differing > 0


def test_padding_is_chosen_by_measurement_and_refused_when_none_works(wide_model_dir) -> None:
    target = TargetModel.load(wide_model_dir, device="cpu", dtype="float32")
    padding = choose_padding(target.model)
    assert padding in CANDIDATES
    layers = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(invariant_under(layer) for layer in layers)
    assert all(layer.padding == padding for layer in layers)
    use_padding(target.model, None)
    assert all(type(layer) is torch.nn.Linear for layer in layers)
    assert Padding(2, 1).rows(1) == 2 and Padding(4, 4).rows(5) == 8 and Padding(4, 4).rows(8) == 8


def test_the_server_runtime_verifies_trees_in_the_mode(wide_model_dir) -> None:
    """The mode keeps the server's token trees: attention sums a node's keys in sequence
    order, and the batch keeps nodes within the measured block of summed keys."""
    settings = Settings.of(
        model=str(wide_model_dir),
        draft="none",
        device="cpu",
        dtype="bfloat16",
        batch_invariant=True,
        calibration_cache="none",
        prefix_cache_mb=0,
    )
    runtime = load_runtime(settings)
    target = runtime.engine.target
    measured = value_block(torch.device("cpu"), 32)
    trees = settings.speculation.tree_budget if measured else 1  # no block measured: chains
    assert runtime.engine.context.tree_budget == trees and settings.speculation.tree_budget > 1
    assert target.tree_key_block == (measured or 1)
    assert target.plan.invariance is not None and target.plan.head is HeadKind.MODEL


def test_the_mode_belongs_to_its_target_not_to_the_process(wide_model_dir, monkeypatch) -> None:
    """Batch invariance is a property of a target's plan: a second target loaded beside one
    in the mode keeps the stock kernels, and only the first's passes take
    invariant_attention."""
    calls: list[int] = []
    original = attention.invariant_attention

    def spy(query, *args, **options):  # type: ignore[no-untyped-def]
        calls.append(query.shape[2])
        return original(query, *args, **options)

    monkeypatch.setattr(attention, "invariant_attention", spy)
    invariant = _invariant(wide_model_dir, "float32")
    stock = TargetModel.load(wide_model_dir, device="cpu", dtype="float32")
    assert invariant.plan.attention.pass_padding is not None
    assert stock.plan.invariance is None and stock.plan.attention.pass_padding is None
    assert stock.tree_key_block == 0 < invariant.tree_key_block
    assert not any(isinstance(m, InvariantLinear) for m in stock.model.modules())
    calls.clear()  # (loading checks a packed pass)
    for target in (stock, invariant):
        cache = target.new_cache(1)
        target.prefill(cache, 0, 0, target.encode_prompt(PROMPTS[0]))
    # one call a layer, for one pass: the invariant target's prefill, not the stock one's
    assert len(calls) == invariant.model.config.num_hidden_layers


def test_float32_greedy_in_the_mode_with_trees_is_transformers_generate(wide_model_dir) -> None:
    """The mode's kernels compute the model, not just the same bits everywhere: in float32 its
    greedy answers, verified in token trees, are transformers' `generate`."""
    stock = TargetModel.load(wide_model_dir, device="cpu", dtype="float32")
    prompts = [stock.encode_prompt(PROMPTS[1]), _long_prompt(stock, 180)]
    expected = [reference_greedy(stock, prompt, NEW_TOKENS) for prompt in prompts]
    target = _invariant(wide_model_dir, "float32")
    for prompt, reference in zip(prompts, expected, strict=True):
        branching = Branching(reference, target.vocab_size)
        assert _greedy(target, prompt, branching, enabled=True, tree_budget=8) == reference
