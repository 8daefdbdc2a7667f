"""Drafting from the request's own context, combined with a static draft (KenLM).

Prompt lookup (transformers' PromptLookupCandidateGenerator, vLLM's NgramProposer): when the
last n tokens of prompt + output occurred before, propose what followed them then. It is
strong where the output copies or paraphrases its input (rewriting, summaries, code edits,
RAG) and where the output repeats itself; a static n-gram is strong on the target's habitual
phrasing; an index of past answers (`SuffixIndex`, or a tenant's view of the server's) is
strong where answers recur. Each round offers a chain per source: the context continuation
when the longest suffix match is at least `min_match` tokens (1 by default: it gave the most
tokens per round on every prompt set, replaying the default model's greedy answers;
docs/design.md, "Drafts"), the index's, and the static draft's; a matched chain that runs
out is continued by the static draft (llama.cpp's ngram-cache combines a context and a static
cache the same way). The longest match leads, the others ride along as alternatives that the
speculator weighs by measured acceptance. With a learned head (engine.draft_head), one more
chain comes from the target's own hidden state at the row that chose the last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kenspec.server.engine.draft import (
    Branching,
    Candidates,
    Chain,
    DraftSession,
    StaticDraft,
    StaticSession,
)
from kenspec.server.engine.draft_head import DraftHead, HeadChain
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.suffix_index import SuffixIndex
from kenspec.server.engine.tenant_index import TenantView

HEAD_AFTER_MATCH = 4  # no head chain after a context match this long (accepted ~95% already)
HEAD_BRANCHES = 2  # in a token tree, the head's next best first tokens offered as branches
RECYCLED_MIN_PROB = 0.1  # a recycled chain stops where its path probability falls below this
TREE_MIN_DRAFT_PROB = 0.05  # the static chain's gate in a token tree (see _static_chain)
LONG_DRAFT_TOKENS = 16  # the most a chain after a long exact match drafts (see propose)


class ContextIndex:
    """Latest occurrence of every n-gram (min_match <= n <= max_match) that has a continuation.

    Updated once per appended token in O(max_match); never rebuilt. Maps an n-gram to the
    position right after its most recent earlier occurrence, where its continuation starts.
    """

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            end = len(self.tokens)  # the n-grams ending here are continued by `token`
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def may_match(self, min_match: int) -> bool:
        """Whether `continuation` may give a match of at least `min_match` tokens: the current
        suffix's n-gram of that length (within the indexed lengths) occurred before."""
        n = min(max(min_match, self.min_match), self.max_match)
        return len(self.tokens) >= max(n, min_match) and tuple(self.tokens[-n:]) in self._next

    def continuation(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest earlier match of the current suffix, and
        the match length (0 when nothing of at least min_match tokens matched)."""
        end = len(self.tokens)
        for n in range(min(self.max_match, end), self.min_match - 1, -1):
            start = self._next.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return self.tokens[start : start + k], n
        return [], 0


class ContextDraft:
    """Chains from the request's own context, an index of past answers (`suffix`, if
    any) and the static draft (if any), the longest match first (see module doc)."""

    def __init__(
        self,
        static: StaticDraft | None,
        *,
        min_match: int = 1,
        max_match: int = 16,
        name: str = "",
        suffix: SuffixIndex | TenantView | None = None,
        recycled: RecycledPredictions | None = None,
        recycled_min_prob: float = RECYCLED_MIN_PROB,
        long_draft_tokens: int = LONG_DRAFT_TOKENS,
        branches: int = 0,
        head: DraftHead | None = None,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.static = static
        self.min_match = min_match
        self.max_match = max_match
        self.suffix = suffix
        self.recycled = recycled
        self.recycled_min_prob = recycled_min_prob
        self.long_draft_tokens = long_draft_tokens
        self.branches = branches  # n-best alternatives at the root, for token trees (0: none)
        self.head = head  # a learned head over the target's hidden states (engine.draft_head)
        parts = ["context", *(["suffix"] if suffix is not None else [])]
        parts += ["recycled"] if recycled is not None else []
        parts += [static.name] if static is not None else []
        parts += ["head"] if head is not None else []
        self._name = name or "+".join(parts)

    @property
    def name(self) -> str:
        return self._name

    def start(
        self,
        prompt_ids: Sequence[int],
        *,
        suffix: SuffixIndex | TenantView | None = None,
        recycled: RecycledPredictions | None = None,
    ) -> ContextSession:
        """A session; `suffix` and `recycled` in place of the draft's own index and table (a
        tenant's view of the index, a tenant's table)."""
        index = ContextIndex(self.min_match, self.max_match)
        index.extend(prompt_ids)
        static = self.static.start(prompt_ids) if self.static is not None else None
        suffix = suffix if suffix is not None else self.suffix
        return ContextSession(self, index, static, suffix, recycled)


class ContextSession(DraftSession, Branching):
    """One generation's context index and static session; the rest is its draft's."""

    def __init__(
        self,
        draft: ContextDraft,
        index: ContextIndex,
        static: StaticSession | None,
        suffix: SuffixIndex | TenantView | None = None,
        recycled: RecycledPredictions | None = None,
    ) -> None:
        self._index = index
        self._static = static
        self._suffix = suffix
        # a tenant's table where the draft has recycled predictions on at all
        self._recycled = draft.recycled if recycled is None or draft.recycled is None else recycled
        self._recycled_min_prob = draft.recycled_min_prob
        self._long = draft.long_draft_tokens
        self._branches = draft.branches
        self._head = draft.head
        # the head's chain after the token at _head_at - 1 (drafted in `observe`)
        self._head_found: HeadChain | None = None
        self._head_at = -1

    def propose(self, k: int) -> Candidates:
        """The chain of the longest match (own context, or the suffix index if longer; a tie
        goes to the request's own) first, else the static draft's; then the other sources'
        chains, for the speculator to weigh by their measured acceptance.

        A matched chain drafts as far as its match is long, up to `long_draft_tokens` (at
        least k): after 12 tokens that matched exactly, the next 12 are likely to as well
        (SuffixDecoding's match-proportional speculation; the speculator cuts chains to the
        round's cap)."""
        chains = self._matched_chains(k)
        if self._static is not None:
            chains.append((0, self._labelled(self._static_chain(k))))
        chains += [(0, chain) for chain in self._head_chains(k)]
        # In a token tree, recycled predictions come in below every node (`expand`); their
        # chain as well would count the same prediction twice, as if two sources agreed.
        if self._recycled is not None and not self._branches:
            found, probs = self._recycled.chain(self._index.tokens[-1], k, self._recycled_min_prob)
            if found:
                chains.append((0, Chain(tuple(found), tuple(probs), RECYCLED)))
        chains += [(0, chain) for chain in self._alternatives_at_root()]
        if not chains:
            return (Chain(source=_source("context", 0)),)
        chains.sort(key=lambda chain: -chain[0])  # stable: the context before an equal suffix
        first, *others = (chain for _, chain in chains)
        return (first, *(chain for chain in others if len(chain)))

    def copies(self, k: int, min_match: int) -> Candidates:
        """The matched chains (own context, suffix index) of matches at least `min_match`
        tokens long, the longest first (a tie: the request's own)."""
        chains = self._matched_chains(k, min_match)
        chains.sort(key=lambda pair: -pair[0])
        return tuple(chain for _, chain in chains)

    def may_copy(self, min_match: int) -> bool:
        """Whether `copies(k, min_match)` may find a chain: the context's last `min_match`
        tokens occurred before, in the request's own context or the index of past answers (a
        dictionary lookup each: microseconds, where building the copy costs ~0.3 ms)."""
        if self._index.may_match(min_match):
            return True
        return self._suffix is not None and self._suffix.may_match(self._index.tokens, min_match)

    def _matched_chains(self, k: int, min_match: int = 1) -> list[tuple[int, Chain]]:
        """(match length, chain) of the request's own context and of the suffix index, of
        matches at least `min_match` tokens long (a shorter one's chain is not built)."""
        chains: list[tuple[int, Chain]] = []
        longest = max(k, self._long)
        tokens, matched = self._index.continuation(longest)
        if matched >= max(1, min_match):
            reach = self._reach(k, matched)
            chains.append(
                (matched, self._chain(tokens[:reach], reach, _source("context", matched)))
            )
        if self._suffix is not None:
            found, length = self._suffix.propose(self._index.tokens, longest, min_match)
            if found:
                reach = self._reach(k, length)
                chains.append(
                    (length, self._chain(found[:reach], reach, _source("suffix", length)))
                )
        return chains

    @property
    def wants_features(self) -> bool:
        return self._head is not None

    def observe(self, feature: torch.Tensor) -> None:
        """The target's hidden state at the row that chose the last token: the head drafts
        its chain now, on the engine thread, for the next round's proposal.

        Not at `propose`, which runs on the draft thread: kenspec's kernels called from a
        second thread start a second OpenMP team, and with more OpenMP threads than cores
        libgomp's workers stop spinning between parallel regions, so every later pass, plain
        ones included, ran ~30% slower (measured: docs/design.md, "A learned draft head").
        None after a context match of HEAD_AFTER_MATCH tokens or more."""
        tokens = self._index.tokens
        self._head_at = len(tokens)
        self._head_found = None
        if self._head is None or self._index.continuation(1)[1] >= HEAD_AFTER_MATCH:
            return
        self._head_found = self._head.chain(
            feature, tokens[-1], self._head.max_tokens,
            alternatives=HEAD_BRANCHES if self._branches else 0,
        )  # fmt: skip

    def _head_chains(self, k: int) -> list[Chain]:
        """The learned head's chain (drafted in `observe`) cut to k, and in a token tree its
        next best first tokens as one-token chains; none before the first round, or when the
        stream moved on since (tokens given ahead by a grammar). Tokens are labelled by the
        head's probability decile: acceptance is learned per decile, as for n-gram guesses."""
        found = self._head_found
        if found is None or self._head_at != len(self._index.tokens):
            return []
        chains = [
            Chain((token,), (p,), HEAD, (Source("head", _decile(p)),))
            for token, p in found.alternatives
        ]
        if found.tokens:
            drafted, probs = found.tokens[:k], found.probs[:k]
            labels = tuple(Source("head", _decile(p)) for p in probs)
            chains.insert(0, Chain(drafted, probs, HEAD, labels if self._branches else ()))
        return chains

    def branching(self) -> Branching:
        """A token tree branches below any node on the target's recycled predictions."""
        return self

    @property
    def root_token(self) -> int:
        """The stream's last token (the pending one): a token tree's root."""
        return self._index.tokens[-1]

    def expand(self, token: int) -> list[tuple[int, Source]]:
        """Candidate children of a tree node whose token is `token`: the target's recycled top
        next tokens after it, each labelled by its probability's decile (acceptance is learned
        per decile: the table's probabilities were the target's in another context)."""
        if self._recycled is None:
            return []
        return [
            (following, Source("recycled", _decile(probability)))
            for following, probability in self._recycled.next_tokens(token)
            if probability >= self._recycled_min_prob
        ]

    def _static_chain(self, k: int) -> Chain:
        """The static draft's chain; for a token tree gated at TREE_MIN_DRAFT_PROB only, not
        at the draft's own min_draft_prob (tuned for chains): the tree's path probability,
        learned per n-gram probability decile, decides how far it is worth verifying."""
        assert self._static is not None
        return self._static.chain(k, TREE_MIN_DRAFT_PROB if self._branches else None)

    def _labelled(self, chain: Chain) -> Chain:
        """For a token tree, the static chain's tokens each labelled by their n-gram
        probability's decile, like its n-best alternatives: acceptance is learned per decile."""
        if not self._branches or not chain.confidences:
            return chain
        labels = tuple(Source("ngram", _decile(p)) for p in chain.confidences)
        return replace(chain, token_sources=labels)

    def _alternatives_at_root(self) -> list[Chain]:
        """The static draft's next best tokens after its first, one-token chains labelled by
        probability decile, for a token tree to branch on."""
        if not self._branches or self._static is None:
            return []
        return [
            Chain((token,), (probability,), Source("ngram", _decile(probability)))
            for token, probability in self._static.n_best(self._branches + 1)[1:]
        ]

    def _reach(self, k: int, matched: int) -> int:
        """How far a chain after a `matched`-token exact match drafts: k, or further when the
        match is longer, up to the long-draft cap."""
        return max(k, min(matched, self._long))

    def _chain(self, tokens: list[int], k: int, source: Source) -> Chain:
        """A matched continuation, which the static draft continues where it runs out (the
        earlier occurrence runs into the present, or an answer ended)."""
        if self._static is not None and len(tokens) < k:
            tokens = [*tokens, *self._static.chain_after(tokens, k - len(tokens)).tokens]
        return Chain(tuple(tokens), tuple(1.0 for _ in tokens), source)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._index.extend(token_ids)
        if self._static is not None:
            self._static.extend(token_ids)


RECYCLED = Source("recycled")  # the recycled predictions' chain (a tree's: per decile)
HEAD = Source("head")  # the learned head's chain (a tree's: per decile of its probability)
_BUCKETS = (16, 8, 5, 4, 3, 2, 1)


def _decile(probability: float) -> int:
    return min(9, max(0, int(probability * 10)))


def _source(kind: str, matched: int) -> Source:
    """Where a chain came from and its match length, bucketed (1, 2, 3, 4, 5-7, 8-15, 16+):
    the length predicts acceptance, so acceptance is tracked per bucket. Replayed on the
    default model's greedy answers, per-token acceptance of the context draft after a 1-token
    match was 0.29-0.59 (by prompt set), 2: 0.56-0.79, 3: 0.65-0.82, 4 or more: 0.94-0.95."""
    return Source(kind, next((edge for edge in _BUCKETS if matched >= edge), 0))
