"""`python -m bench.replica_state`: which per-process state a fleet of replicas loses.

bench.replicas measures real replicas on loopback; their tokens per round move with what
each process learned, and that is more than the suffix index the answer stream shares. This
replays bench.replicas' sharing workloads (the same prompts, the same round robin, each
measured prompt sent with speculation on, then off) through in-process engines on one thread:
one engine serving it all, and --replicas engines, each of the state below either kept per
engine or shared by all of them:

- `answers`: every answer learned is added to the other engines' suffix indices, as the
  answer stream adds it (the record's answer and prompt tail); `--lag N` delivers it only
  once N more requests have started (0: before the next one starts);
- `acceptance`: one AcceptanceStats, the per-source priors a request's draft lengths and
  token trees start from;
- `recycled`: one table of the target's recycled predictions;
- `prefixes`: one prefix cache (a repeated prompt's keys and values).

The engines share one loaded target and draft and use the start-up pass costs without live
updates (`--no-live-costs` is added) and no draft latency budget, so that every configuration
chooses drafts by the same costs however loaded the machine: tokens per round and
drafted/accepted counts do not depend on its speed, and only the shared state differs.
Arguments after `--` are server flags (server.settings).

    python -m bench.replica_state --workload repeat --limit 16 \
        --configs one,answers,answers+acceptance,answers+acceptance+recycled+prefixes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.replicas import RoundRobin
from bench.suite import read_prompts
from bench.workloads import plan, prompt_file
from harness.server_process import REPO
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculative_engine import SpeculativeEngine
from kenspec.server.engine.tenant_index import SHARED_TENANT
from kenspec.server.engine.tenant_state import TenantState
from kenspec.server.runtime import Runtime, _load_suffix_index, _warm_up, load_runtime
from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL, Settings, parse_settings

# Pass costs as calibrated at start-up, never updated; the draft-fault breaker never counts
# a slow draft (a loaded machine would switch drafting off for its reset timeout).
FIXED_FLAGS = ("--no-live-costs", "--draft-latency-budget-ms", "1000000")
STATE = ("answers", "acceptance", "recycled", "prefixes")
Learned = tuple[int, str, tuple[int, ...], tuple[int, ...]]  # (engine, tenant, prompt, answer)


class Fleet:
    """`count` fresh engines over the runtime's target, draft and fixed costs, sharing `shared`
    (a subset of STATE)."""

    def __init__(
        self, runtime: Runtime, settings: Settings, count: int, shared: set[str], lag: int
    ):
        template = runtime.engine
        self.engines = [_engine_like(template, settings) for _ in range(count)]
        for engine in self.engines:
            _warm_up(engine)
        first = self.engines[0]
        for engine in self.engines[1:]:
            own, theirs = engine.tenants.of(SHARED_TENANT), first.tenants.of(SHARED_TENANT)
            acceptance = theirs.acceptance if "acceptance" in shared else own.acceptance
            recycled = theirs.recycled if "recycled" in shared else own.recycled
            engine.tenants.adopt(SHARED_TENANT, TenantState(recycled, acceptance))
            if "prefixes" in shared:  # one cache: the batch's and its intake's reference
                engine.batch.prefixes = engine.batch._intake._prefixes = first.batch.prefixes
        self._lag = lag
        self._in_flight: deque[tuple[int, Learned]] = deque()  # (deliver at request, record)
        self._requests = 0
        if "answers" in shared and count > 1:
            for number, engine in enumerate(self.engines):
                engine.on_learned = self._publisher(number)

    def _publisher(self, number: int) -> Callable[[str, Sequence[int], Sequence[int]], None]:
        def publish(tenant: str, prompt: Sequence[int], answer: Sequence[int]) -> None:
            record = (number, tenant, tuple(prompt), tuple(answer))
            self._in_flight.append((self._requests + self._lag, record))

        return publish

    def _deliver(self) -> None:
        """The answers due by now reach every other engine, as the stream's reader adds them."""
        while self._in_flight and self._in_flight[0][0] <= self._requests:
            _, (origin, tenant, prompt, answer) = self._in_flight.popleft()
            for number, engine in enumerate(self.engines):
                if number != origin and engine.suffix is not None:
                    engine.suffix.add(tenant, answer, prompt)

    def serve(
        self, engine: int, prompt_ids: list[int], speculation: SpeculationParams, tokens: int
    ) -> dict:
        """One greedy request on engine `engine`: its counts, as bench.workloads reports them."""
        self._deliver()
        self._requests += 1
        generation = self.engines[engine].start(
            prompt_ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=tokens),
            speculation=speculation,
            tenant=SHARED_TENANT,
        )
        rounds = drafted = accepted = 0
        output: list[int] = []
        sources: list[str] = []
        for round_ in self.engines[engine].batch.rounds(generation):
            if not round_.token_ids:
                continue
            rounds += 1
            output += round_.token_ids
            drafted += round_.drafted
            accepted += round_.accepted
            sources.append(round_.source)
        return {
            "tokens": len(output),
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "tokens_per_round": len(output) / rounds if rounds else 0.0,
            "first_source": sources[0] if sources else "",
            "output": output,
        }


def _engine_like(template: SpeculativeEngine, settings: Settings) -> SpeculativeEngine:
    """A fresh engine as load_runtime builds one (with its helpers), reusing the template's
    target, draft and costs (nothing learned: its own suffix index, priors, recycled table
    and prefix cache)."""
    recycled = template.tenants.of(SHARED_TENANT).recycled
    return SpeculativeEngine(
        template.target,
        template.static_draft,
        template.breaker_settings,
        context=template.context,
        batching=template.batch.settings,
        costs=template.batch.costs,
        suffix=_load_suffix_index(settings, template.target),
        isolate_tenants=template.isolate_tenants,
        recycled=RecycledPredictions(recycled.vocab_size) if recycled is not None else None,
    )


def replay(
    fleet: Fleet,
    runtime: Runtime,
    warm: list[str],
    measured: list[str],
    tokens: int,
    with_off: bool = True,
) -> dict:
    """The workload through the fleet. A measured prompt that was answered before (repeat)
    records whether its answer reproduced the last one: bfloat16 passes of other shapes can
    flip a near-tie, and an answer that changes is recalled only up to the change."""
    encode = runtime.engine.target.encode_chat
    defaults = runtime.defaults
    on = SpeculationParams(
        num_draft_tokens=defaults.num_draft_tokens,
        chain_tokens=defaults.chain_tokens,
        adaptive=defaults.adaptive,
    )
    off = SpeculationParams(enabled=False, chain_tokens=defaults.chain_tokens)
    balancer = RoundRobin(len(fleet.engines))
    ids = {prompt: encode([{"role": "user", "content": prompt}]) for prompt in {*warm, *measured}}
    answers: dict[str, list[int]] = {}
    for prompt in warm:
        answers[prompt] = fleet.serve(balancer.pick(prompt), ids[prompt], on, tokens)["output"]
    results = []
    for prompt in measured:
        engine = balancer.pick(prompt)
        run_on = fleet.serve(engine, ids[prompt], on, tokens)
        output = run_on.pop("output")
        result = {"engine": engine, "on": run_on}
        if prompt in answers:
            result["reproduced"] = output == answers[prompt]
            result["same_prefix"] = _common_prefix(output, answers[prompt])
        if with_off:
            result["same_as_off"] = (
                output == fleet.serve(engine, ids[prompt], off, tokens)["output"]
            )
        results.append(result)
    return {"results": results, "summary": summarize(results)}


def summarize(results: list[dict]) -> dict:
    on = [r["on"] for r in results]
    return {
        "tokens_per_round_median": statistics.median(r["tokens_per_round"] for r in on),
        "tokens_per_round_total": sum(r["tokens"] for r in on)
        / max(1, sum(r["rounds"] for r in on)),
        "tokens": sum(r["tokens"] for r in on),
        "rounds": sum(r["rounds"] for r in on),
        "drafted": sum(r["drafted"] for r in on),
        "accepted": sum(r["accepted"] for r in on),
        "reproduced": sum(r.get("reproduced", False) for r in results),
        "same_as_off": sum(r.get("same_as_off", False) for r in results),
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def parse_configs(text: str) -> list[tuple[str, set[str]]]:
    """ "one,answers,answers+acceptance" -> [("one", set()), ("answers", {"answers"}), ...]."""
    configs = []
    for name in text.split(","):
        parts = set() if name in ("one", "none") else set(name.split("+"))
        if unknown := parts - set(STATE):
            raise SystemExit(
                f"--configs: unknown state {sorted(unknown)} (known: {', '.join(STATE)})"
            )
        configs.append((name, parts))
    return configs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_state", description=__doc__)
    parser.add_argument("--workload", choices=["templated", "repeat"], required=True)
    parser.add_argument("--prompts-dir", type=Path, default=REPO / "prompts")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--warm", type=int, default=8, help="templated: unmeasured first ones")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--configs", default="one,none,answers,answers+acceptance")
    parser.add_argument("--lag", type=int, default=0, help="requests an answer takes to arrive")
    parser.add_argument(
        "--off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also send each measured prompt with speculation off (as bench.replicas)",
    )
    parser.add_argument("--out", type=Path, help="append each configuration as a JSON line here")
    parser.add_argument("server_args", nargs="*", help="after --: server flags")
    args = parser.parse_args(argv)
    settings = parse_settings(
        [
            "--model",
            args.model,
            "--draft",
            args.draft,
            *args.server_args,
            *FIXED_FLAGS,
        ]
    )
    runtime = load_runtime(settings)
    prompts = read_prompts(prompt_file(args.workload, args.prompts_dir), args.limit)
    warm, measured = plan(args.workload, prompts, args.warm)
    for name, shared in parse_configs(args.configs):
        count = 1 if name == "one" else args.replicas
        started = time.perf_counter()
        fleet = Fleet(runtime, settings, count, shared, args.lag)
        record = replay(fleet, runtime, warm, measured, args.max_new_tokens, args.off)
        line = {
            "workload": args.workload,
            "config": name,
            "replicas": count,
            "lag": args.lag,
            **record,
        }
        print(
            name,
            json.dumps(record["summary"]),
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
