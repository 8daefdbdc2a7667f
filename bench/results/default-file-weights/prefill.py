"""Prefill time of one long prompt: the default folder served as the file keeps it (gguf) and
in bf16, alternating in one process."""

import statistics
import time
from pathlib import Path

from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass

MODEL = "models/smollm2-135m-instruct"
targets = {
    w: TargetModel.load(
        MODEL, device="cpu", weights=w, execution=ExecutionOptions(lean=LeanMode.AUTO)
    )
    for w in ("auto", "bf16")
}
text = Path("prompts/grounded.txt").read_text()
for n in (256, 1024, 2048):
    ids = targets["auto"].encode_prompt(text)[:n]
    times = {w: [] for w in targets}
    for _ in range(3):
        for w, t in targets.items():
            cache = t.new_cache(1)
            started = time.perf_counter()
            t.forward(cache, VerifyPass.sequences([0], [ids]))
            times[w].append(time.perf_counter() - started)
    print(
        n,
        len(ids),
        {
            w: f"{statistics.median(v) * 1e3:.0f} ms ({len(ids) / statistics.median(v):.0f} tok/s)"
            for w, v in times.items()
        },
        flush=True,
    )
