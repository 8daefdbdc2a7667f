"""The server loads a draft folder's head for its target with --draft-head, refuses another's."""

from __future__ import annotations

import structlog
import torch

from kenspec.server.engine.draft_head import HeadNet, save_head
from kenspec.server.engine.target import TargetModel
from kenspec.server.runtime import _load_head
from kenspec.server.settings import parse_settings
from tests import tiny


def test_a_head_loads_for_its_target_and_is_refused_for_another(
    tiny_model_dir, tiny_target, tmp_path
) -> None:
    folder = tmp_path / "draft"
    net = HeadNet(tiny_target.model.config.hidden_size, 8)
    save_head(folder, net, torch.arange(16), tiny_target.model)
    plain = ["--model", str(tiny_model_dir), "--draft", str(folder)]
    assert _load_head(parse_settings(plain), tiny_target) is None  # off by default
    flags = [*plain, "--draft-head"]
    head = _load_head(parse_settings(flags), tiny_target)
    assert head is not None and head.vocabulary == 16
    assert _load_head(parse_settings([*flags, "--no-draft-head"]), tiny_target) is None
    assert _load_head(parse_settings([*flags, "--no-draft-context"]), tiny_target) is None
    other_dir = tiny.save_tiny_model(tmp_path / "other", tiny.build_byte_tokenizer(), seed=9)
    other = TargetModel.load(other_dir, device="cpu", dtype="float32")
    with structlog.testing.capture_logs() as logs:
        assert _load_head(parse_settings(flags), other) is None  # the server still starts
    refused = [log for log in logs if log["event"] == "draft_head_refused"]
    assert refused and "trained for another target" in refused[0]["reason"]


def test_a_head_is_not_loaded_where_passes_give_logits(tiny_model_dir, tiny_target, tmp_path):
    """A plan whose passes return the model's logits has no hidden states to feed a head."""
    from kenspec.server.engine.forward.plan import ExecutionOptions, HeadKind

    folder = tmp_path / "draft"
    save_head(folder, HeadNet(tiny_target.model.config.hidden_size, 8), torch.arange(16),
              tiny_target.model)  # fmt: skip
    generic = TargetModel.load(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        execution=ExecutionOptions(head=HeadKind.MODEL),
    )
    flags = ["--model", str(tiny_model_dir), "--draft", str(folder), "--draft-head"]
    with structlog.testing.capture_logs() as logs:
        assert _load_head(parse_settings(flags), generic) is None
    assert any("hidden states" in log.get("reason", "") for log in logs)
    (folder / "head.json").write_text("{not json")
    with structlog.testing.capture_logs() as logs:
        assert _load_head(parse_settings(flags), tiny_target) is None  # a warning, no crash
    assert any(log["event"] == "draft_head_refused" for log in logs)
