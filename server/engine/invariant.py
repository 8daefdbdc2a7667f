"""Batch-invariant execution: each token's logits bit-identical whatever shares its pass.

A pass computes a token's numbers with kernels chosen by the pass's shape, and kernels sum in
different orders: in bf16 a token's logits then depend on how many tokens and rows share its
pass, so speculation, batching, chunked prefill and the prefix cache change greedy output
(``python -m bench.invariance`` shows where, layer by layer). Three sources, three fixes:

- Linear layers. oneDNN's bf16 products give a single row (a GEMV) other bits than the same
  row among 2 or more; MKL's float32 products give each row the same bits only in blocks of 4
  rows. Every linear layer's input is padded with zero rows to a row count the kernels treat
  alike (bf16: at least 2; float32: a multiple of 4), chosen at start-up by measurement on the
  model's own layers (`choose_padding`), so the rule follows the CPU and its libraries.
- Attention. SDPA's kernels split the work by the number of queries; `grouped_attention` pads
  queries and keys to fixed blocks (slot_cache), so every pass, prefill included, goes there.
- The output layer. Lazy logits rows use a GEMV for one row and W @ h^T for blocks; instead the
  model's own output layer, padded like the others, computes the pass's rows.

Rows of zeros change no other row's result; what they cost is measured in bench/ (see
docs/design.md, "Batch invariance").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from server.engine.slot_cache import KERNELS, use_grouped


@dataclass(frozen=True, slots=True)
class Padding:
    """Pad a product's rows to at least `minimum` and to a multiple of `multiple`."""

    minimum: int = 1
    multiple: int = 1

    def rows(self, rows: int) -> int:
        return max(self.minimum, -(-rows // self.multiple) * self.multiple)


# Tried in order; the first that makes every layer of the model invariant is used.
CANDIDATES = (Padding(2, 1), Padding(4, 4), Padding(8, 8), Padding(16, 16))
# Row counts the check computes each row among (1: a decode step; 512: a prefill chunk).
_CHECKED_ROWS = (1, 2, 3, 5, 7, 8, 9, 17, 33, 64)


class InvariantError(RuntimeError):
    """No padding rule makes this machine's kernels batch-invariant."""


def _padded(product, x: torch.Tensor, padding: Padding) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    wanted = padding.rows(rows)
    if wanted == rows:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(wanted - rows, flat.shape[1])])
    out = product(flat)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


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


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """Every linear layer, the output layer included (stock or already switched)."""
    kinds = (nn.Linear, Conv1D)
    return [m for m in model.modules() if isinstance(m, kinds)]


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
            layer.padding = padding


@torch.inference_mode()
def invariant_under(layer: nn.Module, rows: Sequence[int] = _CHECKED_ROWS) -> bool:
    """Whether `layer` (as switched now) gives each of 64 random rows the same bits computed
    among any of `rows` rows at a time."""
    features = layer.weight.shape[0 if isinstance(layer, Conv1D) else 1]
    weight = layer.weight
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
    layers = {}
    for layer in linear_layers(model):
        layers.setdefault((type(layer), tuple(layer.weight.shape)), layer)
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


@dataclass(frozen=True, slots=True)
class Invariance:
    """What `make_invariant` switched, to report and to undo."""

    padding: Padding
    grouped: tuple[tuple[int, int], ...]  # the attention choice before
    upcast: bool
    head_t: torch.Tensor | None
    plain_head: bool


def make_invariant(target) -> Invariance:  # type: ignore[no-untyped-def]
    """Switch `target` (a TargetModel) to batch-invariant execution: padded linear layers,
    grouped attention for every pass, the output layer over the pass's rows. Process-wide for
    the attention choice (slot_cache.KERNELS), as that choice always is."""
    padding = choose_padding(target.model)
    before = Invariance(padding, KERNELS.grouped, KERNELS.upcast, target.head_t, target.plain_head)
    use_grouped({1 << 30: 0})  # every width, every length
    KERNELS.upcast = KERNELS.invariant = True
    target.head_t = None  # no lazy rows: the output layer runs as a linear layer of the pass
    target.plain_head = False
    return before


def undo_invariant(target, before: Invariance) -> None:  # type: ignore[no-untyped-def]
    use_padding(target.model, None)
    KERNELS.grouped, KERNELS.upcast = before.grouped, before.upcast
    KERNELS.invariant = False
    target.head_t, target.plain_head = before.head_t, before.plain_head
