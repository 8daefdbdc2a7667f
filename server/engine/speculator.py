"""Per-generation drafting policy: what to draft this round, how much, and whether to at all.

The speculator alone turns a session's candidate chains into the round's `DraftTree`: the
chain with the most expected accepted tokens, or a token tree over all of them
(`token_tree.build_tree`, with the session's branching), inside the draft-fault breaker so a
source that raises or stalls while the tree grows trips it like any draft. Then it cuts the
draft once to the request's cap (`SpeculationParams.num_draft_tokens`, nodes) and the tokens
left (`limit`, depth).

With a constraint (a request's grammar, engine.grammar), the tokens it forces come first,
drafted whatever the breakers say (the grammar's, not a draft's guess, so they are not
learned as one); the session is given them before it drafts, so the learned tree is drafted
after them; then the nodes the constraint forbids are pruned. Everything learned (acceptance,
k, the breaker) counts the learned nodes alone.

A round's life: `propose` returns a `Proposal`, a value holding the tree, its gains and its
sources; the batch keeps `proposal.cut(kept)` of it; `record(kept_proposal, accepted, path)`
learns from the value it is handed. Nothing is left between the calls: the speculator holds
only what it learned (acceptance, k, the breaker, how long its drafts have been starved).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import structlog
import torch

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.breaker import AcceptanceBreaker, DraftFaultBreaker
from kenspec.server.engine.costs import chain_gains
from kenspec.server.engine.draft import UNNAMED, Candidates, Chain, DraftSession
from kenspec.server.engine.draft_tree import NO_DRAFTS, DraftTree, Source
from kenspec.server.engine.params import SpeculationParams
from kenspec.server.engine.token_tree import build_tree

log = structlog.get_logger("kenspec.speculator")

PROBE_AFTER = 16  # starved rounds before the first re-probe; doubles after each failed probe
# A request whose drafts the batch cut REST_AFTER rounds in a row drafts only every REST_EVERY-th
# round until drafts are kept again: drafting costs about a tenth of a step (KenLM, the suffix
# index, the tree), spent for nothing while the choice finds no draft worth its pass.
REST_AFTER = 2
REST_EVERY = 4
# While a request's acceptance breaker is open it still drafts the one chain that continues an
# exact match of COPY_MATCH tokens or more (its own context, past answers): replayed on the
# default model's greedy answers, such chains' tokens were accepted 94-95% of the time on every
# prompt set (context_draft._source), so they pay where the drafts as a whole did not, as when
# a rewrite copies its source again after a stretch of its own words. Not judged by the breaker.
# The session first says whether one may follow (`may_copy`: the last COPY_MATCH tokens
# occurred before, a dictionary lookup on this thread); only then is it built, on the draft
# thread.
COPY_MATCH = 4
PROBE_AFTER_MAX = 256
PRIOR_TRIES = 2.0  # weight of the shared prior in a request's estimate, in draft tokens tried
_OWN_DECAY = 0.8  # a request's own counts: the last few rounds of a source dominate
TREE = Source("tree")  # a token tree round's source, as users see it ("tree")

AcceptanceKey = tuple[Source, bool]  # (draft source, sampled): what acceptance is learned per
FORCED = Source("grammar")  # a round whose drafts are forced tokens alone, as users see it


# A round's tree holds at most this many nodes, or as many as its longest candidate chain (a
# long match), within the tree budget. Guesses branching from uncertain tokens pay less than
# their pass costs past ~10 nodes: served on one core, held-out chat ran 4-8% faster at 10
# than at 16 (four pairs), repeated prompts (long suffix matches) no slower (docs/design.md,
# "Bushy trees stop at 10 nodes").
BUSHY_TREE_NODES = 10


@dataclass(frozen=True, slots=True)
class Proposal:
    """What one round's drafting decided, and, once `cut`, what the batch kept of it.

    `tree` is what the pass verifies: the `forced` grammar tokens first (a chain), then the
    learned tree below them, drafted by `learned` (a chain's `Source`, or TREE). A `probe`
    (a starved request re-measuring a stale estimate) counts each learned draft a gain of 1.0.
    `rested`: a starved request drafted nothing this round (REST_EVERY). `copied`: drafted
    while the request's breaker was open (a copy, COPY_MATCH). `proposed` is how many nodes
    drafting proposed, before the batch cut any.
    """

    tree: DraftTree = NO_DRAFTS
    forced: int = 0
    learned: Source = UNNAMED
    probe: bool = False
    proposed: int = 0
    rested: bool = False
    copied: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.forced <= len(self.tree) <= self.proposed:
            raise ValueError(
                f"a proposal needs 0 <= forced <= nodes <= proposed: {self.forced} forced, "
                f"{len(self.tree)} nodes, {self.proposed} proposed"
            )

    @classmethod
    def of(
        cls,
        tree: DraftTree,
        forced: int = 0,
        learned: Source = UNNAMED,
        probe: bool = False,
        rested: bool = False,
        copied: bool = False,
    ) -> Proposal:
        """A round's proposal of `tree`, before any cut."""
        return cls(tree, forced, learned, probe, len(tree), rested, copied)

    @property
    def learned_tree(self) -> DraftTree:
        """The learned nodes, below the forced ones (rooted at the pending token)."""
        return self.tree.below(self.forced)

    @property
    def gains(self) -> list[float]:
        """Expected accepted tokens each draft adds, in order (non-increasing): 1.0 for a
        forced token, then a chain's alpha^j or a tree's path probabilities (1.0 for a probe)."""
        learned = len(self.tree) - self.forced
        gains = chain_gains(learned, 1.0) if self.probe else list(self.tree.probs[self.forced :])
        return [1.0] * self.forced + gains if self.forced else gains

    @property
    def source(self) -> str:
        """Where the drafts came from, as users see it ("kenlm", "context:3", "tree",
        "grammar" when only forced tokens were drafted)."""
        return str(FORCED if self.forced and self.forced == len(self.tree) else self.learned)

    def cut(self, kept: int) -> Proposal:
        """The proposal as a batch cut it: its first `kept` drafts (a tree's first nodes are a
        tree, the forced ones first)."""
        if kept >= len(self.tree):
            return self
        return replace(self, tree=self.tree.prefix(kept), forced=min(self.forced, kept))


class DraftConstraint(Protocol):
    """What a grammar does to a round's draft (engine.grammar.GrammarState)."""

    def forced(self) -> tuple[int, ...]:
        """Tokens with no alternative after the output: drafted first."""
        ...

    def prune(self, tree: DraftTree) -> DraftTree:
        """`tree` (rooted at the pending token) less the nodes it forbids, with their subtrees."""
        ...


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
        self._rested = 0  # rounds in a row a starved request rested (REST_EVERY)
        self._probe_every = PROBE_AFTER
        self._probing = False
        self._shared = shared if shared is not None else AcceptanceStats()
        self._own = AcceptanceStats(decay=_OWN_DECAY)
        self._sampled = sampled  # sampled rounds accept less than greedy ones: separate priors
        self._ahead: list[int] = []  # forced tokens the session holds that the output does not
        # (a session class that does not subclass DraftSession declares no features)
        self._features = bool(getattr(self._session, "wants_features", False))

    @property
    def breaker_state(self) -> BreakerState:
        return self._acceptance.state if self._acceptance else BreakerState.CLOSED

    @property
    def window_acceptance(self) -> float:
        return self._acceptance.window_acceptance if self._acceptance else 0.0

    def acceptance_estimate(self, proposal: Proposal) -> float:
        """Per-token acceptance to expect of `proposal`'s learned drafts: this request's recent
        acceptance of drafts from the same source (KenLM, or the context after a match of a
        given length), shrunk towards the shared prior for that source over all recent
        requests by PRIOR_TRIES pseudo-tries.

        After `probe_every` rounds in a row whose drafts a batch cut entirely, 1.0 once (a
        probe: a stale estimate is re-measured); a probe that fails doubles the wait for the
        next one (up to PROBE_AFTER_MAX), one that pays resets it."""
        if proposal.probe:
            return 1.0
        return self._rate(proposal.learned)

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

    @property
    def _rests(self) -> bool:
        """Whether a starved request drafts nothing this round: REST_EVERY - 1 rounds in a row,
        then one that drafts (a probe always drafts)."""
        return self._starved >= REST_AFTER and not self._probe_due and self._rested < REST_EVERY - 1

    def propose(self, limit: int, constraint: DraftConstraint | None = None) -> Proposal:
        """This round's draft: at most num_draft_tokens nodes, none deeper than `limit` (the
        tokens left); none when speculation is off; while the acceptance breaker is open, only
        a copy of an exact match (COPY_MATCH). With a constraint, its forced tokens first (see
        the module doc)."""
        if not self._params.enabled or limit <= 0:
            return Proposal()
        cap = self._params.num_draft_tokens
        forced = constraint.forced()[: min(cap, limit)] if constraint is not None else ()
        copying = self._acceptance is not None and not self._acceptance.allows_speculation()
        drafted = self._learned(limit - len(forced), cap - len(forced), forced, copying)
        learned, source = drafted or (NO_DRAFTS, UNNAMED)
        probe, rested = self._probe_due and not copying, drafted is None
        if constraint is None:
            return Proposal.of(learned, 0, source, probe, rested, copying)
        chain = DraftTree.chain(forced, [1.0] * len(forced), FORCED)
        tree = constraint.prune(learned.after(chain))
        return Proposal.of(tree, _leading_forced(tree), source, probe, rested, copying)

    def _learned(
        self, limit: int, cap: int, forced: tuple[int, ...], copying: bool
    ) -> tuple[DraftTree, Source] | None:
        """The session's draft after `forced` (given to it first) and its source: up to `cap`
        nodes, none deeper than `limit`; none without a session; only a copy (`_copy`) while
        `copying` (the breaker says no), and none where the session says none may follow; None
        when a starved request rests."""
        if self._session is None or limit <= 0 or cap <= 0:
            return NO_DRAFTS, UNNAMED
        if not copying and self._rests:
            return None
        if copying and not _may_copy(self._session):
            return NO_DRAFTS, UNNAMED  # the draft thread is not even asked
        self._give_ahead(self._session, forced)
        how = self._copy if copying else self._draft
        draft = partial(how, self._session, min(self.k, limit), limit, cap)
        if self._faults is None:
            drafted: tuple[DraftTree, Source] | None = draft()
        else:
            drafted = self._faults.call(draft, self._request_id)
        return drafted or (NO_DRAFTS, UNNAMED)

    def _give_ahead(self, session: DraftSession, forced: tuple[int, ...]) -> None:
        """Extend the session by the forced tokens it does not hold yet. A session cannot take
        tokens back: if the target chose otherwise (another tokenization of forced text),
        those it held stay, and only its drafts' quality suffers."""
        held = _common(self._ahead, forced)
        if held == len(forced):
            return
        if held < len(self._ahead):
            held = 0
        session.extend(forced[held:])
        self._ahead = list(forced)

    def _draft(
        self, session: DraftSession, k: int, limit: int, cap: int
    ) -> tuple[DraftTree, Source]:
        """The session's candidates as one draft tree, cut to the cap (see the module doc)."""
        candidates = session.propose(k)
        longest = max((len(chain) for chain in candidates), default=0)
        nodes = min(self._tree_budget, cap, max(BUSHY_TREE_NODES, longest))
        tree, source = self._as_tree(session, candidates, nodes, limit)
        return tree.within(cap, limit), source  # the one cut: nodes and depth

    def _copy(
        self, session: DraftSession, k: int, limit: int, cap: int
    ) -> tuple[DraftTree, Source]:
        """An open breaker's draft: of the chains continuing an exact match of COPY_MATCH
        tokens or more, the one with the most expected accepted tokens; else none."""
        tree, source = self._best_chain(session.copies(k, COPY_MATCH))
        return tree.within(cap, limit), source

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
        return self._best_chain(candidates)

    def _best_chain(self, candidates: Candidates) -> tuple[DraftTree, Source]:
        """The chain with the most expected accepted tokens, with its expected acceptance
        alpha^j as path probabilities (this request's rate for its source); none of none."""
        best = max(candidates, key=self._expected_accepted, default=Chain())
        gains = chain_gains(len(best), self._rate(best.source))
        return DraftTree.chain(best.tokens, gains, best.source), best.source

    def record(self, proposal: Proposal, accepted: int, path: Sequence[int] = ()) -> None:
        """A round verified `proposal` (as the batch cut it) and accepted `accepted` drafts (for
        a tree: the accepted nodes, `path`): the cut counts towards a probe (see
        `acceptance_estimate`); acceptance is learned per source (per node's sources in a
        tree). A copy (drafted while the breaker was open, chosen for being sure) teaches only
        this request's rate of its source: not the shared rates, k, probes or the breaker."""
        drafted, forced = len(proposal.tree), proposal.forced
        if drafted and proposal.probe:
            self._probing = True
        if proposal.rested:  # a round that rested keeps the request starved
            self._rested += 1
        elif not proposal.copied:
            self._rested = 0
            self._starved = self._starved + 1 if proposal.proposed and not drafted else 0
        if forced:  # forced nodes are the grammar's: learn the nodes after them only
            if accepted < forced:
                return  # the learned nodes were not reached
            drafted, accepted = drafted - forced, accepted - forced
            path = [node - forced for node in path[forced:]]
        if drafted == 0:
            return
        if proposal.copied:  # a biased sample (the breaker is open): this request's rate alone
            self._own.observe((proposal.learned, self._sampled), drafted, accepted)
            return
        if self._probing:  # a probe pays when at least half its drafts were accepted
            self._probing = False
            failed = 2 * accepted < drafted
            self._probe_every = (
                min(2 * self._probe_every, PROBE_AFTER_MAX) if failed else PROBE_AFTER
            )
        if proposal.learned == TREE:
            full, judged = self._learn_tree(proposal.learned_tree, accepted, path)
        else:
            key = (proposal.learned, self._sampled)
            self._own.observe(key, drafted, accepted)
            self._shared.observe(key, drafted, accepted)
            full, judged = accepted == drafted, (drafted, accepted)
        if self._acceptance is not None:
            self._acceptance.record(*judged)
        if self._params.adaptive:
            grown = self.k + 2 if full else self.k - 1
            self.k = max(1, min(self._params.k, grown))

    def charge(self, extra_seconds: float, saved_seconds: float) -> None:
        """A round that verified drafts took `extra_seconds` past a plain round and emitted
        tokens that plain decoding would have taken `saved_seconds` more to: the request's
        paced breaker judges speculation by it (breaker.AcceptanceBreaker.charge)."""
        if self._acceptance is not None:
            self._acceptance.charge(extra_seconds, saved_seconds)

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

    @property
    def wants_features(self) -> bool:
        """Whether the session drafts from the target's hidden states (a learned head)."""
        return self._features

    def observe(self, feature: torch.Tensor) -> None:
        """The target's final hidden state [hidden_size] at the row that chose the output's
        last token (after `extend` with the round's tokens); none while the session holds
        grammar tokens ahead of the output, the acceptance breaker is open or the next round
        rests. A session that fails on it is given no more (a draft's failure never fails the
        request; its other sources go on)."""
        if self._session is None or not self._features:
            return
        if self._ahead:  # the session holds grammar tokens the state did not choose
            return
        if self._acceptance is not None and self._acceptance.state is BreakerState.OPEN:
            return  # no drafts until it half-opens: nothing to draft for
        if self._rests:
            return  # the next round rests (REST_EVERY): its proposal drafts nothing
        try:
            self._session.observe(feature)
        except Exception:
            log.exception("draft_observe_failed", request_id=self._request_id)
            self._features = False

    def extend(self, token_ids: Sequence[int]) -> None:
        """The output grew by `token_ids` (the session already holds forced ones given ahead)."""
        held = _common(self._ahead, token_ids) if self._ahead else 0
        if held:
            self._ahead = self._ahead[held:] if held == len(token_ids) else []
            token_ids = token_ids[held:]
        else:
            self._ahead = []
        if self._session is not None:
            self._session.extend(token_ids)


def _may_copy(session: DraftSession) -> bool:
    """Whether the session may have a copy (COPY_MATCH) now; a session class that does not
    subclass DraftSession and does not say is asked for one."""
    may_copy = getattr(session, "may_copy", None)
    return True if may_copy is None else bool(may_copy(COPY_MATCH))


def _common(first: Sequence[int], second: Sequence[int]) -> int:
    """The length of the longest common prefix."""
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


def _leading_forced(tree: DraftTree) -> int:
    """How many nodes at the front of `tree` are forced ones (a chain from the root)."""
    count = 0
    while count < len(tree) and tree.sources[count] == (FORCED,):
        count += 1
    return count
