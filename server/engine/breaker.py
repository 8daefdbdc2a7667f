"""Circuit breakers that keep speculation from costing more than it gives.

Two scopes, both built on pybreaker and driven from the engine's thread (pybreaker's
call_async is Tornado-only):

- AcceptanceBreaker, one per request: a sliding window over the request's last N speculative
  rounds. Paced (where pass costs are live, engine.live_costs), it judges the rounds by their
  measured time: it opens when the window's rounds took longer than plain decoding would have
  taken for the tokens they emitted (`charge`: each drafting round's seconds past a plain
  round's, against the tokens it emitted past one, at a plain round's seconds a token).
  Otherwise (a threshold the operator fixed), by acceptance: it opens when the acceptance the
  rounds imply (the alpha at which the tokens they were expected to emit, each at its own draft
  length, equal those they did emit; see implied_window_acceptance) falls below the
  threshold. Open, the request decodes autoregressively; after the reset timeout one trial
  speculative round runs (half-open) and closes it again if that round alone passes. Per
  request, because one prompt in a language the n-gram never saw must not switch speculation
  off for everyone else.
- DraftFaultBreaker, one per process: the draft raising, or taking longer than its latency
  budget, is a fault; after fault_max consecutive faults the breaker opens for every request
  (a broken KenLM model is broken for all) until a trial call after the reset timeout succeeds.

Both read time from an injectable clock (time.monotonic by default): their reset timeouts, and
the draft's latency against its budget. pybreaker, which judges its reset timeout by wall-clock
datetime, is given one it never reaches; the breakers move to half-open themselves once their
clock says the timeout has passed. Only the hang timeout is real time: it abandons a thread.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar, cast

import pybreaker
import structlog

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.costs import expected_tokens_per_round, solve_acceptance

log = structlog.get_logger("kenspec.breaker")

_STATES = {
    pybreaker.STATE_CLOSED: BreakerState.CLOSED,
    pybreaker.STATE_OPEN: BreakerState.OPEN,
    pybreaker.STATE_HALF_OPEN: BreakerState.HALF_OPEN,
}


class AcceptanceTooLow(Exception):
    """A failure signal for the acceptance breaker (never leaves this module)."""


class DraftHung(Exception):
    """The draft did not answer within its hang timeout; its thread is abandoned."""


class DraftTooSlow(Exception):
    """The draft answered, but past its latency budget: a fault, though its answer is usable."""

    def __init__(self, seconds: float, answer: object) -> None:
        super().__init__(f"draft took {seconds * 1000:.1f} ms")
        self.answer = answer


Drafted = TypeVar("Drafted")  # what a timed draft call returns (candidates, a draft tree)


TransitionHook = Callable[[str, BreakerState], None]  # (scope, new state), e.g. for metrics
Clock = Callable[[], float]  # seconds, monotonic; only differences are used

# pybreaker's own reset timeout, judged against datetime.now(): a century, so that it never
# half-opens a breaker by itself and only the breakers' clocks decide (see _ClockedBreaker).
_PYBREAKER_NEVER_S = 100 * 365 * 24 * 3600.0


def implied_window_acceptance(rounds: Sequence[tuple[int, int]]) -> float:
    """The per-token acceptance alpha that explains a window of (drafted, accepted) rounds.

    The alpha at which the tokens the rounds were expected to emit, sum of E(alpha, drafted)
    over them, equals the tokens they emitted, sum of accepted + 1: each round is judged at
    the draft length it verified, so a fully accepted one-draft round counts as acceptance 1,
    whatever the request's maximum k. 0 when no draft was accepted, 1 when all were. For one
    round this is costs.implied_acceptance(accepted + 1, drafted).
    """
    lengths: Counter[int] = Counter()  # rounds by draft length: a solve step sums a few terms
    emitted = 0
    for drafted, accepted in rounds:
        if drafted > 0:
            lengths[drafted] += 1
            emitted += accepted + 1
    if not lengths:
        return 0.0

    def expected(alpha: float) -> float:
        return sum(count * expected_tokens_per_round(alpha, n) for n, count in lengths.items())

    return solve_acceptance(expected, emitted)


class _TransitionLog(pybreaker.CircuitBreakerListener):
    """A structlog event for every transition, and the optional hook (scope: request/draft)."""

    def __init__(
        self, describe: Callable[[], dict[str, object]], scope: str, hook: TransitionHook | None
    ) -> None:
        self._describe = describe
        self._scope = scope
        self._hook = hook

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state, new_state) -> None:  # type: ignore[no-untyped-def]
        if self._hook is not None:
            self._hook(self._scope, _STATES[new_state.name])
        log.info(
            "breaker_transition",
            breaker=cb.name,
            old=getattr(old_state, "name", None),
            new=new_state.name,
            **self._describe(),
        )


class _ClockedBreaker(pybreaker.CircuitBreakerListener):
    """A pybreaker.CircuitBreaker whose reset timeout is judged by `clock`.

    Listens to its breaker to note, by the clock, when it opened; `half_open_if_due` moves an
    open breaker to half-open (notifying the listeners: log, metrics) once reset_timeout_s
    has passed on the clock. pybreaker's own timeout is one it never reaches.
    """

    def __init__(
        self,
        *,
        fail_max: int,
        reset_timeout_s: float,
        name: str,
        listeners: Sequence[pybreaker.CircuitBreakerListener],
        clock: Clock,
    ) -> None:
        self.reset_timeout_s = float(reset_timeout_s)
        self._clock = clock
        self._opened_at: float | None = None
        self.breaker = pybreaker.CircuitBreaker(
            fail_max=fail_max,
            reset_timeout=_PYBREAKER_NEVER_S,
            name=name,
            listeners=[self, *listeners],
        )

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state, new_state) -> None:  # type: ignore[no-untyped-def]
        if new_state.name == pybreaker.STATE_OPEN:
            self._opened_at = self._clock()

    @property
    def state(self) -> BreakerState:
        return _STATES[self.breaker.current_state]

    def half_open_if_due(self) -> bool:
        """True unless the breaker is open and its reset timeout has not passed on the clock."""
        if self.breaker.current_state != pybreaker.STATE_OPEN:
            return True
        opened_at = self._opened_at
        if opened_at is None or self._clock() - opened_at >= self.reset_timeout_s:
            self.breaker.half_open()
            return True
        return False


class AcceptanceBreaker:
    """Per-request breaker on the last `window_rounds` speculative rounds: by their measured
    time when `paced_rounds` (that many rounds judged), else by their acceptance."""

    def __init__(
        self,
        *,
        threshold: float | Callable[[], float],
        window_rounds: int,
        reset_timeout_s: float,
        request_id: str = "",
        on_transition: TransitionHook | None = None,
        clock: Clock = time.monotonic,
        paced_rounds: int = 0,
    ) -> None:
        # A callable follows the live pass costs (engine.live_costs): read at every judgement.
        self._threshold = threshold if callable(threshold) else lambda: threshold
        self._window: deque[tuple[int, int]] = deque(maxlen=window_rounds)
        # Paced: (seconds past a plain round, seconds the tokens past one would take plainly)
        self._paced: deque[tuple[float, float]] | None = (
            deque(maxlen=paced_rounds) if paced_rounds > 0 else None
        )
        self._request_id = request_id
        self._clocked = _ClockedBreaker(
            fail_max=1,
            reset_timeout_s=reset_timeout_s,
            name=f"acceptance:{request_id}",
            listeners=[
                _TransitionLog(self._describe, "request", on_transition),
                _ClearOnClose(self._window),
                *([_ClearOnClose(self._paced)] if self._paced is not None else []),
            ],
            clock=clock,
        )
        self._breaker = self._clocked.breaker

    @property
    def state(self) -> BreakerState:
        return self._clocked.state

    @property
    def threshold(self) -> float:
        return self._threshold()

    @property
    def reset_timeout_s(self) -> float:
        return self._clocked.reset_timeout_s

    @property
    def window_acceptance(self) -> float:
        drafted = sum(d for d, _ in self._window)
        return sum(a for _, a in self._window) / drafted if drafted else 0.0

    def allows_speculation(self) -> bool:
        """Closed, or half-open for a trial round once the reset timeout has passed."""
        return self._clocked.half_open_if_due()

    @property
    def window_effective_acceptance(self) -> float:
        """The acceptance implied by the window's tokens per round (what is judged)."""
        return implied_window_acceptance(self._window)

    @property
    def paced(self) -> bool:
        """Whether rounds are judged by their measured time (`charge`), not their acceptance."""
        return self._paced is not None

    def record(self, drafted: int, accepted: int) -> None:
        """A speculative round's acceptance; judged (unless paced) a trial round alone, others
        by the full window."""
        if drafted == 0:
            return
        trial = self._breaker.current_state == pybreaker.STATE_HALF_OPEN
        self._window.append((drafted, accepted))
        if self._paced is not None:
            return
        too_low = False
        if trial or len(self._window) == self._window.maxlen:
            rate = implied_window_acceptance([(drafted, accepted)] if trial else self._window)
            too_low = rate < self.threshold
        self._judge(too_low)

    def charge(self, extra_seconds: float, saved_seconds: float) -> None:
        """Judge a paced speculative round by its time: `extra_seconds` it took past a plain
        round, against `saved_seconds`, what plain decoding would have taken for the tokens it
        emitted past one. Too slow when the full window's extra exceeds what it saved (a trial
        round: judged alone)."""
        if self._paced is None or self._breaker.current_state == pybreaker.STATE_OPEN:
            return
        trial = self._breaker.current_state == pybreaker.STATE_HALF_OPEN
        self._paced.append((extra_seconds, saved_seconds))
        if not trial and len(self._paced) < (self._paced.maxlen or 0):
            return
        judged = [self._paced[-1]] if trial else self._paced
        self._judge(sum(extra for extra, _ in judged) > sum(saved for _, saved in judged))

    @property
    def window_pace(self) -> float | None:
        """The paced window's seconds saved per second spent past plain rounds (> 1: paying)."""
        if not self._paced:
            return None
        extra = sum(extra for extra, _ in self._paced)
        saved = sum(saved for _, saved in self._paced)
        return saved / extra if extra > 0 else math.inf

    def _judge(self, failed: bool) -> None:
        with contextlib.suppress(AcceptanceTooLow, pybreaker.CircuitBreakerError):
            self._breaker.call(_judge, failed)

    def _describe(self) -> dict[str, object]:
        return {
            "request_id": self._request_id,
            "window_acceptance": round(self.window_acceptance, 3),
            "window_effective_acceptance": round(self.window_effective_acceptance, 3),
            "threshold": round(self.threshold, 3),
            **({"window_pace": round(pace, 3)} if (pace := self.window_pace) is not None else {}),
        }


class _ClearOnClose(pybreaker.CircuitBreakerListener):
    """A breaker that closes after a good trial starts a fresh window: old rounds are stale."""

    def __init__(self, window: deque[Any]) -> None:
        self._window = window

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state, new_state) -> None:  # type: ignore[no-untyped-def]
        if new_state.name == pybreaker.STATE_CLOSED:
            last = self._window[-1] if self._window else None
            self._window.clear()
            if last is not None:
                self._window.append(last)


def _judge(too_low: bool) -> None:
    if too_low:
        raise AcceptanceTooLow


class DraftFaultBreaker:
    """Process-wide breaker on draft faults: exceptions and proposals slower than the budget."""

    def __init__(
        self,
        *,
        fault_max: int,
        reset_timeout_s: float,
        latency_budget_s: float,
        on_transition: TransitionHook | None = None,
        hang_timeout_s: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.latency_budget_s = latency_budget_s
        # A draft that hangs must not hang the engine: proposals run on their own thread and
        # are abandoned after hang_timeout_s (default: 20 latency budgets, at least 1 s).
        self.hang_timeout_s = hang_timeout_s or max(1.0, 20 * latency_budget_s)
        self._clock = clock
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kenspec-draft")
        self._clocked = _ClockedBreaker(
            fail_max=fault_max,
            reset_timeout_s=reset_timeout_s,
            name="draft-faults",
            listeners=[_TransitionLog(lambda: {"fault_max": fault_max}, "draft", on_transition)],
            clock=clock,
        )
        self._breaker = self._clocked.breaker

    @property
    def state(self) -> BreakerState:
        return self._clocked.state

    @property
    def fault_max(self) -> int:
        return self._breaker.fail_max

    @property
    def reset_timeout_s(self) -> float:
        return self._clocked.reset_timeout_s

    def call(self, draft: Callable[[], Drafted], request_id: str = "") -> Drafted | None:
        """What `draft()` returns (on the draft thread, timed), or None when the breaker is
        open or the draft failed: raised, hung, or (counted, but its answer used) ran slow."""
        if not self._clocked.half_open_if_due():
            return None  # open: the draft is not even called
        try:
            return cast(Drafted, self._breaker.call(self._timed, draft))
        except pybreaker.CircuitBreakerError as error:
            cause = error.__context__
            if isinstance(cause, DraftTooSlow):
                return cast(Drafted, cause.answer)
            return None
        except DraftTooSlow as slow:
            log.warning("draft_slow", request_id=request_id, error=str(slow))
            return cast(Drafted, slow.answer)
        except Exception as error:  # any draft failure must not fail the request
            log.warning("draft_fault", request_id=request_id, error=repr(error))
            return None

    def _timed(self, draft: Callable[[], Drafted]) -> Drafted:
        started = self._clock()
        future = self._runner.submit(draft)
        try:
            answer = future.result(timeout=self.hang_timeout_s)
        except FutureTimeout:
            self._runner.shutdown(wait=False)  # leave the hung thread behind, start afresh
            self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kenspec-draft")
            raise DraftHung(f"draft gave no answer within {self.hang_timeout_s:g} s") from None
        elapsed = self._clock() - started
        if elapsed > self.latency_budget_s:
            raise DraftTooSlow(elapsed, answer)
        return answer
