"""Per-generation drafting policy: how many tokens to draft this round, and whether to at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kenspec_api.outputs import BreakerState
from server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from server.engine.costs import chain_gains
from server.engine.draft import DraftSession, Proposal
from server.engine.draft_tree import NO_DRAFTS, DraftTree, Source
from server.engine.params import SpeculationParams
from server.engine.token_tree import build_tree, depths, reached

_NOTHING = Proposal()
PROBE_AFTER = 16  # starved rounds before the first re-probe; doubles after each failed probe
PROBE_AFTER_MAX = 256
PRIOR_TRIES = 2.0  # weight of the shared prior in a request's estimate, in draft tokens tried
_OWN_DECAY = 0.8  # a request's own counts: the last few rounds of a source dominate


def _cut(proposal: Proposal, count: int) -> Proposal:
    distributions = proposal.distributions
    return replace(
        proposal,
        token_ids=proposal.token_ids[:count],
        probs=proposal.probs[:count],
        distributions=distributions[:count] if distributions is not None else None,
        alternatives=(),
        parents=proposal.parents[:count],
        node_sources=proposal.node_sources[:count],
    )


class _TreeSession:
    """A session whose proposal is a token tree over the wrapped session's chains (its
    proposal and alternatives) and, where it offers them, its branches (`expand`): built
    inside the draft-fault breaker, so a source that raises or stalls while the tree grows
    trips it like any draft."""

    def __init__(
        self, session: DraftSession, rate: Callable[[str], float], budget: int, limit: int
    ) -> None:
        self._session = session
        self._rate = rate
        self._budget = budget
        self._limit = limit

    def propose(self, k: int) -> Proposal:
        proposal = self._session.propose(k)
        expand = getattr(self._session, "expand", None)
        if not proposal.alternatives and expand is None:
            return proposal  # one chain: nothing to branch on
        chains = [chain for chain in (proposal, *proposal.alternatives) if len(chain)]
        return build_tree(
            chains,
            self._rate,
            budget=self._budget,
            max_depth=self._limit,
            root_token=getattr(self._session, "last_token", -1),
            expand=expand,
        )

    def extend(self, token_ids: Sequence[int]) -> None:
        self._session.extend(token_ids)


class AcceptanceStats:
    """Decayed counts of draft tokens accepted and tried, per key (draft source, sampling).

    Each draft position tried is accepted or ends the round (the geometric model of Leviathan
    et al. 2023), so accepted / tried estimates the per-token acceptance alpha. Shared by all
    requests of an engine, this is the prior a new request starts from: `unseen` (0.5: at
    k=6 a draft worth trying when a wide pass costs < 2 steps) counted as `unseen_tries`
    tries, so that one early round cannot decide a source's prior alone.
    """

    def __init__(self, decay: float = 0.99, unseen: float = 0.5, unseen_tries: float = 4.0) -> None:
        self.decay = decay
        self.unseen = unseen
        self.unseen_tries = unseen_tries
        self._counts: dict[object, tuple[float, float]] = {}

    def observe(self, key: object, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)
        old_accepted, old_tried = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (old_accepted * self.decay + accepted, old_tried * self.decay + tried)

    def counts(self, key: object) -> tuple[float, float]:
        return self._counts.get(key, (0.0, 0.0))

    def rate(self, key: object) -> float:
        accepted, tried = self.counts(key)
        return (accepted + self.unseen * self.unseen_tries) / (tried + self.unseen_tries)


class Speculator:
    """Drafts through the breakers and adapts the draft length k to recent acceptance.

    Adaptive k follows transformers' "heuristic" schedule: +2 after a fully accepted round,
    -1 after a rejection, within [1, num_draft_tokens].
    """

    def __init__(
        self,
        session: DraftSession | None,
        params: SpeculationParams,
        *,
        acceptance: AcceptanceBreaker | None = None,
        faults: DraftFaultBreaker | None = None,
        request_id: str = "",
        shared: AcceptanceStats | None = None,
        sampled: bool = False,
        tree_budget: int = 1,
    ) -> None:
        self._session = session if params.enabled else None
        # Up to this many nodes per round in a token tree over all sources' candidates, where
        # the session offers more than one chain or a way to branch (1: the best chain).
        self._tree_budget = tree_budget
        self._params = params
        self._acceptance = acceptance
        self._faults = faults
        self._request_id = request_id
        self.k = params.num_draft_tokens
        self._starved = 0  # consecutive rounds whose drafts a batch cut entirely
        self._probe_every = PROBE_AFTER
        self._probing = False
        self._shared = shared if shared is not None else AcceptanceStats()
        self._own = AcceptanceStats(decay=_OWN_DECAY)
        self._sampled = sampled  # sampled rounds accept less than greedy ones: separate priors
        self._source = ""  # of this round's proposal
        self._proposal = _NOTHING  # this round's, as the batch cut it
        self._tree = NO_DRAFTS  # the same, as verification gets it

    @property
    def breaker_state(self) -> BreakerState:
        return self._acceptance.state if self._acceptance else BreakerState.CLOSED

    @property
    def source(self) -> str:
        """Where this round's proposal came from (see Proposal.source)."""
        return self._source

    @property
    def window_acceptance(self) -> float:
        return self._acceptance.window_acceptance if self._acceptance else 0.0

    def acceptance_estimate(self) -> float:
        """Per-token acceptance to expect of this round's proposal, for a batch choosing its
        width: this request's recent acceptance of drafts from the same source (KenLM, or the
        context after a match of a given length), shrunk towards the shared prior for that
        source over all recent requests by PRIOR_TRIES pseudo-tries.

        After `probe_every` rounds in a row whose drafts a batch cut entirely, 1.0 once (a
        probe: a stale estimate is re-measured); a probe that fails doubles the wait for the
        next one (up to PROBE_AFTER_MAX), one that pays resets it."""
        if self._probe_due:
            return 1.0
        return self._rate(self._source)

    def gains(self) -> list[float]:
        """Expected accepted tokens each of this round's drafts adds, in order (non-increasing):
        a chain's alpha^j, a tree's path probabilities; 1.0 each for a probe."""
        if self._probe_due:
            return chain_gains(len(self._tree), 1.0)
        return list(self._tree.probs)

    def _rate(self, source: str) -> float:
        """This request's acceptance of `source`, shrunk towards the shared rate."""
        key = (source, self._sampled)
        accepted, tried = self._own.counts(key)
        return (accepted + PRIOR_TRIES * self._shared.rate(key)) / (tried + PRIOR_TRIES)

    def _expected_accepted(self, proposal: Proposal) -> float:
        """Draft tokens a chain is expected to have accepted: the sum of alpha^j, j = 1..n."""
        alpha = self._rate(proposal.source)
        return sum(alpha**j for j in range(1, len(proposal) + 1))

    @property
    def _key(self) -> tuple[str, bool]:
        """What acceptance is tracked by: this round's draft source, and greedy or sampled."""
        return (self._source, self._sampled)

    @property
    def _probe_due(self) -> bool:
        return self._starved > 0 and self._starved % self._probe_every == 0

    def cut(self, proposed: int, kept: int) -> None:
        """A batch kept `kept` of this round's `proposed` drafts."""
        if kept and self._probe_due:
            self._probing = True
        self._starved = self._starved + 1 if proposed and not kept else 0
        if kept < len(self._proposal):
            self._proposal = _cut(self._proposal, kept)
            self._tree = self._tree.prefix(kept)

    def propose(self, limit: int) -> DraftTree:
        """At most min(k, limit) draft tokens (a long match's chain, or a tree, may hold more,
        never past limit); none when speculation is off or not paying."""
        self._proposal, self._tree = _NOTHING, NO_DRAFTS
        if self._session is None or limit <= 0:
            return NO_DRAFTS
        if self._acceptance is not None and not self._acceptance.allows_speculation():
            return NO_DRAFTS
        k = min(self.k, limit)
        source: DraftSession = self._session
        if self._tree_budget > 1:
            source = _TreeSession(self._session, self._rate, self._tree_budget, limit)
        if self._faults is None:
            proposal = source.propose(k)
        else:
            proposal = self._faults.propose(source, k, self._request_id) or _NOTHING
        if proposal.alternatives:  # the chain with the most expected accepted tokens
            proposal = max((proposal, *proposal.alternatives), key=self._expected_accepted)
        if len(proposal) > limit and not proposal.parents:  # a long match's chain may draft
            # past k, never past limit (a tree is never deeper than limit)
            proposal = _cut(proposal, limit)
        self._source = proposal.source
        self._proposal = proposal
        self._tree = self._as_tree(proposal)
        return self._tree

    def _as_tree(self, proposal: Proposal) -> DraftTree:
        """The proposal as verification takes it: a tree's path probabilities, or a chain's
        expected acceptance alpha^j (this request's rate for its source)."""
        if proposal.parents:
            sources = tuple(
                tuple(Source.parse(part) for part in label.split("+"))
                for label in proposal.node_sources
            )
            return DraftTree(proposal.token_ids, proposal.parents, proposal.probs, sources)
        gains = chain_gains(len(proposal), self._rate(proposal.source))
        return DraftTree.chain(proposal.token_ids, gains, Source.parse(proposal.source))

    def record(self, drafted: int, accepted: int, path: Sequence[int] = ()) -> None:
        """A round verified `drafted` drafts and accepted `accepted` (for a tree: the accepted
        nodes, `path`); acceptance is learned per source (per node's sources in a tree)."""
        if drafted == 0:
            return
        if self._probing:  # a probe pays when at least half its drafts were accepted
            self._probing = False
            failed = 2 * accepted < drafted
            self._probe_every = (
                min(2 * self._probe_every, PROBE_AFTER_MAX) if failed else PROBE_AFTER
            )
        proposal = self._proposal
        if proposal.parents:
            accepted_nodes = set(path)
            for node in reached(proposal.parents[:drafted], path):
                for source in proposal.node_sources[node].split("+"):
                    key = (source, self._sampled)
                    self._own.observe(key, 1, node in accepted_nodes)
                    self._shared.observe(key, 1, node in accepted_nodes)
            full = accepted == max(depths(proposal.parents[:drafted]))
            # The breaker judges a tree as one draft that paid when any node was accepted: a
            # deep tree's misses are mostly branches it never needed, and judged as a chain of
            # its depth, a few rounds that accepted nothing open the breaker (which costs the
            # request every draft until its reset timeout); the batch already keeps only the
            # nodes worth their cost.
            judged = (1, min(accepted, 1))
        else:
            self._own.observe(self._key, drafted, accepted)
            self._shared.observe(self._key, drafted, accepted)
            full = accepted == drafted
            judged = (drafted, accepted)
        if self._acceptance is not None:
            self._acceptance.record(*judged)
        if self._params.adaptive:
            grown = self.k + 2 if full else self.k - 1
            self.k = max(1, min(self._params.num_draft_tokens, grown))

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._session is not None:
            self._session.extend(token_ids)
