"""The engine is pure decoding: importing all of it pulls in neither gRPC nor protobuf, and it
never imports the service around it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHECK = """
import importlib, pkgutil, sys
import kenspec.server.engine
for module in pkgutil.iter_modules(kenspec.server.engine.__path__):
    importlib.import_module(f"kenspec.server.engine.{module.name}")
loaded = set(sys.modules)
service = sorted(name for name in loaded if name.startswith("kenspec.server.") and
                 not name.startswith("kenspec.server.engine"))
heavy = sorted({"grpc", "google.protobuf", "kenspec.api.generator_pb2"} & loaded)
assert not service and not heavy, (service, heavy)
"""


def test_engine_imports_no_grpc_protobuf_or_service() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
