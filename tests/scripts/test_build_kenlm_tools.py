"""scripts/build_kenlm_tools.sh: syntax always; the idempotent fast path when the tools exist.

The full build (apt packages, sdist download, compile) is exercised by CI's setup step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "build_kenlm_tools.sh"


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def _tools_dir() -> Path:
    return Path(os.environ.get("KENSPEC_TOOLS_DIR", REPO_ROOT / "tools"))


@pytest.mark.skipif(
    not (_tools_dir() / "kenlm" / "bin" / "lmplz").exists(), reason="KenLM tools not built"
)
def test_second_run_is_a_quick_no_op() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, check=True
    )
    assert "nothing to do" in result.stdout


def test_refuses_a_tampered_sdist(tmp_path: Path) -> None:
    """When pip hands over a tampered sdist, the build stops on the checksum and deletes it."""
    kenlm_dir = tmp_path / "kenlm"
    kenlm_dir.mkdir()
    fake_pip = tmp_path / "fakepython"
    # A "python" whose `-m pip download` writes a tampered sdist into the -d folder.
    fake_pip.write_text(
        '#!/usr/bin/env bash\nfor a; do dest=$a; done\necho tampered > "$dest/kenlm-0.3.0.tar.gz"\n'
    )
    fake_pip.chmod(0o755)
    env = {
        **os.environ,
        "KENSPEC_TOOLS_DIR": str(tmp_path),
        "KENSPEC_PYTHON": str(fake_pip),
        "KENSPEC_SKIP_APT": "1",  # a test must never apt-get install
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode != 0
    assert "sha256 mismatch" in result.stderr
    assert not (kenlm_dir / "kenlm-0.3.0.tar.gz").exists()
    assert not (kenlm_dir / "bin").exists()
