"""n choices of one request: one prefill, n rows, each choice what a single request with its
seed gives."""

from __future__ import annotations

from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.speculative_engine import ContextSettings, SpeculativeEngine
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import Collector, generate

PROMPT = tiny.PROMPTS[3] * 3  # long enough that sharing its prefill shows
MAX_NEW = 12


def _start(engine: SpeculativeEngine, ids: list[int], seed: int, choice: int):  # type: ignore[no-untyped-def]
    return engine.start(
        ids,
        sampling=SamplingParams(temperature=0.8, seed=seed),
        stopping=StoppingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        speculation=SpeculationParams(chain_tokens=3),
        choice=choice,
    )


def _solo(target: TargetModel, draft, ids: list[int], seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    generation = generate(
        target,
        draft,
        ids,
        sampling=SamplingParams(temperature=0.8, seed=seed),
        max_new_tokens=MAX_NEW,
        ignore_eos=True,
        k=3,
    )
    list(generation)
    return generation.output_ids


def test_choices_share_one_prefill_and_equal_single_requests(tiny_target, partly_matching) -> None:
    ids = tiny_target.encode_prompt(PROMPT)
    # No prefix cache: the copy must come from the first choice's row alone.
    batching = BatchSettings(prefix_cache_bytes=0)
    engine = SpeculativeEngine(
        tiny_target, partly_matching, context=ContextSettings(), batching=batching
    )
    generations = [_start(engine, ids, 100 + choice, choice) for choice in range(3)]
    collectors = [Collector() for _ in generations]
    for index, (generation, collector) in enumerate(zip(generations, collectors, strict=True)):
        engine.batch.add(generation, collector, follows=generations[0] if index else None)
    engine.batch.run_until_idle()
    stats = engine.batch.stats
    assert stats.prefill_tokens == len(ids) - 1  # the first choice's prompt, once
    assert stats.reused_tokens == 2 * (len(ids) - 1)  # copied into the other two rows
    for choice, (generation, collector) in enumerate(zip(generations, collectors, strict=True)):
        assert collector.error is None
        assert all(round_.choice == choice for round_ in collector.rounds)
        assert generation.output_ids == _solo(tiny_target, partly_matching, ids, 100 + choice)
    assert len({tuple(g.output_ids) for g in generations}) > 1  # different seeds, answers


def test_a_choice_whose_first_is_gone_prefills_itself(tiny_target) -> None:
    """The first choice cancelled before the others could copy its row: they prefill."""
    ids = tiny_target.encode_prompt(PROMPT)
    engine = SpeculativeEngine(tiny_target, None, context=ContextSettings())
    first, second = (_start(engine, ids, 7 + choice, choice) for choice in range(2))
    engine.batch.add(first, Collector())
    collector = Collector()
    engine.batch.add(second, collector, follows=first)
    engine.batch.cancel(first)
    engine.batch.run_until_idle()
    assert collector.error is None
    assert second.output_ids == _solo(tiny_target, None, ids, 8)
