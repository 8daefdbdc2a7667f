"""The draft tree: the one thing drafting hands to verification.

Node i is token `tokens[i]`, a child of node `parents[i]` (-1: of the pending token, the
root); parents come before their children, so the first n nodes of a tree are a tree too (a
batch that can afford only n of them keeps a prefix). A chain is the tree whose every node's
parent is the node before it.

`probs[i]` is node i's path probability: the chance that verification accepts it (the product
of its ancestors' conditional acceptance and its own), which is also the expected number of
accepted tokens it adds, so the batch spends a pass's slots on the nodes with the highest.
`sources[i]` says who proposed node i (one or more sources), for acceptance learned per source.

Example: a chain [5, 7] from the request's context after a 3-token match, and KenLM's
alternative 9 at the root:

    DraftTree(tokens=(5, 7, 9), parents=(-1, 0, -1), probs=(0.8, 0.6, 0.1),
              sources=((Source("context", 3),), (Source("context", 3),), (Source("ngram", 1),)))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Source:
    """Who proposed a draft token, and in which bucket its acceptance is learned: the match
    length for a context or suffix match, a confidence decile for an n-gram guess (0: none)."""

    kind: str
    bucket: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.bucket}" if self.bucket else self.kind

    @classmethod
    def parse(cls, text: str) -> Source:
        """The Source that str() wrote: "context:3" -> Source("context", 3)."""
        kind, _, bucket = text.partition(":")
        return cls(kind, int(bucket) if bucket else 0)


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1: a child of the root), for parents that come before children."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def chain_parents(count: int) -> tuple[int, ...]:
    """The parents of a chain of `count` drafts: each follows the one before (-1: the root)."""
    return tuple(range(-1, count - 1))


@dataclass(frozen=True, slots=True)
class DraftTree:
    """Draft tokens as a tree over the pending token (see the module doc)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    sources: tuple[tuple[Source, ...], ...] = ()

    def __post_init__(self) -> None:
        count = len(self.tokens)
        if not len(self.parents) == len(self.probs) == len(self.sources) == count:
            raise ValueError(
                f"a draft tree needs one parent, probability and source set per token: "
                f"{count} tokens, {len(self.parents)} parents, {len(self.probs)} probs, "
                f"{len(self.sources)} sources"
            )
        for node, parent in enumerate(self.parents):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} does not come before it")

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float], source: Source) -> DraftTree:
        """A tree without branches: each token follows the one before, all from `source`."""
        return cls(
            tuple(tokens), chain_parents(len(tokens)), tuple(probs), ((source,),) * len(tokens)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def prefix(self, count: int) -> DraftTree:
        """The first `count` nodes (a tree too: parents come first)."""
        if count >= len(self):
            return self
        return DraftTree(
            self.tokens[:count], self.parents[:count], self.probs[:count], self.sources[:count]
        )

    def within(self, nodes: int, depth: int) -> DraftTree:
        """The first `nodes` nodes, less those deeper than `depth` (a tree too: a kept node's
        parent is shallower, so kept). For a chain, its first min(nodes, depth) tokens."""
        first = self.depths()[:nodes]
        keep = [node for node, node_depth in enumerate(first) if node_depth <= depth]
        if len(keep) == len(first):
            return self.prefix(nodes)
        return self.subset(keep)

    def subset(self, keep: Sequence[int]) -> DraftTree:
        """The nodes `keep` (ascending, each one's parent kept too), renumbered in order."""
        renumbered = {-1: -1, **{old: new for new, old in enumerate(keep)}}
        return DraftTree(
            tuple(self.tokens[node] for node in keep),
            tuple(renumbered[self.parents[node]] for node in keep),
            tuple(self.probs[node] for node in keep),
            tuple(self.sources[node] for node in keep),
        )

    def after(self, chain: DraftTree) -> DraftTree:
        """`chain` (a chain), then this tree below its last node: what this tree's root
        children follow is then the chain's last token."""
        if not chain:
            return self
        if not self:
            return chain
        below = len(chain) - 1
        return DraftTree(
            chain.tokens + self.tokens,
            chain.parents + tuple(below if p < 0 else p + len(chain) for p in self.parents),
            chain.probs + self.probs,
            chain.sources + self.sources,
        )

    def below(self, count: int) -> DraftTree:
        """What `after` put below a chain of `count` nodes at the front: the rest, renumbered,
        the chain's last node's children the root's."""
        if count == 0:
            return self
        return DraftTree(
            self.tokens[count:],
            tuple(-1 if parent < count else parent - count for parent in self.parents[count:]),
            self.probs[count:],
            self.sources[count:],
        )

    def depths(self) -> list[int]:
        """Each node's depth (1: a child of the root)."""
        return depths(self.parents)

    def reached(self, path: Sequence[int]) -> list[int]:
        """The nodes a walk that accepted `path` tried: the children of the root and of every
        accepted node (each was accepted or rejected; the others were never looked at)."""
        on_path = {-1, *path}
        return [node for node, parent in enumerate(self.parents) if parent in on_path]


NO_DRAFTS = DraftTree()
