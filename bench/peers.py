"""kenspec against the servers a CPU user would pick instead, side by side in one run.

    python -m bench.peers --llama-python /path/to/venv/bin/python --out bench/results/peers
    python -m bench.peers --openai vllm=http://127.0.0.1:8001 --openai vllm-ngram=http://...

What users run: kenspec at its default flags (all cores) unless flags follow `--`, the peers at
the same thread count (`--threads`, default all cores), `--starts` fresh starts of every side
(3), interleaved: a start runs kenspec, then each peer, so the VM's drift hits all alike. Same
prompts (a chat set, `--skip` then `--limit` of them: keep prompts you tuned on out), greedy,
up to `--max-new-tokens`, one request at a time, then `--streams` concurrent streams (`--raw`:
the prompts completed as they are, for a base model without a chat template):

- kenspec OFF and AUTO: one `kenspec serve` (flags after `--`), reached over its HTTP API,
  the two modes alternating prompt by prompt (`speculation: "off"` per request); its
  `calibrated` and `execution_plan` log lines are kept with the results;
- llama.cpp through llama-cpp-python (`--llama-python`: the interpreter of a venv holding it,
  never kenspec's), plain and with prompt-lookup decoding, on the default model's own GGUF
  (Q4_1, `--gguf`; another file with `--gguf`, named in `--llama-files` by its type) and a
  BF16 copy of it (llama.cpp's quantize: the same values); the Python
  bindings serve one sequence, so it has no concurrent-streams figure;
- any OpenAI-compatible server already running (`--openai NAME=URL`, e.g. vLLM CPU plain and
  with n-gram speculation), one stream and `--streams`.

Per mode and start, medians over prompts: decode tokens/s ((completion tokens - 1) / (last
token's time - first token's)), time to first token, and for concurrent streams the aggregate
tokens/s (all completion tokens over the wall time). Each ratio (kenspec AUTO or OFF over each
other side) is taken within a start and reported as min / median / max over the starts, with
every start's `calibrated` and `execution_plan` lines. Writes results.json, summary.md and
peers.png.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

from bench.machine import machine
from bench.suite import read_prompts

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = REPO / ".cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"


_MODELS: dict[str, str] = {}


def served_model(url: str) -> str:
    """The first model id the server lists at /v1/models (vLLM wants it exactly)."""
    if url not in _MODELS:
        parsed = urlparse(url)
        connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
        connection.request("GET", "/v1/models")
        _MODELS[url] = json.loads(connection.getresponse().read())["data"][0]["id"]
        connection.close()
    return _MODELS[url]


def chat_stream(url: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed greedy chat completion from an OpenAI-compatible server (extra "raw":
    a completion of the prompt as it is): its timings."""
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    raw = bool(extra and extra.get("raw"))
    extra = {key: value for key, value in (extra or {}).items() if key != "raw"}
    text = {"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]}
    body = {
        "model": served_model(url),
        **text,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    started = time.perf_counter()
    path = "/v1/completions" if raw else "/v1/chat/completions"
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    pieces, completion = 0, None
    for line in _sse_lines(response):
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            completion = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice.get("text") or choice.get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                pieces += 1
    connection.close()
    tokens = completion if completion is not None else pieces
    return {
        "ttft_s": (first or started) - started,
        "completion_tokens": tokens,
        "events": pieces,
        "decode_tok_s": (tokens - 1) / (last - first) if first and last and last > first else None,
        "seconds": (last or started) - started,
    }


def _sse_lines(response: http.client.HTTPResponse) -> Iterator[str]:
    """The event stream's lines as they arrive (iterating the response would buffer them)."""
    pending = b""
    while data := response.read1(65536):
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line.decode().strip()


def concurrent(
    url: str, prompts: Sequence[str], streams: int, max_tokens: int, extra: dict
) -> dict:
    """`streams` workers, each sending the prompts in its own rotation: aggregate tokens/s."""
    results: list[dict] = []
    lock = threading.Lock()

    def worker(offset: int) -> None:
        for i in range(len(prompts)):
            result = chat_stream(url, prompts[(i + offset) % len(prompts)], max_tokens, dict(extra))
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    tokens = sum(r["completion_tokens"] for r in results)
    return {"streams": streams, "requests": len(results), "tokens": tokens,
            "aggregate_tok_s": tokens / wall, "wall_s": wall}  # fmt: skip


class KenspecServer:
    """`kenspec serve` on free ports, its log lines kept."""

    def __init__(self, flags: Sequence[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[dict] = []
        command = [sys.executable, "-m", "kenspec.server", "--grpc-port", str(port + 1), "--port",
                   str(port), "--metrics-port", "-1", *flags]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.lines.append(record)
            if record.get("event") == "ready":
                break
        else:
            raise RuntimeError("kenspec exited before it was ready: " + json.dumps(self.lines[-3:]))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for _ in self.process.stdout:
            pass

    def line(self, event: str) -> dict | None:
        return next((r for r in self.lines if r.get("event") == event), None)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def llama_cpp(python: str, job: dict) -> list[dict]:
    """Run bench/peer_llama_cpp.py under the peer's interpreter; its per-prompt results."""
    done = subprocess.run(
        [python, str(REPO / "bench/peer_llama_cpp.py")],
        input=json.dumps(job), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker exited {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _median(results: Sequence[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts/dev.txt")
    parser.add_argument("--skip", type=int, default=0, help="prompts skipped before --limit")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (0: none)")
    parser.add_argument(
        "--starts", type=int, default=3, help="fresh starts of every side, interleaved"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="the peers' threads (kenspec's: its own default, all cores, unless its flags say)",
    )
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument(
        "--llama-files",
        default="BF16,Q4_1",
        help="llama.cpp's files to run: BF16 (a copy of --gguf in BF16) and a name for --gguf "
        "itself (its type, e.g. Q4_1 or Q8_0: the label)",
    )
    parser.add_argument("--lookup", type=int, default=0, help="prompt-lookup drafts (0: none)")
    parser.add_argument(
        "--raw", action="store_true", help="prompts completed as they are, no chat template"
    )
    parser.add_argument("--openai", action="append", default=[], help="NAME=URL of a peer")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peers")
    parser.add_argument("server_flags", nargs="*", help="kenspec server flags (after --)")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts, args.skip + args.limit)[args.skip :]
    args.out.mkdir(parents=True, exist_ok=True)
    starts: list[dict] = []
    for number in range(args.starts):  # every side once a start, in turn: drift hits all alike
        start: dict = {"runs": {}, "streams": {}, "failures": {}}
        _kenspec(args, prompts, start)
        _llama(args, prompts, start)
        _openai(args, prompts, start)
        start["summary"] = _summary(start["runs"])
        starts.append(start)
        print(f"start {number + 1}: " + ", ".join(
            f"{name} {s['decode_tok_s']:.1f}" for name, s in start["summary"].items()
            if s["decode_tok_s"]
        ), flush=True)  # fmt: skip
    report = {"machine": machine(), "prompts": str(args.prompts), "skip": args.skip,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "server_flags": args.server_flags,
              "starts": starts, "ratios": ratios(starts)}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "summary.md").write_text(_markdown(report))
    _plot(starts, args.out / "peers.png")
    print(_markdown(report))
    return 0


def _kenspec(args: argparse.Namespace, prompts: Sequence[str], start: dict) -> None:
    """A fresh kenspec server: AUTO and OFF prompt by prompt, then the concurrent streams."""
    server = KenspecServer(args.server_flags, args.port)
    try:
        chat_stream(server.url, "Say hello.", 8, {"raw": args.raw})  # a warm-up, not counted
        for i, prompt in enumerate(prompts):
            # AUTO first: an answer OFF gave would be in the suffix index AUTO drafts from.
            for mode in ("auto", "off"):
                fields = {"speculation": mode, "raw": args.raw}
                result = chat_stream(server.url, prompt, args.max_new_tokens, fields)
                start["runs"].setdefault(f"kenspec {mode.upper()}", []).append(result)
                print(f"kenspec {mode} {i}: {result['decode_tok_s']:.1f} tok/s", flush=True)
        if args.streams:
            for mode in ("off", "auto"):
                start["streams"][f"kenspec {mode.upper()}"] = concurrent(
                    server.url, prompts, args.streams, args.max_new_tokens,
                    {"speculation": mode, "raw": args.raw},
                )  # fmt: skip
    finally:
        start["calibrated"] = server.line("calibrated")
        start["execution_plan"] = server.line("execution_plan")
        server.stop()


def _llama(args: argparse.Namespace, prompts: Sequence[str], start: dict) -> None:
    """llama.cpp on each of --llama-files, plain and (--lookup) with prompt lookup."""
    if not args.llama_python:
        return
    if not args.gguf.exists():
        raise SystemExit(f"{args.gguf}: no such GGUF file (make model extracts it; or --gguf)")
    bf16 = args.out / "model-bf16.gguf"
    if not bf16.exists():
        llama_cpp(args.llama_python, {"model": str(args.gguf), "quantize_bf16": str(bf16)})
    for name in args.llama_files.split(","):  # BF16: the copy; any other: --gguf itself
        for lookup in (0, args.lookup) if args.lookup else (0,):
            label = f"llama.cpp {name}" + (f" lookup {lookup}" if lookup else "")
            model = bf16 if name == "BF16" else args.gguf
            job = {"model": str(model), "prompts": list(prompts), "threads": args.threads,
                   "max_tokens": args.max_new_tokens, "lookup": lookup,
                   "raw": args.raw}  # fmt: skip
            try:
                start["runs"][label] = llama_cpp(args.llama_python, job)
            except RuntimeError as error:  # one peer's failure costs only its rows
                start["failures"][label] = str(error)[-500:]
                print(f"{label}: failed: {start['failures'][label]}", flush=True)
                continue
            rate = _median(start["runs"][label], "decode_tok_s")
            print(f"{label}: {rate:.1f} tok/s", flush=True)


def _openai(args: argparse.Namespace, prompts: Sequence[str], start: dict) -> None:
    """Every --openai peer (already running), one stream, then --streams."""
    for peer in args.openai:
        name, url = peer.split("=", 1)
        start["runs"][name] = [chat_stream(url, p, args.max_new_tokens, {}) for p in prompts]
        if args.streams:
            start["streams"][name] = concurrent(url, prompts, args.streams, args.max_new_tokens, {})


def _summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    return {
        name: {"decode_tok_s": _median(r, "decode_tok_s"), "ttft_s": _median(r, "ttft_s"),
               "tokens": _median(r, "completion_tokens"), "events": _median(r, "events")}
        for name, r in runs.items()
    }  # fmt: skip


def ratios(starts: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Each kenspec mode's median decode rate over every other side's, start by start (one
    start's servers beside each other): {"kenspec AUTO / llama.cpp BF16": {min, median, max,
    starts}}; and the same for aggregate rates at --streams ("... streams")."""
    found: dict[str, list[float]] = {}

    def add(name: str, ours: float | None, theirs: float | None) -> None:
        if ours and theirs:
            found.setdefault(name, []).append(ours / theirs)

    for start in starts:
        summary, streams = start["summary"], start["streams"]
        for mode in ("kenspec AUTO", "kenspec OFF"):
            for other in summary:
                if other != mode and not (mode == "kenspec OFF" and other == "kenspec AUTO"):
                    add(f"{mode} / {other}", (summary.get(mode) or {}).get("decode_tok_s"),
                        summary[other]["decode_tok_s"])  # fmt: skip
            for other in streams:
                if other != mode and not (mode == "kenspec OFF" and other == "kenspec AUTO"):
                    add(f"{mode} / {other} streams",
                        (streams.get(mode) or {}).get("aggregate_tok_s"),
                        streams[other]["aggregate_tok_s"])  # fmt: skip
    return {
        name: {"min": min(v), "median": statistics.median(v), "max": max(v), "starts": v}
        for name, v in found.items()
    }


def _markdown(report: dict) -> str:
    starts = report["starts"]
    names = list(dict.fromkeys(name for start in starts for name in start["summary"]))
    lines = [
        "| server | " + " | ".join(f"start {i + 1}" for i in range(len(starts))) + " |",
        "|---|" + "---|" * len(starts),
    ]
    for name in names:
        cells = []
        for start in starts:
            rate = (start["summary"].get(name) or {}).get("decode_tok_s")
            failed = start["failures"].get(name)
            cells.append("failed" if failed else "n/a" if rate is None else f"{rate:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "decode tokens/s, median over prompts, one stream, each start's servers fresh"]
    stream_names = list(dict.fromkeys(n for start in starts for n in start["streams"]))
    if stream_names:
        lines += ["", "| server | " + " | ".join(f"start {i + 1}" for i in range(len(starts)))
                  + " |", "|---|" + "---|" * len(starts)]  # fmt: skip
        for name in stream_names:
            cells = [f"{start['streams'][name]['aggregate_tok_s']:.1f}"
                     if name in start["streams"] else "n/a" for start in starts]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        streams = next(iter(starts[0]["streams"].values()))["streams"]
        lines += ["", f"aggregate tokens/s at {streams} concurrent streams"]
    lines += ["", "| ratio | min | median | max |", "|---|---|---|---|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {r['min']:.2f} | {r['median']:.2f} | {r['max']:.2f} |")
    lines.append("")
    for i, start in enumerate(starts):
        cal = start.get("calibrated") or {}
        plan = (start.get("execution_plan") or {}).get("plan")
        lines.append(
            f"start {i + 1}: calibrated step {cal.get('step_ms')} ms, verify {cal.get('verify_ms')}"
            f" ms, cost ratio {cal.get('cost_ratio')}, steps {cal.get('steps')}; plan: {plan}"
        )
    return "\n".join(lines) + "\n"


def _plot(starts: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for start in starts for n in start["summary"]))
    figure, axis = plt.subplots(figsize=(8, 0.5 + 0.45 * len(names)))
    for number, start in enumerate(starts):
        rates = [(start["summary"].get(n) or {}).get("decode_tok_s") or 0.0 for n in names]
        offsets = [
            i + (number - (len(starts) - 1) / 2) * 0.8 / len(starts) for i in range(len(names))
        ]
        axis.barh(offsets, rates, height=0.8 / len(starts), label=f"start {number + 1}")
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("decode tokens/s, one stream (median over prompts)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
