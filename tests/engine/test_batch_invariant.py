"""Batch-invariant mode (engine.invariant): a token's logits are bit-identical whatever shares
its pass, so greedy output is identical with speculation on or OFF, alone or in a batch, with
or without the prefix cache, in bfloat16 as in float32.

The model is a tiny Llama whose MLP is as wide as SmolLM2's (1536): the widths at which the
CPU's kernels change their summation order with the number of rows (bench.invariance finds
them layer by layer on a real model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.invariance import compare, run_layout
from server.engine.admission import BatchSettings
from server.engine.batch import Batch
from server.engine.invariant import (
    CANDIDATES,
    Padding,
    choose_padding,
    invariant_under,
    make_invariant,
    undo_invariant,
    use_padding,
)
from server.engine.slot_cache import KERNELS
from server.engine.target import TargetModel, cpu_has_native_bf16
from server.runtime import load_runtime
from server.settings import Settings
from tests import tiny
from tests.engine.drafts import Collector, OracleDraft, start

PROMPTS = ("The quick brown fox", "def add(a, b):", "Once upon a time there", "1, 2, 3, 4,")
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wide-llama")
    tokenizer = tiny.build_byte_tokenizer()
    return tiny.save_tiny_model(
        directory, tokenizer, seed=3, hidden_size=128, intermediate_size=1536
    )


@pytest.fixture(params=["bfloat16", "float32"])
def invariant_target(request, wide_model_dir) -> Iterator[TargetModel]:
    """The wide model in the mode; the process-wide attention choice restored after."""
    target = TargetModel.load(wide_model_dir, device="cpu", dtype=request.param)
    before = make_invariant(target)
    yield target
    undo_invariant(target, before)


def test_logits_and_every_layer_are_bit_identical_in_every_layout(invariant_target) -> None:
    target = invariant_target
    prompt = target.encode_prompt(PROMPTS[0])
    others = [target.encode_prompt(p) for p in PROMPTS[1:3]]
    tokens = [
        int(t) for t in torch.randint(3, 200, (8,), generator=torch.Generator().manual_seed(1))
    ]
    steps, steps_logits = run_layout(target, prompt, tokens, "steps", others)
    assert steps, "no module output was captured: the comparison would be empty"
    for layout in ("wide", "batched", "chunked"):
        outputs, logits = run_layout(target, prompt, tokens, layout, others)
        assert compare(steps, outputs) == [], layout
        assert torch.equal(logits, steps_logits), layout


def _greedy(target: TargetModel, prompt: list[int], draft, *, enabled: bool, **options):
    _, generation = start(
        target, draft, prompt, max_new_tokens=NEW_TOKENS, k=5, enabled=enabled, **options
    )
    collector = Collector()
    batch = Batch(target, BatchSettings(prefix_cache_bytes=0))
    batch.add(generation, collector)
    batch.run_until_idle()
    assert collector.error is None
    return collector.tokens


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


@pytest.mark.skipif(
    not cpu_has_native_bf16(),
    reason="this CPU has no native bf16: its bf16 products are emulated, and whether they "
    "vary with the row count is not what this test is about",
)
def test_without_the_mode_some_logits_depend_on_the_pass(wide_model_dir) -> None:
    """What the mode is for: the stock kernels give some token other bits in another pass."""
    target = TargetModel.load(wide_model_dir, device="cpu", dtype="bfloat16")
    assert not KERNELS.invariant
    differing = 0
    for prompt_text in PROMPTS:
        prompt = target.encode_prompt(prompt_text)
        tokens = list(range(40, 56))
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


def test_the_server_runtime_verifies_chains_only_in_the_mode(wide_model_dir) -> None:
    """Token trees put a node's ancestors at slots the tree's shape decides, so attention sums
    them in another order than a chain or a decode step does: the mode drafts chains."""
    settings = Settings(
        model=str(wide_model_dir),
        draft="none",
        device="cpu",
        dtype="bfloat16",
        batch_invariant=True,
        calibration_cache="none",
        prefix_cache_mb=0,
    )
    before = KERNELS.grouped, KERNELS.upcast
    try:
        runtime = load_runtime(settings)
        assert runtime.engine.context.tree_budget == 1
        assert KERNELS.invariant and runtime.engine.target.head_t is None
    finally:
        use_padding(runtime.engine.target.model, None)
        KERNELS.grouped, KERNELS.upcast = before
        KERNELS.invariant = False
