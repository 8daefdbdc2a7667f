"""One process, Gemma 3 270M's Q4_K_M file (`make gemma`): its decoder through the Python loop
over the layer kernels (a dozen C calls a layer) and through the whole pass in one C call
(layer_avx2.c's team), alternating in blocks of 10 passes, medians a width; the greedy tokens
compared (the two compute the same bits: tests/server/engine/forward/test_fused_layer.py).

    PYTHONPATH=. .venv/bin/python bench/results/gemma-one-call/one_call_vs_loop.py 30

One row after CONTEXT (200) cached tokens, widths 1, 2, 4, 8; AVX2's layer kernels only (where
they are AVX512-BF16's, Gemma keeps the loop).
"""

import logging
import os
import statistics
import sys
import time

import structlog

from kenspec.server.engine.forward.passes import LeanForward
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.params import AttentionMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
FILE = os.environ.get("GEMMA", "models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf")


def main() -> None:
    options = ExecutionOptions(lean=LeanMode.AUTO, attention=AttentionMode.AUTO)
    target = TargetModel.load(FILE, "cpu", "bfloat16", weights="auto", execution=options)
    print(target.plan.describe(), target.weights)
    assert isinstance(target.passes, LeanForward)
    decoder = target.passes.decoder
    described = decoder._layers
    assert described is not None, "no whole pass here (AVX2's layer kernels only)"
    context = int(os.environ.get("CONTEXT", 200))
    prompt = [(7 + 31 * i) % 40000 + 100 for i in range(context + 20)]
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:context])
    blocks, per = int(sys.argv[1]), 10
    for width in (1, 2, 4, 8):
        step = VerifyPass.sequences([context], [prompt[context : context + width]])
        times: dict[str, list[float]] = {"loop": [], "one call": []}
        tokens = {}
        for block in range(blocks):
            for mode in ("loop", "one call") if block % 2 else ("one call", "loop"):
                decoder._layers = described if mode == "one call" else None
                for _ in range(per):
                    started = time.perf_counter()
                    rows = target.forward(cache, step)[0]
                    token = [rows.argmax(i) for i in range(width)]
                    times[mode].append(time.perf_counter() - started)
                tokens.setdefault(mode, token)
        loop, one = (statistics.median(times[m]) * 1e3 for m in ("loop", "one call"))
        assert tokens["loop"] == tokens["one call"]
        print(
            f"width {width}: loop {loop:.2f} ms  one call {one:.2f} ms  one/loop {one / loop:.3f}"
        )


if __name__ == "__main__":
    main()
