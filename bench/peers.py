"""kenspec against the servers a CPU user would pick instead, side by side in one run.

    python -m bench.peers --llama-python /path/to/venv/bin/python --out bench/results/peers
    python -m bench.peers --openai vllm=http://127.0.0.1:8001 --openai vllm-ngram=http://...

Same prompts (a chat set, `--limit` of them), greedy, up to `--max-new-tokens`, one request at
a time, then `--streams` concurrent streams:

- kenspec OFF and AUTO: one `python -m server` (flags after `--`), reached over its HTTP API,
  the two modes alternating prompt by prompt (`speculation: "off"` per request); its
  `calibrated` and `execution_plan` log lines are kept with the results;
- llama.cpp through llama-cpp-python (`--llama-python`: the interpreter of a venv holding it,
  never kenspec's), plain and with prompt-lookup decoding, on the default model's own GGUF
  (Q4_1, `--gguf`) and a BF16 copy of it (llama.cpp's quantize: the same values); the Python
  bindings serve one sequence, so it has no concurrent-streams figure;
- any OpenAI-compatible server already running (`--openai NAME=URL`, e.g. vLLM CPU plain and
  with n-gram speculation), one stream and `--streams`.

Per mode, medians over prompts: decode tokens/s ((completion tokens - 1) / (last token's time
- first token's)), time to first token, and for concurrent streams the aggregate tokens/s
(all completion tokens over the wall time). Writes results.json, summary.md and peers.png.
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
    """One streamed greedy chat completion from an OpenAI-compatible server: its timings."""
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    body = {
        "model": served_model(url),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    started = time.perf_counter()
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
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
            if choice.get("delta", {}).get("content"):
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
    """`python -m server` on free ports, its log lines kept."""

    def __init__(self, flags: Sequence[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[dict] = []
        command = [sys.executable, "-m", "server", "--port", str(port + 1), "--http-port",
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
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (0: none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--lookup", type=int, default=6, help="prompt-lookup draft tokens")
    parser.add_argument("--openai", action="append", default=[], help="NAME=URL of a peer")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peers")
    parser.add_argument("server_flags", nargs="*", help="kenspec server flags (after --)")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts, args.limit)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    streams: dict[str, dict] = {}
    failures: dict[str, str] = {}
    server = KenspecServer(args.server_flags, args.port)
    try:
        chat_stream(server.url, "Say hello.", 8)  # a warm-up, not counted
        for i, prompt in enumerate(prompts):
            # AUTO first: an answer OFF gave would be in the suffix index AUTO drafts from.
            for mode in ("auto", "off"):
                result = chat_stream(server.url, prompt, args.max_new_tokens, {"speculation": mode})
                runs.setdefault(f"kenspec {mode.upper()}", []).append(result)
                print(f"kenspec {mode} {i}: {result['decode_tok_s']:.1f} tok/s", flush=True)
        if args.streams:
            for mode in ("off", "auto"):
                streams[f"kenspec {mode.upper()}"] = concurrent(
                    server.url, prompts, args.streams, args.max_new_tokens, {"speculation": mode}
                )
    finally:
        calibrated, plan = server.line("calibrated"), server.line("execution_plan")
        server.stop()
    if args.llama_python:
        if not args.gguf.exists():
            raise SystemExit(f"{args.gguf}: no such GGUF file (make model extracts it; or --gguf)")
        bf16 = args.out / "model-bf16.gguf"
        if not bf16.exists():
            llama_cpp(args.llama_python, {"model": str(args.gguf), "quantize_bf16": str(bf16)})
        for name, model in (("BF16", bf16), ("Q4_1", args.gguf)):
            for lookup in (0, args.lookup):
                label = f"llama.cpp {name}" + (f" lookup {lookup}" if lookup else "")
                job = {"model": str(model), "prompts": prompts, "threads": args.threads,
                       "max_tokens": args.max_new_tokens, "lookup": lookup}  # fmt: skip
                try:
                    runs[label] = llama_cpp(args.llama_python, job)
                except RuntimeError as error:  # one peer's failure costs only its rows
                    failures[label] = str(error)[-500:]
                    print(f"{label}: failed: {failures[label]}", flush=True)
                    continue
                print(f"{label}: {_median(runs[label], 'decode_tok_s'):.1f} tok/s", flush=True)
    for peer in args.openai:
        name, url = peer.split("=", 1)
        runs[name] = [chat_stream(url, p, args.max_new_tokens, {}) for p in prompts]
        if args.streams:
            streams[name] = concurrent(url, prompts, args.streams, args.max_new_tokens, {})
    summary = {
        name: {"decode_tok_s": _median(r, "decode_tok_s"), "ttft_s": _median(r, "ttft_s"),
               "tokens": _median(r, "completion_tokens"), "events": _median(r, "events")}
        for name, r in runs.items()
    }  # fmt: skip
    report = {"machine": machine(), "prompts": str(args.prompts), "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "server_flags": args.server_flags,
              "calibrated": calibrated, "execution_plan": plan, "summary": summary,
              "streams": streams, "failures": failures, "runs": runs}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "summary.md").write_text(_markdown(report))
    _plot(summary, streams, args.out / "peers.png")
    print(_markdown(report))
    return 0


def _markdown(report: dict) -> str:
    lines = ["| server | decode tok/s (median) | TTFT ms | tokens | stream events |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, s in report["summary"].items():
        rate, ttft, tokens, events = (
            "n/a" if value is None else f"{value:{spec}}"
            for value, spec in ((s["decode_tok_s"], ".1f"), (None if s["ttft_s"] is None else
                                s["ttft_s"] * 1000, ".0f"), (s["tokens"], ".0f"),
                                (s["events"], ".0f"))
        )  # fmt: skip
        lines.append(f"| {name} | {rate} | {ttft} | {tokens} | {events} |")
    for name, error in report.get("failures", {}).items():
        lines.append(
            f"| {name} | failed: {error.splitlines()[-1] if error.strip() else 'crashed'} | | | |"
        )
    if report["streams"]:
        lines += ["", "| server | streams | aggregate tok/s |", "|---|---|---|"]
        for name, s in report["streams"].items():
            lines.append(f"| {name} | {s['streams']} | {s['aggregate_tok_s']:.1f} |")
    cal = report.get("calibrated") or {}
    lines += ["", f"calibrated: step {cal.get('step_ms')} ms, verify {cal.get('verify_ms')} ms, "
              f"cost ratio {cal.get('cost_ratio')}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(summary: dict, streams: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, s in summary.items() if s["decode_tok_s"]]
    figure, axes = plt.subplots(1, 2 if streams else 1, figsize=(11 if streams else 6, 4))
    first = axes[0] if streams else axes
    first.barh(names, [summary[n]["decode_tok_s"] for n in names])
    first.set_xlabel("decode tokens/s, one stream (median)")
    if streams:
        axes[1].barh(list(streams), [s["aggregate_tok_s"] for s in streams.values()])
        axes[1].set_xlabel(f"aggregate tokens/s, {next(iter(streams.values()))['streams']} streams")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
