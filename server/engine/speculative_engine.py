"""The engine: a target, an optional draft, the process-wide draft-fault breaker and the batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.batch import Batch
from kenspec.server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from kenspec.server.engine.context_draft import LONG_DRAFT_TOKENS, ContextDraft
from kenspec.server.engine.costs import Costs
from kenspec.server.engine.draft import Draft, DraftSession, StaticDraft
from kenspec.server.engine.draft_head import DraftHead
from kenspec.server.engine.events import NO_EVENTS, EngineEvents
from kenspec.server.engine.generation import Generation
from kenspec.server.engine.grammar import GrammarCompiler, GrammarSpec, GrammarState, check_stopping
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.live_costs import LiveCosts
from kenspec.server.engine.params import (
    ProcessorParams,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculator import AcceptanceStats, Speculator
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.tenant_index import MAX_TENANTS, SHARED_TENANT, TenantSuffixIndex
from kenspec.server.engine.tenant_state import TenantState, TenantStates

TREE_WINDOW_FACTOR = 4


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    window_rounds: int = 8
    threshold: float = 0.0  # acceptance below this opens a request's breaker
    reset_timeout_s: float = 2.0
    fault_max: int = 3
    fault_reset_timeout_s: float = 30.0
    draft_latency_budget_s: float = 0.05


@dataclass(frozen=True, slots=True)
class ContextSettings:
    enabled: bool = False  # the default for requests that do not say
    min_match: int = 1
    max_match: int = 16
    long_draft_tokens: int = LONG_DRAFT_TOKENS  # how far a chain after a long match drafts
    tree_budget: int = 1  # nodes of a token tree over every source's candidates (1: chains)
    branches: int = 5  # KenLM n-best alternatives at a tree's root
    learn_prompts: bool = False  # the suffix index learns prompts too, not only answers


class SpeculativeEngine:
    """Starts generations that share one target, one draft and one draft-fault breaker, and
    runs them together in `batch`: the server's streams, the warm-up, the bench and the tests
    alike (`batch.rounds(generation)` drives a single one on the caller's thread)."""

    def __init__(
        self,
        target: TargetModel,
        draft: StaticDraft | None,
        breaker_settings: BreakerSettings | None = None,
        *,
        context: ContextSettings | None = None,
        batching: BatchSettings | None = None,
        costs: Costs | None = None,
        events: EngineEvents = NO_EVENTS,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        suffix: TenantSuffixIndex | None = None,
        recycled: RecycledPredictions | None = None,
        isolate_tenants: bool = True,
        max_tenants: int = MAX_TENANTS,
        head: DraftHead | None = None,
    ) -> None:
        self.target = target
        self._grammars: GrammarCompiler | None = None  # made for the first grammar asked
        self.batch = Batch(target, batching, costs=costs, events=events, timer=timer)
        self.static_draft = draft
        self.context = context or ContextSettings()
        self.suffix = suffix  # past answers, drafted from with the context; learns as it serves
        # Each tenant drafts from its own answers (and reuses its own prefixes) only; False
        # (--suffix-index-scope shared): every request is SHARED_TENANT's.
        self.isolate_tenants = isolate_tenants
        # Per tenant (server.engine.tenant_state): the target's recent predictions per token
        # (`recycled` is the shared tenant's table, and the model of every other's) and the
        # acceptance statistics per draft source, the priors of each request's own.
        self.tenants = TenantStates(
            recycled.empty_like if recycled is not None else None,
            max_tenants if isolate_tenants else 1,
        )
        self.tenants.adopt(SHARED_TENANT, TenantState(recycled, AcceptanceStats()))
        # (tenant, prompt, answer) of each answer learned, on the engine thread: where the
        # server publishes it to other replicas (server.answer_stream). It must not block.
        self.on_learned: Callable[[str, Sequence[int], Sequence[int]], None] | None = None
        self.context_draft = ContextDraft(
            draft,
            min_match=self.context.min_match,
            max_match=self.context.max_match,
            long_draft_tokens=self.context.long_draft_tokens,
            branches=self.context.branches if self.context.tree_budget > 1 else 0,
            suffix=suffix.view(SHARED_TENANT) if suffix is not None else None,
            recycled=recycled,
            head=head,
        )
        # Both breakers' settings: each request's acceptance breaker and the draft-fault one.
        self.breaker_settings = breaker_settings or BreakerSettings()
        self._clock = clock  # what the breakers judge their reset timeouts by
        self._events = events
        self.fault_breaker = DraftFaultBreaker(
            fault_max=self.breaker_settings.fault_max,
            reset_timeout_s=self.breaker_settings.fault_reset_timeout_s,
            latency_budget_s=self.breaker_settings.draft_latency_budget_s,
            on_transition=events.observe_transition,
            clock=clock,
        )

    def breaker_threshold(self) -> float:
        """The acceptance below which a request's breaker opens: the live costs' (which follow
        what passes cost now) when the batch tracks them, else the settings'."""
        live = self.batch.costs
        return live.threshold() if isinstance(live, LiveCosts) else self.breaker_settings.threshold

    @property
    def paced_breakers(self) -> bool:
        """Whether requests' breakers judge rounds by their measured time (live costs, no
        fixed threshold) rather than by acceptance."""
        live = self.batch.costs
        return isinstance(live, LiveCosts) and live.paces

    @property
    def draft_breaker_state(self) -> BreakerState:
        """The process-wide draft-fault breaker's state."""
        return self.fault_breaker.state

    @property
    def draft(self) -> Draft | None:
        """The draft a request gets by default."""
        return self.draft_for(None)

    def draft_for(self, context: bool | None) -> Draft | None:
        use_context = self.context.enabled if context is None else context
        return self.context_draft if use_context else self.static_draft

    def start(
        self,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingParams,
        stopping: StoppingParams,
        speculation: SpeculationParams,
        request_id: str = "",
        tenant: str = SHARED_TENANT,
        grammar: GrammarSpec | None = None,
        processing: ProcessorParams | None = None,
        top_logprobs: int | None = None,
        choice: int = 0,
    ) -> Generation:
        """A generation for `tenant` (server.security.tenant_of): it drafts from the seeded
        corpus and that tenant's learned answers, learns into them, and reuses that tenant's
        cached prefixes only (all one tenant's when isolate_tenants is off). With a `grammar`,
        its output matches it (engine.grammar); InvalidParameter for one that does not compile.
        `processing`: penalties and logit_bias applied at every verified position;
        `top_logprobs` (None: none): each token's logprob and that many alternatives; `choice`:
        which of a request's n choices it is (its rounds say so)."""
        constraint = None
        if grammar is not None:
            check_stopping(stopping, grammar)
            constraint = self._grammar(grammar)
        tenant = tenant if self.isolate_tenants else SHARED_TENANT
        learned = self.tenants.of(tenant)
        session = self._session(prompt_ids, speculation, tenant, learned.recycled)
        trees = self.context.tree_budget > 1
        settings = self.breaker_settings
        acceptance = AcceptanceBreaker(
            threshold=self.breaker_threshold,
            # A tree round is judged hit or miss (Speculator.record): less evidence per round
            # than a chain's, so the window holds TREE_WINDOW_FACTOR times as many rounds.
            window_rounds=settings.window_rounds * (TREE_WINDOW_FACTOR if trees else 1),
            reset_timeout_s=settings.reset_timeout_s,
            request_id=request_id,
            on_transition=self._events.observe_transition,
            clock=self._clock,
            # Where pass costs are live, rounds are judged by time: a round's time is the
            # whole evidence, a tree's included, so the window is not widened for trees.
            paced_rounds=settings.window_rounds if self.paced_breakers else 0,
        )
        speculator = Speculator(
            session,
            speculation,
            acceptance=acceptance,
            faults=self.fault_breaker,
            request_id=request_id,
            shared=learned.acceptance,
            sampled=not sampling.greedy,
            tree_budget=self.context.tree_budget,
        )
        return Generation(
            self.target,
            prompt_ids,
            sampling=sampling,
            stopping=stopping,
            speculator=speculator,
            on_finish=partial(self._learn, tenant) if self.suffix is not None else None,
            recycled=learned.recycled,
            tenant=tenant,
            grammar=constraint,
            processing=processing,
            top_logprobs=top_logprobs,
            choice=choice,
        )

    def _grammar(self, spec: GrammarSpec) -> GrammarState:
        if self._grammars is None:
            target = self.target
            eos = sorted(target.eos_token_ids)
            self._grammars = GrammarCompiler(target.tokenizer, eos, target.vocab_size)
        return self._grammars.start(spec)

    def _session(
        self,
        prompt_ids: Sequence[int],
        speculation: SpeculationParams,
        tenant: str,
        recycled: RecycledPredictions | None,
    ) -> DraftSession | None:
        draft = self.draft_for(speculation.draft_context)
        if draft is None or not speculation.enabled:
            return None
        if draft is self.context_draft:
            suffix = self.suffix.view(tenant) if self.suffix is not None else None
            return self.context_draft.start(prompt_ids, suffix=suffix, recycled=recycled)
        return draft.start(prompt_ids)

    def _learn(self, tenant: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index a finished answer (and its prompt, if so configured) for the tenant's later
        drafts."""
        assert self.suffix is not None
        if self.context.learn_prompts:
            self.suffix.add(tenant, prompt_ids)
        self.suffix.add(tenant, output_ids, prompt_ids)
        if self.on_learned is not None:
            self.on_learned(tenant, prompt_ids, output_ids)
