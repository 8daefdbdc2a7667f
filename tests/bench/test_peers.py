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
            "--starts",
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
    assert len(report["starts"]) == 2  # each start a fresh server
    for start in report["starts"]:
        assert set(start["summary"]) == {"kenspec AUTO", "kenspec OFF"}
        for mode in ("kenspec AUTO", "kenspec OFF"):
            assert len(start["runs"][mode]) == 2
            assert all(1 <= run["completion_tokens"] <= 8 for run in start["runs"][mode])
            assert start["streams"][mode]["requests"] == 4  # 2 streams x 2 prompts
            assert start["streams"][mode]["tokens"] >= 4
        for run in start["runs"]["kenspec OFF"] + start["runs"]["kenspec AUTO"]:
            assert 1 <= run["events"] <= run["completion_tokens"]  # a text event: >= 1 token
        assert start["calibrated"]["step_ms"] > 0
        assert start["execution_plan"]["plan"].startswith("eager;")  # (float32, tiny model)
    ratio = report["ratios"]["kenspec AUTO / kenspec OFF"]
    assert len(ratio["starts"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    expected = [
        start["summary"]["kenspec AUTO"]["decode_tok_s"]
        / start["summary"]["kenspec OFF"]["decode_tok_s"]
        for start in report["starts"]
    ]
    assert ratio["starts"] == expected
    assert "kenspec AUTO / kenspec OFF streams" in report["ratios"]
    summary = (out / "summary.md").read_text()
    assert "| kenspec OFF |" in summary and "| kenspec AUTO / kenspec OFF |" in summary
    assert summary.count("calibrated step") == 2
    assert (out / "peers.png").stat().st_size > 0
