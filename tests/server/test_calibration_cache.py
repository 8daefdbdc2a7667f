"""Start-up pass costs on disk: a restart on the same machine reads them instead of measuring;
any change in what they depend on, or a damaged file, means measuring again."""

from __future__ import annotations

import json

import pytest

from kenspec.server import calibration_cache, runtime
from kenspec.server.runtime import SAVE_AFTER_PASSES, load_runtime
from kenspec.server.settings import Settings

SECONDS = {(1, 1): 0.02, (1, 2): 0.021, (1, 3): 0.023, (2, 2): 0.024}


def test_an_entry_is_read_back_only_under_its_own_key(tiny_model_dir, tmp_path) -> None:
    key = calibration_cache.cache_key(tiny_model_dir, dtype="torch.float32", k=2)
    path = calibration_cache.store(str(tmp_path), key, SECONDS, source="start-up")
    assert path is not None and path.parent == tmp_path
    assert calibration_cache.load(str(tmp_path), key) == SECONDS
    other = calibration_cache.cache_key(tiny_model_dir, dtype="torch.bfloat16", k=2)
    assert calibration_cache.load(str(tmp_path), other) is None
    assert calibration_cache.store("none", key, SECONDS, source="start-up") is None
    assert calibration_cache.load("none", key) is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: "{not json",
        lambda entry: json.dumps({**entry, "pass_seconds": []}),
        lambda entry: json.dumps({**entry, "pass_seconds": [[1, 1, -1.0]]}),
        lambda entry: json.dumps({**entry, "pass_seconds": [[1, 1, 0.02], [1, 2, 1e999]]}),
        lambda entry: json.dumps({**entry, "key": {**entry["key"], "k": 99}}),
    ],
)
def test_a_damaged_entry_is_ignored(tiny_model_dir, tmp_path, damage) -> None:
    key = calibration_cache.cache_key(tiny_model_dir, k=2)
    path = calibration_cache.store(str(tmp_path), key, SECONDS, source="start-up")
    path.write_text(damage(json.loads(path.read_text())))
    assert calibration_cache.load(str(tmp_path), key) is None


def test_the_key_follows_the_model_files(tiny_model_dir, tmp_path) -> None:
    copy = tmp_path / "model"
    copy.mkdir()
    for file in tiny_model_dir.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    before = calibration_cache.cache_key(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert calibration_cache.cache_key(copy) != before


def test_a_restart_reads_the_costs_and_shutdown_keeps_the_live_ones(
    tiny_model_dir, tiny_draft_path, tmp_path, monkeypatch
) -> None:
    settings = Settings.of(
        model=str(tiny_model_dir),
        draft=str(tiny_draft_path),
        device="cpu",
        dtype="float32",
        calibration_cache=str(tmp_path),
        skinny_gemm=False,
    )
    first = load_runtime(settings)
    (entry,) = tmp_path.glob("*.json")
    assert json.loads(entry.read_text())["source"] == "start-up"
    measured = dict(first.engine.batch.costs.table.seconds)

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(runtime, "calibrate", no_measuring)
    second = load_runtime(settings)
    live = second.engine.batch.costs
    # The warm-up's passes already moved the live table a little; it started from the cache.
    assert live.table.seconds.keys() == measured.keys()
    second.save_costs()  # too few passes to trust over start-up's measurement
    assert json.loads(entry.read_text())["source"] == "start-up"
    for _ in range(SAVE_AFTER_PASSES):
        live.observe(1, 1, 0.5)
    second.save_costs()
    saved = json.loads(entry.read_text())
    assert saved["source"] == "live"
    assert dict(((r, t), s) for r, t, s in saved["pass_seconds"])[1, 1] > measured[1, 1]
    with pytest.raises(AssertionError, match="measured again"):
        load_runtime(settings.replace(num_draft_tokens=3))  # another key: measured
    # An entry under the right key that lacks a width calibration measures is not trusted.
    entry.write_text(json.dumps({**saved, "pass_seconds": [[1, 1, 0.02], [1, 2, 0.02]]}))
    with pytest.raises(AssertionError, match="measured again"):
        load_runtime(settings)


def test_the_automatic_prefix_cache_holds_four_contexts_within_a_tenth_of_memory(
    tiny_target, monkeypatch
) -> None:
    per_position = tiny_target.kv_bytes_per_position
    config = tiny_target.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert per_position == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert runtime._prefix_cache_bytes(3, tiny_target) == 3 << 20  # as set
    monkeypatch.setattr(runtime, "_available_memory_bytes", lambda: 1 << 40)
    assert (
        runtime._prefix_cache_bytes(-1, tiny_target) == 4 * tiny_target.max_context * per_position
    )
    monkeypatch.setattr(runtime, "_available_memory_bytes", lambda: 10 * per_position)
    assert runtime._prefix_cache_bytes(-1, tiny_target) == per_position  # a tenth of it


def test_the_key_of_a_gguf_model_is_its_file(tmp_path) -> None:
    """--model may be a GGUF file (or a folder holding one): the key follows that file."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    assert calibration_cache.cache_key(gguf)["weights"] == [("model.gguf", 40)]
    assert calibration_cache.cache_key(tmp_path)["weights"] == [("model.gguf", 40)]
    gguf.write_bytes(b"GGUF" * 11)
    assert calibration_cache.cache_key(gguf)["weights"] == [("model.gguf", 44)]
