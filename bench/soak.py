"""`python -m bench.soak`: a server under a bounded, seeded mix of good and hostile calls.

Starts `kenspec serve` on loopback (flags after `--`; without any, the default model and
draft, and `--dtype float32` unless the flags name a dtype) or attaches to `--address` (with
`--pid` for the resource readings). First each prompt of the pool runs alone (greedy) for its
reference tokens; then `--concurrency` client tasks mix, by `--weights`, for `--seconds`:

- normal: a greedy stream to the end, compared token for token with the prompt's reference;
- cancel: read 1-3 messages, then cancel;
- deadline: a gRPC timeout shorter than the prompt took alone (DEADLINE_EXCEEDED);
- bad: one of the bad inputs in BAD_CASES (INVALID_ARGUMENT; RESOURCE_EXHAUSTED when over
  --max-message-bytes);
- slow: read one message, stop reading for --slow-pause-s, then read the rest or cancel;
- burst: more streams at once than the server's slots and queue hold (some RESOURCE_EXHAUSTED),
  at most one per --burst-gap-s. While a burst passes admission no other call starts, so only
  bursts may meet a full server; a call of another kind refused all the same (a cancelled
  call's slot is freed after the pass in flight) is tried again, as a client honouring the
  pushback would, and counted among the findings.

Every stream's tokens, finished or not, must match the reference (a prefix when cut short).
Meanwhile it samples the server's VmRSS and open file descriptors and polls grpc.health.v1.
It prints a summary, writes result.json and summary.md to --out, and exits 1 on a failure:
INTERNAL or UNKNOWN, a greedy mismatch, a status a kind must never get, a health answer other
than SERVING, and with --check-flat memory or descriptor drift over the thresholds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.server_process import REPO, ServerProcess
from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc

DEFAULT_PROMPTS = REPO / "prompts" / "dev.txt"
GENERATE = "/kenspec.v1.Generator/Generate"
DEFAULT_WEIGHTS = {
    "normal": 0.50,
    "cancel": 0.12,
    "deadline": 0.10,
    "bad": 0.14,
    "slow": 0.08,
    "burst": 0.04,
}
BAD_CASES = (
    "empty_prompt",
    "max_new_tokens",
    "temperature",
    "speculation_mode",
    "request_id_control",
    "request_id_long",
    "unparseable",
    "oversize",
)
REQUEST_ID_KINDS = frozenset({"bad:request_id_control", "bad:request_id_long"})
# The status codes each kind of call may end with; anything else is a failure.
ALLOWED = {
    "reference": {"OK"},
    "normal": {"OK"},
    "cancel": {"CANCELLED", "OK"},  # OK: the stream ended before the cancel
    "deadline": {"DEADLINE_EXCEEDED", "OK"},  # OK: it finished within the deadline after all
    "slow": {"OK", "CANCELLED"},  # and DEADLINE_EXCEEDED for the server's stall timeout
    "burst": {"OK", "RESOURCE_EXHAUSTED"},
    "bad:oversize": {"RESOURCE_EXHAUSTED"},
    **{f"bad:{case}": {"INVALID_ARGUMENT"} for case in BAD_CASES if case != "oversize"},
}
NEVER = frozenset({"INTERNAL", "UNKNOWN", "CLIENT_ERROR"})
_RETRIES, _RETRY_S = 3, 0.25  # a refused call that must not be refused: tried again (_stream)


@dataclass
class SoakOptions:
    seconds: float = 60.0
    concurrency: int = 6
    seed: int = 0
    prompts: Path = DEFAULT_PROMPTS
    prompt_count: int = 12  # distinct prompts in the pool, drawn from the file by the seed
    min_new_tokens: int = 16
    max_new_tokens: int = 64
    speculation: str = "auto"  # or "off"
    raw_prompts: bool = False  # send the prompt as raw text instead of a chat user message
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    address: str | None = None  # attach to this server instead of starting one
    pid: int | None = None  # the attached server's process, for RSS and descriptors
    server_args: list[str] = field(default_factory=list)
    burst_streams: int = 0  # 0: the server's --max-concurrent-streams + --max-queue + 8
    burst_new_tokens: int = 4
    burst_gap_s: float = 15.0  # a burst drawn sooner after the last one runs as a normal stream
    max_message_bytes: int = 0  # 0: the server's --max-message-bytes (default 1 MiB)
    slow_pause_s: float = 5.0
    sample_every_s: float = 2.0
    health_every_s: float = 1.0
    health_timeout_s: float = 5.0
    call_timeout_s: float = 120.0  # any stream that runs longer is a hang (DEADLINE_EXCEEDED)
    warmup_s: float | None = None  # mix seconds left out of the drift; None: 20%, at most 60
    strict_request_id: bool = True
    check_flat: bool = False
    max_rss_drift_mb: float = 64.0
    max_fd_drift: float = 8.0


@dataclass
class Item:
    """One prompt of the pool with its fixed max_new_tokens and solo greedy reference."""

    index: int
    prompt: str
    max_new_tokens: int
    reference: list[int] | None = None
    solo_s: float = 0.0


@dataclass
class Call:
    kind: str
    code: str = ""
    started_s: float = 0.0  # since the run began
    ttft_s: float | None = None
    total_s: float | None = None
    messages: int = 0
    tokens: int = 0
    prompt: int | None = None  # index of the pool item
    max_new_tokens: int | None = None
    finished: bool = False  # the last message read carried a finish reason
    retry_hint: str | None = None  # retry metadata on RESOURCE_EXHAUSTED, if any
    refused: int = 0  # attempts refused with RESOURCE_EXHAUSTED before this one (see _stream)
    details: str = ""


@dataclass
class SoakResult:
    options: dict
    server: dict
    calls: list[Call]
    mismatches: list[dict]
    samples: list[dict]
    health: dict
    bursts: list[dict]
    elapsed_s: float
    failures: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def codes(self) -> dict[str, dict[str, int]]:
        return status_table(self.calls)

    def resources(self) -> dict[str, dict]:
        return resource_report(self.samples, self.options["warmup_s"])

    def to_json(self) -> dict:
        return {
            "options": self.options,
            "server": self.server,
            "elapsed_s": round(self.elapsed_s, 3),
            "ok": self.ok,
            "failures": self.failures,
            "findings": self.findings,
            "codes": self.codes,
            "latency": latency_report(self.calls),
            "completed": completed(self.calls),
            "resources": self.resources(),
            "health": self.health,
            "bursts": self.bursts,
            "mismatches": self.mismatches,
            "samples": self.samples,
            "calls": [asdict(call) for call in self.calls],
        }


# ---------------------------------------------------------------------------------------------
# Pure reporting functions


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def drift(values: Sequence[float]) -> float | None:
    """Median of the last quarter minus median of the first quarter; None under 4 values."""
    if len(values) < 4:
        return None
    quarter = len(values) // 4
    return statistics.median(values[-quarter:]) - statistics.median(values[:quarter])


def first_difference(got: Sequence[int], expected: Sequence[int], finished: bool) -> int | None:
    """Where `got` departs from the reference: a finished stream must equal `expected`, one cut
    short must be a prefix of it. None when it matches."""
    for position, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return position
    if len(got) > len(expected) or (finished and len(got) != len(expected)):
        return min(len(got), len(expected))
    return None


def status_table(calls: Sequence[Call]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = defaultdict(Counter)
    for call in calls:
        table[call.kind][call.code] += 1
    return {kind: dict(sorted(codes.items())) for kind, codes in sorted(table.items())}


def latency_report(calls: Sequence[Call]) -> dict[str, dict[str, float | None]]:
    """p50/p90/p99 (ms) of time to first message and whole-stream time of finished normal
    streams."""
    normal = [c for c in calls if c.kind == "normal" and c.code == "OK"]
    report = {}
    for name, values in (
        ("ttft_ms", [c.ttft_s for c in normal if c.ttft_s is not None]),
        ("stream_ms", [c.total_s for c in normal if c.total_s is not None]),
    ):
        report[name] = {
            f"p{round(q * 100)}": None if (v := percentile(values, q)) is None else 1000 * v
            for q in (0.5, 0.9, 0.99)
        }
        report[name]["n"] = len(values)
    return report


def completed(calls: Sequence[Call]) -> dict[str, int]:
    mix = [c for c in calls if c.kind != "reference"]
    return {
        "calls": len(mix),
        "streams_ok": sum(c.code == "OK" for c in mix),
        "normal_ok": sum(c.kind == "normal" and c.code == "OK" for c in mix),
        "tokens": sum(c.tokens for c in mix),
    }


def resource_report(samples: Sequence[dict], warmup_s: float) -> dict[str, dict]:
    """Per reading (rss_mb, fds): first, min, max, last over every sample, and the drift over
    the mix's samples after the warm-up."""
    report = {}
    for name in ("rss_mb", "fds"):
        values = [s[name] for s in samples if s.get(name) is not None]
        settled = [
            s[name]
            for s in samples
            if s.get(name) is not None and s["phase"] == "mix" and s["mix_s"] >= warmup_s
        ]
        report[name] = {
            "first": values[0] if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "last": values[-1] if values else None,
            "drift": drift(settled),
            "drift_samples": len(settled),
        }
    return report


def allowed(call: Call) -> bool:
    """Whether a call's status is one its kind may end with."""
    if call.code in NEVER:
        return False
    if call.code in ALLOWED.get(call.kind, set()):
        return True
    # A slow reader whose window filled: the server may drop it for its stall timeout.
    return call.kind == "slow" and call.code == "DEADLINE_EXCEEDED" and "stall" in call.details


def judge(result: SoakResult, options: SoakOptions) -> tuple[list[str], list[str]]:
    """(failures, findings) of a finished run."""
    failures: list[str] = []
    findings: list[str] = []
    unexpected: Counter = Counter()
    for call in result.calls:
        if not allowed(call):
            unexpected[call.kind, call.code] += 1
    for (kind, code), count in sorted(unexpected.items()):
        if code in NEVER:
            failures.append(f"{kind}: {count} x {code}")
            continue
        line = f"{kind}: {count} x {code} (expected {'/'.join(sorted(ALLOWED[kind]))})"
        if kind in REQUEST_ID_KINDS and not options.strict_request_id:
            findings.append(line)
        else:
            failures.append(line)
    if result.mismatches:
        failures.append(f"{len(result.mismatches)} greedy mismatches against the solo reference")
    bad_health = {k: v for k, v in result.health["answers"].items() if k != "SERVING"}
    if bad_health:
        failures.append(f"health answers other than SERVING: {bad_health}")
    if result.bursts and not any(b["resource_exhausted"] for b in result.bursts):
        failures.append(f"{len(result.bursts)} bursts and not one RESOURCE_EXHAUSTED")
    if result.server.get("exited"):
        failures.append(f"the server process exited during the run: {result.server['exited']}")
    resources = result.resources()
    if options.check_flat:
        rss, fds = resources["rss_mb"]["drift"], resources["fds"]["drift"]
        if rss is not None and rss > options.max_rss_drift_mb:
            failures.append(f"RSS drift {rss:.1f} MB > {options.max_rss_drift_mb:g} MB")
        if fds is not None and fds > options.max_fd_drift:
            failures.append(f"descriptor drift {fds:g} > {options.max_fd_drift:g}")
        if rss is None and fds is None:
            failures.append("--check-flat: too few resource samples after the warm-up")
    deadline = result.codes.get("deadline", {})
    if deadline.get("OK"):
        findings.append(f"deadline: {deadline['OK']} streams finished within the short deadline")
    retried = [c for c in result.calls if c.refused]
    if retried:
        findings.append(
            f"met a full server and tried again after {_RETRY_S} s: {len(retried)} calls "
            f"({sum(c.refused for c in retried)} refusals; a cancelled call's slot is freed "
            "after the pass in flight)"
        )
    exhausted = [c for c in result.calls if c.code == "RESOURCE_EXHAUSTED" and c.kind == "burst"]
    if exhausted:
        hinted = sum(c.retry_hint is not None for c in exhausted)
        findings.append(f"RESOURCE_EXHAUSTED with retry metadata: {hinted} of {len(exhausted)}")
    # The server's own view (when the soak holds its log): an error it logged is a failure even
    # where the client saw an allowed code (e.g. INTERNAL logged for a call the client cancelled).
    for level, events in sorted(result.server.get("log_problems", {}).items()):
        for event, count in sorted(events.items()):
            line = f"server log: {count} x {level} {event}"
            (findings if level == "warning" else failures).append(line)
    if result.server.get("returncode") not in (None, 0):
        failures.append(f"the server exited {result.server['returncode']} after SIGTERM, not 0")
    return failures, findings


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_markdown(result: SoakResult) -> str:
    data = result.to_json()
    options, server = data["options"], data["server"]
    lines = [
        "# Soak",
        "",
        f"- result: **{'PASS' if result.ok else 'FAIL'}**",
        f"- server: {server.get('model')} ({server.get('dtype')}, {server.get('device')}), "
        f"draft {server.get('draft')}, at {server.get('address')}",
        f"- mix: {options['seconds']:g} s, concurrency {options['concurrency']}, seed "
        f"{options['seed']}, {server.get('pool')} prompts from {options['prompts']}, "
        f"max_new_tokens {options['min_new_tokens']}-{options['max_new_tokens']}, speculation "
        f"{options['speculation']}; whole run {data['elapsed_s']:.0f} s",
        f"- completed: {data['completed']['calls']} calls, {data['completed']['streams_ok']} "
        f"streams OK ({data['completed']['normal_ok']} normal), "
        f"{data['completed']['tokens']} tokens",
        f"- greedy mismatches: {len(result.mismatches)}",
        "",
        "## Status codes",
        "",
    ]
    codes = data["codes"]
    columns = sorted({code for row in codes.values() for code in row})
    lines.append("| kind | " + " | ".join(columns) + " |")
    lines.append("|---|" + "---:|" * len(columns))
    for kind, row in codes.items():
        lines.append(f"| {kind} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    lines += [
        "",
        "## Normal streams (ms)",
        "",
        "| | n | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in data["latency"].items():
        lines.append(
            f"| {name} | {row['n']} | {_fmt(row['p50'])} | {_fmt(row['p90'])} | "
            f"{_fmt(row['p99'])} |"
        )
    lines += [
        "",
        "## Server process",
        "",
        "| | first | min | max | last | drift after warm-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in data["resources"].items():
        digits = 1 if name == "rss_mb" else 0
        lines.append(
            f"| {name} | {_fmt(row['first'], digits)} | {_fmt(row['min'], digits)} | "
            f"{_fmt(row['max'], digits)} | {_fmt(row['last'], digits)} | "
            f"{_fmt(row['drift'], digits)} ({row['drift_samples']} samples) |"
        )
    health = data["health"]
    latency = health.get("latency_ms", {})
    lines += [
        "",
        f"Health: {health['answers']} over {health['checks']} checks, "
        f"latency p50 {_fmt(latency.get('p50'), 1)} ms, max {_fmt(latency.get('max'), 1)} ms.",
        f"Bursts: {len(result.bursts)}, with RESOURCE_EXHAUSTED: "
        f"{sum(1 for b in result.bursts if b['resource_exhausted'])}.",
    ]
    if result.mismatches:
        lines += ["", "## Greedy mismatches", ""]
        for m in result.mismatches[:20]:
            lines.append(
                f"- {m['kind']} prompt {m['prompt']} ({m['text']!r}): position {m['position']}"
            )
    for title, items in (("Failures", result.failures), ("Findings", result.findings)):
        if items:
            lines += ["", f"## {title}", "", *(f"- {item}" for item in items)]
    problems = server.get("log_problem_events") or []
    if problems:
        lines += ["", "## Server log, warnings and errors (the first 5)", ""]
        for event in problems[:5]:
            exception = str(event.get("exception", "")).strip().splitlines()
            tail = f": {exception[-1]}" if exception else ""
            lines.append(f"- {event.get('level')} {event.get('event')}{tail}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The run


class Gate:
    """Bursts pass admission alone: a burst waits until no other call is in its admission phase
    (sent, no message yet) and holds new calls back until its own streams are all through."""

    def __init__(self) -> None:
        self.admitting = 0
        self.burst = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def enter(self) -> None:
        while self.burst:
            await self._changed.wait()
        self.admitting += 1

    def leave(self) -> None:
        self.admitting -= 1
        self._notify()

    async def begin_burst(self) -> None:
        while self.burst:
            await self._changed.wait()
        self.burst = True
        while self.admitting:
            await self._changed.wait()

    def end_burst(self) -> None:
        self.burst = False
        self._notify()


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in server flags (the last one wins)."""
    value = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _read_proc(pid: int) -> tuple[float, int, float] | None:
    """(VmRSS in MB, open descriptors, CPU seconds used) of a process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return rss_kb / 1024, fds, cpu_s


class Soak:
    def __init__(self, options: SoakOptions, address: str, pid: int | None) -> None:
        self.options = options
        self.address = address
        self.pid = pid
        self.calls: list[Call] = []
        self.mismatches: list[dict] = []
        self.samples: list[dict] = []
        self.bursts: list[dict] = []
        self.health_answers: Counter = Counter()
        self.health_latency: list[float] = []
        self.gate = Gate()
        self.pool: list[Item] = []
        self.exited: str | None = None
        self.started = time.perf_counter()
        self.mix_started: float | None = None
        self.serial = 0
        self.last_burst: float | None = None
        self.health_started = asyncio.Event()
        self.mode = {"auto": pb.SPECULATION_MODE_AUTO, "off": pb.SPECULATION_MODE_OFF}[
            options.speculation
        ]

    # -- requests ----------------------------------------------------------------------------

    def _request(
        self, kind: str, item: Item, max_new_tokens: int | None = None
    ) -> pb.GenerateRequest:
        self.serial += 1
        request = pb.GenerateRequest(
            request_id=f"soak-{kind}-{self.serial}",
            sampling=pb.SamplingParameters(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens or item.max_new_tokens),
            speculation=pb.SpeculationParameters(mode=self.mode),
        )
        if self.options.raw_prompts:
            request.prompt = item.prompt
        else:
            request.messages.messages.add(role="user", content=item.prompt)
        return request

    def _check(self, call: Call, item: Item | None, tokens: list[int]) -> None:
        if item is None or item.reference is None or not tokens:
            return
        limit = call.max_new_tokens or item.max_new_tokens
        expected = item.reference[:limit]
        position = first_difference(tokens, expected, call.finished)
        if position is not None:
            self.mismatches.append(
                {
                    "kind": call.kind,
                    "prompt": item.index,
                    "text": item.prompt[:80],
                    "position": position,
                    "expected": expected[position] if position < len(expected) else None,
                    "got": tokens[position] if position < len(tokens) else None,
                    "code": call.code,
                    "tokens": len(tokens),
                }
            )

    async def _stream(
        self,
        kind: str,
        start: Callable[[], grpc.aio.UnaryStreamCall],
        *,
        item: Item | None = None,
        max_new_tokens: int | None = None,
        cancel_after: int | None = None,
        pause_s: float | None = None,
        cancel_after_pause: bool = False,
        gated: bool = True,
        admitted: asyncio.Event | None = None,
        refused: int = 0,
    ) -> Call:
        """One Generate call read as the kind says; its record (tokens checked).

        A kind that must not meet a full server is tried again (up to _RETRIES times, after
        _RETRY_S) when refused with RESOURCE_EXHAUSTED, as a client honouring the pushback
        would: the gate keeps bursts apart, but a cancelled or timed-out call holds its slot
        on the server until the pass in flight ends, a little after the client let it go."""
        call = Call(kind=kind, prompt=item.index if item else None, refused=refused)
        call.max_new_tokens = max_new_tokens or (item.max_new_tokens if item else None)
        if gated:
            await self.gate.enter()
        through = False

        def admit() -> None:  # the call is past admission: a first message, or its end
            nonlocal through
            if not through:
                through = True
                if gated:
                    self.gate.leave()
                if admitted is not None:
                    admitted.set()

        tokens: list[int] = []
        began = time.perf_counter()
        call.started_s = began - self.started
        try:
            rpc = start()
            while True:
                response = await rpc.read()
                if response is grpc.aio.EOF:
                    break
                call.messages += 1
                if call.ttft_s is None:
                    call.ttft_s = time.perf_counter() - began
                    admit()
                tokens.extend(response.token_ids)
                if response.finish_reason:
                    call.finished = True
                if cancel_after is not None and call.messages >= cancel_after:
                    rpc.cancel()
                    break
                if pause_s is not None and call.messages == 1:
                    await asyncio.sleep(pause_s)
                    if cancel_after_pause:
                        rpc.cancel()
                        break
            call.code = (await rpc.code()).name
        except grpc.aio.AioRpcError as error:
            call.code = error.code().name
            call.details = (error.details() or "")[:300]
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                for key, value in error.trailing_metadata() or ():
                    if "retry" in key.lower():
                        call.retry_hint = f"{key}={value!r}"
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the soak's own bug: reported, the run goes on
            call.code = "CLIENT_ERROR"
            call.details = repr(error)[:300]
        finally:
            admit()
        if (
            call.code == "RESOURCE_EXHAUSTED"
            and call.code not in ALLOWED.get(kind, ())
            and refused < _RETRIES
        ):
            await asyncio.sleep(_RETRY_S)
            return await self._stream(
                kind,
                start,
                item=item,
                max_new_tokens=max_new_tokens,
                cancel_after=cancel_after,
                pause_s=pause_s,
                cancel_after_pause=cancel_after_pause,
                gated=gated,
                admitted=admitted,
                refused=refused + 1,
            )
        call.total_s = time.perf_counter() - began
        call.tokens = len(tokens)
        self._check(call, item, tokens)
        self.calls.append(call)
        return call

    def _generate(self, request) -> Callable[[], grpc.aio.UnaryStreamCall]:
        return lambda: self.stub.Generate(request, timeout=self.options.call_timeout_s)

    # -- kinds -------------------------------------------------------------------------------

    async def normal(self, rng: random.Random) -> None:
        item = rng.choice(self.pool)
        await self._stream("normal", self._generate(self._request("normal", item)), item=item)

    async def cancel(self, rng: random.Random) -> None:
        item = rng.choice(self.pool)
        request = self._request("cancel", item)
        await self._stream(
            "cancel", self._generate(request), item=item, cancel_after=rng.randint(1, 3)
        )

    async def deadline(self, rng: random.Random) -> None:
        item = rng.choice(self.pool)
        timeout = max(0.005, item.solo_s * rng.uniform(0.1, 0.5))
        request = self._request("deadline", item)
        await self._stream(
            "deadline", lambda: self.stub.Generate(request, timeout=timeout), item=item
        )

    async def slow(self, rng: random.Random) -> None:
        item = rng.choice(self.pool)
        request = self._request("slow", item)
        await self._stream(
            "slow",
            self._generate(request),
            item=item,
            pause_s=self.options.slow_pause_s,
            cancel_after_pause=rng.random() < 0.5,
        )

    async def bad(self, rng: random.Random) -> None:
        case = rng.choice(BAD_CASES)
        item = rng.choice(self.pool)
        short = 4  # should the server accept it after all, its tokens are still checked
        request = self._request(f"bad-{case}", item, short)
        start = self._generate(request)
        if case == "empty_prompt":
            request.prompt = ""
        elif case == "max_new_tokens":
            request.stopping.max_new_tokens = self.max_new_tokens_limit + 1
        elif case == "temperature":
            request.sampling.temperature = -1.0
        elif case == "speculation_mode":
            request.speculation.mode = 7  # no such SpeculationMode
        elif case == "request_id_control":
            request.request_id = "soak-" + "r" * 97 + "\x07" + "r" * 97
        elif case == "request_id_long":
            request.request_id = "r" * 100_000
        elif case == "unparseable":
            raw = self.channel.unary_stream(
                GENERATE, response_deserializer=pb.GenerateResponse.FromString
            )
            data = b"\x12\x05ab"  # the prompt field says 5 bytes; 2 follow
            start = lambda: raw(data, timeout=self.options.call_timeout_s)  # noqa: E731
        elif case == "oversize":
            request.prompt = "x" * (self.max_message_bytes + 1)
        checked = item if case.startswith("request_id") else None
        await self._stream(f"bad:{case}", start, item=checked, max_new_tokens=short)

    async def burst(self, rng: random.Random) -> None:
        now = time.perf_counter()
        if self.last_burst is not None and now - self.last_burst < self.options.burst_gap_s:
            await self.normal(rng)
            return
        self.last_burst = now
        count, short = self.burst_streams, self.options.burst_new_tokens
        await self.gate.begin_burst()
        try:
            passed = [asyncio.Event() for _ in range(count)]
            tasks = []
            for event in passed:
                item = rng.choice(self.pool)
                request = self._request("burst", item, short)
                stream = self._stream(
                    "burst",
                    self._generate(request),
                    item=item,
                    max_new_tokens=short,
                    gated=False,
                    admitted=event,
                )
                tasks.append(asyncio.create_task(stream))
            # A stream stuck past the call timeout ends with DEADLINE_EXCEEDED: a failure.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(e.wait() for e in passed)), self.options.call_timeout_s
                )
        finally:
            self.gate.end_burst()
        calls = await asyncio.gather(*tasks)
        self.bursts.append(
            {
                "at_s": round(calls[0].started_s, 3),
                "streams": count,
                "codes": dict(Counter(c.code for c in calls)),
                "resource_exhausted": sum(c.code == "RESOURCE_EXHAUSTED" for c in calls),
            }
        )

    # -- background readings -----------------------------------------------------------------

    def sample(self, phase: str) -> None:
        if self.pid is None:
            return
        reading = _read_proc(self.pid)
        if reading is None:
            self.exited = self.exited or f"/proc/{self.pid} is gone"
            return
        now = time.perf_counter()
        mix_s = now - self.mix_started if self.mix_started is not None else None
        self.samples.append(
            {
                "t_s": round(now - self.started, 3),
                "phase": phase,
                "mix_s": None if mix_s is None else round(mix_s, 3),
                "rss_mb": round(reading[0], 2),
                "fds": reading[1],
                "cpu_s": round(reading[2], 2),  # the server's CPU time: against load1, contention
                "load1": os.getloadavg()[0],
            }
        )

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample("mix" if self.mix_started is not None else "reference")
            await _sleep_unless(stop, self.options.sample_every_s)

    async def health(self, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                began = time.perf_counter()
                try:
                    answer = await stub.Check(
                        health_pb2.HealthCheckRequest(service=""),
                        timeout=self.options.health_timeout_s,
                    )
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
                except grpc.aio.AioRpcError as error:
                    status = f"error:{error.code().name}"
                self.health_answers[status] += 1
                self.health_latency.append(time.perf_counter() - began)
                self.health_started.set()
                await _sleep_unless(stop, self.options.health_every_s)

    # -- phases ------------------------------------------------------------------------------

    async def references(self) -> None:
        """Each pool prompt alone, greedy, one after another: its reference tokens."""
        for item in self.pool:
            holder: list[int] = []
            request = self._request("reference", item)
            call = Call(kind="reference", prompt=item.index)
            began = time.perf_counter()
            call.started_s = began - self.started
            try:
                async for response in self.stub.Generate(
                    request, timeout=self.options.call_timeout_s
                ):
                    holder.extend(response.token_ids)
                    call.messages += 1
                    if call.ttft_s is None:
                        call.ttft_s = time.perf_counter() - began
                    call.finished = call.finished or bool(response.finish_reason)
                call.code = "OK"
                item.reference = holder
            except grpc.aio.AioRpcError as error:
                call.code = error.code().name
                call.details = (error.details() or "")[:300]
            call.total_s = item.solo_s = time.perf_counter() - began
            call.tokens = len(holder)
            self.calls.append(call)

    async def worker(self, index: int, end: float) -> None:
        rng = random.Random(f"{self.options.seed}:{index}")
        kinds = [k for k, w in self.options.weights.items() if w > 0]
        weights = [self.options.weights[k] for k in kinds]
        while time.perf_counter() < end:
            kind = rng.choices(kinds, weights)[0]
            await getattr(self, kind)(rng)

    async def run(self) -> None:
        options = self.options
        async with grpc.aio.insecure_channel(
            self.address, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            self.channel = channel
            self.stub = pb_grpc.GeneratorStub(channel)
            self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            self.max_new_tokens_limit = self.info.max_new_tokens_limit
            stop = asyncio.Event()
            background = [asyncio.create_task(self.health(stop))]
            try:
                # The first reading once both channels are open: it counts their descriptors.
                await asyncio.wait_for(self.health_started.wait(), 60)
                background.append(asyncio.create_task(self.sampler(stop)))
                await self.references()
                self.pool = [item for item in self.pool if item.reference is not None]
                if self.pool:
                    self.mix_started = time.perf_counter()
                    end = self.mix_started + options.seconds
                    workers = [self.worker(i, end) for i in range(options.concurrency)]
                    limit = options.seconds + options.call_timeout_s + options.slow_pause_s + 30
                    await asyncio.wait_for(asyncio.gather(*workers), limit)
                await asyncio.sleep(1.0)  # let the server let go of what the last calls held
                self.sample("end")
            finally:
                stop.set()
                await asyncio.gather(*background)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def build_pool(options: SoakOptions) -> list[Item]:
    rng = random.Random(f"{options.seed}:pool")
    lines = [line.strip() for line in options.prompts.read_text().splitlines() if line.strip()]
    chosen = rng.sample(lines, min(options.prompt_count, len(lines)))
    return [
        Item(i, prompt, rng.randint(options.min_new_tokens, options.max_new_tokens))
        for i, prompt in enumerate(chosen)
    ]


def _log_problems(events: Sequence[dict]) -> list[dict]:
    """The server's log events at warning level and above."""
    return [e for e in events if e.get("level") in ("warning", "error", "critical", "exception")]


def run(options: SoakOptions, process: ServerProcess | None = None) -> SoakResult:
    """The whole soak: start a server (or use `process`, which the caller stops, or attach to
    options.address), references, the mix; judged. The server's log is judged too when the soak
    holds it (a server it started, or `process`)."""
    if set(options.weights) - set(DEFAULT_WEIGHTS):
        raise ValueError(f"unknown kinds in weights: {set(options.weights) - set(DEFAULT_WEIGHTS)}")
    if options.speculation not in ("auto", "off"):
        raise ValueError("speculation must be auto or off")
    server_args = list(options.server_args)
    owned = process is None and options.address is None
    if owned:
        if _flag(server_args, "--dtype") is None:
            server_args += ["--dtype", "float32"]
        process = ServerProcess(server_args)
    if process is not None:
        address, pid = process.address, process.process.pid
    else:
        address, pid = options.address, options.pid
    slots = int(_flag(server_args, "--max-concurrent-streams") or 8)
    queue = int(_flag(server_args, "--max-queue") or 32)
    if options.concurrency > slots + queue:
        raise ValueError(
            f"--concurrency {options.concurrency} exceeds the server's slots and queue "
            f"({slots} + {queue}): normal streams would meet a full server outside bursts"
        )
    warmup = options.warmup_s if options.warmup_s is not None else min(60.0, options.seconds / 5)
    soak = Soak(options, address, pid)
    soak.burst_streams = options.burst_streams or slots + queue + 8
    soak.max_message_bytes = options.max_message_bytes or int(
        _flag(server_args, "--max-message-bytes") or 1 << 20
    )
    soak.pool = build_pool(options)
    try:
        asyncio.run(soak.run())
    finally:
        if owned:
            process.stop()
    info = soak.info
    server = {
        "address": address,
        "pid": pid,
        "args": server_args if owned else None,
        "model": info.model,
        "draft": info.draft,
        "dtype": info.dtype,
        "device": info.device,
        "version": info.version,
        "max_new_tokens_limit": info.max_new_tokens_limit,
        "burst_streams": soak.burst_streams,
        "max_message_bytes": soak.max_message_bytes,
        "pool": len(soak.pool),
        "exited": soak.exited,
    }
    if owned:
        server["returncode"] = process.process.returncode
    if process is not None:
        problems = _log_problems(process.events)
        by_level: dict[str, Counter] = defaultdict(Counter)
        for event in problems:
            by_level[str(event.get("level"))][str(event.get("event"))] += 1
        server["log_problems"] = {level: dict(events) for level, events in by_level.items()}
        server["log_problem_events"] = [
            {k: v[-3000:] if isinstance(v, str) else v for k, v in e.items()}
            for e in problems[:100]
        ]
    latency = [1000 * s for s in soak.health_latency]
    result = SoakResult(
        options={**asdict(options), "prompts": str(options.prompts), "warmup_s": warmup},
        server=server,
        calls=soak.calls,
        mismatches=soak.mismatches,
        samples=soak.samples,
        health={
            "checks": sum(soak.health_answers.values()),
            "answers": dict(soak.health_answers),
            "latency_ms": {"p50": percentile(latency, 0.5), "max": max(latency, default=None)},
        },
        bursts=soak.bursts,
        elapsed_s=time.perf_counter() - soak.started,
    )
    result.failures, result.findings = judge(result, options)
    return result


def write(result: SoakResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(result))


def parse_weights(text: str) -> dict[str, float]:
    """`normal=50,burst=0` over the defaults."""
    weights = dict(DEFAULT_WEIGHTS)
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        if kind.strip() not in DEFAULT_WEIGHTS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}")
        weights[kind.strip()] = float(value)
    return weights


def parse_args(argv: Sequence[str] | None) -> tuple[SoakOptions, Path | None]:
    """The options and the --out directory."""
    defaults = SoakOptions()
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__.split("\n\n")[0],
        epilog="Server flags go after --, e.g. -- --model models/smollm2-135m-instruct",
    )
    add = parser.add_argument
    add("--seconds", type=float, default=defaults.seconds, help="length of the mix")
    add("--concurrency", type=int, default=defaults.concurrency, help="client tasks")
    add("--seed", type=int, default=defaults.seed)
    add("--prompts", type=Path, default=defaults.prompts, help="one prompt a line")
    add("--prompt-count", type=int, default=defaults.prompt_count)
    add("--min-new-tokens", type=int, default=defaults.min_new_tokens)
    add("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    add("--speculation", choices=("auto", "off"), default=defaults.speculation)
    add("--raw-prompts", action="store_true", help="raw text, not a chat user message")
    add("--weights", type=parse_weights, default=defaults.weights, help="e.g. normal=50,burst=0")
    add("--address", help="attach to this server (HOST:PORT) instead of starting one")
    add("--pid", type=int, help="the attached server's process id, for RSS and descriptors")
    add("--burst-streams", type=int, default=0, help="0: server slots + queue + 8")
    add("--burst-new-tokens", type=int, default=defaults.burst_new_tokens)
    add("--burst-gap-s", type=float, default=defaults.burst_gap_s, help="seconds between bursts")
    add("--max-message-bytes", type=int, default=0, help="0: the server's flag or 1 MiB")
    add("--slow-pause-s", type=float, default=defaults.slow_pause_s)
    add("--sample-every-s", type=float, default=defaults.sample_every_s)
    add("--health-every-s", type=float, default=defaults.health_every_s)
    add("--health-timeout-s", type=float, default=defaults.health_timeout_s)
    add("--call-timeout-s", type=float, default=defaults.call_timeout_s)
    add("--warmup-s", type=float, help="mix seconds left out of the drift (20%%, at most 60)")
    add("--strict-request-id", action=argparse.BooleanOptionalAction, default=True)
    add("--check-flat", action="store_true", help="fail on RSS or descriptor drift")
    add("--max-rss-drift-mb", type=float, default=defaults.max_rss_drift_mb)
    add("--max-fd-drift", type=float, default=defaults.max_fd_drift)
    add("--out", type=Path, help="write result.json and summary.md here")
    add("server_args", nargs="*", help="after --: flags for kenspec serve")
    values = vars(parser.parse_args(argv))
    out = values.pop("out")
    return SoakOptions(**values), out


def main(argv: Sequence[str] | None = None) -> int:
    options, out = parse_args(argv)
    result = run(options)
    if out is not None:
        write(result, out)
    print(summary_markdown(result), end="")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
