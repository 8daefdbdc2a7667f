"""The inputs of one packed pass: every row's new tokens one after another (`pack`).

A pass packs the new tokens of all its rows into one sequence (row r contributing its own
number of tokens, no padding), so the linear layers, which dominate a CPU pass, see each token
once. Each token's keys and values go to its row of the cache (engine.kv_cache) at length_r,
length_r + 1, ...; attention lays the queries out over the rows as the pass's Packing says
(engine.packing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kenspec.server.engine.kernels import Kernels
from kenspec.server.engine.packing import Packing, attention_mask, tree_key_order


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
    *,
    kernels: Kernels | None = None,
) -> PackedPass:
    """Row i's tokens follow row i-1's; row i's first goes to position lengths[i] of its row.

    pad_to: pad the pass to at least this many tokens by repeating the last row's last token
    (scored, never read, overwritten by that row's next pass), for widths measured cheaper.
    parents: per row, None for a sequence, or a token tree over its tokens (parents[w]: the
    index of token w's parent in the row, -1 for the first): token w then takes position
    length + depth(w) and cache slot length + w, and attends to its ancestors only.
    kernels: the target's (TargetModel.kernels), which its attention reads from the packing;
    None: the stock choice (for a mask, or a model outside a target).

    Example: lengths [5, 9], rows [[a], [b, c]] -> input [[a, b, c]], positions [[5, 9, 10]],
    slots [[0, 0], [1, 2]] (row 0's padding repeats its token).
    """
    kernels = Kernels() if kernels is None else kernels
    one_step = len(token_rows) == 1 and len(token_rows[0]) == 1 and pad_to <= 1
    if one_step and (parents is None or parents[0] is None) and device.type == "cpu":
        return _one_token(lengths[0], token_rows[0][0], dtype, kernels)
    return _rows(lengths, token_rows, dtype, device, pad_to, parents, kernels)


def _rows(
    lengths: Sequence[int],
    token_rows: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    pad_to: int,
    parents: Sequence[Sequence[int] | None] | None,
    kernels: Kernels,
) -> PackedPass:
    """pack's pass of any rows (see pack)."""
    rows, trees = _padded(token_rows, parents, pad_to)
    width = max(len(row) for row in rows)
    columns = _Columns()
    for index, (length, row, tree) in enumerate(zip(lengths, rows, trees, strict=True)):
        columns.add(index, length, row, tree, width)
    grid_values = [length + w for length in lengths for w in range(width)]
    kv_length = max(lengths) + width  # the largest position + 1, known without the device
    grid, cache_slots, slot_grid, packed_flat, packed_ids, packed_positions, packed_owners = (
        _to_device([grid_values, *columns.on_device()], device)
    )
    grid = grid.view(len(rows), width)
    packing = Packing(
        slot_grid.view(len(rows), width),
        packed_flat,
        attention_mask(grid, kv_length, dtype, columns.tree_rows),
        grid,
        tuple(columns.tree_depths),
        tuple(  # needed (and paid for) only where keys are summed in a fixed order
            entry
            for row, _, tree in (columns.tree_rows if kernels.invariant else ())
            for entry in tree_key_order(row, tree)
        ),
        kernels=kernels,
    )
    return PackedPass(
        input_ids=packed_ids[None],
        positions=packed_positions[None],
        token_rows=packed_owners,
        starts=columns.starts,
        kv_length=kv_length,
        packing=packing,
        cache_positions=cache_slots if columns.tree_rows else None,
    )


def _one_token(length: int, token: int, dtype: torch.dtype, kernels: Kernels) -> PackedPass:
    """pack's pass of one row's one token (a decoding step) on the host, built directly: the
    same tensors (the token sees every key: its mask all zeros) for a fifth of the work."""
    values = torch.tensor([length, 0, 0, token, length, 0])  # (int64, as pack's columns)
    grid, slots, flat, ids, positions, owners = values.split(1)
    mask = torch.zeros(1, 1, 1, length + 1, dtype=dtype)
    packing = Packing(slots.view(1, 1), flat, mask, grid.view(1, 1), kernels=kernels)
    return PackedPass(
        input_ids=ids[None],
        positions=positions[None],
        token_rows=owners,
        starts=[0],
        kv_length=length + 1,
        packing=packing,
    )


def _padded(
    token_rows: Sequence[Sequence[int]],
    parents: Sequence[Sequence[int] | None] | None,
    pad_to: int,
) -> tuple[list[list[int]], list[list[int] | None]]:
    """Copies of the rows and trees, the last row padded to `pad_to` tokens in all (see pack)."""
    rows = [list(row) for row in token_rows]
    trees = [list(tree) if tree is not None else None for tree in (parents or [None] * len(rows))]
    extra = pad_to - sum(len(row) for row in rows)
    if extra > 0:
        last_tree = trees[-1]
        if last_tree is not None:  # the padding follows the row's last token, as a sequence
            last_tree += range(len(rows[-1]) - 1, len(rows[-1]) - 1 + extra)
        rows[-1] += [rows[-1][-1]] * extra
    return rows, trees


@dataclass(slots=True)
class _Columns:
    """pack's index columns, built on the host a row at a time."""

    starts: list[int] = field(default_factory=list)  # where each row's tokens begin
    cache_slots: list[int] = field(default_factory=list)  # [tokens]: length + index in row
    slot_grid: list[int] = field(default_factory=list)  # [rows * width]: Packing.slots
    flat: list[int] = field(default_factory=list)  # [tokens]: Packing.tokens
    ids: list[int] = field(default_factory=list)  # [tokens]
    positions: list[int] = field(default_factory=list)  # [tokens]: length + index, or depth
    owners: list[int] = field(default_factory=list)  # [tokens]: each token's row
    tree_rows: list[tuple[int, int, Sequence[int]]] = field(default_factory=list)
    tree_depths: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)

    def add(
        self, index: int, length: int, row: Sequence[int], tree: Sequence[int] | None, width: int
    ) -> None:
        start = len(self.ids)
        self.starts.append(start)
        self.ids += row
        self.cache_slots += range(length, length + len(row))
        if tree is None:
            self.positions += range(length, length + len(row))
        else:
            depth: list[int] = []
            for parent in tree:
                depth.append(0 if parent < 0 else depth[parent] + 1)
            self.positions += [length + d for d in depth]
            self.tree_rows.append((index, length, tree))
            self.tree_depths.append((index, length, tuple(depth)))
        self.owners += [index] * len(row)
        self.slot_grid += [start + min(w, len(row) - 1) for w in range(width)]
        self.flat += range(index * width, index * width + len(row))

    def on_device(self) -> list[list[int]]:
        """The columns _to_device copies after the grid, in pack's order."""
        return [self.cache_slots, self.slot_grid, self.flat, self.ids, self.positions, self.owners]


def _to_device(columns: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """The columns as int64 tensors on `device`: one host-to-device copy for a pass (from
    pinned memory, queued behind the device's work on an accelerator) instead of one
    blocking copy per tensor."""
    values = torch.tensor([value for column in columns for value in column], dtype=torch.long)
    if device.type == "cuda":
        values = values.pin_memory().to(device, non_blocking=True)
    elif values.device != device:
        values = values.to(device)
    return list(torch.split(values, [len(column) for column in columns]))
