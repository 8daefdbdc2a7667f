"""How a packed pass's queries are laid out for attention: the 4D mask and the query grid.

A pass (engine.packed_pass) packs the new tokens of all its rows into one sequence; attention
then lays the queries out as [rows, widest row] over the rows' cache (`Packing`), with a 4D
mask that lets row r's query at offset w see keys 0 .. length_r + w and nothing else
(`attention_mask`), so padding and stale positions past a row's length are never read. A row
may hold a token tree: its nodes see the row's cache and their own ancestors. The Packing also
carries the target's Kernels, which is how attention knows the kernel choice of the model it
runs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kenspec.server.engine.kernels import Kernels


def attention_mask(
    positions: torch.Tensor,
    kv_length: int,
    dtype: torch.dtype,
    trees: Sequence[tuple[int, int, Sequence[int]]] = (),
) -> torch.Tensor:
    """Additive 4D mask [n, 1, width, kv_length]: query at position p sees keys 0..p.

    trees: (row, length, parents) for rows holding a token tree: that row's query w sees the
    row's first `length` keys and, of its new tokens, only its ancestors and itself
    (parents[w]: the index of w's parent among the row's new tokens, -1 for none).

    Example: positions [[3, 4]] -> row 0 sees keys 0..3 at offset 0 and 0..4 at offset 1.
    """
    keys = torch.arange(kv_length, device=positions.device)
    visible = keys[None, None, :] <= positions[:, :, None]
    for row, length, parents in trees:
        visible[row, :, length:] = False
        block = _ancestors(parents).to(positions.device)
        visible[row, : len(parents), length : length + len(parents)] = block
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def _ancestors(parents: Sequence[int]) -> torch.Tensor:
    """[nodes, nodes] bool, on the host: node q sees node k when k is q or an ancestor of q
    (built in Python and copied once: element writes on an accelerator are a launch each)."""
    seen = [[False] * len(parents) for _ in parents]
    for query in range(len(parents)):
        for node in _path(parents, query):
            seen[query][node] = True
    return torch.tensor(seen, dtype=torch.bool)


def _path(parents: Sequence[int], node: int) -> list[int]:
    """`node`'s ancestors from the root down, then `node` (parents[n]: n's parent, -1: none)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@dataclass(frozen=True, slots=True)
class Packing:
    """How a packed pass's queries are laid out for attention: [rows, width] over the cache."""

    slots: torch.Tensor  # [rows, width]: packed index of row r's w-th token (padding: its last)
    tokens: torch.Tensor  # [tokens]: each packed token's index in the flattened [rows * width]
    mask: torch.Tensor  # [rows, 1, width, kv_length], additive (see attention_mask)
    grid: torch.Tensor | None = None  # [rows, width]: row r's length + w (see attention_mask)
    # (row, length, depths) per row holding a token tree: its new tokens' positions are
    # length + depth, not their slots' length + w
    trees: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # (row, query, key offset, slot offset): in a token tree, the query's keys in the order a
    # sequence gives them (its ancestors by depth, itself, then the rest) where it differs
    # from the slots' order; offsets from the row's length (see tree_key_order)
    reordered: tuple[tuple[int, int, int, int], ...] = ()
    # The target's choice of kernels, read by its attention (engine.attention)
    kernels: Kernels = field(default_factory=Kernels)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask
    # made once per pass for invariant_attention, by (kv_heads, group, rows, keys)
    _orders: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (id of the mask, kv_heads, group, rows, keys) -> (the mask, kept so its id stays its
    # own; the mask padded)
    _padded_masks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    @property
    def windows(self) -> frozenset[int]:
        """The sliding windows the pass's layers asked masks for."""
        return frozenset(self._windowed)

    def windowed_mask(self, window: int) -> torch.Tensor:
        """`mask` where a query at position p also sees no key at or before p - window
        (transformers' sliding window: the key and the window - 1 keys before it)."""
        mask = self._windowed.get(window)
        if mask is None:
            queries, keys = self._positions()
            outside = (keys[:, None, :] <= queries[:, :, None] - window)[:, None]
            mask = self.mask.masked_fill(outside, torch.finfo(self.mask.dtype).min)
            self._windowed[window] = mask
        return mask

    def sequence_order(
        self, kv_heads: int, group: int, rows: int, keys: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Flat indices (in sequence order, in slot order) into invariant_attention's scores
        [rows * kv_heads, `rows` query rows (a kv head's queries, padded), `keys`], for each
        tree query whose keys the slots put in another order than a sequence would (None: no
        such query): scores[in_sequence] = scores[in_slots] puts them in sequence order."""
        if not self.reordered:
            return None
        order = self._orders.get((kv_heads, group, rows, keys))
        if order is None:
            width = self.slots.shape[1]
            lengths = {row: length for row, length, _ in self.trees}
            entries = torch.tensor(
                [(r, w, lengths[r] + key, lengths[r] + slot) for r, w, key, slot in self.reordered]
            )
            row, query, in_sequence, in_slots = (entries[:, None, i] for i in range(4))
            head = torch.arange(kv_heads * group)[None]  # kv head h // group, h % group in it
            at = ((row * kv_heads + head // group) * rows + head % group * width + query) * keys
            sequence, slots = ((at + c).reshape(-1) for c in (in_sequence, in_slots))
            order = (sequence.to(self.mask.device), slots.to(self.mask.device))
            self._orders[kv_heads, group, rows, keys] = order
        return order

    def padded_mask(
        self, mask: torch.Tensor, kv_heads: int, group: int, rows: int, keys: int
    ) -> torch.Tensor:
        """`mask` (this pass's, or a windowed one) as invariant_attention adds it to its scores:
        float32 [rows * kv_heads, `rows` query rows (a kv head's queries, padded), `keys`],
        -inf past the pass's keys, 0 in the padding rows; made once per pass."""
        cache_key = (id(mask), kv_heads, group, rows, keys)
        kept = self._padded_masks.get(cache_key)
        if kept is not None and kept[0] is mask:
            return kept[1]
        n, _, width, kv_length = mask.shape
        padded = torch.full(
            (n, kv_heads, rows, keys), float("-inf"), dtype=torch.float32, device=mask.device
        )
        padded[:, :, group * width :] = 0.0  # padding queries: finite, never read
        grouped = padded[:, :, : group * width].view(n, kv_heads, group, width, keys)
        grouped[..., :kv_length] = mask[:, :, None].float()
        padded = padded.view(n * kv_heads, rows, keys)
        self._padded_masks[cache_key] = (mask, padded)
        return padded

    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of each row's queries [rows, width] and cache slots [rows, kv_length]:
        a slot's own index, but for a token tree's new tokens, length + depth."""
        if self.grid is None:
            raise ValueError("this packing has no positions for a sliding-window mask")
        rows, kv_length = self.mask.shape[0], self.mask.shape[-1]
        if not self.trees:
            return self.grid, torch.arange(kv_length, device=self.grid.device).expand(rows, -1)
        queries = self.grid.clone()
        keys = torch.arange(kv_length, device=self.grid.device).repeat(rows, 1)
        for row, length, depths in self.trees:
            tree = length + torch.tensor(depths, device=self.grid.device)
            queries[row, : len(depths)] = tree
            keys[row, length : length + len(depths)] = tree
        return queries, keys


def tree_key_order(row: int, parents: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(row, query, key, slot) for each of a tree's queries whose keys, put in the order a
    sequence of its ancestors gives them (ancestors by depth, itself, then the row's other
    new tokens in slot order), are not in slot order: that key offset holds that slot's key.

    Example: parents [-1, 0, 0] (a root and two children): query 2's ancestors are slots 0
    and 2, so key 1 is slot 2 and key 2 is slot 1: [(row, 2, 1, 2), (row, 2, 2, 1)]."""
    entries: list[tuple[int, int, int, int]] = []
    for query in range(len(parents)):
        path = _path(parents, query)
        on_path = set(path)
        order = path + [slot for slot in range(len(parents)) if slot not in on_path]
        entries += [(row, query, key, slot) for key, slot in enumerate(order) if key != slot]
    return entries
