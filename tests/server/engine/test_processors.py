"""Penalties, logit_bias and min-p at every verified position: the processors alone, greedy
output identical to plain decoding with the same processors (and to transformers `generate`
where it has them), and sampled output distributed as plain sampling with them."""

from __future__ import annotations

import pytest
import torch

from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.params import InvalidParameter, ProcessorParams, SamplingParams
from kenspec.server.engine.processors import PresenceFrequencyPenalty, penalties, processed
from kenspec.server.engine.sampling import warp_logits
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import Branching, OracleDraft, generate, reference_greedy
from tests.server.engine.test_sampling import (
    SAMPLES,
    _last_logits,
    chi_square_pvalue,
    speculative_samples,
)

MAX_NEW = 20


def _penalized(**options: object) -> tuple:
    defaults: dict = {
        "prompt": [],
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "device": torch.device("cpu"),
    }
    return penalties(**{**defaults, **options})


@pytest.mark.parametrize(
    ("options", "output", "path", "expected"),
    [
        ({}, [1], [2], [1.0, 2.0, -1.0, 4.0]),  # nothing asked: unchanged
        # repetition: the prompt's, the output's and the path's tokens; / when > 0, * when < 0
        ({"repetition_penalty": 2.0, "prompt": [3]}, [1], [2], [1.0, 1.0, -2.0, 2.0]),
        # presence and frequency: generated tokens only (output + path), by count
        (
            {"presence_penalty": 0.5, "frequency_penalty": 1.0, "prompt": [3]},
            [1, 1],
            [1, 2],
            [1.0, 2.0 - 3.5, -1.0 - 1.5, 4.0],
        ),
        ({"logit_bias": {0: 5.0, 3: -100.0}}, [], [], [6.0, 2.0, -1.0, -96.0]),
        # all at once, in order: the bias, then repetition, then presence/frequency
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 1.0, "logit_bias": {1: 1.0}},
            [1],
            [],
            [1.0, (2.0 + 1.0) / 2.0 - 1.0, -1.0, 4.0],
        ),
    ],
)
def test_processors_change_the_row_as_documented(
    options: dict, output: list[int], path: list[int], expected: list[float]
) -> None:
    row = torch.tensor([1.0, 2.0, -1.0, 4.0])
    result = processed(row, _penalized(**options), output, path)
    assert result.tolist() == pytest.approx(expected)
    assert row.tolist() == [1.0, 2.0, -1.0, 4.0]  # the pass's row is never changed


def test_default_parameters_ask_for_no_processor() -> None:
    assert _penalized() == ()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ProcessorParams(repetition_penalty=0.0), "repetition_penalty"),
        (lambda: ProcessorParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (lambda: ProcessorParams(presence_penalty=2.5), "presence_penalty"),
        (lambda: ProcessorParams(frequency_penalty=-3.0), "frequency_penalty"),
        (lambda: ProcessorParams(logit_bias=((5, 101.0),)), "logit_bias[5]"),
        (lambda: ProcessorParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (lambda: ProcessorParams(logit_bias=tuple((i, 1.0) for i in range(1025))), "logit_bias"),
        (lambda: SamplingParams(min_p=1.5), "min_p"),
    ],
)
def test_invalid_processor_parameters_name_the_field(build, field: str) -> None:
    with pytest.raises(InvalidParameter) as error:
        build()
    assert error.value.field == field


def test_logit_bias_outside_the_vocabulary_is_refused_at_start(tiny_target) -> None:
    ids = tiny_target.encode_prompt("Hello")
    with pytest.raises(InvalidParameter, match="not in the vocabulary"):
        generate(
            tiny_target,
            None,
            ids,
            processing=ProcessorParams(logit_bias=((tiny_target.vocab_size, 1.0),)),
        )


def test_min_p_keeps_tokens_near_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp_logits(logits, SamplingParams(temperature=1.0, min_p=0.5))[0]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


# --- greedy: identical to plain decoding with the same processors ---------------------------------


def plain_greedy(target: TargetModel, ids: list[int], processing: ProcessorParams) -> list[int]:
    """Plain greedy decoding, one full forward per token, with OpenAI's presence and frequency
    penalties and logit_bias written out here (not engine.processors)."""
    output: list[int] = []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + output])).logits[0, -1].float()
        for token in set(output):
            count = output.count(token)
            logits[token] -= processing.frequency_penalty * count + processing.presence_penalty
        for token, amount in processing.logit_bias:
            logits[token] += amount
        output.append(int(logits.argmax()))
        if output[-1] in target.eos_token_ids:
            break
    return output


def _drafts(kind: str, expected: list[int], partly_matching, vocab: int):  # type: ignore[no-untyped-def]
    return {
        "plain-reference": OracleDraft(expected),
        "partly": partly_matching,
        "context": ContextDraft(partly_matching, min_match=1, max_match=4),
        "tree": Branching(expected, vocab),
    }[kind]


@pytest.mark.parametrize("kind", ["plain-reference", "partly", "context", "tree"])
def test_greedy_with_repetition_penalty_and_bias_equals_transformers(
    tiny_target, partly_matching, kind: str
) -> None:
    """repetition_penalty and logit_bias (transformers' sequence_bias) against `generate` with
    its own processors, for drafts that always, sometimes and (off the tree's wrong branch)
    never match; the prompts' answers change under the processors, so this checks them."""
    bias = {5: 2.0, 40: -3.0}
    changed = 0
    for prompt in tiny.PROMPTS[:10]:
        ids = tiny_target.encode_prompt(prompt)
        expected = reference_greedy(
            tiny_target,
            ids,
            MAX_NEW,
            repetition_penalty=1.3,
            sequence_bias={(token,): amount for token, amount in bias.items()},
        )
        processing = ProcessorParams(repetition_penalty=1.3, logit_bias=tuple(bias.items()))
        draft = _drafts(kind, expected, partly_matching, tiny_target.vocab_size)
        generation = generate(
            tiny_target,
            draft,
            ids,
            max_new_tokens=MAX_NEW,
            k=4,
            processing=processing,
            tree_budget=8 if kind == "tree" else 1,
        )
        list(generation)
        assert generation.output_ids == expected, prompt
        changed += expected != reference_greedy(tiny_target, ids, MAX_NEW)
    assert changed >= 3, "the processors must change some answers for the test to mean much"


@pytest.mark.parametrize("kind", ["plain-reference", "partly", "tree"])
def test_greedy_with_presence_and_frequency_penalties_equals_plain_decoding(
    tiny_target, partly_matching, kind: str
) -> None:
    processing = ProcessorParams(
        presence_penalty=0.4, frequency_penalty=0.6, logit_bias=((7, 1.5),)
    )
    changed = 0
    for prompt in tiny.PROMPTS[:10]:
        ids = tiny_target.encode_prompt(prompt)
        expected = plain_greedy(tiny_target, ids, processing)
        draft = _drafts(kind, expected, partly_matching, tiny_target.vocab_size)
        generation = generate(
            tiny_target,
            draft,
            ids,
            max_new_tokens=MAX_NEW,
            k=4,
            processing=processing,
            tree_budget=8 if kind == "tree" else 1,
        )
        rounds = list(generation)
        assert generation.output_ids == expected[: len(generation.output_ids)], prompt
        assert len(generation.output_ids) == len(expected)
        if kind == "plain-reference":  # the oracle's drafts are all accepted: long rounds
            assert max(len(r.token_ids) for r in rounds) > 1
        changed += expected != reference_greedy(tiny_target, ids, MAX_NEW)
    assert changed >= 3


# --- sampling: distributed as plain sampling with the same processors -----------------------------


FREQUENCY = ProcessorParams(frequency_penalty=2.0)


def exact_penalized_joint(target: TargetModel, prompt_ids: list[int], params) -> dict:  # type: ignore[no-untyped-def]
    """p(y1, y2) of plain sampling with a frequency penalty of 2: y2's logits lose 2 at y1."""
    first = warp_logits(_last_logits(target, prompt_ids), params)[0]
    joint = {}
    for y1 in range(target.vocab_size):
        if first[y1] == 0:
            continue
        logits = _last_logits(target, [*prompt_ids, y1]).clone()
        logits[0, y1] -= FREQUENCY.frequency_penalty
        second = warp_logits(logits, params)[0]
        for y2 in range(target.vocab_size):
            joint[(y1, y2)] = first[y1].item() * second[y2].item()
    return joint


def _repeat_draft(target: TargetModel, prompt_ids: list[int]) -> OracleDraft:
    """The most likely first token, twice: after it (on its path) the penalty bites."""
    first = int(_last_logits(target, prompt_ids)[0].argmax())
    return OracleDraft([first, first])


def test_sampling_with_a_penalty_follows_plain_sampling_with_it(word_target) -> None:
    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt("the cat")
    joint = exact_penalized_joint(word_target, prompt_ids, params)
    draft = _repeat_draft(word_target, prompt_ids)
    samples = speculative_samples(word_target, prompt_ids, params, draft, processing=FREQUENCY)
    first = draft.start(prompt_ids).chain(1).tokens[0]
    accepted_first = sum(1 for s in samples if s[0] == first) / SAMPLES
    assert 0.05 < accepted_first < 0.95, "the draft must be neither always nor never accepted"
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_distribution_check_rejects_a_penalty_from_the_pending_token_only(
    word_target, monkeypatch
) -> None:
    """A wrong rule, penalizing from the output before the round (the pending token's context)
    and not from the drafts on the node's path, must fail the same check."""
    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt("the cat")
    joint = exact_penalized_joint(word_target, prompt_ids, params)
    original = PresenceFrequencyPenalty.process

    def pending_only(self, scores, output, path):  # type: ignore[no-untyped-def]
        return original(self, scores, output, ())

    monkeypatch.setattr(PresenceFrequencyPenalty, "process", pending_only)
    draft = _repeat_draft(word_target, prompt_ids)
    samples = speculative_samples(word_target, prompt_ids, params, draft, processing=FREQUENCY)
    assert chi_square_pvalue(samples, joint) < 1e-6
