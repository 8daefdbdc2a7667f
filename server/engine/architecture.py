"""Which architectures the engine serves exactly, checked when a target model loads.

The engine runs a model's own modules but replaces its attention (packed rows over a SlotCache,
with masks of its own) and reads its output layer directly. That is exact for decoders whose
attention goes through transformers' attention interface and depends only on the queries, the
cached keys and values, the scaling, soft-capping and a sliding window: those are what packed
attention implements. Anything else is refused here, by name, rather than served wrong:

- layers that are not attention (Mamba, linear attention: no keys and values to cache);
- models that compute attention in code of their own (Bloom and MPT with ALiBi biases, Falcon,
  GPT-Neo, ...), which packed attention cannot replace;
- chunked attention (Llama 4) and attention sinks (gpt-oss), which packed attention does not
  implement (it raises if a layer passes them).

Then one packed pass of two rows is checked against the model's own forward on the same tokens
(`check_packed_passes`): a feature none of the above names still shows up as different logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig, PreTrainedModel

from kenspec.server.engine.kernels import Kernels
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.packed_pass import pack

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
_ALIBI_TYPES = {"bloom"}  # always ALiBi; MPT and Falcon say so in their configs
_CHECK_TOKENS = 12
# Largest difference from the model's own logits, as a share of their largest magnitude: the
# two compute the same products in another order (float32), or round them (bf16, fp16).
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_REDUCED_TOLERANCE = 5e-2


class UnsupportedArchitecture(ValueError):
    """The model uses a feature the engine cannot serve exactly (the message names it)."""


def _refusal(config: PretrainedConfig, feature: str, why: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"model_type {config.model_type!r} uses {feature}, which kenspec's engine does not "
        f"support: {why}"
    )


def attention_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of every attention layer."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "multi_query", False):  # GPT-BigCode: one key/value head
        kv_heads = 1
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def refuse_unsupported(model: PreTrainedModel) -> None:
    """Raise UnsupportedArchitecture if the model has a feature packed passes cannot serve."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= _ATTENTION_LAYERS:
        raise _refusal(
            config,
            f"layer types {sorted(kinds - _ATTENTION_LAYERS)}",
            "packed attention and its KV cache serve full and sliding-window attention layers only",
        )
    attn_config = getattr(config, "attn_config", None)
    alibi_config = getattr(config, "alibi", False) or getattr(attn_config, "alibi", False)
    if config.model_type in _ALIBI_TYPES or alibi_config:
        raise _refusal(config, "ALiBi position biases", "packed attention adds no biases")
    if not getattr(model, "_supports_attention_backend", False):
        raise _refusal(
            config,
            "attention code of its own",
            "packed attention replaces attention through transformers' attention interface, "
            "which this model does not call",
        )
    if getattr(config, "attention_chunk_size", None):
        raise _refusal(config, "chunked attention", "packed attention attends over whole rows")


def declared_window(config: PretrainedConfig) -> int | None:
    """The sliding window the config gives some layer, if any (Mistral: every layer; Gemma 2
    and 3: the "sliding_attention" layers; Qwen2: none while use_sliding_window is off)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    kinds = set(getattr(config, "layer_types", None) or [])
    if "sliding_attention" in kinds:
        return int(window)
    if kinds or getattr(config, "use_sliding_window", None) is False:
        return None
    return int(window)


def served_context(config: PretrainedConfig, windows: frozenset[int]) -> int:
    """The context kenspec serves: the model's, capped at its sliding window where the config
    declares one that its layers did not pass packed attention (`windows`, from
    check_packed_passes): within the window, full causal attention is the model's attention."""
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    window = declared_window(config)
    if window and not windows:
        context = min(context, window)
    return context


@torch.inference_mode()
def check_packed_passes(
    model: PreTrainedModel, implementation: str, kernels: Kernels | None = None
) -> frozenset[int]:
    """Switch the model's attention to `implementation` (packed attention) after checking
    that packed passes give the logits of the model's own forward; the sliding windows its
    layers passed to packed attention. The passes take `kernels` (the target's; None: the
    stock choice).

    A prompt of _CHECK_TOKENS tokens runs through the model as shipped, then as two packed
    rows (its first 8 and first 5 tokens, then the rest of each, so the second pass reads
    cached keys of different lengths per row).
    """
    config = model.config
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    tokens = [(7 + 31 * index) % vocab for index in range(_CHECK_TOKENS)]
    expected = model(input_ids=torch.tensor([tokens], device=device)).logits[0].float()
    model.set_attn_implementation(implementation)
    cache = SlotCache(2, 2 * _CHECK_TOKENS)  # room for the shorter row's padding
    try:
        first, _ = _packed_logits(model, cache, [0, 0], [tokens[:8], tokens[:5]], kernels)
        second, windows = _packed_logits(model, cache, [8, 5], [tokens[8:], tokens[5:]], kernels)
    except NotImplementedError as error:
        raise _refusal(config, "an attention argument", str(error)) from None
    got = torch.cat([first[0], first[1], second[0], second[1]])
    wanted = torch.cat([expected[:8], expected[:5], expected[8:], expected[5:]])
    scale = max(1.0, float(wanted.abs().max()))
    difference = float((got - wanted).abs().max())
    if not difference <= _TOLERANCE.get(model.dtype, _REDUCED_TOLERANCE) * scale:
        raise _refusal(
            config,
            "a feature packed attention does not implement",
            f"a packed pass's logits differ from the model's own by up to {difference:.3g} "
            f"(largest logit {scale:.3g})",
        )
    return windows


def _packed_logits(
    model: PreTrainedModel,
    cache: SlotCache,
    lengths: Sequence[int],
    token_rows: Sequence[Sequence[int]],
    kernels: Kernels | None,
) -> tuple[list[torch.Tensor], frozenset[int]]:
    """Each row's logits [tokens, vocab] in float32, and the windows the layers asked for."""
    device = next(model.parameters()).device
    packed = pack(lengths, token_rows, model.dtype, device, kernels=kernels)
    cache.bind(0, packed)
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=packed.packing.mask,
        position_ids=packed.positions,
        cache=cache,
        use_cache=True,
        packing=packed.packing,
    ).logits[0]
    rows = [
        logits[start : start + len(row)].float()
        for start, row in zip(packed.starts, token_rows, strict=True)
    ]
    return rows, packed.packing.windows
