"""Loading targets: clear errors for bad folders; dtype and device resolution; cache rollback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server.engine import target as target_module
from server.engine.target import TargetLoadError, TargetModel, resolve_dtype


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TargetLoadError, match="does not exist"):
        TargetModel.load(tmp_path / "missing")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(TargetLoadError, match=r"no config\.json"):
        TargetModel.load(tmp_path)


def test_non_causal_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert"})
    )
    with pytest.raises(TargetLoadError, match="not a causal language model"):
        TargetModel.load(tmp_path)


def test_cuda_requested_without_cuda(tiny_model_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.xfail("this machine has CUDA")  # the check is for CPU-only machines like CI
    with pytest.raises(TargetLoadError, match="CUDA is not available"):
        TargetModel.load(tiny_model_dir, device="cuda")


def test_dtype_resolution(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cuda) is torch.bfloat16
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) is torch.float32
    assert resolve_dtype("float32", cuda) is torch.float32
    with pytest.raises(TargetLoadError, match="dtype 'int8'"):
        resolve_dtype("int8", cpu)


def test_rollback_restores_the_cache_exactly(tiny_target: TargetModel) -> None:
    """Scoring after a crop equals scoring on a cache that never saw the rejected tokens."""
    prompt = tiny_target.encode_prompt("The quick brown fox")
    rolled = tiny_target.new_cache()
    tiny_target.prefill(rolled, prompt)
    tiny_target.forward(rolled, [5, 6, 7])
    tiny_target.rollback(rolled, 3)
    fresh = tiny_target.new_cache()
    tiny_target.prefill(fresh, prompt)
    assert rolled.get_seq_length() == fresh.get_seq_length() == len(prompt)
    after_rollback, never_seen = (
        tiny_target.forward(rolled, [9, 10]),
        tiny_target.forward(fresh, [9, 10]),
    )
    for row in range(2):
        torch.testing.assert_close(after_rollback[row], never_seen[row])


def test_lazy_transposed_head_only_in_float32(
    tiny_model_dir: Path, tiny_target: TargetModel
) -> None:
    assert tiny_target.head_t is not None  # llama, float32: rows through the transposed head
    bf16 = TargetModel.load(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert bf16.head_t is None  # transformers' own head, as `generate` uses it
    logits = bf16.forward(bf16.new_cache(), bf16.encode_prompt("Hello"))
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32
