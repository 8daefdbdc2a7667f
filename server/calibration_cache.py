"""Start-up pass costs kept on disk, so that a restart on the same machine does not measure again.

An entry is keyed by everything its numbers depend on: the model (its config and weight file
sizes), dtype, device, the CPU (model name, instruction-set flags, cores) and torch's threads,
the torch and transformers versions, the W @ x^T rows chosen for it, and what was measured
(k, batch rows, long-draft widths). Any change is a different key, measured afresh.

What is stored is the live table at shutdown when the server saw enough passes to have
corrected it (engine.live_costs), else the start-up measurement: a calibration taken under a
neighbour's load is not kept for the next process any more than for this one.

A file that cannot be read or does not match its key is ignored (and measured over), never
trusted; the cache is an optimisation, so failing to write it is logged, not fatal.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch
import transformers

log = structlog.get_logger("kenspec.calibration_cache")

FORMAT = 1


def cache_key(model_dir: str | Path, **measured: object) -> dict[str, object]:
    """What a calibration's numbers depend on, as a JSON-able dict (measured: dtype, device,
    k, rows, the skinny rows chosen, ...)."""
    folder = Path(model_dir).expanduser().resolve()
    config = folder / "config.json"
    files = [folder] if folder.is_file() else list(folder.iterdir())  # a GGUF --model: one file
    weights = sorted(
        (path.name, path.stat().st_size)
        for path in files
        if path.suffix in (".safetensors", ".bin", ".pt", ".gguf")
    )
    return {
        "format": FORMAT,
        "model": str(folder),
        "config_sha256": _sha256(config.read_bytes()) if config.is_file() else None,
        "weights": weights,
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **measured,
    }


def load(directory: str, key: Mapping[str, object]) -> dict[tuple[int, int], float] | None:
    """The pass seconds stored under key, or None (no cache, no entry, or an unusable one)."""
    path = _path(directory, key)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if entry.get("key") != json.loads(json.dumps(key)):
            raise ValueError("its key does not match (a hash collision or an edited file)")
        seconds = {(int(r), int(t)): float(s) for r, t, s in entry["pass_seconds"]}
        if not seconds or (1, 1) not in seconds:
            raise ValueError("no usable pass costs in it")
        if not all(0 < value < math.inf for value in seconds.values()):
            raise ValueError("a pass cost in it is not a positive finite number")
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("calibration_cache_ignored", path=str(path), error=str(error))
        return None
    return seconds


def store(
    directory: str,
    key: Mapping[str, object],
    pass_seconds: Mapping[tuple[int, int], float],
    *,
    source: str,
) -> Path | None:
    """Write an entry (atomically: a reader sees the old file or the new one); None if off."""
    path = _path(directory, key)
    if path is None:
        return None
    entry = {
        "key": key,
        "source": source,  # "start-up" or "live"
        "pass_seconds": [[r, t, s] for (r, t), s in sorted(pass_seconds.items())],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entry, indent=1))
        partial.replace(path)
    except OSError as error:
        log.warning("calibration_cache_not_written", path=str(path), error=str(error))
        return None
    return path


def _path(directory: str, key: Mapping[str, object]) -> Path | None:
    if directory.strip().lower() in ("", "none", "off"):
        return None
    digest = _sha256(json.dumps(key, sort_keys=True).encode())[:20]
    return Path(directory).expanduser() / f"{digest}.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cpu() -> dict[str, object]:
    """The CPU as far as kernel speed goes: its model name, instruction-set flags and cores."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name" and not name:
                name = value.strip()
            elif field.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return {
        "name": name or platform.processor(),
        "flags_sha256": _sha256(" ".join(sorted(flags.split())).encode())[:16],
        "cores": os.cpu_count(),
        "machine": platform.machine(),
    }
