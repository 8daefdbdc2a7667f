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

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

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

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """What transformers asks a cache for positions and masks it was not given. kenspec
        gives every pass both (each row has a length of its own), so no model reads this but
        as a default (OPT asks for it whether or not it was given positions)."""
        return 0

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
    path = []
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
    # from the slots' order; offsets from the row's length (see _sequence_order)
    reordered: tuple[tuple[int, int, int, int], ...] = ()
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask
    _invariant: dict[tuple, object] = field(default_factory=dict)  # see invariant_attention

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
        order = self._invariant.get(("order", kv_heads, group, rows, keys))
        if order is None:
            width = self.slots.shape[1]
            lengths = {row: length for row, length, _ in self.trees}
            entries = torch.tensor(
                [(r, w, lengths[r] + key, lengths[r] + slot) for r, w, key, slot in self.reordered]
            )
            row, query, in_sequence, in_slots = (entries[:, None, i] for i in range(4))
            head = torch.arange(kv_heads * group)[None]  # kv head h // group, h % group in it
            at = ((row * kv_heads + head // group) * rows + head % group * width + query) * keys
            order = tuple(
                (at + column).reshape(-1).to(self.mask.device) for column in (in_sequence, in_slots)
            )
            self._invariant[("order", kv_heads, group, rows, keys)] = order
        return order  # type: ignore[return-value]

    def padded_mask(self, mask: torch.Tensor, kv_heads: int, group: int, rows: int, keys: int):
        """`mask` (this pass's, or a windowed one) as invariant_attention adds it to its scores:
        float32 [rows * kv_heads, `rows` query rows (a kv head's queries, padded), `keys`],
        -inf past the pass's keys, 0 in the padding rows; made once per pass."""
        cache_key = ("mask", id(mask), kv_heads, group, rows, keys)
        kept = self._invariant.get(cache_key)
        if kept is not None and kept[0] is mask:  # type: ignore[index]
            return kept[1]  # type: ignore[index]
        n, _, width, kv_length = mask.shape
        padded = torch.full(
            (n, kv_heads, rows, keys), float("-inf"), dtype=torch.float32, device=mask.device
        )
        padded[:, :, group * width :] = 0.0  # padding queries: finite, never read
        grouped = padded[:, :, : group * width].unflatten(2, (group, width))
        grouped[..., :kv_length] = mask[:, :, None].float()
        padded = padded.view(n * kv_heads, rows, keys)
        self._invariant[cache_key] = (mask, padded)  # the mask kept: its id stays its own
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
    tree_depths: list[tuple[int, int, tuple[int, ...]]] = []
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
            tree_depths.append((index, length, tuple(depth)))
        owners += [index] * len(row)
        slots.append([start + min(w, len(row) - 1) for w in range(width)])
        flat += range(index * width, index * width + len(row))
    grid_values = [length + w for length in lengths for w in range(width)]
    kv_length = max(lengths) + width  # the largest position + 1, known without the device
    columns = [grid_values, slots_in_row, [s for row in slots for s in row], flat, ids]
    columns += [positions, owners]
    grid, cache_slots, slot_grid, packed_flat, packed_ids, packed_positions, packed_owners = (
        _to_device(columns, device)
    )
    grid = grid.view(len(rows), width)
    mask = attention_mask(grid, kv_length, dtype, tree_rows)
    packing = Packing(
        slot_grid.view(len(rows), width),
        packed_flat,
        mask,
        grid,
        tuple(tree_depths),
        tuple(  # needed (and paid for) only where keys are summed in a fixed order
            entry
            for row, _, tree in (tree_rows if KERNELS.invariant else ())
            for entry in _sequence_order(row, tree)
        ),
    )
    return PackedPass(
        input_ids=packed_ids[None],
        positions=packed_positions[None],
        token_rows=packed_owners,
        starts=starts,
        kv_length=kv_length,
        packing=packing,
        cache_positions=cache_slots if tree_rows else None,
    )


def _sequence_order(row: int, parents: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(row, query, key, slot) for each of a tree's queries whose keys, put in the order a
    sequence of its ancestors gives them (ancestors by depth, itself, then the row's other
    new tokens in slot order), are not in slot order: that key offset holds that slot's key.

    Example: parents [-1, 0, 0] (a root and two children): query 2's ancestors are slots 0
    and 2, so key 1 is slot 2 and key 2 is slot 1: [(row, 2, 1, 2), (row, 2, 2, 1)]."""
    entries = []
    for query in range(len(parents)):
        path = _path(parents, query)
        on_path = set(path)
        order = path + [slot for slot in range(len(parents)) if slot not in on_path]
        entries += [(row, query, key, slot) for key, slot in enumerate(order) if key != slot]
    return entries


def _to_device(columns: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """The columns as int64 tensors on `device`: one host-to-device copy for a pass (from
    pinned memory, queued behind the device's work on an accelerator) instead of one
    blocking copy per tensor."""
    values = torch.tensor([value for column in columns for value in column], dtype=torch.long)
    if device.type == "cuda":
        values = values.pin_memory().to(device, non_blocking=True)
    elif values.device != device:
        values = values.to(device)
    return list(values.split([len(column) for column in columns]))


PACKED_ATTENTION = "kenspec_packed"


@dataclass(slots=True)
class AttentionKernels:
    """Which kernel a packed pass's attention takes (set at start-up: use_grouped)."""

    # (width, min_length), by width: a pass whose rows carry at most `width` queries (the
    # narrowest such entry) over at least `min_length` positions takes grouped_attention;
    # others, and passes wider than the widest entry (prefill chunks), take SDPA.
    grouped: tuple[tuple[int, int], ...] = ((16, 0),)
    # bf16/fp16 caches in grouped_attention: True, keys and values converted into float32
    # buffers and everything in float32; False, the products in the cache's dtype, in place.
    upcast: bool = True
    # Batch-invariant mode (engine.invariant): every pass takes invariant_attention, whose keys
    # are padded to one of `short_keys` (measured at start-up) or else to at least MIN_KEYS.
    invariant: bool = False
    short_keys: tuple[int, ...] = ()

    def takes_grouped(self, width: int, kv_length: int) -> bool:
        for max_width, min_length in self.grouped:
            if width <= max_width:
                return kv_length >= min_length
        return False


KERNELS = AttentionKernels()


def use_grouped(min_lengths: Mapping[int, int]) -> None:
    """{width: min_length}: passes of at most `width` queries per row (the narrowest such
    entry) over at least `min_length` positions take grouped_attention, the others SDPA.
    {16: 0}: grouped up to 16 queries per row at any length; {}: SDPA always."""
    KERNELS.grouped = tuple(sorted((w, max(0, n)) for w, n in min_lengths.items() if w > 0))


_REDUCED = (torch.bfloat16, torch.float16)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None = None,
    *,
    upcast: bool | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a few queries per row over long caches, as plain products over the cache.

    query [rows, heads, width, dim]; key/value [rows, kv_heads, kv_length, dim] (the bound
    rows' cache, views of [rows, kv_heads, capacity, dim] as SlotCache.update gives them),
    never expanded to `heads`; mask [rows, 1, width, kv_length], additive. Returns [rows,
    heads, width, dim] in the query's dtype, as SDPA would.

    Head h uses kv head h // group (transformers' layout), so a kv head's `group` query heads
    are consecutive: one product per (row, kv head) scores all of them, [group * width, dim] @
    [dim, kv_length]. Scores, mask and softmax are float32.

    float32 (BLAS): one batched product over (row, kv head) reads the cache in place (BLAS
    takes strided batches), and all is float32 math.

    bf16/fp16 (`upcast`, default KERNELS.upcast): the keys and values are first converted into
    float32 buffers kept from pass to pass (the conversion is a fifth to a quarter of this
    function's time on a CPU; new buffers would add page faults), then all is float32: exact
    float32 scores and sums, closer to a float64 reference than SDPA's CPU kernel, which
    rounds its probabilities to bf16. Without it, the products run on the cache in place in
    its dtype (oneDNN on CPUs: dense operands only, so one product per (row, kv head), each
    call costing some 20 us), and round their output: the scores to bf16 (8 bits: a score of
    10 is off by up to 0.02, its weight by 2%; about 4x SDPA's error), the probabilities too.
    That is faster past about 2,000 positions (twice at 4,000), slower below 1,000. No CPU
    product in torch takes bf16 in and gives float32 out; a compensated pair of bf16 products
    (the rounding error as a second, fused product) reads in place too, but costs as much as
    the conversion, for less precision.

    Queries are padded to a multiple of 4 rows per product and the values to 384 keys (_MIN_BLOCK,
    MIN_KEYS): zeros, which change no result but make each query's bits independent of what
    shares its pass.

    softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2's
    attn_logit_softcapping), as transformers' eager attention does.

    Batch-invariant mode has a kernel of its own with the same layout: invariant_attention.
    """
    dtype = query.dtype
    if dtype in _REDUCED and (KERNELS.upcast if upcast is None else upcast):
        query = query.float()
        key, value = _in_float32(key, value)
    rows, heads, width, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    batch, block = rows * kv_heads, heads // kv_heads * width  # block: a kv head's queries
    padded = -(-block // _MIN_BLOCK) * _MIN_BLOCK  # a multiple of 4 rows (below)
    q = _at_least(query.reshape(batch, block, dim), padded)  # a small copy
    k = key.reshape(batch, keys, dim)  # a view of SlotCache's rows
    v = value.reshape(batch, keys, dim)
    scores = _products(q, k.transpose(1, 2))[:, :block].float()
    scores = scores.reshape(rows, kv_heads, -1, width, keys)  # [.., group, width, ..]
    scores.mul_(dim**-0.5 if scaling is None else scaling)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.add_(mask[:, :, None])
    probs = torch.softmax(scores, dim=-1).view(batch, block, keys).to(v.dtype)
    if keys < MIN_KEYS:  # zero weights on zero values: a copy of a short cache
        v = F.pad(v, (0, 0, 0, MIN_KEYS - keys))
    probs = _at_least(probs, padded, MIN_KEYS)
    out = _products(probs, v)[:, :block]
    return out.reshape(rows, heads, width, dim).to(dtype)


# Batch invariance (as far as MKL's float32 products give it): a product of a multiple of 4
# rows gives each row the same result whatever their number (1 to 3 rows take other kernels,
# and so do the last rows of a count that is not a multiple of 4: 5, 6, 7, 9, ...), and one
# summing over at least 384 keys (MKL on AVX-512 sums blocks of 192 from there on) gives the
# same sums whatever the number of zero-weighted keys after a row's own. So queries are
# padded to 4 rows per product and the values to 384 keys: a query's output does not depend
# on how many queries or rows share its pass, nor on their lengths
# (tests/engine/test_grouped_attention).
_MIN_BLOCK = 4
# Exact batch invariance (KERNELS.invariant, invariant_attention) needs more: the score
# product gives a key other bits in the last, partial block of 16 columns than in a full one,
# and the softmax's vectorised sums change with a short row's length. So keys are padded
# (their scores -inf) to a multiple of KEY_BLOCK, and to at least MIN_KEYS unless the count is
# one measured to sum alike (KERNELS.short_keys: MKL sums up to 192 keys in one block, 256 or
# 320 in two halves, and from 384 on in blocks of 192).
KEY_BLOCK = 64
MIN_KEYS = 384


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    packing: Packing,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """grouped_attention's result (same arguments, and the pass's packing), with each query's
    bits independent of whatever shares its pass: batch-invariant mode's attention, for every
    pass, prefill chunks included. All float32.

    - Queries are padded to a multiple of 4 rows per product, keys to a multiple of
      KEY_BLOCK (their scores -inf) and to at least MIN_KEYS unless that count is one of
      KERNELS.short_keys (see the constants above, and invariant.short_key_counts).
    - A token tree's query has its scores put in the order a sequence of its ancestors would
      give them before the softmax (whose vectorised sums depend on where each term lies),
      and its weights back in slot order after (Packing.sequence_order). The weighted sum of
      values then differs from a sequence's only by zero terms between its own, which add
      nothing as long as each term stays in the block of keys the product sums in one run;
      the batch keeps a tree's nodes so (invariant.value_block, Generation.drafts_in_blocks).
    - Few operations (a one-token pass runs this once a layer, at some 10 us an operation):
      the queries are copied (and converted) into a padded buffer, the keys and values into
      zero-padded buffers kept from call to call, and the mask, the scale and the padding's
      -inf go into one fused product (baddbmm), the mask laid out once per pass
      (Packing.padded_mask).
    """
    dtype = query.dtype
    rows, heads, width, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    batch, block = rows * kv_heads, group * width  # block: a kv head's queries
    padded = -(-block // _MIN_BLOCK) * _MIN_BLOCK
    keys = -(-kv_length // KEY_BLOCK) * KEY_BLOCK
    keys = keys if keys in KERNELS.short_keys else max(MIN_KEYS, keys)
    shape = (rows, kv_heads, keys, dim)
    q, k, v = _scratch((batch, padded, dim), shape, shape, device=query.device)
    grouped = q.view(rows, kv_heads, padded, dim)[:, :, :block].unflatten(2, (group, width))
    grouped.copy_(query.unflatten(1, (kv_heads, group)))
    k[:, :, :kv_length].copy_(key)
    v[:, :, :kv_length].copy_(value)
    if keys > kv_length:  # an earlier pass's keys there would be scored -inf and weighted 0,
        k[:, :, kv_length:].zero_()  # but an inf among them would be NaN: zeros cost ~1%
        v[:, :, kv_length:].zero_()
    k, v = k.view(batch, keys, dim), v.view(batch, keys, dim)
    scale = dim**-0.5 if scaling is None else scaling
    added = packing.padded_mask(mask, kv_heads, group, padded, keys)
    if softcap is None:
        scores = torch.baddbmm(added, q, k.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).div_(softcap).tanh_()
        scores.mul_(softcap).add_(added)
    order = packing.sequence_order(kv_heads, group, padded, keys)
    if order is not None:
        in_sequence, in_slots = order
        flat = scores.view(-1)
        flat.index_copy_(0, in_sequence, flat.index_select(0, in_slots))
    probs = torch.softmax(scores, dim=-1)
    if order is not None:
        flat = probs.view(-1)
        flat.index_copy_(0, in_slots, flat.index_select(0, in_sequence))
    out = torch.bmm(probs, v).view(rows, kv_heads, padded, dim)[:, :, :block]
    return out.reshape(rows, heads, width, dim).to(dtype)


def _scratch(*shapes: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
    """float32 tensors of `shapes`, in zeroed buffers this thread reuses (not _in_float32's):
    each is good until the next call and holds what earlier calls left in it."""
    return _reused("invariant", shapes, device, torch.zeros)


def _at_least(tensor: torch.Tensor, rows: int, columns: int = 0) -> torch.Tensor:
    """tensor [batch, n, m] with zeros appended up to `rows` rows and `columns` columns."""
    more_rows, more_columns = rows - tensor.shape[1], columns - tensor.shape[2]
    if more_rows <= 0 and more_columns <= 0:
        return tensor
    return F.pad(tensor, (0, max(0, more_columns), 0, max(0, more_rows)))


_SCRATCH = threading.local()  # float32 buffers by name (_reused): _in_float32's, _scratch's


def _in_float32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Float32 copies of `tensors`, in buffers this thread reuses: each is good until the next
    call. A buffer grows (at least doubling) to the largest copy asked for and stays."""
    copies = _reused("buffers", [tensor.shape for tensor in tensors], tensors[0].device)
    return [copy.copy_(tensor) for copy, tensor in zip(copies, tensors, strict=True)]


def _reused(
    name: str,
    shapes: Sequence[Sequence[int]],
    device: torch.device,
    make: Callable[..., torch.Tensor] = torch.empty,
) -> list[torch.Tensor]:
    """Views of `shapes` into this thread's float32 buffers `name` (one a shape, made by
    `make`), grown (at least doubling) to the largest view asked for, and kept."""
    buffers: list[torch.Tensor] = getattr(_SCRATCH, name, [])
    setattr(_SCRATCH, name, buffers)
    views = []
    for index, shape in enumerate(shapes):
        size = torch.Size(shape).numel()
        if index == len(buffers):
            buffers.append(make(size, dtype=torch.float32, device=device))
        elif not _reusable(buffers[index], device):
            buffers[index] = make(size, dtype=torch.float32, device=device)
        elif buffers[index].numel() < size:
            grown = max(size, 2 * buffers[index].numel())
            buffers[index] = make(grown, dtype=torch.float32, device=device)
        views.append(buffers[index][:size].view(shape))
    return views


def _reusable(buffer: torch.Tensor, device: torch.device) -> bool:
    """Whether a scratch buffer can be written here: on `device`, and not an inference tensor
    outside inference mode (torch refuses that write)."""
    return buffer.device == device and (
        not buffer.is_inference() or torch.is_inference_mode_enabled()
    )


def _products(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left[b] @ right[b] for each b: one batched product where the kernel reads strided
    batches in place (BLAS for float32 and float64, CUDA), or `right` is dense. oneDNN, which
    runs bf16/fp16 products on CPUs, copies an operand that is not dense, and a batch of cache
    rows is not (each head's capacity lies between two heads' keys), so there each b is a
    product of its own, over its dense [kv_length, dim] keys."""
    if (
        left.device.type != "cpu"
        or left.dtype in (torch.float32, torch.float64)
        or right.is_contiguous()
        or right.transpose(1, 2).is_contiguous()
    ):
        return torch.bmm(left, right)
    out = left.new_empty(left.shape[0], left.shape[1], right.shape[2])
    for a, b, c in zip(left.unbind(), right.unbind(), out.unbind(), strict=True):
        torch.mm(a, b, out=c)
    return out


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
    rows' keys/values [rows, kv_heads, kv_length, dim] (SlotCache.update): grouped_attention
    for passes KERNELS chooses it for (a few queries per row) and for soft-capped scores
    (SDPA has no soft-capping), SDPA for the others. A layer given `sliding_window` attends
    over that window (Packing.windowed_mask). Without a packing (transformers' own generate
    on the same model) this is transformers' SDPA attention."""
    if packing is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    unsupported = sorted(name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None)
    if unsupported:
        raise NotImplementedError(
            f"{type(module).__name__} passes {', '.join(unsupported)} to its attention, "
            "which kenspec's packed attention does not implement"
        )
    rows, width = packing.slots.shape
    laid_out = query[0][:, packing.slots].transpose(0, 1)  # [rows, heads, width, dim]
    window = kwargs.get("sliding_window")
    mask = packing.windowed_mask(int(window)) if window else packing.mask  # type: ignore[call-overload]
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap is not None else None  # type: ignore[arg-type]
    if KERNELS.invariant:
        out = invariant_attention(laid_out, key, value, mask, packing, scaling, softcap)
    elif softcap is not None:
        out = grouped_attention(laid_out, key, value, mask, scaling, softcap=softcap)
    elif KERNELS.takes_grouped(width, key.shape[2]):
        out = grouped_attention(laid_out, key, value, mask, scaling)
    else:
        out = sdpa_attention(laid_out, key, value, mask, scaling)
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(rows * width, heads, dim)
    return out[packing.tokens][None], None  # [1, tokens, heads, dim]


# Arguments some architectures pass their attention that change its result and that packed
# attention does not implement: attention sinks (gpt-oss), chunked attention (Llama 4).
_UNSUPPORTED_ARGUMENTS = ("s_aux", "sinks", "attention_chunk_size", "chunk_size")


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """The SDPA path of a packed pass, with grouped_attention's arguments and result."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )


@torch.inference_mode()
def measure_grouped(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    widths: Sequence[int] = (1, 4, 8, 16, 32),
    kv_lengths: Sequence[int] = (128, 512, 2048),
    repeats: int = 5,
    calls: int = 4,
) -> tuple[dict[int, int], dict[tuple[int, int], tuple[float, float]]]:
    """Where grouped_attention ran no slower than SDPA: ({width: min_length} for use_grouped,
    {(width, length): (SDPA seconds, grouped seconds)}).

    One row of each width over a cache of each length (random keys and values, views of a
    cache twice as long, as SlotCache gives them), causal mask; each sample times `calls`
    calls, the kernels alternating; medians of `repeats` after a warm-up. See choose_grouped.
    """
    device = torch.device(device)
    kernels = (sdpa_attention, grouped_attention)
    timings: dict[tuple[int, int], tuple[float, float]] = {}
    for width in widths:
        for kv_length in kv_lengths:
            shape = (1, kv_heads, 2 * kv_length, head_dim)
            inputs = (
                torch.randn(1, heads, width, head_dim, dtype=dtype, device=device),
                torch.randn(shape, dtype=dtype, device=device)[:, :, :kv_length],
                torch.randn(shape, dtype=dtype, device=device)[:, :, :kv_length],
                attention_mask(
                    torch.arange(kv_length - width, kv_length, device=device)[None],
                    kv_length,
                    dtype,
                ),
            )
            samples: list[list[float]] = [[], []]
            for repeat in range(repeats + 1):  # the first of each warms up and is dropped
                for index in (0, 1) if repeat % 2 else (1, 0):
                    started = time.perf_counter()
                    for _ in range(calls):
                        kernels[index](*inputs)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    samples[index].append((time.perf_counter() - started) / calls)
            timings[width, kv_length] = (
                statistics.median(samples[0][1:]),
                statistics.median(samples[1][1:]),
            )
    return choose_grouped(timings), timings


def choose_grouped(timings: Mapping[tuple[int, int], tuple[float, float]]) -> dict[int, int]:
    """{width: min_length} (use_grouped) from {(width, length): (SDPA s, grouped s)}: the
    widths, from the narrowest, where grouped wins at the longest length measured, each from
    the shortest length at which it wins at that and every longer length. A width between two
    measured takes the wider one's length; one past the last winner takes SDPA."""

    def wins(width: int, length: int) -> bool:
        sdpa_s, grouped_s = timings[width, length]
        return grouped_s <= sdpa_s

    widths = sorted({width for width, _ in timings})
    lengths = sorted({length for _, length in timings})
    chosen: dict[int, int] = {}
    for width in widths:
        if not wins(width, lengths[-1]):
            break
        min_length = lengths[-1]
        for length in reversed(lengths[:-1]):
            if not wins(width, length):
                break
            min_length = length
        chosen[width] = min_length
    return chosen


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # for transformers' own generate
