"""A KV cache with one row per active sequence, for verifying many sequences in one pass.

Each row r holds a sequence whose first `length_r` positions are valid. A pass packs the new
tokens of all its rows into one sequence (row r contributing its own number of tokens, no
padding), so the linear layers, which dominate a CPU pass, see each token once. Each token's
keys and values go to its row at length_r, length_r + 1, ...; attention then lays the queries
out as [rows, widest row] over the rows' cache (`Packing`), with a 4D mask that lets row r's
query at offset w see keys 0 .. length_r + w and nothing else, so padding and stale positions
past a row's length are never read. Rolling back rejected drafts therefore copies nothing:
the caller's next pass just starts at the shorter length and overwrites them. This is the
slot layout of Orca/vLLM's iteration-level batching, kept dense because a CPU pass is
dominated by the weights, not by the few kilobytes of KV a row adds.

Rows in use are kept contiguous (0 .. n-1) so attention reads a view, never a gathered copy;
`move` relocates one row when another leaves. Memory grows by doubling the per-row capacity,
bounded by rows x max_length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

_MIN_CAPACITY = 256


class SlotCache:
    """Keys and values of up to `rows` sequences; duck-types the part of transformers' Cache
    a decoder layer calls (`update`), which is all a pass with explicit positions and a 4D
    mask needs."""

    def __init__(self, rows: int, max_length: int) -> None:
        if rows < 1:
            raise ValueError("a SlotCache needs at least one row")
        self.rows = rows
        self.max_length = max_length
        self.capacity = 0
        self._keys: list[torch.Tensor] = []  # per layer: [rows, kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._first = 0
        self._stop = 0
        self._batch_index: torch.Tensor | None = None  # [tokens]: row of each new token
        self._positions: torch.Tensor | None = None  # [tokens]: where each new token goes
        self._kv_length = 0

    def bind(self, first_row: int, packed: PackedPass) -> None:
        """Set where the next pass writes: its rows are first_row, first_row + 1, ..."""
        rows = packed.packing.slots.shape[0]
        if first_row < 0 or first_row + rows > self.rows:
            raise ValueError(f"rows {first_row}..{first_row + rows - 1} outside 0..{self.rows - 1}")
        self._kv_length = packed.kv_length
        if self._kv_length > self.max_length:
            raise ValueError(
                f"a pass needs {self._kv_length} positions; the cache holds {self.max_length}"
            )
        self._reserve(self._kv_length)
        self._first, self._stop = first_row, first_row + rows
        cache_positions = packed.cache_positions
        self._positions = packed.positions[0] if cache_positions is None else cache_positions
        self._batch_index = packed.token_rows + first_row

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys/values ([1, heads, tokens, dim]); return the bound rows'."""
        if self._positions is None or self._batch_index is None:
            raise RuntimeError("SlotCache.bind() must be called before a forward pass")
        if layer_idx == len(self._keys):
            self._allocate_layer(key_states, value_states)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        # Advanced indices in dims 0 and 2 put the indexed dim first: [tokens, heads, dim].
        keys[self._batch_index, :, self._positions] = key_states[0].transpose(0, 1)
        values[self._batch_index, :, self._positions] = value_states[0].transpose(0, 1)
        span = slice(self._first, self._stop)
        return keys[span, :, : self._kv_length], values[span, :, : self._kv_length]

    @torch.inference_mode()
    def move(self, source: int, destination: int, length: int) -> None:
        """Copy row source's first `length` positions into row destination."""
        if source == destination or length == 0:
            return
        for tensor in (*self._keys, *self._values):
            tensor[destination, :, :length] = tensor[source, :, :length]

    @torch.inference_mode()
    def relocate(self, row: int, moves: Sequence[tuple[int, int]]) -> None:
        """Copy positions of row `row`: (source, destination) pairs, all read before any is
        written (a token tree's accepted path, made contiguous)."""
        if not moves:
            return
        device = self._keys[0].device if self._keys else None
        sources = torch.tensor([source for source, _ in moves], device=device)
        destinations = torch.tensor([destination for _, destination in moves], device=device)
        for tensor in (*self._keys, *self._values):
            tensor[row, :, destinations] = tensor[row, :, sources]

    @property
    def bytes_per_position(self) -> int:
        """Bytes of keys and values one position of one row takes (0 before the first pass)."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in (*self._keys, *self._values))

    @torch.inference_mode()
    def read(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s first `length` positions, per layer [kv_heads, length, dim]."""
        return (
            [tensor[row, :, :length].clone() for tensor in self._keys],
            [tensor[row, :, :length].clone() for tensor in self._values],
        )

    @torch.inference_mode()
    def write(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Put keys/values (as `read` returns them) at the first positions of row `row`."""
        length = keys[0].shape[1]
        self._reserve(length)
        for stored, new in zip((*self._keys, *self._values), (*keys, *values), strict=True):
            stored[row, :, :length] = new

    def _allocate_layer(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        def empty(like: torch.Tensor) -> torch.Tensor:
            _, heads, _, dim = like.shape
            shape = (self.rows, heads, self.capacity, dim)
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        self._keys.append(empty(key_states))
        self._values.append(empty(value_states))

    def _reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        capacity = max(_MIN_CAPACITY, self.capacity)
        while capacity < length:
            capacity *= 2
        capacity = min(capacity, self.max_length)

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            rows, heads, old, dim = tensor.shape
            bigger = tensor.new_zeros((rows, heads, capacity, dim))
            bigger[:, :, :old] = tensor
            return bigger

        self._keys = [grown(t) for t in self._keys]
        self._values = [grown(t) for t in self._values]
        self.capacity = capacity


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
        for query in range(len(parents)):
            node = query
            while node >= 0:  # itself, then its ancestors
                visible[row, query, length + node] = True
                node = parents[node]
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


@dataclass(frozen=True, slots=True)
class Packing:
    """How a packed pass's queries are laid out for attention: [rows, width] over the cache."""

    slots: torch.Tensor  # [rows, width]: packed index of row r's w-th token (padding: its last)
    tokens: torch.Tensor  # [tokens]: each packed token's index in the flattened [rows * width]
    mask: torch.Tensor  # [rows, 1, width, kv_length], additive (see attention_mask)


@dataclass(frozen=True, slots=True)
class PackedPass:
    """The inputs of one packed pass: every row's new tokens, one after another."""

    input_ids: torch.Tensor  # [1, tokens]
    positions: torch.Tensor  # [1, tokens]: each token's position in its row (rotary position)
    token_rows: torch.Tensor  # [tokens]: each token's row, counted from the pass's first row
    starts: list[int]  # where each row's tokens begin in the packed sequence
    kv_length: int
    packing: Packing
    # [tokens]: where each token's keys/values go in its row: its position, except in a tree,
    # where siblings share a position but not a slot (length + index among the row's tokens).
    cache_positions: torch.Tensor | None = None


def pack(
    lengths: Sequence[int],
    token_rows: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    pad_to: int = 0,
    parents: Sequence[Sequence[int] | None] | None = None,
) -> PackedPass:
    """Row i's tokens follow row i-1's; row i's first goes to position lengths[i] of its row.

    pad_to: pad the pass to at least this many tokens by repeating the last row's last token
    (scored, never read, overwritten by that row's next pass), for widths measured cheaper.
    parents: per row, None for a sequence, or a token tree over its tokens (parents[w]: the
    index of token w's parent in the row, -1 for the first): token w then takes position
    length + depth(w) and cache slot length + w, and attends to its ancestors only.

    Example: lengths [5, 9], rows [[a], [b, c]] -> input [[a, b, c]], positions [[5, 9, 10]],
    slots [[0, 0], [1, 2]] (row 0's padding repeats its token).
    """
    rows = [list(row) for row in token_rows]
    trees = [list(tree) if tree is not None else None for tree in (parents or [None] * len(rows))]
    if pad_to > sum(len(row) for row in rows):
        extra = pad_to - sum(len(row) for row in rows)
        if trees[-1] is not None:  # the padding follows the row's last token, as a sequence
            trees[-1] += range(len(rows[-1]) - 1, len(rows[-1]) - 1 + extra)
        rows[-1] += [rows[-1][-1]] * extra
    width = max(len(row) for row in rows)
    starts, ids, positions, slots_in_row, owners, slots, flat = [], [], [], [], [], [], []
    tree_rows: list[tuple[int, int, Sequence[int]]] = []
    for index, (length, row, tree) in enumerate(zip(lengths, rows, trees, strict=True)):
        start = len(ids)
        starts.append(start)
        ids += row
        slots_in_row += range(length, length + len(row))
        if tree is None:
            positions += range(length, length + len(row))
        else:
            depth: list[int] = []
            for parent in tree:
                depth.append(0 if parent < 0 else depth[parent] + 1)
            positions += [length + d for d in depth]
            tree_rows.append((index, length, tree))
        owners += [index] * len(row)
        slots.append([start + min(w, len(row) - 1) for w in range(width)])
        flat += range(index * width, index * width + len(row))
    grid = torch.tensor(
        [[length + w for w in range(width)] for length in lengths], dtype=torch.long, device=device
    )
    kv_length = int(grid.max()) + 1

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    mask = attention_mask(grid, kv_length, dtype, tree_rows)
    packing = Packing(tensor(slots).view(len(rows), width), tensor(flat), mask)
    return PackedPass(
        input_ids=tensor(ids)[None],
        positions=tensor(positions)[None],
        token_rows=tensor(owners),
        starts=starts,
        kv_length=kv_length,
        packing=packing,
        cache_positions=tensor(slots_in_row) if tree_rows else None,
    )


PACKED_ATTENTION = "kenspec_packed"


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packing: Packing | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention for a packed pass: query [1, heads, tokens, dim] against the bound
    rows' keys/values [rows, kv_heads, kv_length, dim] (SlotCache.update). Without a packing
    (transformers' own generate on the same model) this is transformers' SDPA attention."""
    if packing is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, width = packing.slots.shape
    laid_out = query[0][:, packing.slots].transpose(0, 1)  # [rows, heads, width, dim]
    out = F.scaled_dot_product_attention(
        laid_out,
        key,
        value,
        attn_mask=packing.mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(rows * width, heads, dim)
    return out[packing.tokens][None], None  # [1, tokens, heads, dim]


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # for transformers' own generate
