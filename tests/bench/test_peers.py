"""bench.peers end to end on the tiny model: a real server, OFF and AUTO over HTTP streams."""

from __future__ import annotations

import json
import socket

from bench.peers import main


def _free_pair() -> int:
    """A port p with p + 1 free too (HTTP on p, gRPC on p + 1)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def test_peers_measures_kenspec_off_and_auto(tiny_model_dir, tiny_draft_path, tmp_path) -> None:
    prompts = tmp_path / "dev.txt"
    prompts.write_text("The quick brown fox\nHello world\nover the\n")
    out = tmp_path / "out"
    code = main(
        [
            "--prompts",
            str(prompts),
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--streams",
            "2",
            "--port",
            str(_free_pair()),
            "--out",
            str(out),
            "--",
            "--model",
            str(tiny_model_dir),
            "--draft",
            str(tiny_draft_path),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--breaker-threshold",
            "0",
        ]
    )
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert set(report["summary"]) == {"kenspec AUTO", "kenspec OFF"}
    for mode in ("kenspec AUTO", "kenspec OFF"):
        assert len(report["runs"][mode]) == 2
        assert all(1 <= run["completion_tokens"] <= 8 for run in report["runs"][mode])
        assert report["streams"][mode]["requests"] == 4  # 2 streams x 2 prompts
        assert report["streams"][mode]["tokens"] >= 4
    for run in report["runs"]["kenspec OFF"] + report["runs"]["kenspec AUTO"]:
        assert 1 <= run["events"] <= run["completion_tokens"]  # a text event holds >= 1 token
    assert report["calibrated"]["step_ms"] > 0
    assert "| kenspec OFF |" in (out / "summary.md").read_text()
    assert (out / "peers.png").stat().st_size > 0
