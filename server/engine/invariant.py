"""Batch-invariant execution: each token's logits bit-identical whatever shares its pass.

A pass computes a token's numbers with kernels chosen by the pass's shape, and kernels sum in
different orders: in bf16 a token's logits then depend on how many tokens and rows share its
pass, so speculation, batching, chunked prefill and the prefix cache change greedy output
(``python -m bench.invariance`` shows where, layer by layer). Three sources, three fixes:

- Linear layers. oneDNN's bf16 products give a single row (a GEMV) other bits than the same
  row among 2 or more; MKL's float32 products give each row the same bits only in blocks of 4
  rows. Every linear layer's input is padded with zero rows to a row count the kernels treat
  alike (bf16: at least 2; float32: a multiple of 4), chosen at start-up by measurement on the
  model's own layers (`choose_padding`), so the rule follows the CPU and its libraries. The
  whole pass is padded to such a count where the cache has room (Kernels.pass_padding):
  one padding token instead of a padded copy in each of the model's linear layers.
- Attention. SDPA's kernels split the work by the number of queries; `invariant_attention`
  pads queries and keys to fixed blocks (engine.attention), and every pass, prefill included,
  goes there.
  A token tree's node sums its keys in the order a sequence would: its scores are reordered
  around the softmax (Packing.sequence_order), and the batch keeps only nodes whose cache
  slot lies in the same block of summed keys as their position (`value_block`, measured).
- The output layer. Lazy logits rows use a GEMV for one row and W @ h^T for blocks; instead the
  model's own output layer, padded like the others, computes the pass's rows.

Rows of zeros change no other row's result; what they cost is measured in bench/ (see
docs/design.md, "Batch invariance"). The mode is a property of the target's execution plan (a
BatchInvariance in its attention Kernels, which every pass hands to attention; the padding
switched on in the model's layers when its forward is built: engine.forward), not of the
process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from kenspec.server.engine.kernels import KEY_BLOCK, MIN_KEYS, Padding

# Tried in order; the first that makes every layer of the model invariant is used. The blocked
# ones are for CPUs whose bf16 products switch kernels past a row count (on AMX, oneDNN gives
# 1 to 32 rows the same bits and 33 or more others), at the price of smaller products.
CANDIDATES = (
    Padding(2, 1),
    Padding(4, 4),
    Padding(8, 8),
    Padding(16, 16),
    Padding(1, 1, block=32),
    Padding(2, 1, block=32),
    Padding(4, 4, block=32),
    Padding(2, 1, block=16),
    Padding(4, 4, block=16),
)
# Row counts the check computes each row among (1: a decode step; 512: a prefill chunk).
_CHECKED_ROWS = (1, 2, 3, 5, 7, 8, 9, 17, 33, 64)


class InvariantError(RuntimeError):
    """No padding rule makes this machine's kernels batch-invariant."""


Product = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] -> [rows, out]


def _padded(product: Product, x: torch.Tensor, padding: Padding) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    block = padding.block if padding.block and rows > padding.block else rows
    out = torch.cat(
        [_padded_block(product, flat[s : s + block], padding) for s in range(0, rows, block)]
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _padded_block(product: Product, flat: torch.Tensor, padding: Padding) -> torch.Tensor:
    rows = len(flat)
    wanted = padding.rows(rows)
    if wanted == rows:
        return product(flat)
    return product(torch.cat([flat, flat.new_zeros(wanted - rows, flat.shape[1])]))[:rows]


class InvariantLinear(nn.Linear):
    """An nn.Linear whose inputs are padded to `padding`'s row counts."""

    padding: Padding = Padding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _padded(lambda rows: F.linear(rows, self.weight, self.bias), x, self.padding)


class InvariantConv1D(Conv1D):
    """GPT-2's Conv1D (x @ W + b, W [in, out]) with its inputs padded likewise."""

    padding: Padding = Padding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _padded(lambda rows: torch.addmm(self.bias, rows, self.weight), x, self.padding)


_INVARIANT = {nn.Linear: InvariantLinear, Conv1D: InvariantConv1D}
_STOCK = {invariant: stock for stock, invariant in _INVARIANT.items()}


Linear = nn.Linear | Conv1D  # a linear layer, either way its weight is stored


def linear_layers(model: nn.Module) -> list[Linear]:
    """Every linear layer, the output layer included (stock or already switched)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear | Conv1D)]


def use_padding(model: nn.Module, padding: Padding | None) -> None:
    """Pad every linear layer's inputs by `padding` (None: back to the stock layers)."""
    for layer in linear_layers(model):
        stock = _STOCK.get(type(layer), type(layer))
        if stock not in _INVARIANT:
            continue  # a subclass of the model's own: left alone, and the check will say
        if padding is None:
            layer.__class__ = stock
            layer.__dict__.pop("padding", None)
        else:
            layer.__class__ = _INVARIANT[stock]
            if isinstance(layer, InvariantLinear | InvariantConv1D):
                layer.padding = padding


@torch.inference_mode()
def invariant_under(layer: Linear, rows: Sequence[int] = _CHECKED_ROWS) -> bool:
    """Whether `layer` (as switched now) gives each of 64 random rows the same bits computed
    among any of `rows` rows at a time."""
    weight: torch.Tensor = layer.weight
    features = weight.shape[0 if isinstance(layer, Conv1D) else 1]
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, features, generator=generator).to(weight.device, weight.dtype)
    reference = None
    for count in rows:
        out = torch.cat([layer(x[start : start + count]) for start in range(0, len(x), count)])
        if reference is None:
            reference = out
        elif not torch.equal(out, reference):
            return False
    return True


def choose_padding(model: nn.Module) -> Padding:
    """The first candidate padding under which every distinct linear layer shape is invariant
    (switched on in the model); InvariantError if none is."""
    layers: dict[tuple[type, tuple[int, ...]], Linear] = {}
    for layer in linear_layers(model):
        weight: torch.Tensor = layer.weight
        layers.setdefault((type(layer), tuple(weight.shape)), layer)
    for padding in CANDIDATES:
        use_padding(model, padding)
        if all(invariant_under(layer) for layer in layers.values()):
            return padding
    use_padding(model, None)
    raise InvariantError(
        "--batch-invariant: no row padding makes this machine's matrix products give a row the "
        f"same bits whatever rows share it (tried {', '.join(map(str, CANDIDATES))}); serve "
        "without it"
    )


# Keys the value-block probe moves a weight across (MKL on AVX-512 sums 192 keys a block).
_PROBED_KEYS = 1024


@torch.inference_mode()
def value_block(device: torch.device, dim: int, keys: int = _PROBED_KEYS) -> int | None:
    """How many keys attention's float32 weighted sum of values (a batched product) adds up
    in order before it adds a block's total to the rest, measured: the positions where moving
    a weight one key later changes the sum are the block boundaries. Within a block the sum runs key
    by key, so zero weights between a query's own change nothing; a token tree's node whose
    slot and position lie in one block sums its keys as a sequence would. None when the
    boundaries are no multiples of one block (trees are then not verified in the mode); the
    probe's length when there is none in it."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator).to(device)

    boundaries = set()
    for rows in (4, 32):  # a one-token pass's query rows (9 heads over 3), and a tree's
        values, weights = random(2, keys, dim), random(2, rows, keys)
        for moved in range(1, keys):
            early = weights.clone()
            early[..., moved:] = 0
            late = early.clone()
            late[..., moved] = late[..., moved - 1]
            late[..., moved - 1] = 0
            shifted = values.clone()
            shifted[:, moved] = values[:, moved - 1]
            if not torch.equal(torch.bmm(early, values), torch.bmm(late, shifted)):
                boundaries.add(moved)
    if not boundaries:
        return keys
    block = min(boundaries)
    return block if all(boundary % block == 0 for boundary in boundaries) else None


@torch.inference_mode()
def short_key_counts(device: torch.device, dim: int, rows: int = 8) -> tuple[int, ...]:
    """The key counts below MIN_KEYS (multiples of KEY_BLOCK) over which attention's
    products and softmax give a query the same bits as over _PROBED_KEYS keys, measured for
    queries of several lengths: those a short pass may pad its keys to instead (MKL on AVX-512:
    64, 128 and 192, one block; 256 and 320 are split in two halves, other sums)."""
    generator = torch.Generator(device="cpu").manual_seed(1)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    keys = _PROBED_KEYS
    query, key, value = random(2, rows, dim), random(2, keys, dim), random(2, keys, dim)
    counts = []
    for count in range(KEY_BLOCK, MIN_KEYS, KEY_BLOCK):
        same = True
        for length in {1, count // 2 + 1, count - 7, count}:
            outputs = []
            for columns in (count, keys):
                mask = torch.zeros(2, rows, columns, device=device)
                mask[..., length:] = float("-inf")
                scores = torch.baddbmm(mask, query, key[:, :columns].transpose(1, 2), alpha=0.1)
                outputs.append(torch.bmm(torch.softmax(scores, -1), value[:, :columns]))
            same = same and torch.equal(*outputs)
        if same:
            counts.append(count)
    return tuple(counts)
