"""Greedy speculative output equals plain transformers greedy output, token for token (float32)."""

from __future__ import annotations

import pytest

from kenspec.api.outputs import FinishReason, Mode
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.costs import PassCosts
from kenspec.server.engine.forward.plan import ExecutionOptions, HeadKind
from kenspec.server.engine.linear_kernels import SkinnyLinear, decoder_linears
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import OracleDraft, generate, reference_greedy

MAX_NEW = 24


def test_at_least_twenty_prompts() -> None:
    assert len(tiny.PROMPTS) >= 20


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("kind", ["always", "never", "partly", "context"])
def test_greedy_speculative_equals_plain_greedy(
    tiny_target, references, partly_matching, never_matching, kind: str, k: int
) -> None:
    totals = {"drafted": 0, "accepted": 0}
    for ids, expected in references.values():
        draft = {
            "always": OracleDraft(expected),
            "never": never_matching,
            "partly": partly_matching,
            "context": ContextDraft(partly_matching, min_match=1, max_match=4),
        }[kind]
        generation = generate(tiny_target, draft, ids, max_new_tokens=MAX_NEW, k=k)
        rounds = list(generation)
        assert [t for r in rounds for t in r.token_ids] == expected
        assert generation.output_ids == expected
        usage = rounds[-1].usage
        totals["drafted"] += usage.drafted_tokens
        totals["accepted"] += usage.accepted_tokens
    # The three drafts really are what they claim to be, so each path of the rule is exercised.
    if kind == "always":
        assert totals["accepted"] == totals["drafted"] > 0
    elif kind == "never":
        assert totals["drafted"] > 0 and totals["accepted"] == 0
    else:  # partly, and context over partly: some accepted, some not
        assert 0 < totals["accepted"] < totals["drafted"]


def test_autoregressive_mode_equals_plain_greedy(tiny_target, references, partly_matching) -> None:
    for ids, expected in references.values():
        generation = generate(
            tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW, enabled=False
        )
        rounds = list(generation)
        assert all(r.mode is Mode.AUTOREGRESSIVE and r.drafted == 0 for r in rounds)
        assert generation.output_ids == expected


@pytest.mark.parametrize("k", [1, 4, 8])
def test_oracle_draft_accepts_everything_with_k_plus_one_tokens_per_round(
    tiny_target, references, k: int
) -> None:
    ids, expected = references[tiny.PROMPTS[0]]
    assert len(expected) == MAX_NEW, "the reference must not stop early for this test"
    generation = generate(tiny_target, OracleDraft(expected), ids, max_new_tokens=MAX_NEW, k=k)
    rounds = list(generation)
    assert all(r.accepted == r.drafted for r in rounds)
    # Every round but the last emits k drafts + 1 bonus token; the last is cut by the length limit.
    assert all(len(r.token_ids) == k + 1 for r in rounds[:-1])
    assert len(rounds) == -(-MAX_NEW // (k + 1))
    usage = rounds[-1].usage
    assert usage.accepted_tokens == usage.drafted_tokens
    assert rounds[-1].finish_reason is FinishReason.LENGTH


def test_chat_prompt_matches_plain_greedy(tiny_target, partly_matching) -> None:
    ids = tiny_target.encode_chat([{"role": "user", "content": "The quick brown fox"}])
    assert ids[0] == tiny_target.tokenizer.convert_tokens_to_ids("<|im_start|>")
    generation = generate(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW, k=4)
    list(generation)
    assert generation.output_ids == reference_greedy(tiny_target, ids, MAX_NEW)


def test_generic_logits_path_and_padded_passes_are_exact(
    tiny_model_dir, references, partly_matching, monkeypatch
) -> None:
    """Models outside the plain-head list take full logits; padded passes change nothing."""
    execution = ExecutionOptions(head=HeadKind.MODEL)
    generic = TargetModel.load(tiny_model_dir, device="cpu", dtype="float32", execution=execution)
    # A 5-token pass measured cheapest: every one-row pass of 2-4 tokens is padded to 5.
    costs = PassCosts({**{(1, width): 1.0 for width in range(1, 5)}, (1, 5): 0.9})
    padded: list[int] = []
    forward = TargetModel.forward

    def recording_forward(self, cache, verify):  # type: ignore[no-untyped-def]
        if 1 < len(verify.rows[0].tokens) < verify.width:
            padded.append(len(verify.rows[0].tokens))
        return forward(self, cache, verify)

    monkeypatch.setattr(TargetModel, "forward", recording_forward)
    for ids, expected in list(references.values())[:8]:
        generation = generate(
            generic, partly_matching, ids, max_new_tokens=MAX_NEW, k=4, costs=costs
        )
        list(generation)
        assert generation.output_ids == expected
    assert padded  # some passes really were padded


def test_skinny_linears_are_exact(tiny_model_dir, references, partly_matching) -> None:
    """Passes of 2-8 tokens through W @ x^T (engine.linear_kernels) give plain greedy output."""
    execution = ExecutionOptions(skinny_rows=frozenset(range(2, 9)))
    skinny = TargetModel.load(tiny_model_dir, device="cpu", dtype="float32", execution=execution)
    layer = decoder_linears(skinny.model)[0]
    assert isinstance(layer, SkinnyLinear) and layer.skinny_rows == frozenset(range(2, 9))
    seen: list[int] = []
    layer.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].numel() // args[0].shape[-1])
    )
    for ids, expected in references.values():
        generation = generate(skinny, partly_matching, ids, max_new_tokens=MAX_NEW, k=4)
        list(generation)
        assert generation.output_ids == expected
    assert {2, 3, 4, 5} & set(seen)  # verify passes really went through the skinny path
