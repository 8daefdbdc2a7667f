"""The client package must stay installable and importable without torch/transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Run in a fresh interpreter: this test session may already have imported torch elsewhere.
CHECK = """
import sys
import kenspec.client, kenspec.client.cli, kenspec.api
heavy = sorted({"torch", "transformers", "numpy", "kenspec.server"} & set(sys.modules))
assert not heavy, heavy
"""

ROOT = Path(__file__).resolve().parents[2]  # the repository, where `kenspec/client` lives


def test_client_imports_without_server_dependencies() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def test_messages_pickle_under_their_real_module() -> None:
    import pickle

    from kenspec.api import generator_pb2 as pb

    request = pb.GenerateRequest(prompt="hi")
    assert pb.GenerateRequest.__module__ == "kenspec.api.generator_pb2"
    assert pickle.loads(pickle.dumps(request)) == request
    assert pb.DESCRIPTOR.name == "kenspec/v1/generator.proto"  # what reflection serves
