"""Start-up time and resident memory of kenspec and llama.cpp serving the same GGUF file.

    python -m bench.footprint --gguf FILE.gguf --llama-python .peers/llama/bin/python \\
        --out bench/results/gguf-weights/footprint.json [-- kenspec serve flags]

kenspec: `kenspec serve --model FILE` (its default flags, plus any after `--`) from the process
start to its `ready` line (a warm cache: run it twice, the first converts the file), then
`--requests` greedy chat completions of `--max-new-tokens`, then its resident set (VmRSS) and
its peak (VmHWM) from /proc. llama.cpp: llama-cpp-python in its own venv loading the file,
the same completions, the same two figures. Figures in MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.peers import KenspecServer, chat_stream

PROMPT = "Write a short story about a robot who learns to paint."
# llama.cpp's side, run by the peer's interpreter: load, complete, report (stdlib + llama_cpp)
_LLAMA = """
import json, sys, time
started = time.perf_counter()
import llama_cpp
job = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=job["model"], n_ctx=4096, n_threads=job["threads"],
                      n_threads_batch=job["threads"], verbose=False)
loaded = time.perf_counter() - started
for _ in range(job["requests"]):
    llm.reset()
    llm.create_chat_completion([{"role": "user", "content": job["prompt"]}],
                               max_tokens=job["max_tokens"], temperature=0.0)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda key: int(status[key].split()[0])
print(json.dumps({"ready_s": loaded, "rss_mib": kib("VmRSS") / 1024,
                  "peak_mib": kib("VmHWM") / 1024}))
"""


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MiB."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
    }


def kenspec(gguf: Path, flags: Sequence[str], requests: int, max_tokens: int) -> dict:
    started = time.perf_counter()
    server = KenspecServer(["--model", str(gguf), *flags], 18180)
    ready = time.perf_counter() - started
    try:
        for _ in range(requests):
            chat_stream(server.url, PROMPT, max_tokens)
        loaded = server.line("model_loaded") or {}
        return {"ready_s": ready, **memory(server.process.pid), "weights": loaded.get("weights")}
    finally:
        server.stop()


def llama(python: str, gguf: Path, threads: int, requests: int, max_tokens: int) -> dict:
    job = {"model": str(gguf), "threads": threads, "requests": requests,
           "max_tokens": max_tokens, "prompt": PROMPT}  # fmt: skip
    done = subprocess.run(
        [python, "-c", _LLAMA, json.dumps(job)], capture_output=True, text=True, check=True
    )
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--starts", type=int, default=2, help="fresh starts of each side")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_flags", nargs="*", help="kenspec server flags (after --)")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"kenspec": [], "llama.cpp": []}
    for _ in range(args.starts):
        runs["kenspec"].append(
            kenspec(args.gguf, args.server_flags, args.requests, args.max_new_tokens)
        )
        runs["llama.cpp"].append(
            llama(args.llama_python, args.gguf, args.threads, args.requests, args.max_new_tokens)
        )
        for name, results in runs.items():
            last = results[-1]
            print(f"{name}: ready {last['ready_s']:.1f} s, resident {last['rss_mib']:.0f} MiB, "
                  f"peak {last['peak_mib']:.0f} MiB", flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": machine(), "gguf": str(args.gguf), "flags": args.server_flags,
                  "runs": runs}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
