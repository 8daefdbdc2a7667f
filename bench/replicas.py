"""`python -m bench.replicas`: a fleet of replicas against one replica, on loopback.

1. Sharing: each workload (`templated`, `repeat`, as bench.workloads serves them) sent by the
   bench itself round-robin to --replicas replicas, without and with the shared answer stream
   (`--share-answers` to a redis-server the bench starts), and to one replica serving it all.
   Request i goes to replica i mod N, one request after another as a user sends them; a prompt
   already answered skips the replica that answered it (with plain round robin, whether a
   repeat meets that replica depends on the prompt count modulo N). Each measured prompt is
   sent with speculation on, then off to the same replica (the ratio compares one replica's
   speeds). Per configuration: tokens per round and speed-up on/off, medians over prompts.
2. Routing: five-turn chats (the conversation so far and a new user message each turn)
   through real nginx with deploy/nginx.conf in front of --replicas replicas, with the
   `x-session-id` metadata (prefix routing) and without (calls spread), and through nginx in
   front of one replica: time to first token of turns 2.., measured at the client. The
   conversations with and without the session id alternate on the same replicas, each tagged
   so that none shares a prefix with another, and which goes first alternates too; each
   replica serves a short unmeasured chat first, so that no turn pays a first request's costs.
3. Outage: two replicas sharing answers under a mixed gRPC and HTTP load for
   --outage-seconds, Redis SIGKILLed at 1/3 and restarted on its port at 2/3: failed
   requests per phase, the replicas' warnings and errors, their shared-answer metrics, and
   whether B's index catches up on A's answers after the restart (bench.outage).

Each workload's configurations and each of the two chat set-ups (one replica, --replicas
replicas) get fresh replicas, started one after another (so that their start-up calibrations
do not disturb each other). Arguments after `--` go to every replica.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from bench import fleet, outage, replicas_report, routing
from bench.machine import machine
from bench.suite import read_prompts
from bench.workloads import measure_request, plan, prompt_file, summarize
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient

SHARE_FLAG = "--share-answers"


class RoundRobin:
    """Request i to replica i mod N; a prompt already answered skips the replica that
    answered it last, so that a repeat meets another replica."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0
        self._answered: dict[str, int] = {}

    def pick(self, prompt: str) -> int:
        if self.count > 1 and self._answered.get(prompt) == self._next % self.count:
            self._next += 1
        replica = self._next % self.count
        self._next += 1
        self._answered[prompt] = replica
        return replica


async def serve_round_robin(
    addresses: Sequence[str], warm: Sequence[str], measured: Sequence[str], max_new_tokens: int
) -> tuple[list[dict], list[dict]]:
    """(warm-up requests, measured prompts), each with the replica that served it."""
    clients = [AsyncClient(address) for address in addresses]
    balancer = RoundRobin(len(clients))
    try:
        warm_runs = []
        for prompt in warm:
            replica = balancer.pick(prompt)
            run = await measure_request(clients[replica], prompt, max_new_tokens, "auto")
            warm_runs.append({"prompt": prompt, "replica": replica, **run})
        results = []
        for prompt in measured:
            replica = balancer.pick(prompt)
            on = await measure_request(clients[replica], prompt, max_new_tokens, "auto")
            off = await measure_request(clients[replica], prompt, max_new_tokens, "off")
            results.append({"prompt": prompt, "replica": replica, "on": on, "off": off})
        return warm_runs, results
    finally:
        for client in clients:
            await client.close()


@dataclass(frozen=True, slots=True)
class Setup:
    """Replicas started fresh for one part: a workload's sharing run, or the chats."""

    part: str  # "sharing" or "routing"
    replicas: int
    workload: str = ""  # sharing only
    share: bool = False  # sharing only: --share-answers to a redis-server of its own

    @property
    def name(self) -> str:
        stream = ", shared stream" if self.share else ""
        return f"{self.part} {self.workload} ({self.replicas} replicas{stream})".replace("  ", " ")


def setups(args: argparse.Namespace) -> list[Setup]:
    shares = [False, True] if args.share is None else [args.share]
    planned = []
    if "sharing" in args.parts:
        for workload in args.workloads:
            planned.append(Setup("sharing", 1, workload))
            planned += [Setup("sharing", args.replicas, workload, share) for share in shares]
    if "routing" in args.parts:
        planned += [Setup("routing", 1), Setup("routing", args.replicas)]
    return planned


def replica_args(setup: Setup, args: argparse.Namespace, redis: fleet.Redis | None) -> list[str]:
    extra = [SHARE_FLAG, redis.url] if redis is not None else []
    if setup.part == "routing":
        extra += ["--port", "0"]  # nginx balances the HTTP API too
    return [*args.base_server_args, *extra]


def sharing_run(
    setup: Setup,
    replicas: Sequence[ServerProcess],
    server_args: list[str],
    args: argparse.Namespace,
) -> dict:
    """A workload served round-robin by `replicas` (fresh, and sharing answers if asked)."""
    prompts = read_prompts(prompt_file(setup.workload, args.prompts_dir), args.limit)
    warm, measured = plan(setup.workload, prompts, args.warm)
    addresses = [replica.address for replica in replicas]
    warm_runs, results = asyncio.run(
        serve_round_robin(addresses, warm, measured, args.max_new_tokens)
    )
    config = "one" if setup.replicas == 1 else ("shared" if setup.share else "unshared")
    return {
        "workload": setup.workload,
        "config": config,
        "replicas": setup.replicas,
        "share": setup.share,
        "server_args": server_args,
        "replica_logs": [fleet.replica_log(replica) for replica in replicas],
        "warm": warm_runs,
        "results": results,
        "summary": {
            **summarize(results),
            **answer_counts(warm_runs, results),
            "served_by": dict(Counter(str(r["replica"]) for r in [*warm_runs, *results])),
        },
    }


def answer_counts(warm: Sequence[dict], results: Sequence[dict]) -> dict:
    """Tokens per round over every measured round (the median over prompts swings with one
    prompt when they split between recalled and not), and how many measured answers equal
    the same prompt's warm-up answer (repeat) and its answer with speculation off: bfloat16
    passes of other widths can flip a near-tie, and a changed answer is recalled only up to
    the change."""
    first = {run["prompt"]: run.get("answer") for run in warm}
    repeated = [r for r in results if r["prompt"] in first]
    return {
        "tokens_per_round_all": sum(r["on"]["tokens"] for r in results)
        / max(1, sum(r["on"]["rounds"] for r in results)),
        "repeated": len(repeated),
        "same_as_warm": sum(r["on"].get("answer") == first[r["prompt"]] for r in repeated),
        "same_as_off": sum(r["on"].get("answer") == r["off"].get("answer") for r in results),
    }


def run_setups(planned: Sequence[Setup], args: argparse.Namespace, root: Path) -> dict:
    """Every setup on fresh replicas: started one after another just before it runs, or, with
    --start-together, all side by side at the start. Returns the sharing and routing runs."""
    record: dict[str, list[dict]] = {"sharing": [], "routing": []}
    with ExitStack() as stack:
        redises = [
            stack.enter_context(fleet.Redis(root / f"redis-{i}")) if setup.share else None
            for i, setup in enumerate(planned)
        ]
        arguments = [replica_args(s, args, r) for s, r in zip(planned, redises, strict=True)]
        started = _start_together(planned, arguments, stack) if args.start_together else None
        for index, setup in enumerate(planned):
            if started is not None:
                replicas = started[index]
            else:
                replicas = fleet.start_replicas(setup.replicas, arguments[index])
            try:
                _progress(f"{setup.name}: {len(replicas)} replica(s) ready")
                if setup.part == "sharing":
                    record["sharing"].append(sharing_run(setup, replicas, arguments[index], args))
                else:
                    record["routing"] += routing.runs(replicas, arguments[index], args, root)
            finally:
                fleet.stop_all(replicas)
    return record


def _start_together(
    planned: Sequence[Setup], arguments: Sequence[list[str]], stack: ExitStack
) -> list[list[ServerProcess]]:
    """Every setup's replicas started side by side; per setup, its own."""
    every = fleet.start_together(
        [
            setup_args
            for s, setup_args in zip(planned, arguments, strict=True)
            for _ in range(s.replicas)
        ]
    )
    stack.callback(fleet.stop_all, every)
    ends = itertools.accumulate(s.replicas for s in planned)
    return [every[end - s.replicas : end] for s, end in zip(planned, ends, strict=True)]


def cpu_flags() -> dict[str, bool]:
    """The CPU features that decide the default dtype and the matmul kernels."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    names = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return {name: name in flags for name in names}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--share",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"only with ({SHARE_FLAG}) or only without the shared stream (default: both)",
    )
    parser.add_argument("--parts", default="sharing,routing,outage", help="comma-separated")
    parser.add_argument(
        "--outage-seconds",
        type=float,
        default=120,
        help="outage: the mixed run's length (Redis killed at 1/3, restarted at 2/3)",
    )
    parser.add_argument("--workloads", default="templated,repeat", help="comma-separated")
    parser.add_argument("--prompts-dir", type=Path, default=REPO / "prompts")
    parser.add_argument("--limit", type=int, default=24, help="prompts read per workload (0: all)")
    parser.add_argument("--warm", type=int, default=12, help="templated: unmeasured first ones")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=6, help="first messages: dev.txt")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replicas")
    parser.add_argument(
        "--start-together",
        action="store_true",
        help="start each configuration's replicas side by side, not one after another: "
        "quicker, but their start-up calibrations disturb each other (for tests)",
    )
    parser.add_argument("server_args", nargs="*", help="after --: arguments for every replica")
    args = parser.parse_args(argv)
    if args.replicas < 2:
        parser.error("--replicas must be at least 2 (one replica is always measured beside)")
    if args.turns < 2:
        parser.error("--turns must be at least 2 (turns 2.. are measured)")
    args.parts = [part for part in args.parts.split(",") if part]
    args.workloads = [workload for workload in args.workloads.split(",") if workload]
    if unknown := set(args.parts) - {"sharing", "routing", "outage"}:
        parser.error(f"--parts: unknown {sorted(unknown)}")
    if unknown := set(args.workloads) - {"templated", "repeat", "sequence"}:
        parser.error(f"--workloads: unknown {sorted(unknown)}")
    if args.outage_seconds <= 0:
        parser.error("--outage-seconds must be positive")
    sharing = "sharing" in args.parts and args.share is not False
    if (sharing or "outage" in args.parts) and not _server_shares_answers():
        parser.error(f"this server has no {SHARE_FLAG}: run with --no-share, without outage")
    # The per-source breakdown of bench.workloads reads each round's draft source.
    args.base_server_args = ["--model", args.model, "--draft", args.draft]
    args.base_server_args += ["--report-draft-source", *args.server_args]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kenspec-replicas-") as root:
        runs = run_setups(setups(args), args, Path(root))
        if "outage" in args.parts:
            _progress(f"outage: {args.outage_seconds:g} s, Redis killed at 1/3, back at 2/3")
            runs["outage"] = outage.run(args, Path(root))
    record = {
        "machine": {**machine(), "cpu_flags": cpu_flags()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **runs,
    }
    replicas_report.compare_to_one(record)
    (args.out / "replicas.json").write_text(json.dumps(record, indent=1) + "\n")
    table = replicas_report.tables(record)
    (args.out / "summary.md").write_text(table)
    print(table)
    replicas_report.plot(record, args.out / "replicas.png")
    return 0


def _server_shares_answers() -> bool:
    from kenspec.server.settings import FIELD_GROUPS

    return "share_answers" in FIELD_GROUPS


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
