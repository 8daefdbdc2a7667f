"""The soak (bench/soak.py): a short run against the tiny model's server process, and the pure
functions that judge and report a run."""

from __future__ import annotations

import json

from bench import soak

SLOTS, QUEUE = 2, 2  # small, so that a burst of 10 streams overflows at once


def test_a_short_soak_against_the_tiny_server(tiny_server, tmp_path) -> None:
    """Greedy outputs stay exact under the mix, bad input is INVALID_ARGUMENT (never INTERNAL),
    health stays SERVING, descriptors do not grow."""
    server = tiny_server("--max-concurrent-streams", str(SLOTS), "--max-queue", str(QUEUE))
    options = soak.SoakOptions(
        seconds=60,  # the CI soak: a minute of the mix
        concurrency=3,  # at most SLOTS + QUEUE: only bursts may meet a full server
        seed=1,
        prompt_count=6,
        min_new_tokens=8,
        max_new_tokens=24,
        weights={**soak.DEFAULT_WEIGHTS, "bad": 0.3},
        address=server.address,
        pid=server.process.pid,
        burst_streams=SLOTS + QUEUE + 6,
        burst_gap_s=2.0,
        slow_pause_s=1.5,
        sample_every_s=1.0,
        health_every_s=0.5,
        call_timeout_s=60,
        strict_request_id=True,
    )
    try:
        result = soak.run(options, server)  # its log is judged too: errors fail
    finally:
        server.stop()
    soak.write(result, tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert json.loads((tmp_path / "result.json").read_text())["ok"] == result.ok

    assert result.failures == [], summary
    codes = result.codes
    for kind in ("normal", "cancel", "deadline", "slow", "burst"):
        assert kind in codes, summary
    every_code = {code for row in codes.values() for code in row}
    assert not every_code & {"INTERNAL", "UNKNOWN", "CLIENT_ERROR"}, summary
    assert codes["normal"] == {"OK": codes["normal"]["OK"]}, summary
    assert codes["normal"]["OK"] >= 10, summary
    for case in soak.BAD_CASES:  # each case seen, each answered as bad input
        expected = "RESOURCE_EXHAUSTED" if case == "oversize" else "INVALID_ARGUMENT"
        assert set(codes[f"bad:{case}"]) == {expected}, summary
    assert any(burst["resource_exhausted"] for burst in result.bursts), summary
    assert result.mismatches == [], summary
    assert set(result.health["answers"]) == {"SERVING"} and result.health["checks"] >= 10
    fds = result.resources()["fds"]
    assert fds["last"] <= fds["first"] + 4, summary


def _call(kind: str, code: str, **fields) -> soak.Call:
    return soak.Call(kind=kind, code=code, **fields)


def _result(calls, **fields) -> soak.SoakResult:
    values = {
        "options": {"warmup_s": 0.0},
        "server": {},
        "calls": calls,
        "mismatches": [],
        "samples": [],
        "health": {"checks": 3, "answers": {"SERVING": 3}},
        "bursts": [],
        "elapsed_s": 1.0,
        **fields,
    }
    return soak.SoakResult(**values)


def test_judge_fails_on_a_status_a_kind_must_never_get() -> None:
    options = soak.SoakOptions()
    good = [
        _call("normal", "OK"),
        _call("cancel", "CANCELLED"),
        _call("bad:empty_prompt", "INVALID_ARGUMENT"),
        _call("bad:oversize", "RESOURCE_EXHAUSTED"),
        _call("slow", "DEADLINE_EXCEEDED", details="... the server's stream stall timeout ..."),
    ]
    assert soak.judge(_result(good), options)[0] == []
    for wrong in (
        _call("bad:empty_prompt", "INTERNAL"),
        _call("normal", "RESOURCE_EXHAUSTED"),
        _call("cancel", "UNKNOWN"),
        _call("slow", "DEADLINE_EXCEEDED", details="Deadline Exceeded"),  # a hang, not a stall
    ):
        failures, _ = soak.judge(_result([*good, wrong]), options)
        assert failures and wrong.kind in failures[0], wrong
    retried = _call("normal", "OK")  # refused twice by a full server, then served
    retried.refused = 2
    failures, findings = soak.judge(_result([*good, retried]), options)
    assert failures == [] and any("1 calls (2 refusals" in line for line in findings)
    accepted_id = _call("bad:request_id_long", "OK")
    assert soak.judge(_result([accepted_id]), options)[0]
    lenient = soak.SoakOptions(strict_request_id=False)
    failures, findings = soak.judge(_result([accepted_id]), lenient)
    assert failures == [] and "bad:request_id_long" in findings[0]
    unhealthy = {"checks": 3, "answers": {"SERVING": 2, "NOT_SERVING": 1}}
    assert soak.judge(_result(good, health=unhealthy), options)[0]
    mismatch = [{"kind": "normal", "prompt": 0, "text": "x", "position": 3}]
    assert soak.judge(_result(good, mismatches=mismatch), options)[0]
    assert soak.judge(_result(good, bursts=[{"resource_exhausted": 0}]), options)[0]
    # The server's log, when the soak holds it: its errors fail the run, warnings are findings.
    logged = {"log_problems": {"error": {"generate_failed": 2}, "warning": {"draft_slow": 1}}}
    failures, findings = soak.judge(_result(good, server=logged), options)
    assert failures == ["server log: 2 x error generate_failed"]
    assert "server log: 1 x warning draft_slow" in findings


def test_first_difference_of_finished_and_cut_streams() -> None:
    assert soak.first_difference([1, 2, 3], [1, 2, 3], finished=True) is None
    assert soak.first_difference([1, 2], [1, 2, 3], finished=False) is None  # cut short
    assert soak.first_difference([1, 2], [1, 2, 3], finished=True) == 2  # ended early
    assert soak.first_difference([1, 5, 3], [1, 2, 3], finished=True) == 1
    assert soak.first_difference([1, 2, 3, 4], [1, 2, 3], finished=False) == 3


def test_percentile_and_drift() -> None:
    assert soak.percentile([], 0.5) is None
    assert soak.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert soak.percentile([0.0, 10.0], 0.9) == 9.0
    assert soak.percentile([5.0], 0.99) == 5.0
    assert soak.drift([1.0, 2.0, 3.0]) is None
    assert soak.drift([10.0] * 8) == 0.0
    assert soak.drift([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 5.0, 5.0]) == 4.0
    samples = [
        {"phase": "reference", "mix_s": None, "rss_mb": 100.0, "fds": 20},
        *({"phase": "mix", "mix_s": float(t), "rss_mb": 100.0 + t, "fds": 21} for t in range(9)),
        {"phase": "end", "mix_s": 9.0, "rss_mb": 107.0, "fds": 20},
    ]
    report = soak.resource_report(samples, warmup_s=1.0)  # drift over t = 1..8
    assert report["rss_mb"] == {
        "first": 100.0,
        "min": 100.0,
        "max": 108.0,
        "last": 107.0,
        "drift": 6.0,
        "drift_samples": 8,
    }
    assert report["fds"]["drift"] == 0 and report["fds"]["last"] == 20
