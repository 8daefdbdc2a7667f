"""scripts/gpu_check.sh and gpu_wheels.sh: syntax, the stages a dry run lists, refused flags.

The GPU stages themselves run only on a GPU machine (scripts/gpu_check.sh --help).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK = REPO_ROOT / "scripts" / "gpu_check.sh"
WHEELS = REPO_ROOT / "scripts" / "gpu_wheels.sh"
STAGES = ["preflight", "deps", "model", "tests", "bench-bf16", "bench-fp32", "context"]


def run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("script", [CHECK, WHEELS], ids=["gpu_check", "gpu_wheels"])
def test_script_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_a_dry_run_lists_every_stage_in_order_within_the_budget() -> None:
    result = run(CHECK, "--dry-run", "--out", "/nonexistent/gpu-check")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[1].rstrip(":") for line in lines if "stage" in line] == STAGES
    budget = re.search(r"budget (\d+)s", result.stdout)
    assert budget is not None and int(budget.group(1)) <= 8 * 60  # the boxes are cut to it
    assert "device cuda" in result.stdout and "pytest -m cuda" in result.stdout
    assert not Path("/nonexistent/gpu-check").exists()  # a dry run writes nothing


def test_a_cpu_dry_run_uses_the_cpu_and_float32_only() -> None:
    result = run(CHECK, "--cpu", "--dry-run", "--draft", "none")
    assert result.returncode == 0, result.stderr
    assert "device cpu" in result.stdout and "draft none" in result.stdout
    assert "dtypes float32" in result.stdout and "bfloat16" not in result.stdout


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (CHECK, ["--bogus"], "unknown argument --bogus"),
        (CHECK, ["--budget", "soon", "--dry-run"], "--budget must be whole seconds"),
        (WHEELS, ["--bogus"], "unknown argument --bogus"),
    ],
)
def test_a_wrong_flag_is_refused_by_name(script: Path, args: list[str], message: str) -> None:
    result = run(script, *args)
    assert result.returncode == 2
    assert message in result.stderr
