"""Per-generation drafting policy: what to draft this round, how much, and whether to at all.

The speculator alone turns a session's candidate chains into the round's `DraftTree`: the
chain with the most expected accepted tokens, or a token tree over all of them
(`token_tree.build_tree`, with the session's branching), inside the draft-fault breaker so a
source that raises or stalls while the tree grows trips it like any draft. Then it cuts the
draft once to the request's cap (`SpeculationParams.num_draft_tokens`, nodes) and the tokens
left (`limit`, depth).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kenspec_api.outputs import BreakerState
from server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from server.engine.costs import chain_gains
from server.engine.draft import UNNAMED, Candidates, Chain, DraftSession
from server.engine.draft_tree import NO_DRAFTS, DraftTree, Source
from server.engine.params import SpeculationParams
from server.engine.token_tree import build_tree

PROBE_AFTER = 16  # starved rounds before the first re-probe; doubles after each failed probe
PROBE_AFTER_MAX = 256
PRIOR_TRIES = 2.0  # weight of the shared prior in a request's estimate, in draft tokens tried
_OWN_DECAY = 0.8  # a request's own counts: the last few rounds of a source dominate
TREE = Source("tree")  # a token tree round's source, as users see it ("tree")

AcceptanceKey = tuple[Source, bool]  # (draft source, sampled): what acceptance is learned per


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
        self._counts: dict[AcceptanceKey, tuple[float, float]] = {}

    def observe(self, key: AcceptanceKey, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)
        old_accepted, old_tried = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (old_accepted * self.decay + accepted, old_tried * self.decay + tried)

    def counts(self, key: AcceptanceKey) -> tuple[float, float]:
        return self._counts.get(key, (0.0, 0.0))

    def rate(self, key: AcceptanceKey) -> float:
        accepted, tried = self.counts(key)
        return (accepted + self.unseen * self.unseen_tries) / (tried + self.unseen_tries)


class Speculator:
    """Drafts through the breakers and adapts the draft length k to recent acceptance.

    Adaptive k follows transformers' "heuristic" schedule: +2 after a fully accepted round,
    -1 after a rejection, within [1, params.k] (chain_tokens within the cap).
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
        self.k = params.k
        self._starved = 0  # consecutive rounds whose drafts a batch cut entirely
        self._probe_every = PROBE_AFTER
        self._probing = False
        self._shared = shared if shared is not None else AcceptanceStats()
        self._own = AcceptanceStats(decay=_OWN_DECAY)
        self._sampled = sampled  # sampled rounds accept less than greedy ones: separate priors
        self._source = UNNAMED  # of this round's draft: its chain's source, or TREE
        self._tree = NO_DRAFTS  # this round's draft, as the batch cut it

    @property
    def breaker_state(self) -> BreakerState:
        return self._acceptance.state if self._acceptance else BreakerState.CLOSED

    @property
    def source(self) -> str:
        """Where this round's draft came from, as users see it ("kenlm", "context:3", "tree")."""
        return str(self._source)

    @property
    def window_acceptance(self) -> float:
        return self._acceptance.window_acceptance if self._acceptance else 0.0

    def acceptance_estimate(self) -> float:
        """Per-token acceptance to expect of this round's draft, for a batch choosing its
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

    def _rate(self, source: Source) -> float:
        """This request's acceptance of `source`, shrunk towards the shared rate."""
        key = (source, self._sampled)
        accepted, tried = self._own.counts(key)
        return (accepted + PRIOR_TRIES * self._shared.rate(key)) / (tried + PRIOR_TRIES)

    def _expected_accepted(self, chain: Chain) -> float:
        """Draft tokens a chain is expected to have accepted: the sum of alpha^j, j = 1..n."""
        alpha = self._rate(chain.source)
        return sum(alpha**j for j in range(1, len(chain) + 1))

    @property
    def _probe_due(self) -> bool:
        return self._starved > 0 and self._starved % self._probe_every == 0

    def cut(self, proposed: int, kept: int) -> None:
        """A batch kept `kept` of this round's `proposed` drafts."""
        if kept and self._probe_due:
            self._probing = True
        self._starved = self._starved + 1 if proposed and not kept else 0
        self._tree = self._tree.prefix(kept)

    def propose(self, limit: int) -> DraftTree:
        """This round's draft: at most num_draft_tokens nodes, none deeper than `limit` (the
        tokens left); none when speculation is off or not paying."""
        self._tree = NO_DRAFTS
        if self._session is None or limit <= 0:
            return NO_DRAFTS
        if self._acceptance is not None and not self._acceptance.allows_speculation():
            return NO_DRAFTS
        draft = partial(self._draft, self._session, min(self.k, limit), limit)
        if self._faults is None:
            drafted: tuple[DraftTree, Source] | None = draft()
        else:
            drafted = self._faults.call(draft, self._request_id)
        self._tree, self._source = drafted or (NO_DRAFTS, UNNAMED)
        return self._tree

    def _draft(self, session: DraftSession, k: int, limit: int) -> tuple[DraftTree, Source]:
        """The session's candidates as one draft tree, cut to the cap (see the module doc)."""
        cap = self._params.num_draft_tokens
        candidates = session.propose(k)
        tree, source = self._as_tree(session, candidates, min(self._tree_budget, cap), limit)
        return tree.within(cap, limit), source  # the one cut: nodes and depth

    def _as_tree(
        self, session: DraftSession, candidates: Candidates, budget: int, limit: int
    ) -> tuple[DraftTree, Source]:
        """A token tree over every chain and the session's branching, when trees are on and
        there is more than one chain or a way to branch; else the chain with the most
        expected accepted tokens, with its expected acceptance alpha^j as path probabilities
        (this request's rate for its source)."""
        branching = session.branching()
        if self._tree_budget > 1 and (len(candidates) > 1 or branching is not None):
            tree = build_tree(
                [chain for chain in candidates if len(chain)],
                self._rate,
                budget=budget,
                max_depth=limit,
                root_token=branching.root_token if branching is not None else -1,
                expand=branching.expand if branching is not None else None,
            )
            return tree, TREE
        best = max(candidates, key=self._expected_accepted, default=Chain())
        gains = chain_gains(len(best), self._rate(best.source))
        return DraftTree.chain(best.tokens, gains, best.source), best.source

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
        if self._source == TREE:
            full, judged = self._learn_tree(self._tree.prefix(drafted), accepted, path)
        else:
            key = (self._source, self._sampled)
            self._own.observe(key, drafted, accepted)
            self._shared.observe(key, drafted, accepted)
            full, judged = accepted == drafted, (drafted, accepted)
        if self._acceptance is not None:
            self._acceptance.record(*judged)
        if self._params.adaptive:
            grown = self.k + 2 if full else self.k - 1
            self.k = max(1, min(self._params.k, grown))

    def _learn_tree(
        self, tree: DraftTree, accepted: int, path: Sequence[int]
    ) -> tuple[bool, tuple[int, int]]:
        """Learn each reached node's acceptance for each of its sources; whether the walk went
        as deep as the tree, and the round as the acceptance breaker judges it."""
        accepted_nodes = set(path)
        for node in tree.reached(path):
            for source in tree.sources[node]:
                key = (source, self._sampled)
                self._own.observe(key, 1, node in accepted_nodes)
                self._shared.observe(key, 1, node in accepted_nodes)
        full = accepted == max(tree.depths())
        # The breaker judges a tree as one draft that paid when any node was accepted: a
        # deep tree's misses are mostly branches it never needed, and judged as a chain of
        # its depth, a few rounds that accepted nothing open the breaker (which costs the
        # request every draft until its reset timeout); the batch already keeps only the
        # nodes worth their cost.
        return full, (1, min(accepted, 1))

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._session is not None:
            self._session.extend(token_ids)
