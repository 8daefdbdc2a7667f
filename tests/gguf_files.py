"""GGUF files written in a test from a tiny Llama, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Hugging Face parameter name (after "model.layers.N.") -> GGUF tensor name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_llama(
    tokenizer: PreTrainedTokenizerFast, hidden: int = 32, intermediate: int = 64, tied: bool = True
) -> LlamaForCausalLM:
    """A tiny Llama (two layers, 4 query heads and 2 key/value heads), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def gguf_loaded_tied_llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A tiny Llama with tied embeddings whose config claims GGUF quantization, as a model
    transformers loaded from a GGUF file carries (what the plain copy must drop)."""
    model = tiny_llama(tokenizer)
    model.config.quantization_config = {"quant_method": "gguf"}
    return model


def _permuted(weight: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of q and k (transformers undoes it on load)."""
    rows = weight.shape[0]
    grouped = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape).numpy()


def _tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    config = model.config
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": state["model.norm.weight"].numpy(),
        "output.weight": state["lm_head.weight"].numpy(),
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in _LAYER_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf_name}"]
            if gguf_name == "attn_q.weight":
                array = _permuted(weight, config.num_attention_heads)
            elif gguf_name == "attn_k.weight":
                array = _permuted(weight, config.num_key_value_heads)
            else:
                array = weight.numpy()
            tensors[f"blk.{layer}.{gguf_name}"] = array
    return tensors


def _add_tokenizer(
    writer: GGUFWriter, tokenizer: PreTrainedTokenizerFast, eot_token_id: int | None = None
) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if token in special else TokenType.NORMAL for token in tokens]
    )
    merges = spec["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _llama_writer(path: Path, config: LlamaConfig) -> GGUFWriter:
    """A writer with a Llama's header (llama.cpp's keys for the config's shapes)."""
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer


def write_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    eot_token_id: int | None = None,
) -> Path:
    """The model's weights in F32 (exact) with its tokenizer and chat template (and an end of
    turn token, `tokenizer.ggml.eot_token_id`, when given)."""
    writer = _llama_writer(path, model.config)
    writer.add_file_type(0)  # all F32
    _add_tokenizer(writer, tokenizer, eot_token_id)
    for name, array in _tensors(model).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    _finish(writer)
    return path


def write_header_only_gguf(
    path: Path, architecture: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32
) -> Path:
    """A GGUF file with one tensor of the given type: enough for the checks made at load."""
    writer = GGUFWriter(path, architecture)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # the raw bytes of one block per row, as the type lays them out
        from gguf import GGML_QUANT_SIZES

        _, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = np.zeros((4, block_bytes), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    _finish(writer)
    return path


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Where each K-quant block keeps its float16 factors (ggml's block structs): d, and dmin
_F16_FIELDS = {
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
}


def quantized_blocks(
    weight: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """weight [rows, cols] in `qtype`'s raw blocks: gguf's own quantization where it has one
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); else (the K-quants) random blocks with float16 factors of
    the weight's scale: a tensor whose dequantization *is* the weight served."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    if qtype not in _F16_FIELDS:
        return quantize(np.ascontiguousarray(weight, dtype=np.float32), qtype)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = weight.shape
    blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    step = np.float32(np.abs(weight).max() / 2000)
    for offset in _F16_FIELDS[qtype]:
        factors = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * step).astype(np.float16)
        blocks[..., offset : offset + 2] = factors[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_quantized_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    qtype: GGMLQuantizationType,
    output_qtype: GGMLQuantizationType | None = None,
    float_layers: frozenset[str] = frozenset(),
) -> Path:
    """As write_llama_gguf, with the decoder's linear layers in `qtype` and the token
    embedding (and an untied output layer) in `output_qtype` (None: F32); layers named in
    `float_layers` (GGUF names, e.g. "ffn_down.weight") stay F32."""
    rng = np.random.default_rng(0)
    writer = _llama_writer(path, model.config)
    writer.add_file_type(0)
    _add_tokenizer(writer, tokenizer)
    tied = model.config.tie_word_embeddings
    for name, array in _tensors(model).items():
        if tied and name == "output.weight":
            continue  # llama.cpp's files of tied models have none
        linear = name.startswith("blk.") and array.ndim == 2
        chosen = qtype if linear else output_qtype if array.ndim == 2 else None
        if linear and name.split(".", 2)[2] in float_layers:
            chosen = None
        if chosen is None:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, quantized_blocks(array, chosen, rng), raw_dtype=chosen)
    _finish(writer)
    return path
