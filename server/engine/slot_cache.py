"""A KV cache with one row per active sequence, for verifying many sequences in one pass.

Each row r holds a sequence whose first `length_r` positions are valid. A pass feeds every row
`width` tokens (shorter rows padded) and writes their keys and values at length_r ..
length_r + width - 1 of that row; a 4D attention mask lets row r's query at offset w see keys
0 .. length_r + w and nothing else, so padding and stale positions past a row's length are
never read. Rolling back rejected drafts therefore copies nothing: the caller's next pass just
starts at the shorter length and overwrites them. This is the slot layout of Orca/vLLM's
iteration-level batching, kept dense because a CPU pass is dominated by the weights, not by
the few kilobytes of KV a row adds.

Rows in use are kept contiguous (0 .. n-1) so a pass reads a view, never a gathered copy;
`move` relocates one row when another leaves. Memory grows by doubling the per-row capacity,
bounded by rows x max_length.
"""

from __future__ import annotations

import torch

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
        self._batch_index: torch.Tensor | None = None  # [n, width]: row of each new token
        self._positions: torch.Tensor | None = None  # [n, width]: where each new token goes
        self._kv_length = 0

    def bind(self, first_row: int, positions: torch.Tensor) -> None:
        """Set where the next pass writes: rows first_row.. get positions [n, width]."""
        rows, _ = positions.shape
        if first_row < 0 or first_row + rows > self.rows:
            raise ValueError(f"rows {first_row}..{first_row + rows - 1} outside 0..{self.rows - 1}")
        self._kv_length = int(positions.max()) + 1
        if self._kv_length > self.max_length:
            raise ValueError(
                f"a pass needs {self._kv_length} positions; the cache holds {self.max_length}"
            )
        self._reserve(self._kv_length)
        self._first, self._stop = first_row, first_row + rows
        self._positions = positions
        rows_index = torch.arange(first_row, first_row + rows, device=positions.device)
        self._batch_index = rows_index[:, None].expand_as(positions)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys/values ([n, heads, width, dim]); return the bound rows'."""
        if self._positions is None or self._batch_index is None:
            raise RuntimeError("SlotCache.bind() must be called before a forward pass")
        if layer_idx == len(self._keys):
            self._allocate_layer(key_states, value_states)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        # Advanced indices in dims 0 and 2 put the indexed dims first: [n, width, heads, dim].
        keys[self._batch_index, :, self._positions] = key_states.transpose(1, 2)
        values[self._batch_index, :, self._positions] = value_states.transpose(1, 2)
        span = slice(self._first, self._stop)
        return keys[span, :, : self._kv_length], values[span, :, : self._kv_length]

    @torch.inference_mode()
    def move(self, source: int, destination: int, length: int) -> None:
        """Copy row source's first `length` positions into row destination."""
        if source == destination or length == 0:
            return
        for tensor in (*self._keys, *self._values):
            tensor[destination, :, :length] = tensor[source, :, :length]

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


def attention_mask(positions: torch.Tensor, kv_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [n, 1, width, kv_length]: query at position p sees keys 0..p.

    Example: positions [[3, 4]] -> row 0 sees keys 0..3 at offset 0 and 0..4 at offset 1.
    """
    keys = torch.arange(kv_length, device=positions.device)
    visible = keys[None, None, :] <= positions[:, :, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]
