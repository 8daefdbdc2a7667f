"""Tiny models and checks the quantized-weights tests share (test_int8_weights.py,
test_int4_weights.py): a Llama, a Qwen2 with random q/k/v biases, and the two exactness checks
a quantized target must pass (greedy speculation = plain decoding of the same target; in
float32, the engine's greedy output = transformers' `generate` on the quantized model)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import OracleDraft, generate, never_matching_kenlm, plain_decoding
from tests.tiny_architectures import save_architecture

PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3", "Hello world"]


def llama(directory: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    return save_architecture(directory / "llama", tokenizer, "llama")


def biased_qwen2(directory: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> Path:
    """Biases on q, k and v (random: they start at zero), which a fused product adds."""
    saved = save_architecture(directory / "qwen2", tokenizer, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(saved)
    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in model.base_model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias.normal_(std=0.5)
    return tiny.save_model(model, tokenizer, saved)


def check_greedy_speculation_is_plain_decoding(target: TargetModel, tmp_path: Path) -> None:
    """Whatever is drafted (always right, never right), greedy output equals plain decoding
    of the same target, token for token."""
    plain = plain_decoding(target, PROMPTS, max_new_tokens=20)
    seen = {token for _, output in plain.values() for token in output}
    never = never_matching_kenlm(target, tmp_path / "never.arpa", seen)
    for ids, expected in plain.values():
        for draft in (OracleDraft(expected), never):
            solo = generate(target, draft, ids, max_new_tokens=20, k=4)
            for _ in solo:
                pass
            assert solo.output_ids == expected, draft.name


def check_float32_decoding_is_generate(target: TargetModel) -> None:
    """The engine's greedy output equals transformers' `generate` on the target's model."""
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        output = target.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=20,
        )  # fmt: skip
        solo = generate(target, None, ids, max_new_tokens=20, enabled=False)
        for _ in solo:
            pass
        assert solo.output_ids == output[0, len(ids) :].tolist()
