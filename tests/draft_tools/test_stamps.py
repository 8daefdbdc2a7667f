"""draft_tools/stamps.py: a stage is done only with the same inputs and its outputs present."""

from __future__ import annotations

from pathlib import Path

from kenspec.draft_tools.stamps import Stamps, file_digest, folder_digest


def test_a_stage_is_done_with_the_same_inputs_and_its_outputs(tmp_path: Path) -> None:
    output = tmp_path / "model.bin"
    output.write_text("x")
    stamps = Stamps(tmp_path / "work" / "stages.json")
    assert not stamps.done("fit", {"order": 4}, [output])
    stamps.record("fit", {"order": 4, "prune": [0, 1]})

    again = Stamps(tmp_path / "work" / "stages.json")  # read back, as a rerun does
    assert again.done("fit", {"order": 4, "prune": [0, 1]}, [output])
    assert not again.done("fit", {"order": 3, "prune": [0, 1]}, [output])
    assert not again.done("fit", {"order": 4, "prune": [0, 1]}, [output, tmp_path / "gone"])
    again.forget("fit")
    assert Stamps(again.path).get("fit") is None


def test_digests_follow_content(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    (model / ".cache").mkdir()
    first = folder_digest(model)
    (model / ".cache" / "lock").write_text("ignored")  # hidden: not part of the model
    assert folder_digest(model) == first
    monkeypatch.setattr("kenspec.draft_tools.stamps._WHOLE_FILE_BYTES", 1 << 20)  # weights sampled
    sampled = folder_digest(model)
    with weights.open("r+b") as f:  # a changed last byte changes the sampled identity
        f.seek((3 << 20) - 1)
        f.write(b"\x01")
    assert folder_digest(model) != sampled
    (model / "config.json").write_text('{"a": 1}')
    assert file_digest(model / "config.json") != file_digest(weights)
    assert folder_digest(model) not in (first, sampled)
