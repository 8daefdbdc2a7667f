"""Keys and values of recent prompts, reused by later prompts that begin the same way.

Requests to one application share a system prompt and a chat template, and each turn of a
conversation re-sends the turns before it. The keys and values of a position depend only on
the tokens up to it, so a new prompt that begins with the first p tokens of a stored one can
copy their keys and values into its cache row instead of computing them (vLLM's automatic
prefix caching, SGLang's radix cache). The copy is a few hundred kilobytes; the computation it
replaces is most of a short prompt's first pass (the default model's dev prompts: 36-42 tokens,
24 of them its chat template and system prompt).

A copied prefix was computed in another pass, so it can differ from one computed in the
request's own pass in the last bits, as any two passes of different sizes do.

Stored: each prompt whose first pass ran in a batch, and each finished stream's prompt and
answer (what its row holds: all but the last token), which replaces the prompt's entry; a
stored sequence that begins a newer one is dropped for it. Least recently used first out, up
to `max_bytes` of keys and values in all (layers x 2 x kv_heads x head_dim x dtype bytes a
position: 46 KB for SmolLM2-135M in float32, 23 KB in bfloat16; the server's default budget
holds four of the model's full contexts, so that a long document or system prompt is reused
whole).

Entries are keyed by tenant (`Generation.tenant`): a prompt reuses only its own tenant's
prefixes, so the time to first token cannot tell one caller whether another sent a prompt
(a shared system prompt still hits among one tenant's requests). Tenants share the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.tenant_index import SHARED_TENANT


@dataclass(frozen=True, slots=True)
class Prefix:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]


class PrefixCache:
    def __init__(self, max_bytes: int, min_match: int = 8) -> None:
        self.max_bytes = max_bytes
        self.min_match = min_match
        # By (tenant, tokens), least recently used first.
        self._prefixes: OrderedDict[tuple[str, tuple[int, ...]], Prefix] = OrderedDict()
        self._stored = 0  # bytes held

    @property
    def stored_bytes(self) -> int:
        return self._stored

    def __len__(self) -> int:
        return len(self._prefixes)

    def match(
        self, tokens: Sequence[int], tenant: str = SHARED_TENANT
    ) -> tuple[Prefix | None, int]:
        """The tenant's stored prefix sharing the longest beginning with tokens, and that
        length (None, 0 when no stored one of the tenant's shares `min_match` tokens)."""
        best, length = None, 0
        if len(tokens) < self.min_match:
            return None, 0
        wanted = tuple(tokens)
        for (owner, _), prefix in self._prefixes.items():
            shared = _shared_length(prefix.tokens, wanted) if owner == tenant else 0
            if shared > length:
                best, length = prefix, shared
        if length < self.min_match or best is None:
            return None, 0
        self._prefixes.move_to_end((tenant, best.tokens))
        return best, length

    def copy_into(self, cache: SlotCache, row: int, prefix: Prefix, length: int) -> None:
        """Write the first `length` positions of a matched prefix into cache row `row`."""
        keys = [tensor[:, :length] for tensor in prefix.keys]
        values = [tensor[:, :length] for tensor in prefix.values]
        cache.write(row, keys, values)

    def store(
        self, cache: SlotCache, row: int, tokens: Sequence[int], tenant: str = SHARED_TENANT
    ) -> None:
        """Keep the keys/values of `tokens`, the first len(tokens) positions of cache row `row`,
        for `tenant`'s later prompts."""
        key = tuple(tokens)
        size = len(key) * cache.bytes_per_position
        if len(key) < self.min_match or size > self.max_bytes:
            return
        for owner, stored in list(self._prefixes):
            if owner != tenant:
                continue
            if stored[: len(key)] == key:  # already held, as it is or in a longer sequence
                self._prefixes.move_to_end((owner, stored))
                return
            if key[: len(stored)] == stored:  # the new one holds it all
                del self._prefixes[owner, stored]
                self._stored -= len(stored) * cache.bytes_per_position
        while self._stored + size > self.max_bytes:
            _, evicted = self._prefixes.popitem(last=False)
            self._stored -= len(evicted.tokens) * cache.bytes_per_position
        keys, values = cache.read(row, len(key))
        self._prefixes[tenant, key] = Prefix(key, keys, values)
        self._stored += size


def _shared_length(stored: tuple[int, ...], tokens: tuple[int, ...]) -> int:
    """The length of the longest common beginning: a binary search over slice comparisons,
    which run in C (a Python loop over a 4k-token prompt per stored entry would not)."""
    low, high = 0, min(len(stored), len(tokens))  # stored[:low] == tokens[:low] holds
    while low < high:
        middle = (low + high + 1) // 2
        if stored[:middle] == tokens[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
