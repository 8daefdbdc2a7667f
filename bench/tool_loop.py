"""`python -m bench.tool_loop`: the tool loop of an agent, through the official openai client,
on bench.tool_tasks' twenty tasks, speculation on against off.

A server is started with default flags (then any flags after `--`), its HTTP API on a free port.
Per task, greedy, streamed:

1. the question with `tool_choice: "auto"`: did the model call a tool, and is each call valid
   (an offered function, arguments that validate against its schema)?
2. the question with `tool_choice: "required"`, speculation on, then off: valid calls, the same
   calls on and off, and decode tokens/s of each (tokens after the first round over the time
   from the first event to the last: prefill, the same for both, left out);
3. the calls and the tools' results sent back, `auto`: the answer (text or more calls), on then
   off, timed the same way (skipped when the calls were cut by --max-tokens);
4. a follow-up question on the whole chat, `auto`.

Speculation on goes first for each pair, so its drafts never come from the same request's OFF
answer (earlier tasks' answers are learned, as in service). Prints one JSON line per request
and a summary (medians of the on/off ratios), and writes them to --out.

    python -m bench.tool_loop --out bench/results/tool-loop/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai

from bench.machine import machine
from bench.tool_tasks import TASKS, ToolTask
from harness.server_process import ServerProcess


def _turn(
    client: openai.OpenAI, model: str, chat: list, task: ToolTask, **options: Any
) -> dict[str, Any]:
    """One streamed request: its content, calls, finish reason, tokens and decode speed."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=chat,
        tools=task.tools,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    content, calls, finish, usage = "", [], None, None
    times, round_tokens = [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        times.append(time.perf_counter())
        round_tokens.append(chunk.model_extra["kenspec"]["accepted"] + 1)
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert usage is not None
    tokens = usage.completion_tokens
    decode_tokens = tokens - min(round_tokens[0], tokens) if round_tokens else 0
    decode_seconds = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "content": content,
        "calls": calls,
        "valid": all(_valid(call, task) for call in calls),
        "finish": finish,
        "tokens": tokens,
        "rounds": len(round_tokens),
        "seconds": round(time.perf_counter() - started, 3),
        "decode_tok_s": round(decode_tokens / decode_seconds, 1) if decode_seconds else None,
    }


def _valid(call: dict[str, Any], task: ToolTask) -> bool:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in task.tools}
    if call["name"] not in schemas:
        return False
    try:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _assistant(turn: dict[str, Any]) -> dict[str, Any]:
    """The assistant's turn of calls, as a client sends it back."""
    return {
        "role": "assistant",
        "content": turn["content"] or None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in turn["calls"]
        ],
    }


def run_task(
    client: openai.OpenAI, model: str, index: int, task: ToolTask, max_tokens: int, log
) -> None:
    ask = [{"role": "user", "content": task.question}]
    off = {"extra_body": {"speculation": "off"}}

    def record(step: str, mode: str, turn: dict[str, Any]) -> dict[str, Any]:
        log({"task": index, "step": step, "mode": mode, **turn})
        return turn

    record("auto", "on", _turn(client, model, ask, task, max_tokens=max_tokens))
    required = {"tool_choice": "required", "max_tokens": max_tokens}
    call_on = record("call", "on", _turn(client, model, ask, task, **required))
    record("call", "off", _turn(client, model, ask, task, **required, **off))
    if call_on["finish"] != "tool_calls":  # cut by max_tokens: no whole call to answer
        return
    chat = [*ask, _assistant(call_on)]
    chat += [
        {"role": "tool", "tool_call_id": call["id"], "content": task.results.get(call["name"], "")}
        for call in call_on["calls"]
    ]
    answer = record("answer", "on", _turn(client, model, chat, task, max_tokens=max_tokens))
    record("answer", "off", _turn(client, model, chat, task, max_tokens=max_tokens, **off))
    chat += [
        {"role": "assistant", "content": answer["content"] or "(calls)"},
        {"role": "user", "content": task.follow_up},
    ]
    record("follow_up", "on", _turn(client, model, chat, task, max_tokens=max_tokens))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def pairs(step: str) -> list[tuple[dict, dict]]:
        on = {r["task"]: r for r in rows if r["step"] == step and r["mode"] == "on"}
        off = {r["task"]: r for r in rows if r["step"] == step and r["mode"] == "off"}
        return [(on[task], off[task]) for task in sorted(on) if task in off]

    summary: dict[str, Any] = {}
    for step in ("call", "answer"):
        ratios = [
            on["decode_tok_s"] / off["decode_tok_s"]
            for on, off in pairs(step)
            if on["decode_tok_s"] and off["decode_tok_s"]
        ]
        summary[f"{step}_speedup_median"] = round(statistics.median(ratios), 2) if ratios else None
        summary[f"{step}_speedup_min_max"] = [round(min(ratios), 2), round(max(ratios), 2)]
        summary[f"{step}_tokens_per_round_on"] = round(
            sum(on["tokens"] for on, _ in pairs(step)) / sum(on["rounds"] for on, _ in pairs(step)),
            2,
        )
        summary[f"{step}_same_on_off"] = sum(
            (on["content"], [(c["name"], c["arguments"]) for c in on["calls"]])
            == (off["content"], [(c["name"], c["arguments"]) for c in off["calls"]])
            for on, off in pairs(step)
        )
    calls = [r for r in rows if r["step"] == "call" and r["mode"] == "on"]
    summary["required_valid"] = (
        f"{sum(r['valid'] and bool(r['calls']) for r in calls)}/{len(calls)}"
    )
    # of those, the ones --max-tokens cut mid-call (the model repeating inside a string)
    summary["required_cut"] = sum(r["finish"] == "length" for r in calls)
    autos = [r for r in rows if r["step"] == "auto"]
    summary["auto_called"] = f"{sum(bool(r['calls']) for r in autos)}/{len(autos)}"
    summary["auto_calls_valid"] = sum(r["valid"] for r in autos if r["calls"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON lines of every request")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=len(TASKS))
    parser.add_argument("server_args", nargs="*", help="server flags (after --)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []

    def log(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    server = ServerProcess(["--port", "0", *args.server_args])
    try:
        calibrated = server.logged("calibrated")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0
        )
        model = client.models.list().data[0].id
        for index, task in enumerate(TASKS[: args.limit]):
            run_task(client, model, index, task, args.max_tokens, log)
    finally:
        server.stop()
    summary = {"summary": summarize(rows), "calibrated": calibrated, "machine": machine()}
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as out:
            for row in [*rows, summary]:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
