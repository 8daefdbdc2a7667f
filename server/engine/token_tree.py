"""Token trees: every source's candidates merged into one prefix tree, expanded best-first.

A chain spends a pass on one guess per position; a tree verifies several where the first
guess is uncertain (SpecInfer, Medusa, REST, SuffixDecoding, Token Recycling). The candidates
here:
- the sources' chains (the request's own context, the suffix index, KenLM), inserted into
  one trie, identical prefixes shared;
- KenLM's n-best at the root (single-token chains from the session);
- the target's recycled predictions below any node (`expand`: the top next tokens recorded
  after that node's token).

Each candidate has a conditional probability, the learned acceptance of its source (per
source and match length or confidence bucket, as the speculator measures it: accepted
/ reached, decayed): the chance it is accepted once its parent was. Proposed by several
sources, a token's chance is 1 - prod(1 - p_s). Siblings exclude each other: in order of
chance, each keeps at most what the likelier ones left of 1 (a 0.95 match beside a 0.5 n-gram
guess keeps 0.95; scaling both to sum to 1 made a repeated answer's chain look half as sure).
A node's path probability, the product along its path, is the expected number of times it is
accepted, so the tree with the most expected accepted tokens for a budget of n nodes is the
n best nodes by path probability (a child is never better than its parent, so it comes after
it): SuffixDecoding's best-first expansion with a heap, stopped at the budget or a minimum
path probability.

Nodes are numbered in the order they were taken, so the first n of a tree are a tree too: a
batch that can afford only n of them keeps a prefix (`costs.choose_drafts`). The speculator
builds the tree over a session's candidate chains (`draft.Chain`); this module knows nothing of
sessions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kenspec.server.engine.draft import Chain
from kenspec.server.engine.draft_tree import DraftTree, Source

MIN_PATH_PROBABILITY = 0.01  # nodes less likely than this are not worth a slot of the pass

Expand = Callable[[int], list[tuple[int, Source]]]  # a node's token -> (child, source), best first


@dataclass(slots=True)
class _Candidate:
    token: int
    depth: int  # 1 for a child of the root
    misses: float = 1.0  # prod(1 - p_s) over the sources proposing it
    sources: list[Source] = field(default_factory=list)
    children: dict[int, _Candidate] = field(default_factory=dict)
    expanded: bool = False  # recycled children added

    @property
    def chance(self) -> float:
        return 1.0 - self.misses

    def propose(self, token: int, source: Source, rate: float) -> _Candidate:
        """The child `token`, proposed (once more) by `source` with chance `rate`."""
        child = self.children.get(token)
        if child is None:
            child = self.children[token] = _Candidate(token, self.depth + 1)
        if source not in child.sources:
            child.misses *= 1.0 - rate
            child.sources.append(source)
        return child


def _trie(
    chains: Sequence[Chain], rate: Callable[[Source], float], root_token: int, max_depth: int
) -> _Candidate:
    """Every chain inserted from the root, each token labelled by its source."""
    root = _Candidate(root_token, 0)
    for chain in chains:
        node = root
        for token, source in zip(chain.tokens[:max_depth], chain.labels(), strict=False):
            node = node.propose(token, source, rate(source))
    return root


def build_tree(
    chains: Sequence[Chain],
    rate: Callable[[Source], float],
    *,
    budget: int,
    max_depth: int,
    root_token: int,
    expand: Expand | None = None,
    min_path_probability: float = MIN_PATH_PROBABILITY,
) -> DraftTree:
    """The best `budget` nodes over the candidates (see module doc): each node's path
    probability and the sources that proposed it, in the order they did. `expand(token)`:
    candidate children (token, source) of a node whose token is `token`, best first;
    `rate(source)`: that source's conditional acceptance. Depth is at most max_depth."""
    root = _trie(chains, rate, root_token, max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[float] = []
    sources: list[tuple[Source, ...]] = []
    heap: list[tuple[float, int, int, _Candidate]] = []  # (-path, order, parent index, node)
    order = 0

    def push_children(node: _Candidate, index: int, path: float) -> None:
        nonlocal order
        if node.depth >= max_depth:
            return
        if expand is not None and not node.expanded:
            node.expanded = True
            for token, source in expand(node.token):
                node.propose(token, source, rate(source))
        left = 1.0  # siblings are exclusive: the likeliest claims its chance first
        for child in sorted(node.children.values(), key=lambda c: -c.chance):
            chance = min(child.chance, left)
            left -= chance
            probability = path * chance
            if probability >= min_path_probability:
                heapq.heappush(heap, (-probability, order, index, child))
                order += 1

    push_children(root, -1, 1.0)
    while heap and len(tokens) < budget:
        negative, _, parent, node = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(node.token)
        parents.append(parent)
        paths.append(-negative)
        sources.append(tuple(node.sources))
        push_children(node, index, -negative)
    return DraftTree(tuple(tokens), tuple(parents), tuple(paths), tuple(sources))
