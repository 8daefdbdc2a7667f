"""What makes a build stage "done": a stamp of its inputs' identity, kept in the output folder.

A stage is skipped when its stamp records the same inputs as this run and its outputs exist;
otherwise it runs again. A stage's stamp is dropped before it starts and written when it ends,
so an interrupted stage is never taken for a finished one.

    stamps = Stamps(Path("drafts/d/work/stages.json"))
    inputs = {"corpus": file_digest(Path("corpus.ids")), "order": 4}
    if not stamps.done("fit", inputs, [Path("drafts/d/model.bin")]):
        stamps.forget("fit")
        fit()
        stamps.record("fit", inputs)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_WHOLE_FILE_BYTES = 8 << 20  # smaller files are hashed whole
_SAMPLE_BYTES = 1 << 20  # of larger ones (weights), their size, first and last MiB


def file_digest(path: Path) -> str:
    """sha256 of a file's content (prompts, corpora: read whole, once per run)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digest(folder: Path) -> str:
    """A model folder's identity: every file's name and size, small files' content, and the
    first and last MiB of large ones. Reading gigabytes of weights on every run would cost more
    than it protects against: a changed checkpoint changes its size or its ends."""
    digest = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not _hidden(p, folder))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= _WHOLE_FILE_BYTES:
                digest.update(f.read())
            else:
                digest.update(f.read(_SAMPLE_BYTES))
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _hidden(path: Path, folder: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(folder).parts)


class Stamps:
    """{stage: inputs} in a JSON file, rewritten whole (atomically) on every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamps: dict[str, Any] = (
            json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        )

    def done(self, stage: str, inputs: dict[str, Any], outputs: Sequence[Path]) -> bool:
        return self._stamps.get(stage) == inputs and all(p.exists() for p in outputs)

    def get(self, stage: str) -> dict[str, Any] | None:
        return self._stamps.get(stage)

    def forget(self, stage: str) -> None:
        if self._stamps.pop(stage, None) is not None:
            self._save()

    def record(self, stage: str, inputs: dict[str, Any]) -> None:
        self._stamps[stage] = inputs
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self._stamps, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, self.path)
