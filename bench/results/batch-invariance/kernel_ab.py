"""The kernels of --batch-invariant against the default ones, alternated in one process:
one pass of 1 and of 7 tokens after a chat prompt (bench/results/batch-invariance/NOTES.md).

    PYTHONPATH=. python bench/results/batch-invariance/kernel_ab.py
"""

import statistics
import time

from server.engine.invariant import make_invariant, undo_invariant
from server.engine.target import TargetModel
from server.engine.verify_pass import VerifyPass
from server.settings import DEFAULT_MODEL

t = TargetModel.load(str(DEFAULT_MODEL), device="cpu", dtype="bfloat16")
prompt = t.encode_chat(
    [{"role": "user", "content": "Explain in two sentences why the sky is blue. " * 3}]
)


def timed(width, reps=5):
    cache = t.new_cache(1)
    t.prefill(cache, 0, 0, prompt)
    out = []
    for _ in range(reps):
        s = time.perf_counter()
        logits = t.forward(cache, VerifyPass.sequences([len(prompt)], [[100] * width]))
        _ = logits[0][0]
        _ = logits[0][width - 1]
        out.append(time.perf_counter() - s)
    return statistics.median(out)


res = {"default": {1: [], 7: []}, "invariant": {1: [], 7: []}}
state = None
for _round in range(12):
    for mode in ("default", "invariant"):
        if mode == "invariant":
            state = make_invariant(t)
        for w in (1, 7):
            res[mode][w].append(timed(w))
        if mode == "invariant":
            undo_invariant(t, state)
for mode in res:
    print(mode, {w: round(1000 * statistics.median(v), 2) for w, v in res[mode].items()}, "ms")
