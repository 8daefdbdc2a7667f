"""The suffix index as callers see it: the seeded corpus, shared and read-only, and each
tenant's own learned answers, so that drafts never carry one caller's answers to another.

Drafts are observable: a stream reports each round's drafted and accepted counts, and a
suffix match drafts as far as it is long. Were every caller's answers in one index, a caller
could end a prompt with a guessed phrase and learn from the counts whether someone else's
answer went on with it, and could flood the index with long answers to evict what everyone
else drafts from. So (with scope `tenant`, the default):

- the seeded corpus (the draft folder's corpus.ids.gz) is one SuffixIndex every tenant reads;
  nothing learned is ever added to it, so no flood evicts it;
- each tenant (a bearer token's keyed hash, `server.security.tenant_of`; every caller is one
  tenant when the server has no tokens) learns into its own SuffixIndex, which drops its own
  oldest answers: the learned budget (`max_tokens` less the corpus) is split evenly among the
  tenants held, at most `max_tenants` of them, the least recently used dropped whole;
- a tenant drafts from the corpus and its own answers only (`view`).

The bound is honest: corpus + the sum of the tenants' indices <= max_tokens, since a new
tenant's arrival first shrinks every other tenant to the new share. With scope `shared`,
engines pass SHARED_TENANT for every request: one learned index with the whole budget.

Thread safety: a lock over the tenant table; each SuffixIndex has its own (adds on the engine
thread, lookups on the draft thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kenspec.server.engine.suffix_index import SuffixIndex, may_match, propose_across

SHARED_TENANT = "shared"  # every caller, when the server has no tokens or the scope is shared
MAX_TENANTS = 16  # tenants whose learned answers are kept (--suffix-index-tenants)
SEGMENTS_PER_SHARE = 8  # a tenant's share in about this many segments: eviction in eighths,
MIN_SEGMENT_TOKENS = 2_048  # but segments that hold a long answer whole with its lead,
MAX_SEGMENT_TOKENS = 65_536  # and no larger than a lone index's


class TenantSuffixIndex:
    """The seeded corpus and per-tenant learned answers, within one token bound."""

    def __init__(
        self,
        seeded: SuffixIndex | None = None,
        *,
        max_tokens: int = 1_000_000,
        max_tenants: int = MAX_TENANTS,
    ) -> None:
        if max_tenants < 1:
            raise ValueError(f"need max_tenants >= 1, got {max_tenants}")
        self.seeded = seeded if seeded is not None else SuffixIndex(max_tokens=0)
        self.max_tokens = max_tokens
        self.max_tenants = max_tenants
        self.learned_budget = max(0, max_tokens - self.seeded.tokens)
        self._learned: OrderedDict[str, SuffixIndex] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Token ids held: the corpus and every tenant's answers (separators included)."""
        with self._lock:
            learned = list(self._learned.values())
        return self.seeded.tokens + sum(index.tokens for index in learned)

    @property
    def tenants(self) -> list[str]:
        """The tenants whose answers are held, least recently used first."""
        with self._lock:
            return list(self._learned)

    def learned(self, tenant: str) -> SuffixIndex | None:
        """The tenant's own answers (None: none held)."""
        with self._lock:
            return self._learned.get(tenant)

    def share(self, tenants: int) -> int:
        """Each tenant's bound when `tenants` are held."""
        return self.learned_budget // max(1, tenants)

    def view(self, tenant: str) -> TenantView:
        """What `tenant` drafts from; a use that keeps its answers from the LRU drop."""
        with self._lock:
            if tenant in self._learned:
                self._learned.move_to_end(tenant)
        return TenantView(self, tenant)

    def forget(self, tenant: str) -> None:
        """Drop the tenant's answers (the others keep their shares: the bound still holds)."""
        with self._lock:
            self._learned.pop(tenant, None)

    def add(self, tenant: str, answer: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Learn a finished answer (after its prompt's end, see SuffixIndex.add) for `tenant`
        only; its own oldest answers go when it is over its share."""
        if len(answer) < 2 or self.learned_budget <= 0:
            return
        self._index_for(tenant).add(answer, prompt)

    def _index_for(self, tenant: str) -> SuffixIndex:
        """The tenant's index, made (and every other shrunk to the new share) if new."""
        with self._lock:
            index = self._learned.get(tenant)
            if index is not None:
                self._learned.move_to_end(tenant)
                return index
            if len(self._learned) >= self.max_tenants:
                self._learned.popitem(last=False)  # the least recently used tenant
            share = self.share(len(self._learned) + 1)
            segment = _segment_tokens(share)
            for other in self._learned.values():
                other.bound(share, segment)
            index = SuffixIndex(
                max_tokens=share,
                max_match=self.seeded.max_match,
                slots=self.seeded.slots,
                segment_tokens=segment,
                min_probability=self.seeded.min_probability,
            )
            self._learned[tenant] = index
            return index


class TenantView:
    """One tenant's drafts: the longest match in the seeded corpus or its own answers."""

    def __init__(self, indexes: TenantSuffixIndex, tenant: str) -> None:
        self._indexes = indexes
        self.tenant = tenant

    def propose(self, context: Sequence[int], k: int, min_match: int = 0) -> tuple[list[int], int]:
        """As SuffixIndex.propose, over the corpus then the tenant's answers (newer)."""
        return propose_across(self._indices(), context, k, min_match)

    def may_match(self, context: Sequence[int], min_match: int) -> bool:
        """As SuffixIndex.may_match, over the corpus and the tenant's answers."""
        return may_match(self._indices(), context, min_match)

    def _indices(self) -> tuple[SuffixIndex, ...]:
        """The corpus, then the tenant's answers if it has any (looked up at each call: the
        view learns as it serves)."""
        own = self._indexes.learned(self.tenant)
        return (self._indexes.seeded,) if own is None else (self._indexes.seeded, own)


def _segment_tokens(share: int) -> int:
    """A segment of a tenant's index (its eviction unit): an eighth of its share, at least
    MIN_SEGMENT_TOKENS (a smaller share is one segment), at most MAX_SEGMENT_TOKENS."""
    wanted = max(share // SEGMENTS_PER_SHARE, MIN_SEGMENT_TOKENS)
    return max(1, min(share, wanted, MAX_SEGMENT_TOKENS))
