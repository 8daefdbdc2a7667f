"""The outage part of `bench.replicas`: Redis killed and restarted under a mixed load.

Two replicas share answers through a fresh redis-server; two request streams run for
--outage-seconds, each one request after another, cycling through gRPC (the bundled client,
streamed), HTTP streamed and HTTP whole (/v1/completions), alternating the replicas. Redis is
SIGKILLed at 1/3 of the time and restarted on the same port at 2/3. Recorded: every request's
outcome by phase (before, down, after: when it started), the replicas' warnings and errors
(the answer stream's once-per-outage warnings apart from everything else), their
`kenspec_shared_answers_*` metrics, and whether B's index catches up on A's answers after the
restart (B drafts a fresh prompt that A answered from its first round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from bench import fleet
from bench.suite import read_prompts
from harness.server_process import ServerProcess
from kenspec.client import AsyncClient, KenspecError

APIS = ("grpc", "http_stream", "http_whole")
STREAMS = 2
WAIT_S = 60.0  # bounds each catch-up wait; a passing run never reaches it
PREFIX = "kenspec_shared_answers_"


def phase_of(started: float, kill_at: float, back_at: float | None) -> str:
    """A request's phase by when it started (times from the run's start)."""
    if started < kill_at:
        return "before"
    return "down" if back_at is None or started < back_at else "after"


async def grpc_request(client: AsyncClient, prompt: str, tokens: int) -> tuple[int, str | None]:
    try:
        rounds = [r async for r in client.generate(prompt, max_new_tokens=tokens, timeout=120)]
    except KenspecError as error:
        return 0, error.code_name
    if not rounds or rounds[-1].finish_reason is None:
        return 0, "no finish_reason"
    return sum(len(r.token_ids) for r in rounds), None


async def http_request(
    http: httpx.AsyncClient, model: str, prompt: str, tokens: int, stream: bool
) -> tuple[int, str | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": stream}
    if not stream:
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            return 0, f"HTTP {response.status_code}"
        return response.json()["usage"]["completion_tokens"], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return 0, f"HTTP {response.status_code}"
        chunks, done = 0, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks += "error" not in json.loads(line[6:])
        return chunks, None if done else "stream ended without [DONE]"


async def one_request(
    client: AsyncClient, http: httpx.AsyncClient, model: str, api: str, prompt: str, tokens: int
) -> tuple[int, str | None]:
    """(tokens or chunks received, None or the failure's status)."""
    try:
        if api == "grpc":
            return await grpc_request(client, prompt, tokens)
        return await http_request(http, model, prompt, tokens, api == "http_stream")
    except (httpx.HTTPError, OSError, ValueError, KeyError) as error:
        return 0, type(error).__name__


class Load:
    """The request streams and Redis's schedule, timed from one start."""

    def __init__(
        self, replicas: Sequence[ServerProcess], prompts: Sequence[str], args: argparse.Namespace
    ) -> None:
        self.replicas, self.prompts, self.args = replicas, prompts, args
        self.seconds = float(args.outage_seconds)
        self.kill_at, self.back_at = self.seconds / 3, None  # back_at: once Redis is ready
        self.requests: list[dict] = []
        self.killed_at: float | None = None
        self.reconnected_at: float | None = None  # both replicas' links up again
        self.snapshot: list[dict[str, float]] = [{} for _ in replicas]  # taken while down
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start

    async def stream(
        self,
        index: int,
        clients: Sequence[AsyncClient],
        https: Sequence[httpx.AsyncClient],
        model: str,
    ) -> None:
        n = 0
        while self.now() < self.seconds:
            replica, api = (n + index) % 2, APIS[n % len(APIS)]
            prompt = self.prompts[(n * STREAMS + index) % len(self.prompts)]
            started = self.now()
            got, error = await one_request(
                clients[replica], https[replica], model, api, prompt, self.args.max_new_tokens
            )
            self.requests.append(
                {
                    "stream": index,
                    "replica": replica,
                    "api": api,
                    "phase": phase_of(started, self.kill_at, self.back_at),
                    "start_s": started,
                    "seconds": self.now() - started,
                    "received": got,
                    "ok": error is None,
                    "status": error,
                }
            )
            n += 1

    async def outage(self, redis: fleet.Redis, restart: Callable[[], fleet.Redis]) -> fleet.Redis:
        await asyncio.sleep(self.kill_at)
        redis.kill()
        self.killed_at = self.now()
        await asyncio.sleep(max(2 * self.seconds / 3 - self.now(), 0))
        self.snapshot = [fleet.metrics(r, PREFIX) for r in self.replicas]  # nothing moves now
        started = await asyncio.to_thread(restart)
        self.back_at = self.now()
        # Watched under the load, not after it: how soon the replicas' links are back.
        if await until(lambda: links_up(self.replicas)):
            self.reconnected_at = self.now()
        return started


def phases(requests: Sequence[dict]) -> dict:
    by = {}
    for phase in ("before", "down", "after"):
        mine = [r for r in requests if r["phase"] == phase]
        failed = [r for r in mine if not r["ok"]]
        by[phase] = {
            "requests": len(mine),
            "failed": len(failed),
            "statuses": dict(Counter(str(r["status"]) for r in failed)),
            "by_api": dict(Counter(r["api"] for r in mine)),
        }
    return by


def log_troubles(replica: ServerProcess) -> dict:
    """The replica's warnings and errors: the answer stream's warnings (once per link and
    outage, expected) and slow drafts (`draft_slow`: a draft over --draft-latency-budget-s,
    whose answer was still used; how often depends on how busy the machine is, not on Redis)
    apart from everything else (request errors: there must be none)."""
    troubles = [e for e in replica.events if e.get("level") in ("warning", "error", "critical")]

    def warned(e: dict, prefix: str) -> bool:
        return e.get("level") == "warning" and str(e.get("event")).startswith(prefix)

    stream = [e for e in troubles if warned(e, "shared_answers")]
    slow = [e for e in troubles if warned(e, "draft_slow")]
    others = [e for e in troubles if e not in stream and e not in slow]
    return {
        "stream_warnings": [(e.get("event"), e.get("link")) for e in stream],
        "slow_drafts": len(slow),
        "request_errors": len(others),
        "first_request_errors": others[:10],
    }


async def until(check: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll `check` every 0.1 s until it holds (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def sample(replica: ServerProcess, name: str, labels: str = "") -> float:
    return fleet.metrics(replica, PREFIX).get(PREFIX + name + labels, 0.0)


def links_up(replicas: Sequence[ServerProcess]) -> bool:
    return all(
        sample(r, "connected", f'{{link="{link}"}}') == 1
        for r in replicas
        for link in ("publish", "read")
    )


async def catch_up(load: Load, clients: Sequence[AsyncClient], prompt: str) -> dict:
    """After the restart: both replicas reconnect; A answers a fresh prompt; B receives every
    answer A published since the restart (counted against the metrics taken while Redis was
    down, when nothing moves); then B, asked the same prompt once, drafts it from its index
    in its first round."""
    (a, b), (snap_a, snap_b) = load.replicas, load.snapshot
    reconnected = await until(lambda: links_up(load.replicas))
    back_at = load.back_at if load.back_at is not None else load.now()
    reconnect_s = (load.reconnected_at or load.now()) - back_at
    published = sample(a, "published_total")
    await grpc_request(clients[0], prompt, load.args.max_new_tokens)
    sent = await until(lambda: sample(a, "published_total") > published)
    target = sample(a, "published_total") - snap_a.get(PREFIX + "published_total", 0.0)
    start_b = snap_b.get(PREFIX + "received_total", 0.0)
    received = await until(lambda: sample(b, "received_total") - start_b >= target)
    caught_s = load.now() - back_at
    rounds = [r async for r in clients[1].generate(prompt, max_new_tokens=8, timeout=120)]
    source = rounds[0].draft_source if rounds else ""
    caught = reconnected and sent and received and source.startswith("suffix")
    return {
        "caught_up": caught,
        "reconnected": reconnected,
        "reconnect_s": reconnect_s,
        "a_published_fresh": sent,
        "b_received_all": received,
        "a_published_since_restart": target,
        "seconds": caught_s if caught else None,
        "b_first_round_source": source,
    }


async def measure(load: Load, redis: fleet.Redis, restart: Callable[[], fleet.Redis]) -> dict:
    replicas = load.replicas
    clients = [AsyncClient(r.address) for r in replicas]
    https = [
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.http_port}", timeout=120) for r in replicas
    ]
    try:
        model = (await https[0].get("/v1/models")).json()["data"][0]["id"]
        outage = asyncio.create_task(load.outage(redis, restart))
        await asyncio.gather(*(load.stream(i, clients, https, model) for i in range(STREAMS)))
        await outage
        fresh = f"(outage check, after the restart) {load.prompts[0]}"
        return await catch_up(load, clients, fresh)
    finally:
        for client in clients:
            await client.close()
        for http in https:
            await http.aclose()


def run(args: argparse.Namespace, root: Path) -> dict:
    """The outage part on fresh replicas and a fresh redis-server of its own."""
    prompts = read_prompts(args.prompts_dir / "dev.txt", 0)
    redises = [fleet.Redis(root / "redis-outage")]
    # One chain per round: B's first round then names its source (a tree merges them all).
    server_args = ["--tree-budget", "1", *args.base_server_args]
    server_args += ["--share-answers", redises[0].url]
    server_args += ["--port", "0", "--metrics-port", "0"]
    try:
        if args.start_together:
            replicas = fleet.start_together([server_args, server_args])
        else:
            replicas = fleet.start_replicas(2, server_args)
        try:
            load = Load(replicas, prompts, args)

            def restart() -> fleet.Redis:
                redises.append(fleet.Redis(root / "redis-outage", redises[0].port))
                return redises[-1]

            catch = asyncio.run(measure(load, redises[0], restart))
            end_metrics = [fleet.metrics(r, PREFIX) for r in replicas]
        finally:
            fleet.stop_all(replicas)
        logs = [log_troubles(r) for r in replicas]
    finally:
        for redis in redises:
            redis.stop()
    return record(load, server_args, catch, logs, end_metrics)


def record(
    load: Load, server_args: list[str], catch: dict, logs: list[dict], end: list[dict]
) -> dict:
    by_phase = phases(load.requests)
    return {
        "seconds": load.seconds,
        "killed_at_s": load.killed_at,
        "restarted_at_s": load.back_at,
        "server_args": server_args,
        "requests": len(load.requests),
        "failed": sum(p["failed"] for p in by_phase.values()),
        "request_errors": sum(log["request_errors"] for log in logs),
        "slow_drafts": sum(log["slow_drafts"] for log in logs),
        "phases": by_phase,
        "replica_logs": logs,
        "metrics": [{k: v for k, v in m.items() if "_created" not in k} for m in end],
        "catch_up": catch,
        "caught_up": catch["caught_up"],
        "request_log": load.requests,
    }
