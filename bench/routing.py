"""The routing part of `bench.replicas`: multi-turn chats through nginx, each turn's prompt the
conversation so far and a new user message, streamed through gRPC, its time to first token
measured at the client; with the session id (prefix routing) and without (calls spread)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import grpc.aio

from bench import fleet
from bench.suite import read_prompts
from harness.server_process import ServerProcess
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.client.request import build_generate_request

SESSION_HEADER = "x-session-id"  # gRPC metadata; nginx reads it as $http_x_session_id
# Turns 2.. of every conversation: follow-ups that fit any first message.
FOLLOW_UPS = (
    "Can you say that again more briefly?",
    "Give one concrete example.",
    "What is a common mistake people make with this?",
    "Summarise our conversation in one sentence.",
)


def follow_up(turn: int) -> str:
    """The user message of turn `turn` (2, 3, ...)."""
    return FOLLOW_UPS[(turn - 2) % len(FOLLOW_UPS)]


async def chat_turn(
    stub: pb_grpc.GeneratorStub,
    messages: Sequence[tuple[str, str]],
    max_new_tokens: int,
    session: str | None,
) -> dict:
    """One streamed turn: its time to first token (the first message that carries tokens, as
    the client sees it), the answer's text and tokens, and the replica nginx chose."""
    request = build_generate_request(messages=list(messages), max_new_tokens=max_new_tokens)
    metadata = ((SESSION_HEADER, session),) if session else ()
    started = time.perf_counter()
    call = stub.Generate(request, metadata=metadata, timeout=600)
    ttft: float | None = None
    parts: list[str] = []
    tokens = 0
    async for response in call:
        if ttft is None and response.token_ids:
            ttft = time.perf_counter() - started
        parts.append(response.text)
        tokens += len(response.token_ids)
    seconds = time.perf_counter() - started
    initial = await call.initial_metadata()
    return {
        "ttft_s": ttft if ttft is not None else seconds,
        "seconds": seconds,
        "tokens": tokens,
        "text": "".join(parts),
        "upstream": dict(initial).get(fleet.UPSTREAM_HEADER),
    }


async def conversation(
    stub: pb_grpc.GeneratorStub,
    first: str,
    turns: int,
    max_new_tokens: int,
    session: str | None,
) -> list[dict]:
    """`turns` turns, one after another, each answer appended to the conversation."""
    messages: list[tuple[str, str]] = [("user", first)]
    results = []
    for turn in range(1, turns + 1):
        if turn > 1:
            messages.append(("user", follow_up(turn)))
        result = await chat_turn(stub, messages, max_new_tokens, session)
        messages.append(("assistant", result["text"]))
        results.append({"turn": turn, "prompt_messages": len(messages) - 1, **result})
    return results


async def chats(
    address: str,
    plan: Sequence[tuple[str, str, str | None]],
    turns: int,
    max_new_tokens: int,
) -> list[dict]:
    """Each (configuration, first message, session id or None) of `plan` as one conversation,
    in order, over one channel (one HTTP/2 connection to nginx, as one client holds)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        return [
            {
                "config": config,
                "first": first,
                "session": session,
                "turns": await conversation(stub, first, turns, max_new_tokens, session),
            }
            for config, first, session in plan
        ]


async def warm_up(address: str) -> None:
    """Two short unmeasured turns straight to one replica, before any chat reaches it."""
    async with grpc.aio.insecure_channel(address) as channel:
        await conversation(pb_grpc.GeneratorStub(channel), "Hello.", 2, 8, None)


def summarize_chats(conversations: Sequence[dict]) -> dict:
    """Time to first token of turns 2.. (the ones a prefix cache can serve), medians over all
    conversations and per turn; how many replicas each conversation met."""
    later = [t for c in conversations for t in c["turns"] if t["turn"] >= 2]
    by_turn = {
        str(turn): 1000 * statistics.median(t["ttft_s"] for t in group)
        for turn, group in itertools.groupby(
            sorted(later, key=lambda t: t["turn"]), key=lambda t: t["turn"]
        )
    }
    replicas = [len({t["upstream"] for t in c["turns"]}) for c in conversations]
    return {
        "conversations": len(conversations),
        "ttft_ms_median": 1000 * statistics.median(t["ttft_s"] for t in later) if later else None,
        "ttft_ms_median_by_turn": by_turn,
        "turn1_ttft_ms_median": 1000
        * statistics.median(c["turns"][0]["ttft_s"] for c in conversations),
        "replicas_per_conversation_max": max(replicas),
        "replicas_per_conversation_median": statistics.median(replicas),
    }


def plan(firsts: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """(configuration, first message, session id) per conversation: `routed` (with a session
    id) and `spread` (without) alternate, which one goes first alternating per prompt."""
    entries = []
    for index, first in enumerate(firsts):
        pair = [("routed", f"routed-{index}"), ("spread", None)]
        for config, session in pair if index % 2 == 0 else pair[::-1]:
            entries.append((config, f"({config} {index}) {first}", session))
    return entries


def runs(
    replicas: Sequence[ServerProcess], server_args: list[str], args: argparse.Namespace, root: Path
) -> list[dict]:
    """The chats through nginx in front of `replicas`: `single` for one replica, else
    `routed` and `spread` alternating."""
    firsts = read_prompts(args.prompts_dir / "dev.txt", args.conversations)
    if len(replicas) == 1:
        entries = [("single", f"(single {i}) {f}", f"single-{i}") for i, f in enumerate(firsts)]
    else:
        entries = plan(firsts)
    for replica in replicas:  # a first request's costs are the replica's, not the routing's
        asyncio.run(warm_up(replica.address))
    proxy = fleet.Nginx(replicas, root / f"nginx-{len(replicas)}")
    try:
        conversations = asyncio.run(chats(proxy.address, entries, args.turns, args.max_new_tokens))
    finally:
        proxy.stop()
    upstreams = {f"127.0.0.1:{replica.port}": index for index, replica in enumerate(replicas)}
    for chat in conversations:
        for turn in chat["turns"]:
            turn["replica"] = upstreams.get(turn["upstream"])  # None: not one of ours
    logs = [fleet.replica_log(replica) for replica in replicas]
    results = []
    for config in dict.fromkeys(chat["config"] for chat in conversations):
        mine = [chat for chat in conversations if chat["config"] == config]
        results.append(
            {
                "config": config,
                "replicas": len(replicas),
                "session_header": mine[0]["session"] is not None,
                "server_args": server_args,
                "replica_logs": logs,
                "conversations": mine,
                "summary": summarize_chats(mine),
            }
        )
    return results
