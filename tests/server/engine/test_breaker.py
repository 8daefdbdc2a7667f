"""Circuit breakers: fallback to plain decoding, recovery, scope, calibration, adaptive k.

The breakers read time from the engine's clock: these tests give them a FakeClock and advance
it, so none waits out a reset timeout and no verdict depends on how fast the machine runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import pytest

from kenspec.api.outputs import BreakerState, Mode
from kenspec.server.engine import calibration, costs
from kenspec.server.engine.breaker import (
    AcceptanceBreaker,
    DraftFaultBreaker,
    implied_window_acceptance,
)
from kenspec.server.engine.calibration import calibrate
from kenspec.server.engine.costs import (
    break_even_acceptance,
    expected_tokens_per_round,
    implied_acceptance,
)
from kenspec.server.engine.draft import Candidates, Chain, DraftSession
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.speculative_engine import BreakerSettings, SpeculativeEngine
from kenspec.server.engine.speculator import Speculator
from tests.server.engine.drafts import (
    Collector,
    FixedDraft,
    OracleDraft,
    generate,
    reference_greedy,
)

MAX_NEW = 40


@pytest.fixture(scope="module")
def case(tiny_target):
    ids = tiny_target.encode_prompt("The quick brown fox")
    reference = reference_greedy(tiny_target, ids, MAX_NEW)
    assert len(reference) == MAX_NEW
    wrong = next(t for t in range(3, 300) if t not in reference)
    return ids, reference, wrong


class SwitchingDraft:
    """Wrong (a token the target never emits) for the first `bad_tokens` of output, then oracle;
    at most `width` tokens a round (None: k)."""

    name = "switching"

    def __init__(
        self, reference: Sequence[int], wrong: int, bad_tokens: int, width: int | None = None
    ) -> None:
        self.reference, self.wrong, self.bad_tokens = list(reference), wrong, bad_tokens
        self.width = width

    def start(self, prompt_ids):
        return _SwitchingSession(self)


class _SwitchingSession(DraftSession):
    def __init__(self, draft: SwitchingDraft) -> None:
        self.draft, self.position = draft, 0

    def propose(self, k: int) -> Candidates:
        k = min(k, self.draft.width or k)
        if self.position < self.draft.bad_tokens:
            return (Chain((self.draft.wrong,) * k, (1.0,) * k),)
        tokens = tuple(self.draft.reference[self.position : self.position + k])
        return (Chain(tokens, (1.0,) * len(tokens)),)

    def extend(self, token_ids) -> None:
        self.position += len(token_ids)


class FlakyDraft(DraftSession):
    """Raises while `broken` is set, else proposes a fixed token; counts its calls."""

    name = "flaky"

    def __init__(self, token: int) -> None:
        self.broken, self.token, self.calls = True, token, 0

    def start(self, prompt_ids):
        return self

    def propose(self, k: int) -> Candidates:
        self.calls += 1
        if self.broken:
            raise RuntimeError("kenlm model corrupted")
        return (Chain((self.token,), (1.0,)),)

    def extend(self, token_ids) -> None:
        pass


def settings(**overrides) -> BreakerSettings:
    values = dict(window_rounds=4, threshold=0.5, reset_timeout_s=60.0, fault_max=2)
    return BreakerSettings(**{**values, **overrides})


def test_never_matching_draft_opens_within_window_then_decodes_autoregressively(
    tiny_target, case, clock
) -> None:
    ids, reference, wrong = case
    generation = generate(
        tiny_target,
        FixedDraft([wrong] * 8),
        ids,
        max_new_tokens=MAX_NEW,
        breaker=settings(),
        clock=clock,
    )
    rounds = list(generation)
    speculative = [r for r in rounds if r.mode is Mode.SPECULATIVE]
    assert len(speculative) == 4  # the window: judged once full, opened at once
    assert rounds[3].breaker_state is BreakerState.OPEN
    assert all(r.mode is Mode.AUTOREGRESSIVE for r in rounds[4:])
    assert all(r.breaker_state is BreakerState.OPEN for r in rounds[4:])
    assert generation.output_ids == reference


def test_flips_closed_open_half_open_closed_keep_greedy_output(tiny_target, case, clock) -> None:
    ids, reference, wrong = case
    draft = SwitchingDraft(reference, wrong, bad_tokens=12)
    generation = generate(
        tiny_target,
        draft,
        ids,
        max_new_tokens=MAX_NEW,
        breaker=settings(reset_timeout_s=2.0),
        clock=clock,
    )
    rounds = [generation.step() for _ in range(4)]
    assert [r.breaker_state for r in rounds] == [BreakerState.CLOSED] * 3 + [BreakerState.OPEN]
    rounds.append(generation.step())  # the clock stands still: open, however long rounds take
    assert rounds[-1].mode is Mode.AUTOREGRESSIVE
    assert rounds[-1].breaker_state is BreakerState.OPEN
    # Each trial is one speculative round once the reset timeout has passed on the clock; a bad
    # trial reopens the breaker, and the timeout counts again from that moment.
    trials = []
    while not trials or trials[-1].breaker_state is BreakerState.OPEN:
        clock.advance(1.5)
        waiting = generation.step()
        assert waiting.mode is Mode.AUTOREGRESSIVE
        assert waiting.breaker_state is BreakerState.OPEN
        clock.advance(0.5)
        trials.append(generation.step())
        assert trials[-1].mode is Mode.SPECULATIVE
        rounds += [waiting, trials[-1]]
    assert len(trials) > 1  # the draft was still wrong at the first trial: it reopened
    assert trials[-1].breaker_state is BreakerState.CLOSED
    rest = list(generation)
    assert rest  # closed for good: every later round speculates and is accepted whole
    assert all(r.breaker_state is BreakerState.CLOSED for r in rest)
    assert all(r.mode is Mode.SPECULATIVE and r.accepted == r.drafted for r in [trials[-1], *rest])
    assert generation.output_ids == reference


def test_half_open_trial_after_reset_timeout_returns_to_speculation(tiny_target, case, clock):
    ids, reference, wrong = case
    draft = SwitchingDraft(reference, wrong, bad_tokens=4)
    generation = generate(
        tiny_target,
        draft,
        ids,
        max_new_tokens=MAX_NEW,
        breaker=settings(reset_timeout_s=2.0),
        clock=clock,
    )
    opened = [generation.step() for _ in range(4)][-1]
    assert opened.breaker_state is BreakerState.OPEN
    assert generation.step().mode is Mode.AUTOREGRESSIVE  # still inside the reset timeout
    clock.advance(2.0)
    trial = generation.step()
    assert trial.mode is Mode.SPECULATIVE and trial.accepted == trial.drafted
    assert trial.breaker_state is BreakerState.CLOSED
    list(generation)
    assert generation.output_ids == reference


class CopyingSession(_SwitchingSession):
    """SwitchingDraft's session that also copies: `copies` offers the reference's next tokens
    as an exact match of `matched` tokens at the output positions in `at`, and `may_copy` says
    so there (`checked`: where it was asked, `asked`: where copies were built, and for what)."""

    def __init__(self, draft: SwitchingDraft, at: set[int], matched: int) -> None:
        super().__init__(draft)
        self.at, self.matched, self.asked, self.checked = at, matched, [], []

    def may_copy(self, min_match: int) -> bool:
        self.checked.append(self.position)
        return self.position in self.at and self.matched >= min_match

    def copies(self, k: int, min_match: int) -> Candidates:
        self.asked.append((self.position, min_match))
        if self.position not in self.at or self.matched < min_match:
            return ()
        tokens = tuple(self.draft.reference[self.position : self.position + k])
        return (Chain(tokens, (1.0,) * len(tokens), Source("context", self.matched)),)


@pytest.mark.parametrize("matched", [4, 3])
def test_an_open_breaker_verifies_only_copies_of_long_exact_matches(
    tiny_target, case, clock, matched
) -> None:
    """Once the breaker opens, a round drafts only where the session copies an exact match of
    COPY_MATCH (4) tokens or more; such rounds do not close it, and the output stays greedy
    decoding's."""
    ids, reference, wrong = case
    draft = SwitchingDraft(reference, wrong, bad_tokens=MAX_NEW)  # always wrong
    session = CopyingSession(draft, at=set(range(12, MAX_NEW, 8)), matched=matched)
    draft.start = lambda prompt_ids: session
    generation = generate(
        tiny_target, draft, ids, max_new_tokens=MAX_NEW, breaker=settings(), clock=clock
    )
    rounds = list(generation)
    assert generation.output_ids == reference
    assert rounds[3].breaker_state is BreakerState.OPEN
    opened = rounds[4:]
    assert all(r.breaker_state is BreakerState.OPEN for r in opened)
    copied = [r for r in opened if r.mode is Mode.SPECULATIVE]
    if matched < 4:  # too short to copy: plain decoding, as before
        assert copied == []
    else:
        assert len(copied) >= 2 and all(r.accepted == r.drafted > 0 for r in copied)
    # built only while open, for COPY_MATCH, and only where one may follow: every other
    # round of an open breaker asks the session's cheap check alone, not the draft thread
    assert all(at in session.at and min_match == 4 for at, min_match in session.asked)
    assert len(session.asked) == (len(copied) if matched >= 4 else 0)
    assert len(session.checked) >= len(opened) - 1


def test_a_copy_teaches_only_its_own_requests_rate(clock) -> None:
    """Copies are drafted because the breaker is open and they look sure: a biased sample, so
    the shared rates, k, the breaker and the choice's calibration of gains do not learn them."""
    from kenspec.server.engine.draft_choice import GainCalibration
    from kenspec.server.engine.speculator import AcceptanceStats

    class Copier(FixedDraft):
        def may_copy(self, min_match: int) -> bool:
            return True

        def copies(self, k: int, min_match: int) -> Candidates:
            return (Chain((5,) * k, (1.0,) * k, Source("context", 8)),)

    breaker = AcceptanceBreaker(threshold=0.5, window_rounds=1, reset_timeout_s=60, clock=clock)
    shared, calibration = AcceptanceStats(), GainCalibration()
    params = SpeculationParams(num_draft_tokens=4, adaptive=True)
    speculator = Speculator(Copier([6] * 4), params, acceptance=breaker, shared=shared)
    speculator.record(speculator.propose(4), 0)  # nothing accepted: the breaker opens
    assert breaker.state is BreakerState.OPEN
    k, ratios = speculator.k, calibration.ratios
    copy = speculator.propose(4)
    assert copy.copied and copy.tree.tokens == (5,) * k and copy.source == "context:8"
    key = (Source("context", 8), False)
    for _ in range(5):
        speculator.record(copy, 0)
        calibration.learn(copy, [])
    assert speculator.acceptance_estimate(copy) < shared.rate(key) == AcceptanceStats().rate(key)
    assert (speculator.k, calibration.ratios, breaker.state) == (k, ratios, BreakerState.OPEN)
    clock.advance(60)
    trial = speculator.propose(4)  # half-open: a trial drafts as ever, not a copy
    assert not trial.copied and trial.tree.tokens == (6,) * k


def test_draft_faults_fall_back_silently_and_open_the_process_breaker(
    tiny_target, case, clock
) -> None:
    ids, reference, _ = case
    draft = FlakyDraft(token=reference[0])
    engine = SpeculativeEngine(
        tiny_target, draft, settings(fault_max=2, fault_reset_timeout_s=30.0), clock=clock
    )

    def run():
        generation = engine.start(
            ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=8),
            speculation=SpeculationParams(num_draft_tokens=4, adaptive=True),
        )
        return generation, list(engine.batch.rounds(generation))

    first, rounds = run()
    assert first.output_ids == reference[:8]  # no error reaches the caller
    assert all(r.mode is Mode.AUTOREGRESSIVE for r in rounds)
    assert engine.fault_breaker.state is BreakerState.OPEN
    assert draft.calls == 2  # opened after fault_max faults; not called while open
    second, _ = run()  # process-wide: another request does not even try the broken draft
    assert draft.calls == 2 and second.output_ids == reference[:8]
    draft.broken = False
    clock.advance(29.0)  # the reset timeout counts on the engine's clock, not on the wall
    third, _ = run()
    assert draft.calls == 2 and engine.fault_breaker.state is BreakerState.OPEN
    clock.advance(1.0)
    fourth, fourth_rounds = run()
    assert draft.calls > 2  # the trial call succeeded, and later rounds drafted too
    assert engine.fault_breaker.state is BreakerState.CLOSED
    assert fourth_rounds[0].mode is Mode.SPECULATIVE
    assert third.output_ids == fourth.output_ids == reference[:8]


class TimedSession(DraftSession):
    """A draft session whose every proposal takes `seconds` on the given fake clock."""

    def __init__(self, clock, seconds: float) -> None:
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def propose(self, k: int) -> Candidates:
        self.calls += 1
        self.clock.advance(self.seconds)
        return (Chain((1,), (1.0,)),)

    def extend(self, token_ids) -> None:
        pass


def test_slow_draft_counts_as_a_fault_but_its_proposal_is_used(clock) -> None:
    faults = DraftFaultBreaker(fault_max=2, reset_timeout_s=60, latency_budget_s=0.5, clock=clock)
    on_budget, slow = TimedSession(clock, 0.5), TimedSession(clock, 1.0)
    for _ in range(3):  # within: no fault
        assert faults.call(partial(on_budget.propose, 1)) == (
            Chain((1,), (1.0,)),
        )  # within: no fault
    assert faults.state is BreakerState.CLOSED
    assert faults.call(partial(slow.propose, 1)) == (Chain((1,), (1.0,)),)
    assert faults.state is BreakerState.CLOSED
    assert faults.call(partial(slow.propose, 1)) == (Chain((1,), (1.0,)),)
    assert faults.state is BreakerState.OPEN
    assert faults.call(partial(slow.propose, 1)) is None
    assert slow.calls == 2  # open: the draft is not called at all
    assert faults.reset_timeout_s == 60.0 and faults.fault_max == 2  # as configured


def test_acceptance_is_judged_per_request(tiny_target, case, clock) -> None:
    ids, reference, wrong = case
    engine = SpeculativeEngine(tiny_target, None, settings(), clock=clock)
    params = dict(sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=MAX_NEW))
    good = engine.start(
        ids, speculation=SpeculationParams(num_draft_tokens=4, adaptive=True), **params
    )
    bad = engine.start(
        ids, speculation=SpeculationParams(num_draft_tokens=4, adaptive=True), **params
    )
    # Same engine and breaker settings; each generation gets its own draft session.
    good.speculator._session = OracleDraft(reference).start(ids)
    bad.speculator._session = FixedDraft([wrong] * 8)
    good_rounds, bad_rounds = Collector(), Collector()
    engine.batch.add(good, good_rounds)  # one batch, as the server runs them
    engine.batch.add(bad, bad_rounds)
    engine.batch.run_until_idle()
    assert good_rounds.error is None and bad_rounds.error is None
    assert all(r.breaker_state is BreakerState.CLOSED for r in good_rounds.rounds)
    assert all(r.mode is Mode.SPECULATIVE for r in good_rounds.rounds)
    assert bad_rounds.rounds[-1].breaker_state is BreakerState.OPEN
    assert good.output_ids == bad.output_ids == reference


def test_window_is_judged_by_the_acceptance_its_tokens_per_round_imply(clock) -> None:
    # k=4, threshold 0.5: break-even E(0.5) = 1.9375 tokens per round.
    breaker = AcceptanceBreaker(threshold=0.5, window_rounds=3, reset_timeout_s=60, clock=clock)
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
    clock.advance(59.5)
    assert not breaker.allows_speculation() and breaker.state is BreakerState.OPEN
    clock.advance(0.5)
    assert breaker.allows_speculation() and breaker.state is BreakerState.HALF_OPEN
    assert breaker.reset_timeout_s == 60.0  # as configured, whatever pybreaker is given


def test_a_paced_window_is_judged_by_the_time_its_rounds_saved(clock) -> None:
    """Paced, a round is charged the seconds it took past a plain round against what its
    tokens past one would have taken plainly; the full window opens the breaker when it spent
    more than it saved, whatever its acceptance said."""
    breaker = AcceptanceBreaker(
        threshold=0.99, window_rounds=3, reset_timeout_s=60, clock=clock, paced_rounds=3
    )
    assert breaker.paced and breaker.window_pace is None
    for _ in range(6):
        breaker.record(6, 0)  # no acceptance at all: not what a paced breaker judges
    assert breaker.state is BreakerState.CLOSED
    breaker.charge(0.030, 0.0)  # a round that emitted one token, 30 ms past a plain one
    breaker.charge(0.010, 0.0)
    assert breaker.state is BreakerState.CLOSED  # judged once the window is full
    breaker.charge(0.010, 0.050)  # 50 ms spent, 50 saved: not slower
    assert breaker.state is BreakerState.CLOSED and breaker.window_pace == pytest.approx(1.0)
    breaker.charge(0.020, 0.015)  # the first round leaves: 40 spent, 65 saved
    assert breaker.state is BreakerState.CLOSED
    breaker.charge(0.040, 0.0)  # 70 spent, 65 saved
    assert breaker.state is BreakerState.OPEN and breaker.window_pace == pytest.approx(65 / 70)
    breaker.charge(-1.0, 9.0)  # open: rounds are not charged (and none should come)
    clock.advance(60)
    assert breaker.allows_speculation() and breaker.state is BreakerState.HALF_OPEN
    breaker.charge(0.030, 0.010)  # the trial round alone: slower, open again
    assert breaker.state is BreakerState.OPEN
    clock.advance(60)
    assert breaker.allows_speculation()
    breaker.charge(0.010, 0.030)  # a trial that saved more than it spent closes it
    assert breaker.state is BreakerState.CLOSED
    breaker.charge(0.015, 0.0)  # a fresh window: the trial and these, 25 spent, 30 saved
    breaker.charge(0.0, 0.0)
    assert breaker.state is BreakerState.CLOSED
    breaker.charge(0.020, 0.0)  # the window's first round (the trial) leaves: 35 against 0
    assert breaker.state is BreakerState.OPEN


def test_an_unpaced_breaker_ignores_time_and_judges_acceptance(clock) -> None:
    breaker = AcceptanceBreaker(threshold=0.5, window_rounds=2, reset_timeout_s=60, clock=clock)
    assert not breaker.paced
    for _ in range(4):
        breaker.charge(1.0, 0.0)
    assert breaker.state is BreakerState.CLOSED and breaker.window_pace is None
    breaker.record(4, 0)
    breaker.record(4, 0)
    assert breaker.state is BreakerState.OPEN


def test_all_or_nothing_spans_are_not_judged_by_their_raw_rate(clock) -> None:
    """Context drafts are accepted as whole spans or not at all: half the rounds accepting all 6
    tokens is 4 tokens per round, far above break-even, though accepted/drafted is only 0.5."""
    breaker = AcceptanceBreaker(threshold=0.6, window_rounds=4, reset_timeout_s=60, clock=clock)
    for accepted in (6, 0, 6, 0, 6, 0):
        breaker.record(6, accepted)
    assert breaker.window_acceptance == pytest.approx(0.5)
    assert breaker.window_effective_acceptance > 0.6
    assert breaker.state is BreakerState.CLOSED


def test_fully_accepted_short_rounds_keep_the_breaker_closed_at_a_larger_k(
    tiny_target, case, clock
) -> None:
    """A round is judged at the drafts it verified (a batch may cut them, a draft may offer
    fewer), not at the request's k: one accepted draft of one is full acceptance, not the ~0.5
    that 2 tokens a round would imply at k = 6 (E(0.5, 6) ~ 2), which is below 0.6."""
    ids, reference, _ = case
    generation = generate(
        tiny_target,
        SwitchingDraft(reference, wrong=-1, bad_tokens=0, width=1),  # always right
        ids,
        max_new_tokens=MAX_NEW,
        k=6,
        breaker=settings(threshold=0.6),
        clock=clock,
    )
    rounds = list(generation)
    assert len(rounds) > settings().window_rounds  # the window was full and judged
    assert all(r.mode is Mode.SPECULATIVE and r.drafted == r.accepted == 1 for r in rounds)
    assert all(r.breaker_state is BreakerState.CLOSED for r in rounds)
    assert generation.output_ids == reference


def test_rejected_short_rounds_still_open_the_breaker(tiny_target, case, clock) -> None:
    ids, reference, wrong = case
    generation = generate(
        tiny_target,
        SwitchingDraft(reference, wrong, bad_tokens=10**9, width=1),  # always wrong
        ids,
        max_new_tokens=MAX_NEW,
        k=6,
        breaker=settings(threshold=0.6),
        clock=clock,
    )
    rounds = list(generation)
    window = settings().window_rounds
    assert all(r.mode is Mode.SPECULATIVE and r.drafted == 1 for r in rounds[:window])
    assert all(r.accepted == 0 for r in rounds[:window])
    assert [r.breaker_state for r in rounds[:window]] == [BreakerState.CLOSED] * (window - 1) + [
        BreakerState.OPEN
    ]
    assert all(r.mode is Mode.AUTOREGRESSIVE for r in rounds[window:])
    assert generation.output_ids == reference


def test_a_window_of_one_draft_rounds_is_judged_by_its_own_drafts(clock) -> None:
    breaker = AcceptanceBreaker(threshold=0.6, window_rounds=4, reset_timeout_s=60, clock=clock)
    for _ in range(6):
        breaker.record(1, 1)
    assert breaker.window_effective_acceptance == 1.0
    assert breaker.state is BreakerState.CLOSED
    for _ in range(3):
        breaker.record(1, 0)  # 2, 1, 1, 1 tokens from rounds of one draft: alpha 0.25
    assert breaker.window_effective_acceptance == pytest.approx(0.25)
    assert breaker.state is BreakerState.OPEN


@pytest.mark.parametrize(
    "rounds",
    [
        [(6, 6), (1, 0), (1, 0), (1, 0)],
        [(1, 1), (6, 2), (3, 0), (2, 2)],
        [(4, 1), (4, 1), (4, 4)],
        [(6, 5), (6, 0)],
    ],
)
def test_window_acceptance_solves_the_expected_tokens_of_its_rounds(rounds) -> None:
    alpha = implied_window_acceptance(rounds)
    assert 0.0 < alpha < 1.0
    expected = sum(expected_tokens_per_round(alpha, drafted) for drafted, _ in rounds)
    assert expected == pytest.approx(sum(accepted + 1 for _, accepted in rounds), rel=1e-9)


@pytest.mark.parametrize(("drafted", "accepted"), [(1, 0), (1, 1), (4, 2), (6, 1), (6, 6)])
def test_one_round_window_is_the_single_round_implied_acceptance(drafted, accepted) -> None:
    assert implied_window_acceptance([(drafted, accepted)]) == pytest.approx(
        implied_acceptance(accepted + 1, drafted)
    )


def test_adaptive_k_grows_after_full_acceptance_and_shrinks_after_rejection() -> None:
    speculator = Speculator(
        FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6, adaptive=True)
    )
    assert speculator.k == 6
    steps = [(6, 2, 5), (5, 5, 6), (6, 0, 5), (5, 0, 4), (4, 0, 3), (3, 0, 2), (2, 0, 1), (1, 0, 1)]
    for drafted, accepted, k_after in steps:
        proposal = speculator.propose(6)
        assert len(proposal.tree) == drafted  # k drafts
        speculator.record(proposal, accepted)
        assert speculator.k == k_after
    speculator.record(speculator.propose(6), 1)
    assert speculator.k == 3
    fixed = Speculator(FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6, adaptive=False))
    fixed.record(fixed.propose(6), 0)
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
    ("measured", "padded"),
    [
        ({1: 40, 2: 66, 3: 79, 4: 72, 5: 67}, {3: 5, 4: 5}),
        ({1: 40, 2: 90, 3: 79, 4: 72, 5: 67}, {2: 5, 3: 5, 4: 5}),
        ({1: 40, 2: 50, 3: 60}, {}),  # monotonic: nothing to gain
        ({1: 10, 2: 30, 3: 20, 4: 20}, {2: 3}),  # ties go to the narrower width
    ],
)
def test_cheapest_widths(measured, padded) -> None:
    assert costs.cheapest_widths(measured) == padded


def test_calibration_measures_the_real_model(tiny_target) -> None:
    result = calibrate(tiny_target, k=4, context_tokens=32, repeats=3)
    assert result.step_seconds > 0 and result.verify_seconds > 0
    assert 0.0 <= result.threshold <= 1.0


def test_hanging_draft_is_abandoned_and_counted_as_a_fault(clock) -> None:
    release = threading.Event()
    returned = []

    class HangingSession(DraftSession):
        def propose(self, k: int) -> Candidates:
            release.wait(60)  # until the test ends (60 s only if the breaker waited for it)
            returned.append(k)
            return (Chain((1,), (1.0,)),)

        def extend(self, token_ids) -> None:
            pass

    faults = DraftFaultBreaker(
        fault_max=2, reset_timeout_s=60, latency_budget_s=0.001, hang_timeout_s=0.2, clock=clock
    )
    try:
        assert faults.call(partial(HangingSession().propose, 2)) is None
        assert faults.call(partial(HangingSession().propose, 2)) is None
        assert returned == []  # both drafts still hang: the engine went on without them
        assert faults.state is BreakerState.OPEN
    finally:
        release.set()


def test_acceptance_estimate_is_per_source_and_starts_from_the_shared_prior() -> None:
    from kenspec.server.engine.speculator import PRIOR_TRIES, AcceptanceStats

    shared = AcceptanceStats()
    draft = FixedDraft([1] * 8, source="long-match")
    params = SpeculationParams(num_draft_tokens=6, adaptive=True)
    first = Speculator(draft, params, shared=shared)
    long = first.propose(6)
    assert first.acceptance_estimate(long) == 0.5  # nothing seen: the unseen prior
    for _ in range(20):
        first.record(long, 6)  # long matches are always accepted
    assert first.acceptance_estimate(long) > 0.95
    draft.source = "short-match"
    short = first.propose(6)
    for _ in range(20):
        first.record(short, 0)  # short ones never
    assert first.acceptance_estimate(short) < 0.1
    draft.source = "long-match"
    assert first.acceptance_estimate(first.propose(6)) > 0.95  # each keeps its own estimate

    second = Speculator(draft, params, shared=shared)  # a new request: the shared prior
    long = second.propose(6)
    assert second.acceptance_estimate(long) == pytest.approx(
        shared.rate((Source("long-match"), False))
    )
    assert second.acceptance_estimate(long) > 0.85
    second.record(long, 0)  # one early failure moves it, but does not decide it alone
    assert 0.2 < second.acceptance_estimate(long) < 0.85
    assert second.acceptance_estimate(long) == pytest.approx(
        PRIOR_TRIES * shared.rate((Source("long-match"), False)) / (1 + PRIOR_TRIES)
    )
    sampled = Speculator(draft, params, shared=shared, sampled=True)
    assert sampled.acceptance_estimate(sampled.propose(6)) == 0.5  # sampled: priors of their own


def test_starved_speculator_reprobes_and_backs_off_while_probes_fail() -> None:
    from kenspec.server.engine.speculator import PROBE_AFTER

    speculator = Speculator(
        FixedDraft([1] * 8), SpeculationParams(num_draft_tokens=6, adaptive=False)
    )
    for _ in range(8):
        speculator.record(speculator.propose(6), 0)
    proposal = speculator.propose(6)
    low = speculator.acceptance_estimate(proposal)
    assert low < 0.1 and not proposal.probe

    def starve(rounds: int, estimate: float) -> None:
        """`rounds` rounds whose drafts a batch dropped entirely, none a probe (and the rounds
        a starved request rests between them, drafting nothing)."""
        drafted = 0
        while drafted < rounds:
            proposal = speculator.propose(6)
            assert not proposal.probe
            if proposal.tree:
                drafted += 1
                assert speculator.acceptance_estimate(proposal) == estimate
                assert proposal.gains == [estimate**j for j in range(1, 7)]
            speculator.record(proposal.cut(0), 0)

    starve(PROBE_AFTER, low)
    probe = speculator.propose(6)
    assert probe.probe and speculator.acceptance_estimate(probe) == 1.0  # a stale estimate
    assert probe.gains == [1.0] * 6  # gets a probe
    speculator.record(probe.cut(6), 1)  # the batch let it draft, and it failed:
    stale = speculator.acceptance_estimate(speculator.propose(6))
    assert stale < 0.5
    starve(2 * PROBE_AFTER, stale)  # the next probe waits twice as long
    probe = speculator.propose(6)
    assert speculator.acceptance_estimate(probe) == 1.0
    speculator.record(probe, 5)  # a probe that pays resets the wait
    starve(PROBE_AFTER, speculator.acceptance_estimate(speculator.propose(6)))
    assert speculator.propose(6).probe


def test_calibration_measures_batched_passes(tiny_target) -> None:
    result = calibrate(tiny_target, k=2, context_tokens=16, repeats=2, rows=3)
    assert set(result.pass_seconds) == {(rows, rows * w) for rows in (1, 2, 3) for w in (1, 2, 3)}
    assert all(seconds > 0 for seconds in result.pass_seconds.values())
