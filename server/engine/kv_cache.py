"""A KV cache with one row per active sequence, for verifying many sequences in one pass.

Each row r holds a sequence whose first `length_r` positions are valid. A pass (engine.packing)
writes each new token's keys and values to its row at length_r, length_r + 1, ...; attention
reads each row only up to its own length, so rolling back rejected drafts copies nothing: the
caller's next pass just starts at the shorter length and overwrites them. This is the slot
layout of Orca/vLLM's iteration-level batching, kept dense because a CPU pass is dominated by
the weights, not by the few kilobytes of KV a row adds.

Rows in use are kept contiguous (0 .. n-1) so attention reads a view, never a gathered copy;
`move` relocates one row when another leaves. Memory grows by doubling the per-row capacity,
bounded by rows x max_length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kenspec.server.engine.packed_pass import PackedPass

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
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: object,
        **__: object,
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
        return self.bound_rows(layer_idx)

    def layer_for_kernel(
        self, layer_idx: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a kernel that writes a layer's new keys and values itself (engine.forward.lean):
        the layer's whole keys and values [rows, kv_heads, capacity, head_dim] (allocated as
        `update` would for states shaped like `like`, [1, kv_heads, tokens, head_dim]), and
        each new token's row and position (int64, contiguous)."""
        rows, positions = self._new_tokens()
        if layer_idx == len(self._keys):
            self._allocate_layer(like, like)
        return self._keys[layer_idx], self._values[layer_idx], rows, positions

    def kernel_layers(
        self, count: int, like: torch.Tensor
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """`layer_for_kernel` for layers 0 .. count - 1 at once: each layer's whole keys and
        values, and the new tokens' rows and positions (the same for every layer)."""
        rows, positions = self._new_tokens()
        while len(self._keys) < count:
            self._allocate_layer(like, like)
        layers = list(zip(self._keys[:count], self._values[:count], strict=True))
        return layers, rows, positions

    def _new_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound pass's new tokens' rows and positions (int64, contiguous)."""
        if self._positions is None or self._batch_index is None:
            raise RuntimeError("SlotCache.bind() must be called before a forward pass")
        return self._batch_index.contiguous(), self._positions.contiguous()

    def bound_rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound rows' keys and values of a layer, as `update` returns them."""
        span = slice(self._first, self._stop)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
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
