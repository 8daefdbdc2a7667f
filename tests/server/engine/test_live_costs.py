"""Pass costs that follow the machine: buckets updated by real passes, outliers damped, stale
shapes measured again, the breaker's threshold and the batch's draft choice following them."""

from __future__ import annotations

import pytest

from kenspec.api.outputs import BreakerState
from kenspec.server.engine import live_costs
from kenspec.server.engine.calibration import Calibration
from kenspec.server.engine.costs import lowest_break_even
from kenspec.server.engine.draft import Chain
from kenspec.server.engine.generation import Generation
from kenspec.server.engine.live_costs import LiveCosts
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.target import TargetModel
from tests.server.engine.drafts import (
    Collector,
    FixedDraft,
    OracleDraft,
    Solo,
    StaticDouble,
    reference_greedy,
    start,
)

# One row's passes of 1..7 tokens and of 12 and 17; two rows' of 2..14.
QUIET = {(1, t): 0.020 * (1 + 0.02 * (t - 1)) for t in (*range(1, 8), 12, 17)}
QUIET |= {(2, 2 * t): 0.024 * (1 + 0.02 * (t - 1)) for t in range(1, 8)}


def loaded(factor: float, wide: float) -> dict[tuple[int, int], float]:
    """QUIET with every pass `factor` slower and each token past the first `wide` times more."""
    return {(r, t): s * factor * (1 + (wide - 1) * (t - r) / t) for (r, t), s in QUIET.items()}


def test_a_pass_moves_its_bucket_by_a_decayed_step_and_an_outlier_does_not() -> None:
    costs = LiveCosts(QUIET, k=6, explore=False)
    costs.observe(1, 4, 100.0)  # a page fault, a neighbour's burst: not the median of three
    assert costs.table.seconds[1, 4] == QUIET[1, 4]
    costs.observe(1, 4, QUIET[1, 4] / 2)
    costs.observe(1, 4, QUIET[1, 4] / 2)  # the median of (100, 1/2, 1/2): half the estimate
    assert costs.table.seconds[1, 4] == pytest.approx(QUIET[1, 4] * 0.5**live_costs.DECAY)
    costs = LiveCosts(QUIET, k=6, explore=False)
    for _ in range(2):
        costs.observe(1, 4, 100.0)  # lasting: a step of at most DAMP ** DECAY per pass
    assert costs.table.seconds[1, 4] == pytest.approx(
        QUIET[1, 4] * live_costs.DAMP**live_costs.DECAY
    )
    assert costs.table.seconds[1, 1] == QUIET[1, 1]  # other buckets untouched
    for _ in range(2):
        costs.observe(1, 1, QUIET[1, 1] * 1.1)  # near the estimate: noise, averaged slowly
    assert costs.table.seconds[1, 1] == pytest.approx(QUIET[1, 1] * 1.1**live_costs.SETTLED_DECAY)
    before = dict(costs.table.seconds)
    costs.observe(1, 4, float("nan"))
    costs.observe(3, 3, 1.0)  # no bucket has three rows: not used
    assert costs.table.seconds == before


def test_a_lasting_change_is_followed_and_unmeasured_shapes_map_to_the_nearest() -> None:
    costs = LiveCosts(QUIET, k=6, explore=False)
    for _ in range(40):
        costs.observe(1, 10, 0.2)  # 10 tokens: counted at 12, scaled by the table's ratio
    assert costs.cost(1, 10) == pytest.approx(0.2, rel=0.01)  # the table now predicts it
    assert costs.table.seconds[1, 7] == QUIET[1, 7]  # and only 12 moved
    assert costs.table.seconds[1, 12] > 0.2


def test_the_threshold_follows_one_rows_costs() -> None:
    """Calibrated under load (wide passes 2.4 steps), then quiet: the threshold comes down."""
    start = loaded(6.0, 2.4)
    costs = LiveCosts(start, k=6, explore=False)
    high = costs.threshold()
    assert high == pytest.approx(Calibration.from_pass_seconds(6, start).threshold)
    assert high > 0.3
    for _ in range(40):
        for tokens in range(1, 8):
            costs.observe(1, tokens, QUIET[1, tokens])
    assert costs.threshold() == pytest.approx(
        lowest_break_even({t: QUIET[1, t] for t in range(1, 8)}), abs=0.01
    )
    assert costs.threshold() < 0.1
    assert LiveCosts(start, k=6, fixed_threshold=0.25).threshold() == 0.25


def serve(costs: LiveCosts, passes: int, most_tokens: int | None = None) -> list[int | None]:
    """`passes` one-row passes at QUIET's costs: each at the width exploration asks for, else
    one token; the widths asked for (None: none)."""
    asked = []
    for _ in range(passes):
        tokens = costs.explore(1, most_tokens=most_tokens)
        asked.append(tokens)
        costs.observe(1, tokens or 1, QUIET[1, tokens or 1])
    return asked


def test_stale_shapes_are_measured_again_and_unsettled_ones_soon() -> None:
    asked = serve(LiveCosts(QUIET, k=6), live_costs.STALE_PASSES + 4 * live_costs.EXPLORE_EVERY)
    explored = [t for t in asked if t is not None]
    # Nothing before a bucket goes stale; then the stalest, narrowest first, one per
    # EXPLORE_EVERY passes (one-token steps are never stale here: every other pass is one).
    assert asked.index(explored[0]) >= live_costs.STALE_PASSES - live_costs.EXPLORE_EVERY
    assert explored[:4] == [2, 3, 4, 5]
    # A sample that disagrees (here one outlier at 7 tokens) unsettles every bucket: each is
    # measured once more, one per EXPLORE_EVERY passes, and settles when its sample agrees.
    costs = LiveCosts(QUIET, k=6)
    costs.observe(1, 7, QUIET[1, 7] * 3)
    asked = serve(costs, 20 * live_costs.EXPLORE_EVERY)
    assert sorted(t for t in asked if t is not None) == [2, 3, 4, 5, 6, 7, 12, 17]
    assert asked[-8 * live_costs.EXPLORE_EVERY :] == [None] * 8 * live_costs.EXPLORE_EVERY
    # A pass that cannot be padded (several rows, or --no-pad-verify) is asked only for
    # shapes it reaches by verifying fewer drafts.
    costs = LiveCosts(QUIET, k=6)
    costs.observe(1, 12, QUIET[1, 12] * 3)
    reachable = serve(costs, 20 * live_costs.EXPLORE_EVERY, most_tokens=5)
    assert sorted(t for t in reachable if t is not None) == [2, 3, 4, 5]
    # One somewhat off (noise more than a change of machine) has only itself measured again.
    costs = LiveCosts(QUIET, k=6)
    costs.observe(1, 7, QUIET[1, 7] * 1.4)
    asked = serve(costs, 10 * live_costs.EXPLORE_EVERY)
    assert [t for t in asked if t is not None] == [7]


def test_exploration_adds_at_most_its_budget_where_wide_passes_are_dear() -> None:
    """Wide passes at several steps (a CPU bound by its multiply-adds) on a VM whose speed
    halves and comes back every 40 passes (so every bucket keeps being unsettled):
    explorations still come, but the time they add past a step stays within EXPLORE_BUDGET of
    all passes' time (give or take the last one); uncapped, it was several times that."""
    dear = {(r, t): s * (1 + 0.35 * (t - r)) for (r, t), s in QUIET.items()}  # 17 tokens: 6.6
    for budget, capped in ((live_costs.EXPLORE_BUDGET, True), (1.0, False)):
        costs = LiveCosts(dear, k=6)
        total = added = 0.0
        step = dear[1, 1]
        original = live_costs.EXPLORE_BUDGET
        live_costs.EXPLORE_BUDGET = budget
        try:
            for i in range(2000):
                phase = 2.0 if (i // 40) % 2 else 1.0
                tokens = costs.explore(1)
                seconds = dear[1, tokens or 1] * phase
                costs.observe(1, tokens or 1, seconds)
                total += seconds
                added += seconds - step * phase if tokens else 0.0
        finally:
            live_costs.EXPLORE_BUDGET = original
        assert costs.explorations > 5
        if capped:
            assert added <= live_costs.EXPLORE_BUDGET * total + 2 * dear[1, 17]
            assert costs.summary()["explored_share"] <= live_costs.EXPLORE_BUDGET + 0.01
        else:
            assert added > 3 * live_costs.EXPLORE_BUDGET * total


@pytest.mark.parametrize("paced", [False, True])
def test_costs_that_change_mid_run_change_the_batchs_choice(
    tiny_target, monkeypatch, paced: bool
) -> None:
    """An always-right draft, passes timed by a fake timer: while wide passes cost about one
    step the batch verifies drafts; once they cost far more, it decodes one token a pass. Paced
    (the default), the request's breaker sees the first slow round and opens; with a fixed
    acceptance threshold (the breaker judges acceptance only: the oracle's is 1), the draft
    choice itself learns the new prices and stops choosing drafts."""
    prompt = tiny_target.encode_prompt("The quick brown fox")
    expected = reference_greedy(tiny_target, prompt, 300)
    clock = {"now": 0.0, "per_token": 0.0}
    live = LiveCosts(QUIET, k=6, explore=False, fixed_threshold=None if paced else 0.0)
    engine, generation = start(
        tiny_target,
        OracleDraft(expected),
        prompt,
        max_new_tokens=300,
        k=6,
        costs=live,
        timer=lambda: clock["now"],
    )
    forward = TargetModel.forward

    def timed_forward(self, cache, verify):
        tokens = max(verify.tokens, verify.width)
        clock["now"] += 0.020 + clock["per_token"] * (tokens - 1)
        return forward(self, cache, verify)

    monkeypatch.setattr(TargetModel, "forward", timed_forward)
    assert engine.paced_breakers is paced  # (what GetModelInfo reports as judged_by_time)
    widths, tokens, states = [], [], []
    for round_ in Solo(engine, generation):
        widths.append(round_.drafted)
        states.append(round_.breaker_state)
        tokens += round_.token_ids
        if len(tokens) >= 24 and clock["per_token"] == 0:
            switched = len(widths)
            clock["per_token"] = 0.2  # a 7-token pass now costs 61 steps
    assert tokens == expected  # exact whatever the choice
    before, after = widths[:switched], widths[switched:]
    assert min(before[1:]) >= 5  # drafts nearly free: the oracle's are verified
    assert after[-50:] == [0] * 50  # wide passes priced at today's cost: none
    if paced:  # slow rounds opened the breaker within its window (its reset timeout is real
        # seconds: no trial round follows)
        assert sum(1 for width in after if width) <= 8
        assert states[-1] is BreakerState.OPEN
    else:  # the breaker never opened: the choice priced the wide passes
        assert BreakerState.OPEN not in states
        one_row = {t: s for (r, t), s in live.table.seconds.items() if r == 1 and t <= 7}
        assert lowest_break_even(one_row) > 0.9


def test_rounds_own_work_prices_passes_and_raises_the_threshold() -> None:
    """A pass is priced with the plain rounds' own work added; the threshold with each kind's:
    drafting that costs half a step makes speculation pay only above a higher acceptance."""
    costs = LiveCosts(QUIET, k=6, explore=False)
    forward_only = costs.threshold()
    assert costs.round_work == {"plain": 0.0, "draft": 0.0} and costs.cost(1, 4) == QUIET[1, 4]
    costs.observe_round(1, 0, 0.001)
    assert costs.threshold() == pytest.approx(  # no drafting round seen: plain work for both
        lowest_break_even({t: s + 0.001 for (r, t), s in QUIET.items() if r == 1 and t <= 7})
    )
    for _ in range(60):
        costs.observe_round(1, 0, 0.001)
        costs.observe_round(2, 2, 0.020)  # two drafting rows: 0.010 each
        costs.observe_round(3, 1, 0.012)  # two plain rows at 0.001, one drafting row: 0.010
    assert costs.round_work == pytest.approx({"plain": 0.001, "draft": 0.010})
    assert costs.cost(1, 4) == pytest.approx(QUIET[1, 4] + 0.001)
    assert costs.cost(2, 6) == pytest.approx(costs.table.cost(2, 6) + 0.002)
    one_row = {t: s for (r, t), s in QUIET.items() if r == 1 and t <= 7}
    expected = lowest_break_even({t: s + (0.010 if t > 1 else 0.001) for t, s in one_row.items()})
    assert costs.threshold() == pytest.approx(expected) and expected > forward_only + 0.1
    assert costs.summary()["round_work_ms"] == {"plain": 1.0, "draft": 10.0}
    assert costs.drafting_work == pytest.approx(0.009)


def test_a_drafting_rows_work_is_counted_without_its_tokens_rows_of_logits() -> None:
    """A drafting row that emitted 5 tokens read 4 rows of logits more than a plain row: at
    a plain row's 1 ms each, that is the tokens' work, not drafting's (long accepted runs
    would otherwise price every draft as dear as they are)."""
    costs = LiveCosts(QUIET, k=6, explore=False)
    for _ in range(60):
        costs.observe_round(1, 0, 0.001)
        costs.observe_round(1, 1, 0.010, drafted_tokens=5)  # 10 ms, 4 of them the 4 tokens'
        costs.observe_round(2, 2, 0.008, drafted_tokens=2)  # 4 ms a row, 1 token each
    assert costs.round_work == pytest.approx({"plain": 0.001, "draft": 0.005}, rel=0.05)
    assert costs.drafting_work == pytest.approx(0.004, rel=0.1)
    costs.observe_round(1, 1, 0.0, drafted_tokens=9)  # never below a plain row's work
    assert costs.round_work["draft"] >= costs.round_work["plain"]


class _FirstRight(StaticDouble):
    """Drafts the target's next token, then tokens it never chooses: one accepted a round."""

    name = "first-right"

    def __init__(self, continuation: list[int], wrong: int) -> None:
        self._continuation, self._wrong, self._position = continuation, wrong, 0

    def start(self, prompt_ids) -> _FirstRight:  # type: ignore[no-untyped-def]
        return self

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        tokens = self._continuation[self._position : self._position + 1] + [self._wrong] * (k - 1)
        return Chain(tuple(tokens[:k]), tuple(1.0 for _ in tokens[:k]))

    def extend(self, token_ids) -> None:  # type: ignore[no-untyped-def]
        self._position += len(token_ids)


def test_speculation_slower_than_plain_decoding_by_round_time_stops(
    tiny_target, monkeypatch
) -> None:
    """Passes cost one step at any width (the forward alone says any draft pays), but drafting
    costs 1.5 steps of the round's own time: a draft accepting one token a round gives 2
    tokens per 2.5 steps, slower than plain decoding. Priced by measured round time, the
    request's breaker opens and it decodes plainly within a few rounds."""
    prompt = tiny_target.encode_prompt("The quick brown fox")
    expected = reference_greedy(tiny_target, prompt, 80)
    wrong = next(t for t in range(3, tiny_target.vocab_size) if t not in expected)
    clock = {"now": 0.0}
    live = LiveCosts(QUIET, k=6, explore=False)
    engine, generation = start(
        tiny_target, _FirstRight(expected, wrong), prompt, max_new_tokens=80, k=6, costs=live,
        timer=lambda: clock["now"],
    )  # fmt: skip
    forward, propose = TargetModel.forward, Generation.propose

    def timed_forward(self, cache, verify):  # type: ignore[no-untyped-def]
        clock["now"] += 0.020  # one step, whatever the width
        return forward(self, cache, verify)

    def slow_propose(self):  # type: ignore[no-untyped-def]
        proposal = propose(self)
        clock["now"] += 0.030 if len(proposal.tree) else 0.001
        return proposal

    monkeypatch.setattr(TargetModel, "forward", timed_forward)
    monkeypatch.setattr(Generation, "propose", slow_propose)
    drafted = [round_.drafted for round_ in Solo(engine, generation)]
    assert generation.output_ids == expected  # exact whatever is drafted
    assert live.round_work["draft"] > 0.02 and live.threshold() > 0.5
    first_plain = drafted.index(0)
    assert first_plain <= 12  # the breaker's window of 8 rounds, and a few
    assert drafted[first_plain : first_plain + 20] == [0] * 20


def test_start_up_costs_are_ratios_within_a_round_not_medians_across_rounds() -> None:
    """The VM's speed drifts between rounds of timed passes: a width's cost is the base
    width's median times the median of its ratios within each round. Each width's own median
    mixes phases (below: 2.2 steps for a pass of 1.1), and so does its minimum (one lucky fast
    step: 2.2 again); the ratios within rounds hold."""
    import statistics

    from kenspec.server.engine.calibration import robust_seconds

    mixed = {1: [10.0, 20.0, 10.0, 20.0, 10.0], 7: [11.0, 22.0, 22.0, 22.0, 11.0]}
    assert statistics.median(mixed[7]) / statistics.median(mixed[1]) == pytest.approx(2.2)
    seconds = robust_seconds(mixed, 1)
    assert seconds[1] / seconds[0] == pytest.approx(1.1) and seconds[0] == 10.0
    lucky = {1: [10.0, 20.0, 20.0, 20.0, 5.0], 7: [11.0, 22.0, 22.0, 22.0, 11.0]}
    assert min(lucky[7]) / min(lucky[1]) == pytest.approx(2.2)
    seconds = robust_seconds(lucky, 1)
    assert seconds[1] / seconds[0] == pytest.approx(1.1)
    assert robust_seconds({1: [10.0, 20.0], 7: [11.0, 22.0]}, 1) == [15.0, 16.5]


def test_paced_breakers_judge_each_row_of_a_batch_by_its_own_tokens(
    tiny_target, monkeypatch
) -> None:
    """Two requests in one batch, passes timed by a fake timer (wide ones dear: 5 ms a token
    past the first): a draft that is always right pays for its share of the wider passes and
    keeps speculating; one never right spends the same share for nothing, and its breaker alone
    opens. Both answers are plain greedy decoding."""
    prompt = tiny_target.encode_prompt("The quick brown fox")
    expected = reference_greedy(tiny_target, prompt, 60)
    wrong = next(t for t in range(3, tiny_target.vocab_size) if t not in expected)
    clock = {"now": 0.0}
    live = LiveCosts(QUIET, k=4, explore=False)
    engine, good = start(
        tiny_target, OracleDraft(expected), prompt, max_new_tokens=60, k=4, costs=live,
        timer=lambda: clock["now"],
    )  # fmt: skip
    bad = engine.start(
        prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=60),
        speculation=SpeculationParams(num_draft_tokens=4, adaptive=False),
    )
    bad.speculator._session = FixedDraft([wrong] * 8)
    forward = TargetModel.forward

    def timed_forward(self, cache, verify):  # type: ignore[no-untyped-def]
        clock["now"] += 0.020 + 0.005 * (max(verify.tokens, verify.width) - 1)
        return forward(self, cache, verify)

    monkeypatch.setattr(TargetModel, "forward", timed_forward)
    good_rounds, bad_rounds = Collector(), Collector()
    engine.batch.add(good, good_rounds)
    engine.batch.add(bad, bad_rounds)
    engine.batch.run_until_idle()
    assert good_rounds.error is None and bad_rounds.error is None
    assert good.output_ids == bad.output_ids == expected
    assert all(r.breaker_state is not BreakerState.OPEN for r in good_rounds.rounds)
    assert sum(r.accepted for r in good_rounds.rounds) > 30  # it kept speculating
    assert bad_rounds.rounds[-1].breaker_state is BreakerState.OPEN
    assert sum(1 for r in bad_rounds.rounds if r.drafted) <= 12  # a window, and a few
