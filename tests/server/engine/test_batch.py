"""Continuous batching: each stream's output in a batch is what it gives alone (float32)."""

from __future__ import annotations

import pytest

from kenspec.api.outputs import Mode
from kenspec.server.engine.batch import Batch
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.costs import PassCosts, chain_gains, choose_drafts
from kenspec.server.engine.draft_choice import GainCalibration
from kenspec.server.engine.draft_tree import DraftTree, Source
from kenspec.server.engine.generation import Generation
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.params import SamplingParams
from kenspec.server.engine.speculator import Proposal
from tests.server.engine.drafts import Collector, OracleDraft, fail_passes_fed, generate, start

MAX_NEW = 20


@pytest.fixture(scope="module")
def streams(references) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference greedy continuation of MAX_NEW) for 12 prompts."""
    return [(ids, expected[:MAX_NEW]) for ids, expected in list(references.values())[:12]]


def mixed_generations(tiny_target, streams, partly_matching, never_matching):
    """A generation per reference, cycling draft kinds, draft lengths and speculation on/off."""
    kinds = ["always", "never", "partly", "context", "off"]
    generations = []
    for index, (ids, expected) in enumerate(streams):
        kind = kinds[index % len(kinds)]
        draft = {
            "always": OracleDraft(expected),
            "never": never_matching,
            "partly": partly_matching,
            "context": ContextDraft(partly_matching, min_match=1, max_match=4),
            "off": partly_matching,
        }[kind]
        max_new = MAX_NEW - index % 4  # streams end at different iterations
        k = 1 + index % 6
        _, generation = start(
            tiny_target, draft, ids, max_new_tokens=max_new, k=k, enabled=kind != "off"
        )
        generations.append((kind, generation, expected[:max_new]))
    return generations


def drive(batch: Batch, additions: dict[int, list[tuple[Generation, Collector]]]) -> None:
    """Iterate; before iteration i, add the generations additions[i] (joins mid-batch)."""
    iteration = 0
    while True:
        for generation, collector in additions.get(iteration, []):
            batch.add(generation, collector)
        if not (batch.active or batch.waiting) and iteration > max(additions):
            return
        batch.iterate()
        iteration += 1


def test_mixed_streams_in_a_batch_equal_their_solo_greedy_output(
    tiny_target, streams, partly_matching, never_matching
) -> None:
    generations = mixed_generations(tiny_target, streams, partly_matching, never_matching)
    batch = Batch(tiny_target, BatchSettings(max_rows=5, prefill_chunk=3))
    collectors = [Collector() for _ in generations]
    pairs = [(g, c) for (_, g, _), c in zip(generations, collectors, strict=True)]
    # Four join at once, the rest one every third iteration; only five rows, so some wait.
    additions = {0: pairs[:4], **{3 * i: [pair] for i, pair in enumerate(pairs[4:], start=1)}}
    drive(batch, additions)
    for (kind, _, expected), collector in zip(generations, collectors, strict=True):
        assert collector.error is None
        assert collector.tokens == expected, kind
        assert collector.rounds[-1].finish_reason is not None
        drafted = sum(r.drafted for r in collector.rounds)
        accepted = sum(r.accepted for r in collector.rounds)
        if kind == "always":
            assert accepted == drafted > 0
        elif kind == "never":
            assert drafted > 0 and accepted == 0
        elif kind == "off":
            assert all(r.mode is Mode.AUTOREGRESSIVE for r in collector.rounds)
    assert batch.active == batch.waiting == 0
    assert max(batch.stats.by_width) > 2  # rows of different widths shared passes
    assert batch.stats.rows_verified > 2 * batch.stats.passes  # passes really were batched
    assert batch.stats.prefill_tokens == sum(len(ids) - 1 for ids, _ in streams)


def test_cancelled_stream_leaves_and_the_others_are_unaffected(
    tiny_target, streams, partly_matching, never_matching
) -> None:
    generations = mixed_generations(tiny_target, streams[:6], partly_matching, never_matching)
    batch = Batch(tiny_target, BatchSettings(max_rows=6, prefill_chunk=64))
    collectors = [Collector() for _ in generations]
    for (_, generation, _), collector in zip(generations, collectors, strict=True):
        batch.add(generation, collector)
    for _ in range(2):  # all six start together (their prompts fit one pass), then decode
        batch.iterate()
    victim = generations[1][1]  # a middle row: the last row moves into its place
    rounds_before = len(collectors[1].rounds)
    assert rounds_before == 2 and batch.active == 6
    assert not any(generation.finished for _, generation, _ in generations)
    batch.cancel(victim)
    while batch.active:
        batch.iterate()
    assert len(collectors[1].rounds) == rounds_before
    pairs = list(zip(generations, collectors, strict=True))
    for (_, _, expected), collector in pairs[:1] + pairs[2:]:
        assert collector.tokens == expected


def test_same_seed_same_sample_alone_in_a_batch_and_without_drafts(
    tiny_target, streams, partly_matching
) -> None:
    """Draws are keyed by output position, so neither drafts nor batching change a sample."""
    ids, _ = streams[0]
    sampling = SamplingParams(temperature=1.0, seed=77)
    alone = generate(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW, sampling=sampling)
    list(alone)
    plain = generate(
        tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW, sampling=sampling, enabled=False
    )
    list(plain)
    batch = Batch(tiny_target, BatchSettings(max_rows=4))
    batched, collector = None, None
    others = [Collector() for _ in range(3)]
    for index, (other_ids, _) in enumerate(streams[1:4]):
        _, other = start(
            tiny_target,
            partly_matching,
            other_ids,
            max_new_tokens=MAX_NEW,
            sampling=SamplingParams(temperature=1.0, seed=index),
        )
        batch.add(other, others[index])
    _, batched = start(
        tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW, sampling=sampling, k=2
    )
    collector = Collector()
    batch.add(batched, collector)
    batch.run_until_idle()
    assert alone.output_ids == plain.output_ids == collector.tokens
    assert len(set(map(tuple, (o.tokens for o in others)))) > 1  # they did sample


def test_a_failing_row_fails_alone(tiny_target, streams, partly_matching, monkeypatch) -> None:
    """A pass that raises is rerun row by row; only the row that breaks it fails."""
    poison = streams[2][0][-1]
    assert all(ids[-1] != poison for ids, _ in streams[:2])
    fail_passes_fed(monkeypatch, poison)
    batch = Batch(tiny_target)
    collectors = [Collector() for _ in range(3)]
    for (ids, _), collector in zip(streams[:3], collectors, strict=True):
        batch.add(start(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW)[1], collector)
    batch.run_until_idle()
    assert isinstance(collectors[2].error, RuntimeError) and not collectors[2].rounds
    for (_, expected), collector in zip(streams[:2], collectors[:2], strict=True):
        assert collector.error is None and collector.tokens == expected
    assert batch.active == 0


COSTS = PassCosts({(1, 1): 1.0, (1, 4): 1.6, (1, 7): 2.0, (8, 8): 2.4, (8, 32): 4.0, (8, 56): 5.0})


@pytest.mark.parametrize(
    ("proposed", "acceptance", "costs", "drafts"),
    [
        ([6], [0.9], COSTS, [6]),  # alone, good acceptance: draft fully
        ([6], [0.2], COSTS, [0]),  # alone, poor acceptance: not worth a wider pass
        ([6] * 8, [0.9] * 8, COSTS, [6] * 8),  # eight good speculators
        ([6, 6], [0.5, 0.5], None, [6, 6]),  # uncalibrated: every proposal
        ([0, 0], [1.0, 1.0], COSTS, [0, 0]),
    ],
)
def test_choose_drafts(proposed, acceptance, costs, drafts) -> None:
    assert choose_drafts(gains(proposed, acceptance), costs) == drafts


def gains(proposed: list[int], acceptance: list[float]) -> list[list[float]]:
    return [chain_gains(k, a) for k, a in zip(proposed, acceptance, strict=True)]


def test_a_rows_drafting_work_is_charged_with_its_first_draft() -> None:
    """A row that verifies drafts spends more of the round than a plain row (its tree walked,
    learned, its extra rows of logits read): 0.6 of a step makes a 0.6-acceptance chain,
    worth it on its pass alone, not worth drafting at all; rows that draft well still do."""
    assert choose_drafts(gains([6], [0.6]), COSTS)[0] > 0
    assert choose_drafts(gains([6], [0.6]), COSTS, row_work=0.6) == [0]
    assert choose_drafts(gains([6, 6], [0.95, 0.95]), COSTS, row_work=0.2) == [6, 6]


def test_the_work_of_the_tokens_drafts_add_is_charged_for_them() -> None:
    """Each token a round emits costs its own work (a row of logits read, delivered): at half
    a step a token, a draft that pays on its pass alone no longer does, and fewer of a good
    chain's are worth it."""
    assert choose_drafts(gains([6], [0.3]), COSTS) == [1]
    assert choose_drafts(gains([6], [0.3]), COSTS, token_work=0.5) == [0]
    full = choose_drafts(gains([6], [0.8]), COSTS)[0]
    assert 0 < choose_drafts(gains([6], [0.8]), COSTS, token_work=0.5)[0] < full


def test_gains_are_scaled_by_what_verification_accepted_of_them() -> None:
    """The choice's calibration: learned gains times accepted per predicted (decayed) in their
    bin of predicted probability, 1 before any draft was verified, kept non-increasing;
    forced tokens and probes as they are; a round whose walk stopped among its forced tokens
    says nothing of its learned ones."""
    calibration = GainCalibration()
    chain = Proposal.of(DraftTree.chain([5, 6], [0.8, 0.4], Source("kenlm")))
    assert calibration.ratios == [1.0] * 5 and calibration.gains(chain) == [0.8, 0.4]
    for _ in range(100):
        for accepted in (0, 0, 1, 1, 2):  # node 0 accepted 3 in 5, node 1 once
            calibration.learn(chain, list(range(accepted)))
    assert calibration.ratio(0.8) == pytest.approx(0.75, abs=0.03)
    assert calibration.ratio(0.4) == pytest.approx(0.5, abs=0.03)
    assert calibration.gains(chain) == pytest.approx([0.6, 0.2], abs=0.03)
    with_forced = Proposal.of(DraftTree.chain([7, 5, 6], [1.0, 0.8, 0.4], Source("kenlm")), 1)
    assert calibration.gains(with_forced) == pytest.approx([1.0, 0.6, 0.2], abs=0.03)
    probe = Proposal.of(chain.tree, probe=True)
    assert calibration.gains(probe) == [1.0, 1.0]
    before = calibration.ratios
    calibration.learn(with_forced, [])  # the forced token was refused: learned ones unreached
    assert calibration.ratios == before
    for _ in range(400):
        calibration.learn(probe, [0, 1])  # a probe's predictions (0.8, 0.4) are learned from
    assert calibration.ratio(0.8) > 1.2 and calibration.ratio(0.4) > 2
    for _ in range(400):  # guesses at 0.7 never right, at 0.5 always: no row's order turned
        calibration.observe(0.7, False)
        calibration.observe(0.5, True)
    guesses = calibration.gains(Proposal.of(DraftTree.chain([5, 6], [0.7, 0.5], Source("k"))))
    assert guesses[0] < 0.01 and guesses[1] <= guesses[0]


def test_a_tree_keeps_its_best_nodes_and_a_wide_one_beats_a_poor_chain() -> None:
    """Node gains are path probabilities: a tree whose root has two likely children (0.5,
    0.4) is worth more than the chain of its first (0.5, 0.25): more of it is taken."""
    tree = [0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    chain = chain_gains(6, 0.5)
    assert choose_drafts([tree], COSTS)[0] > choose_drafts([chain], COSTS)[0]
    assert choose_drafts([[0.05] * 6], COSTS) == [0]  # unlikely nodes: not worth the pass


def test_one_good_speculator_among_eight_drafts_alone() -> None:
    """A packed pass charges a row only for its own tokens: the others need not speculate
    for one row's drafts to pay (a padded pass of 8 x 7 tokens would cost 5.0 for 8 + 3)."""
    drafts = choose_drafts(gains([6, 0, 0, 0, 0, 0, 0, 0], [0.8] + [1.0] * 7), COSTS)
    assert drafts[0] >= 4 and drafts[1:] == [0] * 7


def test_better_acceptance_gets_more_drafts_and_prompt_tokens_count_in_the_cost() -> None:
    good, poor = choose_drafts(gains([6, 6], [0.9, 0.3]), COSTS)
    assert good > poor
    # The same rows in a pass that also prefills 40 prompt tokens, paid for either way: a
    # draft adds a smaller share to the pass's cost, so no row drafts less.
    with_prompt = choose_drafts(gains([6, 6], [0.9, 0.3]), COSTS, base_tokens=42)
    assert with_prompt[0] >= good and with_prompt[1] >= poor and with_prompt != [good, poor]


def test_pass_costs_interpolate_in_rows_and_extrapolate_in_tokens() -> None:
    assert COSTS.cost(1, 4) == 1.6
    assert COSTS.cost(8, 56) == 5.0
    assert COSTS.cost(8, 20) == pytest.approx(3.2)
    assert COSTS.cost(4, 4) == pytest.approx(1.6 + (2.4 - 1.6) * 3 / 7)
    assert COSTS.cost(1, 14) == pytest.approx(4.0)  # in proportion beyond the most measured
    assert COSTS.cost(16, 8) == 2.4  # clamped to the largest measured batch
    padded = PassCosts({(1, 1): 1.0, (1, 2): 1.5, (1, 3): 1.8, (1, 4): 1.6})
    assert padded.pass_tokens(3, limit=8) == 4
    assert padded.pass_tokens(3, limit=3) == 3


def test_prompts_prefill_in_large_chunks_alone_and_small_ones_beside_running_streams(
    tiny_target, streams, partly_matching
) -> None:
    (first, _), (second, _), (third, _) = streams[:3]
    assert len(third) > 4  # several 2-token chunks
    batch = Batch(tiny_target, BatchSettings(prefill_chunk=2, prefill_chunk_alone=64))
    collectors = [Collector() for _ in range(3)]
    for ids, collector in zip((first, second), collectors, strict=False):
        batch.add(start(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW)[1], collector)
    batch.iterate()  # nothing decodes: both prompts go into their first round's pass
    assert batch.stats.prefill_tokens == len(first) + len(second) - 2
    assert batch.stats.passes == 1 and "prefill" not in batch.stats.seconds
    assert all(len(c.rounds) == 1 for c in collectors[:2])
    # One newcomer beside two running streams: its own 2-token chunks, the others go on.
    batch.add(start(tiny_target, partly_matching, third, max_new_tokens=MAX_NEW)[1], collectors[2])
    chunks = 0
    while not collectors[2].rounds:
        before = batch.stats.prefill_tokens
        batch.iterate()
        assert batch.stats.prefill_tokens - before <= 2
        chunks += 1
    assert chunks == -(-(len(third) - 1) // 2)
    batch.run_until_idle()
    for (_, expected), collector in zip(streams[:3], collectors, strict=True):
        assert collector.tokens == expected


def test_a_long_prompt_alone_is_chunked_and_its_last_chunk_shares_the_first_round(
    tiny_target, streams, partly_matching
) -> None:
    ids, expected = streams[3]
    assert len(ids) > 5
    batch = Batch(tiny_target, BatchSettings(prefill_chunk=2, prefill_chunk_alone=3))
    collector = Collector()
    batch.add(start(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW)[1], collector)
    iterations = 0
    while not collector.rounds:
        batch.iterate()
        iterations += 1
    separate = -(-(len(ids) - 1) // 3) - 1  # chunks of 3, the last one in the round's pass
    assert iterations == separate + 1 and batch.stats.passes == 1
    batch.run_until_idle()
    assert collector.tokens == expected


def test_a_burst_of_prompts_starts_in_one_pass_and_later_ones_prefill_in_chunks(
    tiny_target, streams, partly_matching, never_matching
) -> None:
    generations = mixed_generations(tiny_target, streams[:7], partly_matching, never_matching)
    budget = sum(len(ids) - 1 for ids, _ in streams[:4])  # the first four prompts exactly
    batch = Batch(
        tiny_target, BatchSettings(max_rows=6, prefill_chunk=2, prefill_chunk_alone=budget)
    )
    collectors = [Collector() for _ in generations]
    pairs = list(zip(generations, collectors, strict=True))
    for (_, generation, _), collector in pairs[:6]:
        batch.add(generation, collector)
    batch.iterate()
    started = [c for c in collectors if c.rounds]
    assert batch.stats.passes == 1 and len(started) == 4  # four fit the budget
    assert all(not c.rounds for c in collectors[4:])  # the rest wait their turn
    batch.add(pairs[6][0][1], pairs[6][1])
    batch.run_until_idle()
    for (kind, _, expected), collector in pairs:
        assert collector.error is None and collector.tokens == expected, kind
    assert batch.stats.prefill_tokens == sum(len(ids) - 1 for ids, _ in streams[:7])


def test_a_burst_joins_a_lone_running_stream_in_one_pass(
    tiny_target, streams, partly_matching
) -> None:
    """Three newcomers beside one running stream join its next pass: they are at least as many
    as the running streams, so the larger budget applies (their prompts exceed the 2-token
    chunk); packed, the running row pays only for their prompt tokens, and no newcomer needs a
    prefill pass of its own."""
    batch = Batch(tiny_target, BatchSettings(prefill_chunk=2, prefill_chunk_alone=256))
    collectors = [Collector() for _ in range(4)]
    pairs = list(zip(streams[:4], collectors, strict=True))
    (ids, _), collector = pairs[0]
    batch.add(start(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW)[1], collector)
    batch.iterate()
    for (ids, _), collector in pairs[1:]:
        batch.add(start(tiny_target, partly_matching, ids, max_new_tokens=MAX_NEW)[1], collector)
    batch.iterate()
    assert batch.stats.passes == 2 and all(len(c.rounds) == 1 for c in collectors[1:])
    assert "prefill" not in batch.stats.seconds
    batch.run_until_idle()
    for (_, expected), collector in pairs:
        assert collector.tokens == expected
