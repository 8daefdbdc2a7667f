"""Circuit breakers: fallback to plain decoding, recovery, scope, calibration, adaptive k."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kenspec_api.outputs import BreakerState, Mode
from server.engine import calibration
from server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from server.engine.costs import break_even_acceptance, calibrate, expected_tokens_per_round
from server.engine.draft import Proposal
from server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from server.engine.speculative_engine import BreakerSettings, SpeculativeEngine
from server.engine.speculator import Speculator
from tests.engine.drafts import FixedDraft, OracleDraft, generate, reference_greedy

MAX_NEW = 40


@pytest.fixture(scope="module")
def case(tiny_target):
    ids = tiny_target.encode_prompt("The quick brown fox")
    reference = reference_greedy(tiny_target, ids, MAX_NEW)
    assert len(reference) == MAX_NEW
    wrong = next(t for t in range(3, 300) if t not in reference)
    return ids, reference, wrong


class SwitchingDraft:
    """Wrong (a token the target never emits) for the first `bad_tokens` of output, then oracle."""

    name = "switching"

    def __init__(self, reference: Sequence[int], wrong: int, bad_tokens: int) -> None:
        self.reference, self.wrong, self.bad_tokens = list(reference), wrong, bad_tokens

    def start(self, prompt_ids):
        return _SwitchingSession(self)


class _SwitchingSession:
    def __init__(self, draft: SwitchingDraft) -> None:
        self.draft, self.position = draft, 0

    def propose(self, k: int) -> Proposal:
        if self.position < self.draft.bad_tokens:
            return Proposal((self.draft.wrong,) * k, (1.0,) * k)
        tokens = tuple(self.draft.reference[self.position : self.position + k])
        return Proposal(tokens, (1.0,) * len(tokens))

    def extend(self, token_ids) -> None:
        self.position += len(token_ids)


class FlakyDraft:
    """Raises while `broken` is set, else proposes a fixed token; counts its calls."""

    name = "flaky"

    def __init__(self, token: int) -> None:
        self.broken, self.token, self.calls = True, token, 0

    def start(self, prompt_ids):
        return self

    def propose(self, k: int) -> Proposal:
        self.calls += 1
        if self.broken:
            raise RuntimeError("kenlm model corrupted")
        return Proposal((self.token,), (1.0,))

    def extend(self, token_ids) -> None:
        pass


def settings(**overrides) -> BreakerSettings:
    values = dict(window_rounds=4, threshold=0.5, reset_timeout_s=60.0, fault_max=2)
    return BreakerSettings(**{**values, **overrides})


def test_never_matching_draft_opens_within_window_then_decodes_autoregressively(
    tiny_target, case
) -> None:
    ids, reference, wrong = case
    generation = generate(
        tiny_target, FixedDraft([wrong] * 8), ids, max_new_tokens=MAX_NEW, breaker=settings()
    )
    rounds = list(generation)
    speculative = [r for r in rounds if r.mode is Mode.SPECULATIVE]
    assert len(speculative) == 4  # the window: judged once full, opened at once
    assert rounds[3].breaker_state is BreakerState.OPEN
    assert all(r.mode is Mode.AUTOREGRESSIVE for r in rounds[4:])
    assert all(r.breaker_state is BreakerState.OPEN for r in rounds[4:])
    assert generation.output_ids == reference


def test_flips_closed_open_half_open_closed_keep_greedy_output(tiny_target, case) -> None:
    ids, reference, wrong = case
    draft = SwitchingDraft(reference, wrong, bad_tokens=12)
    generation = generate(
        tiny_target, draft, ids, max_new_tokens=MAX_NEW, breaker=settings(reset_timeout_s=0.0)
    )
    rounds = list(generation)
    states = [r.breaker_state for r in rounds]
    assert generation.output_ids == reference
    first_open = states.index(BreakerState.OPEN)
    assert BreakerState.CLOSED in states[:first_open]
    # With a zero reset timeout each round after opening is a half-open trial; the bad trials
    # reopen it, and the first good one closes it again for good.
    reclosed = states.index(BreakerState.CLOSED, first_open)
    assert states[reclosed - 1] is BreakerState.OPEN
    assert all(s is BreakerState.CLOSED for s in states[reclosed:])
    assert all(r.mode is Mode.SPECULATIVE and r.accepted == r.drafted for r in rounds[reclosed:])


def test_half_open_trial_after_reset_timeout_returns_to_speculation(tiny_target, case) -> None:
    ids, reference, wrong = case
    draft = SwitchingDraft(reference, wrong, bad_tokens=4)
    generation = generate(
        tiny_target, draft, ids, max_new_tokens=MAX_NEW, breaker=settings(reset_timeout_s=0.2)
    )
    opened = [generation.step() for _ in range(4)][-1]
    assert opened.breaker_state is BreakerState.OPEN
    assert generation.step().mode is Mode.AUTOREGRESSIVE  # still inside the reset timeout
    time.sleep(0.25)
    trial = generation.step()
    assert trial.mode is Mode.SPECULATIVE and trial.accepted == trial.drafted
    assert trial.breaker_state is BreakerState.CLOSED
    list(generation)
    assert generation.output_ids == reference


def test_draft_faults_fall_back_silently_and_open_the_process_breaker(tiny_target, case) -> None:
    ids, reference, _ = case
    draft = FlakyDraft(token=reference[0])
    engine = SpeculativeEngine(tiny_target, draft, settings(fault_max=2, fault_reset_timeout_s=0.3))

    def start():
        return engine.start(
            ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=8),
            speculation=SpeculationParams(num_draft_tokens=4),
        )

    first = start()
    rounds = list(first)
    assert first.output_ids == reference[:8]  # no error reaches the caller
    assert all(r.mode is Mode.AUTOREGRESSIVE for r in rounds)
    assert engine.faults.state is BreakerState.OPEN
    assert draft.calls == 2  # opened after fault_max faults; not called while open
    second = start()  # process-wide: another request does not even try the broken draft
    list(second)
    assert draft.calls == 2 and second.output_ids == reference[:8]
    draft.broken = False
    time.sleep(0.35)
    third = start()
    third_rounds = list(third)
    assert engine.faults.state is BreakerState.CLOSED
    assert third_rounds[0].mode is Mode.SPECULATIVE
    assert third.output_ids == reference[:8]


def test_slow_draft_counts_as_a_fault_but_its_proposal_is_used() -> None:
    class SlowSession:
        def propose(self, k: int) -> Proposal:
            time.sleep(0.02)
            return Proposal((1,), (1.0,))

        def extend(self, token_ids) -> None:
            pass

    faults = DraftFaultBreaker(fault_max=2, reset_timeout_s=60, latency_budget_s=0.001)
    assert faults.propose(SlowSession(), 1) == Proposal((1,), (1.0,))
    assert faults.state is BreakerState.CLOSED
    assert faults.propose(SlowSession(), 1) == Proposal((1,), (1.0,))
    assert faults.state is BreakerState.OPEN
    assert faults.propose(SlowSession(), 1) is None


def test_acceptance_is_judged_per_request(tiny_target, case) -> None:
    ids, reference, wrong = case
    engine = SpeculativeEngine(tiny_target, None, settings())
    params = dict(sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=MAX_NEW))
    good = engine.start(ids, speculation=SpeculationParams(num_draft_tokens=4), **params)
    bad = engine.start(ids, speculation=SpeculationParams(num_draft_tokens=4), **params)
    # Same engine and breaker settings; each generation gets its own draft session.
    good.speculator._session = OracleDraft(reference).start(ids)
    bad.speculator._session = FixedDraft([wrong] * 8)
    good_rounds, bad_rounds = [], []
    while not (good.finished and bad.finished):  # interleaved, as the scheduler does
        if not good.finished:
            good_rounds.append(good.step())
        if not bad.finished:
            bad_rounds.append(bad.step())
    assert all(r.breaker_state is BreakerState.CLOSED for r in good_rounds)
    assert all(r.mode is Mode.SPECULATIVE for r in good_rounds)
    assert bad_rounds[-1].breaker_state is BreakerState.OPEN
    assert good.output_ids == bad.output_ids == reference


def test_window_is_judged_by_the_acceptance_its_tokens_per_round_imply() -> None:
    # k=4, threshold 0.5: break-even E(0.5) = 1.9375 tokens per round.
    breaker = AcceptanceBreaker(
        threshold=0.5, window_rounds=3, reset_timeout_s=60, num_draft_tokens=4
    )
    for drafted, accepted in [(4, 1), (4, 1)]:
        breaker.record(drafted, accepted)
    assert breaker.state is BreakerState.CLOSED  # window not full yet
    breaker.record(4, 4)  # 2, 2, 5 tokens: 3 per round
    assert breaker.window_acceptance == pytest.approx(6 / 12)
    assert expected_tokens_per_round(breaker.window_effective_acceptance, 4) == pytest.approx(3.0)
    breaker.record(4, 0)  # 2, 5, 1
    breaker.record(4, 0)  # 5, 1, 1: 2.33 per round, still above 1.94
    assert breaker.state is BreakerState.CLOSED
    breaker.record(4, 0)  # 1, 1, 1
    assert breaker.window_effective_acceptance == 0.0
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows_speculation()


def test_all_or_nothing_spans_are_not_judged_by_their_raw_rate() -> None:
    """Context drafts are accepted as whole spans or not at all: half the rounds accepting all 6
    tokens is 4 tokens per round, far above break-even, though accepted/drafted is only 0.5."""
    breaker = AcceptanceBreaker(
        threshold=0.6, window_rounds=4, reset_timeout_s=60, num_draft_tokens=6
    )
    for accepted in (6, 0, 6, 0, 6, 0):
        breaker.record(6, accepted)
    assert breaker.window_acceptance == pytest.approx(0.5)
    assert breaker.window_effective_acceptance > 0.6
    assert breaker.state is BreakerState.CLOSED


def test_adaptive_k_grows_after_full_acceptance_and_shrinks_after_rejection() -> None:
    speculator = Speculator(
        FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6, adaptive=True)
    )
    assert speculator.k == 6
    steps = [(6, 2, 5), (5, 5, 6), (6, 0, 5), (5, 0, 4), (4, 0, 3), (3, 0, 2), (2, 0, 1), (1, 0, 1)]
    for drafted, accepted, k_after in steps:
        speculator.record(drafted, accepted)
        assert speculator.k == k_after
    speculator.record(1, 1)
    assert speculator.k == 3
    fixed = Speculator(FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6, adaptive=False))
    fixed.record(6, 0)
    assert fixed.k == 6


@pytest.mark.parametrize(("ratio", "k"), [(1.5, 4), (2.0, 4), (1.2, 1), (3.5, 8)])
def test_break_even_acceptance_solves_the_expected_tokens_equation(ratio, k) -> None:
    alpha = break_even_acceptance(ratio, k)
    assert 0 < alpha < 1
    assert expected_tokens_per_round(alpha, k) == pytest.approx(ratio, rel=1e-6)


def test_break_even_edges() -> None:
    assert break_even_acceptance(0.9, 4) == 0.0  # verifying is cheaper than a step: always draft
    assert break_even_acceptance(5.0, 4) == 1.0  # k + 1 tokens per round could not pay for it


def test_calibrated_threshold_comes_from_measured_costs(tiny_target, monkeypatch) -> None:
    measured = {}

    def fake_costs(target, widths, context_tokens, repeats):
        measured["widths"] = widths
        return [0.040, 0.066, 0.079, 0.072, 0.070]  # a fake cost model: 5 tokens cost 1.75 steps

    monkeypatch.setattr(calibration, "measure_pass_seconds", fake_costs)
    result = calibrate(tiny_target, k=4)
    assert measured["widths"] == [1, 2, 3, 4, 5]
    assert result.widths == {3: 5}  # 2 is cheaper than 5; 4 -> 5 saves less than 5%
    assert result.cost_ratio == pytest.approx(1.75)
    assert result.threshold == pytest.approx(break_even_acceptance(1.75, 4))
    assert expected_tokens_per_round(result.threshold, 4) == pytest.approx(1.75, rel=1e-6)


def test_calibrated_threshold_is_the_lowest_break_even_over_widths(tiny_target, monkeypatch):
    """A cheap 2-token pass (5% over one step) makes one draft pay at 5% acceptance."""
    monkeypatch.setattr(
        calibration,
        "measure_pass_seconds",
        lambda target, widths, context_tokens, repeats: [0.040, 0.042, 0.079, 0.080, 0.090],
    )
    result = calibrate(tiny_target, k=4)
    assert result.cost_ratio == pytest.approx(2.25)
    assert result.threshold == pytest.approx(0.05)
    assert result.threshold < break_even_acceptance(2.25, 4)


def test_a_pass_timed_cheaper_than_a_step_still_leaves_a_threshold(tiny_target, monkeypatch):
    monkeypatch.setattr(
        calibration,
        "measure_pass_seconds",
        lambda target, widths, context_tokens, repeats: [0.040, 0.038, 0.079],
    )
    assert calibrate(tiny_target, k=2).threshold == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("costs", "padded"),
    [
        ({1: 40, 2: 66, 3: 79, 4: 72, 5: 67}, {3: 5, 4: 5}),
        ({1: 40, 2: 90, 3: 79, 4: 72, 5: 67}, {2: 5, 3: 5, 4: 5}),
        ({1: 40, 2: 50, 3: 60}, {}),  # monotonic: nothing to gain
        ({1: 10, 2: 30, 3: 20, 4: 20}, {2: 3}),  # ties go to the narrower width
    ],
)
def test_cheapest_widths(costs, padded) -> None:
    assert calibration.cheapest_widths(costs) == padded


def test_calibration_measures_the_real_model(tiny_target) -> None:
    result = calibrate(tiny_target, k=4, context_tokens=32, repeats=3)
    assert result.step_seconds > 0 and result.verify_seconds > 0
    assert 0.0 <= result.threshold <= 1.0


def test_hanging_draft_is_abandoned_and_counted_as_a_fault() -> None:
    import threading

    release = threading.Event()

    class HangingSession:
        def propose(self, k: int) -> Proposal:
            release.wait(30)
            return Proposal((1,), (1.0,))

        def extend(self, token_ids) -> None:
            pass

    faults = DraftFaultBreaker(
        fault_max=2, reset_timeout_s=60, latency_budget_s=0.001, hang_timeout_s=0.2
    )
    started = time.perf_counter()
    assert faults.propose(HangingSession(), 2) is None
    assert faults.propose(HangingSession(), 2) is None
    assert time.perf_counter() - started < 2.0  # the engine waited 0.2 s each, not 30
    assert faults.state is BreakerState.OPEN
    release.set()


def test_acceptance_estimate_is_per_source_and_starts_from_the_shared_prior() -> None:
    from server.engine.speculator import PRIOR_TRIES, AcceptanceStats

    shared = AcceptanceStats()
    draft = FixedDraft([1] * 8, source="long-match")
    params = SpeculationParams(num_draft_tokens=6)
    first = Speculator(draft, params, shared=shared)
    first.propose(6)
    assert first.acceptance_estimate() == 0.5  # nothing seen: the unseen prior
    for _ in range(20):
        first.record(6, 6)  # long matches are always accepted
    assert first.acceptance_estimate() > 0.95
    draft.source = "short-match"
    first.propose(6)
    for _ in range(20):
        first.record(6, 0)  # short ones never
    assert first.acceptance_estimate() < 0.1
    draft.source = "long-match"
    first.propose(6)
    assert first.acceptance_estimate() > 0.95  # each source keeps its own estimate

    second = Speculator(draft, params, shared=shared)  # a new request: the shared prior
    second.propose(6)
    assert second.acceptance_estimate() == pytest.approx(shared.rate(("long-match", False)))
    assert second.acceptance_estimate() > 0.85
    second.record(6, 0)  # one early failure moves it, but does not decide it alone
    assert 0.2 < second.acceptance_estimate() < 0.85
    assert second.acceptance_estimate() == pytest.approx(
        PRIOR_TRIES * shared.rate(("long-match", False)) / (1 + PRIOR_TRIES)
    )
    sampled = Speculator(draft, params, shared=shared, sampled=True)
    sampled.propose(6)
    assert sampled.acceptance_estimate() == 0.5  # sampled rounds have priors of their own


def test_starved_speculator_reprobes_and_backs_off_while_probes_fail() -> None:
    from server.engine.speculator import PROBE_AFTER

    speculator = Speculator(FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6))
    speculator.propose(6)
    for _ in range(8):
        speculator.record(6, 0)
    low = speculator.acceptance_estimate()
    assert low < 0.1
    for _ in range(PROBE_AFTER - 1):
        speculator.cut(6, 0)  # a batch dropped every draft of the round
        assert speculator.acceptance_estimate() == low
    speculator.cut(6, 0)
    assert speculator.acceptance_estimate() == 1.0  # a stale estimate gets a probe
    speculator.cut(6, 6)  # the batch let the probe draft
    speculator.record(6, 1)  # and it failed: the next probe waits twice as long
    stale = speculator.acceptance_estimate()
    assert stale < 0.5
    for _ in range(2 * PROBE_AFTER - 1):
        speculator.cut(6, 0)
        assert speculator.acceptance_estimate() == stale
    speculator.cut(6, 0)
    assert speculator.acceptance_estimate() == 1.0
    speculator.cut(6, 6)
    speculator.record(6, 5)  # a probe that pays resets the wait
    for _ in range(PROBE_AFTER):
        speculator.cut(6, 0)
    assert speculator.acceptance_estimate() == 1.0


def test_calibration_measures_batched_passes(tiny_target) -> None:
    result = calibrate(tiny_target, k=2, context_tokens=16, repeats=2, rows=3)
    assert set(result.pass_seconds) == {(rows, rows * w) for rows in (1, 2, 3) for w in (1, 2, 3)}
    assert all(seconds > 0 for seconds in result.pass_seconds.values())
