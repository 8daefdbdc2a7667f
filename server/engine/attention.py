"""Packed attention: the attention a packed pass runs, registered with transformers by name.

`packed_attention` takes a layer's queries of a packed pass ([1, heads, tokens, dim]) and lays
them out as [rows, heads, width, dim] over the bound rows' cache (SlotCache.update, Packing),
then runs one of three kernels, as the target's Kernels (Packing.kernels) choose:

- `sdpa_attention`: torch's scaled_dot_product_attention, with the pass's 4D mask;
- `grouped_attention`: plain products over the cache for a few queries per row, each kv
  head's query heads in one product, the cache read in place (docs/design.md, "Attention for
  a few queries over a long cache");
- `invariant_attention`: batch-invariant mode's, each query's bits independent of what shares
  its pass (engine.invariant).

Without a packing (transformers' own `generate` on the same model) it is transformers' SDPA.
"""

from __future__ import annotations

from typing import SupportsFloat

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kenspec.server.engine.kernels import KEY_BLOCK, MIN_KEYS, QUERY_BLOCK, ScratchBuffers
from kenspec.server.engine.packing import Packing

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
    rows' keys/values [rows, kv_heads, kv_length, dim] (SlotCache.update): grouped_attention
    for passes the target's kernels (packing.kernels) choose it for (a few queries per row)
    and for soft-capped scores (SDPA has no soft-capping), invariant_attention for every
    pass in batch-invariant mode, SDPA for the others. A layer given `sliding_window` attends
    over that window (Packing.windowed_mask). Without a packing (transformers' own generate
    on the same model) this is transformers' SDPA attention."""
    if packing is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,  # type: ignore[arg-type]  # transformers' own, passed on as they came
        )
    unsupported = sorted(name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None)
    if unsupported:
        raise NotImplementedError(
            f"{type(module).__name__} passes {', '.join(unsupported)} to its attention, "
            "which kenspec's packed attention does not implement"
        )
    rows, width = packing.slots.shape
    laid_out = query[0][:, packing.slots].transpose(0, 1)  # [rows, heads, width, dim]
    window = attention_number(kwargs.get("sliding_window"))
    mask = packing.windowed_mask(int(window)) if window else packing.mask
    softcap = attention_number(kwargs.get("softcap"))
    kernels = packing.kernels
    if kernels.invariant:
        out = invariant_attention(laid_out, key, value, mask, packing, scaling, softcap)
    elif softcap is not None or kernels.takes_grouped(width, key.shape[2]):
        out = grouped_attention(
            laid_out,
            key,
            value,
            mask,
            scaling,
            upcast=kernels.upcast,
            softcap=softcap,
            scratch=kernels.scratch,
        )
    else:
        out = sdpa_attention(laid_out, key, value, mask, scaling)
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(rows * width, heads, dim)
    return out[packing.tokens][None], None  # [1, tokens, heads, dim]


# Arguments some architectures pass their attention that change its result and that packed
# attention does not implement: attention sinks (gpt-oss), chunked attention (Llama 4).
_UNSUPPORTED_ARGUMENTS = ("s_aux", "sinks", "attention_chunk_size", "chunk_size")


def attention_number(argument: object) -> float | None:
    """A layer's numeric attention argument (sliding_window, softcap) as a float, or None."""
    if argument is None:
        return None
    if not isinstance(argument, SupportsFloat):
        raise TypeError(f"expected a number for an attention argument, got {argument!r}")
    return float(argument)


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


_REDUCED = (torch.bfloat16, torch.float16)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None = None,
    *,
    upcast: bool = True,
    softcap: float | None = None,
    scratch: ScratchBuffers | None = None,
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

    bf16/fp16 (`upcast`, as Kernels.upcast): the keys and values are first converted into
    float32 buffers kept from pass to pass (`scratch`, the target's Kernels.scratch; None: new
    ones; the conversion is a fifth to a quarter of this function's time on a CPU; new
    buffers would add page faults), then all is float32: exact
    float32 scores and sums, closer to a float64 reference than SDPA's CPU kernel, which
    rounds its probabilities to bf16. Without it, the products run on the cache in place in
    its dtype (oneDNN on CPUs: dense operands only, so one product per (row, kv head), each
    call costing some 20 us), and round their output: the scores to bf16 (8 bits: a score of
    10 is off by up to 0.02, its weight by 2%; about 4x SDPA's error), the probabilities too.
    That is faster past about 2,000 positions (twice at 4,000), slower below 1,000. No CPU
    product in torch takes bf16 in and gives float32 out; a compensated pair of bf16 products
    (the rounding error as a second, fused product) reads in place too, but costs as much as
    the conversion, for less precision.

    Queries are padded to a multiple of 4 rows per product and the values to 384 keys
    (QUERY_BLOCK, MIN_KEYS in engine.kernels): zeros, which change no result but make each
    query's bits independent of what shares its pass.

    softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2's
    attn_logit_softcapping), as transformers' eager attention does.

    Batch-invariant mode has a kernel of its own with the same layout: invariant_attention.
    """
    dtype = query.dtype
    if dtype in _REDUCED and upcast:
        query = query.float()
        key, value = (scratch if scratch is not None else ScratchBuffers()).in_float32(key, value)
    rows, heads, width, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    batch, block = rows * kv_heads, heads // kv_heads * width  # block: a kv head's queries
    padded = -(-block // QUERY_BLOCK) * QUERY_BLOCK  # a multiple of 4 rows (engine.kernels)
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
      the packing's Kernels.short_keys (see engine.kernels, and invariant.short_key_counts).
    - A token tree's query has its scores put in the order a sequence of its ancestors would
      give them before the softmax (whose vectorised sums depend on where each term lies),
      and its weights back in slot order after (Packing.sequence_order). The weighted sum of
      values then differs from a sequence's only by zero terms between its own, which add
      nothing as long as each term stays in the block of keys the product sums in one run;
      the batch keeps a tree's nodes so (invariant.value_block, PassRow.nodes_in_key_blocks).
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
    padded = -(-block // QUERY_BLOCK) * QUERY_BLOCK
    keys = -(-kv_length // KEY_BLOCK) * KEY_BLOCK
    keys = keys if keys in packing.kernels.short_keys else max(MIN_KEYS, keys)
    shape = (rows, kv_heads, keys, dim)
    scratch = packing.kernels.scratch
    q, k, v = scratch.zeroed((batch, padded, dim), shape, shape, device=query.device)
    grouped = q.view(rows, kv_heads, padded, dim)[:, :, :block].view(
        rows, kv_heads, group, width, dim
    )
    grouped.copy_(query.view(rows, kv_heads, group, width, dim))
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


def _at_least(tensor: torch.Tensor, rows: int, columns: int = 0) -> torch.Tensor:
    """tensor [batch, n, m] with zeros appended up to `rows` rows and `columns` columns."""
    more_rows, more_columns = rows - tensor.shape[1], columns - tensor.shape[2]
    if more_rows <= 0 and more_columns <= 0:
        return tensor
    return F.pad(tensor, (0, max(0, more_columns), 0, max(0, more_rows)))


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


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # for transformers' own generate
