"""Logprobs with speculation on: every token's log-probability and alternatives equal
transformers' log-softmax of the target's logits for the same context (float32, to 1e-4), in
chains, trees and batches, and asking for them changes no output."""

from __future__ import annotations

import pytest
import torch

from kenspec.api.outputs import TokenLogprob
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.params import (
    ProcessorParams,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.sampling import warp_logits
from kenspec.server.engine.speculative_engine import ContextSettings, SpeculativeEngine
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import Branching, Collector, OracleDraft, generate

MAX_NEW = 16
TOP = 5


def reference_logprobs(target: TargetModel, ids: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of transformers' own logits before each output token."""
    with torch.no_grad():
        logits = target.model(torch.tensor([ids + output])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) + len(output) - 1], dim=-1)


def check(logprobs: list[TokenLogprob], output: list[int], reference: torch.Tensor) -> None:
    assert [lp.token_id for lp in logprobs] == output
    for position, logprob in enumerate(logprobs):
        row = reference[position]
        assert logprob.logprob == pytest.approx(row[logprob.token_id].item(), abs=1e-4)
        values, ids = torch.topk(row, len(logprob.top))
        assert [token for token, _ in logprob.top] == ids.tolist()
        assert [value for _, value in logprob.top] == pytest.approx(values.tolist(), abs=1e-4)


def _logprobs(rounds) -> list[TokenLogprob]:  # type: ignore[no-untyped-def]
    found = []
    for round_ in rounds:
        assert round_.logprobs is not None and len(round_.logprobs) == len(round_.token_ids)
        found.extend(round_.logprobs)
    return found


@pytest.mark.parametrize("kind", ["off", "always", "partly", "context", "tree"])
def test_greedy_logprobs_equal_transformers_on_twenty_prompts(
    tiny_target, references, partly_matching, kind: str
) -> None:
    assert len(references) >= 20
    accepted = 0
    for ids, expected in references.values():
        draft = {
            "off": None,
            "always": OracleDraft(expected),
            "partly": partly_matching,
            "context": ContextDraft(partly_matching, min_match=1, max_match=4),
            "tree": Branching(expected, tiny_target.vocab_size),
        }[kind]
        generation = generate(
            tiny_target,
            draft,
            ids,
            max_new_tokens=MAX_NEW,
            k=4,
            enabled=draft is not None,
            top_logprobs=TOP,
            tree_budget=8 if kind == "tree" else 1,
        )
        rounds = list(generation)
        output = generation.output_ids
        assert output == expected[: len(output)]  # asking for logprobs changes nothing
        check(_logprobs(rounds), output, reference_logprobs(tiny_target, ids, output))
        accepted += sum(r.accepted for r in rounds)
    if kind != "off":
        assert accepted > 0, "speculation must accept drafts for the test to cover it"


def test_logprobs_in_a_batch_equal_transformers(tiny_target, references, partly_matching) -> None:
    engine = SpeculativeEngine(tiny_target, partly_matching, context=ContextSettings())
    collected = []
    for ids, _ in list(references.values())[:6]:
        generation = engine.start(
            ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=MAX_NEW),
            speculation=SpeculationParams(chain_tokens=4),
            top_logprobs=3,
        )
        collector = Collector()
        engine.batch.add(generation, collector)
        collected.append((ids, generation, collector))
    engine.batch.run_until_idle()
    assert engine.batch.stats.rows_verified > engine.batch.stats.passes  # really batched
    for ids, generation, collector in collected:
        assert collector.error is None
        output = generation.output_ids
        check(_logprobs(collector.rounds), output, reference_logprobs(tiny_target, ids, output))


def test_sampled_logprobs_are_of_the_warped_distribution(tiny_target, partly_matching) -> None:
    """Sampling: log p after temperature and top-k; alternatives the filter drops are absent."""
    params = SamplingParams(temperature=0.7, top_k=3, seed=11)
    for prompt in tiny.PROMPTS[:5]:
        ids = tiny_target.encode_prompt(prompt)
        plain = generate(tiny_target, partly_matching, ids, sampling=params, max_new_tokens=12)
        list(plain)
        generation = generate(
            tiny_target,
            partly_matching,
            ids,
            sampling=params,
            max_new_tokens=12,
            top_logprobs=TOP,
        )
        logprobs = _logprobs(list(generation))
        output = generation.output_ids
        assert output == plain.output_ids  # the same draws with or without logprobs
        with torch.no_grad():
            logits = tiny_target.model(torch.tensor([ids + output])).logits[0].float()
        warped = warp_logits(logits[len(ids) - 1 : len(ids) + len(output) - 1], params).log()
        for position, logprob in enumerate(logprobs):
            assert logprob.logprob == pytest.approx(
                warped[position, output[position]].item(), abs=1e-4
            )
            assert len(logprob.top) == 3  # top-k kept 3: the other two are impossible
            assert all(value > float("-inf") for _, value in logprob.top)


def test_logprobs_follow_the_processors(tiny_target) -> None:
    """With a logit_bias the distribution the token came from is the biased one."""
    ids = tiny_target.encode_prompt(tiny.PROMPTS[0])
    bias = ProcessorParams(logit_bias=((9, 4.0),))
    generation = generate(
        tiny_target, None, ids, enabled=False, max_new_tokens=4, top_logprobs=1, processing=bias
    )
    logprobs = _logprobs(list(generation))
    output = generation.output_ids
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([ids + output])).logits[0, len(ids) - 1].float()
    logits[9] += 4.0
    assert logprobs[0].logprob == pytest.approx(
        torch.log_softmax(logits, -1)[output[0]].item(), abs=1e-4
    )


def test_rounds_carry_no_logprobs_unless_asked(tiny_target, partly_matching) -> None:
    ids = tiny_target.encode_prompt(tiny.PROMPTS[1])
    rounds = list(generate(tiny_target, partly_matching, ids, max_new_tokens=8))
    assert all(r.logprobs is None for r in rounds)
    asked = list(generate(tiny_target, partly_matching, ids, max_new_tokens=8, top_logprobs=0))
    assert all(lp.top == () for r in asked for lp in r.logprobs or ())
    assert sum(len(r.logprobs or ()) for r in asked) == 8


def test_a_stop_inside_a_round_cuts_its_logprobs(tiny_target, references) -> None:
    """The oracle makes every round long; a stop string inside one cuts tokens and logprobs."""
    ids, expected = next(iter(references.values()))
    text = tiny_target.tokenizer.decode(expected[:MAX_NEW])
    stop = text[len(text) // 2 :][:2]
    generation = generate(
        tiny_target,
        OracleDraft(expected),
        ids,
        max_new_tokens=MAX_NEW,
        stop=(stop,),
        top_logprobs=2,
    )
    rounds = list(generation)
    assert rounds[-1].finish_reason is not None
    for round_ in rounds:
        assert round_.logprobs is not None and len(round_.logprobs) == len(round_.token_ids)
