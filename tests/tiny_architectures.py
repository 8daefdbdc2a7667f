"""Tiny random causal LMs of several architectures, for the architecture matrix.

Each is two layers of width 64 over tests/tiny's byte tokenizer, saved as a real model folder
and loaded through TargetModel.load. Where an architecture has a feature of its own (sliding
window, soft-capping, tied embeddings, Conv1D layers, learned positions, parallel residual,
fused projections), the config turns it on at a size the tests reach: the sliding windows are
16 positions, shorter than a prompt and its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedTokenizerFast

from tests import tiny

WINDOW = 16  # sliding windows: shorter than a test prompt and its answer together
_WIDTH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
_ROTARY = dict(_WIDTH, num_key_value_heads=2, max_position_embeddings=512)


def _llama() -> dict:
    return dict(_ROTARY, tie_word_embeddings=False)


def _qwen2() -> dict:  # biases on q, k and v
    return dict(_ROTARY, tie_word_embeddings=False)


def _qwen2_windowed() -> dict:  # layers from max_window_layers on attend over a window
    return dict(_ROTARY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _qwen3() -> dict:  # q and k norms, an explicit head_dim
    return dict(_ROTARY, head_dim=16, tie_word_embeddings=False)


def _mistral() -> dict:  # every layer attends over a sliding window
    return dict(_ROTARY, sliding_window=WINDOW, head_dim=16)


def _gemma2() -> dict:  # soft-capped scores and logits, tied embeddings, windowed layers
    return dict(
        _ROTARY,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=0.5,  # low enough to bend the scores of a random model
        final_logit_softcapping=3.0,
        initializer_range=0.1,  # larger attention scores, so that capping them matters
        tie_word_embeddings=True,
    )


def _gemma3() -> dict:  # q and k norms, windowed layers with a rotary base of their own
    return dict(
        _ROTARY,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    )


def _phi3() -> dict:  # fused qkv and gate_up projections, a window (Phi-3-mini: 2047)
    return dict(_ROTARY, sliding_window=WINDOW, tie_word_embeddings=False)


def _gpt2() -> dict:  # Conv1D layers, learned absolute positions, tied embeddings
    return dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512)


def _gpt_neox() -> dict:  # parallel residual, partial rotary, fused qkv
    return dict(_WIDTH, max_position_embeddings=512, rotary_pct=0.25, use_parallel_residual=True)


def _opt() -> dict:  # learned positions (offset by 2), biases everywhere
    return dict(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
    )


def _mixtral() -> dict:  # mixture of experts, a window
    return dict(_ROTARY, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW)


def _starcoder2() -> dict:  # biases, layer norms, a window
    return dict(_ROTARY, sliding_window=WINDOW)


def _phi() -> dict:  # Phi-2: parallel attention and MLP, partial rotary, a head with a bias
    return dict(_ROTARY, partial_rotary_factor=0.5)


def _cohere() -> dict:  # scaled logits (logit_scale), parallel attention and MLP
    return dict(_ROTARY, logit_scale=0.5)


def _granite() -> dict:  # multipliers on embeddings, attention scores, residuals and logits
    return dict(
        _ROTARY,
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    )


def _gpt_bigcode() -> dict:  # multi-query attention, Linear layers, learned positions
    return dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512)


# name (the model_type, or a variant of it) -> (config class, model class, config fields)
ARCHITECTURES: dict[str, tuple[str, str, Callable[[], dict]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _llama),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _qwen2),
    "qwen2-windowed": ("Qwen2Config", "Qwen2ForCausalLM", _qwen2_windowed),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _qwen3),
    "mistral": ("MistralConfig", "MistralForCausalLM", _mistral),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _gemma2),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _phi3),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _gpt2),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _gpt_neox),
    "opt": ("OPTConfig", "OPTForCausalLM", _opt),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _mixtral),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _starcoder2),
    "phi": ("PhiConfig", "PhiForCausalLM", _phi),
    "cohere": ("CohereConfig", "CohereForCausalLM", _cohere),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _granite),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", _gpt_bigcode),
}
# Those whose logits are the output layer alone (soft-capped where set): rows read lazily.
# The others (a bias on the head, scaled logits) take the model's own logits.
MODEL_LOGITS = {"phi", "cohere", "granite"}


def save_architecture(
    directory: Path,
    tokenizer: PreTrainedTokenizerFast,
    model_type: str,
    *,
    seed: int = 0,
    random_norms: bool = False,
    **overrides: object,
) -> Path:
    """A random tiny model of `model_type` (a key of ARCHITECTURES) saved with its tokenizer;
    with `random_norms`, each RMSNorm's weight random too, so that norms differ from layer to
    layer and a norm applied with another's weight shows."""
    config_name, model_name, fields = ARCHITECTURES[model_type]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**fields(), **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    if random_norms:  # (Gemma's start at 0 and Llama's at 1: every norm alike)
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.weight.normal_(0.0, 0.3).add_(
                        1.0 if hasattr(module, "variance_epsilon") else 0.0
                    )
    return tiny.save_model(model, tokenizer, directory)
