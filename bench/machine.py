"""What machine a benchmark ran on, recorded beside its figures."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

# The instruction sets that decide kenspec's kernels and dtype (and the peers'): two machines
# named "AMD EPYC" can differ in all of them.
ISA = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine() -> dict:
    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "isa": [name for name in ISA if name in flags],
        "load_avg": [round(load, 2) for load in os.getloadavg()],
        "cores": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
