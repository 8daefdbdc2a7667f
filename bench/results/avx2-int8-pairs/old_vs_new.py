"""One process, two kernel libraries: the grouped products (the decoder pass and the output
layer) of OLD_LIBRARY (a build of the sources before the change, e.g.
~/.cache/kenspec/kernels/<hash>/libkenspec.so of that commit) and of this tree's, passes
alternating in blocks of 10, medians a width; every row's logits compared bit for bit.

    OLD_LIBRARY=... FILE=x.gguf PYTHONPATH=. .venv/bin/python bench/results/avx2-int8-pairs/old_vs_new.py 20

One pass of WIDTHS (1, 2, 4, 8) rows after CONTEXT (200) cached tokens, every row's logits
computed; every other kernel is this tree's.
"""

import ctypes
import logging
import os
import statistics
import sys
import time

import structlog
import torch

from kenspec.server.engine.forward import cpu_kernels
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.params import AttentionMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
OLD = ctypes.CDLL(os.environ["OLD_LIBRARY"])
SWAPPED = ("kenspec_decoder_pass_avx2", "kenspec_gemv_grouped_avx2")
MODE = ["new"]
original = cpu_kernels.CpuKernels._function


def function(self, name):  # type: ignore[no-untyped-def]
    found = original(self, name)
    if name in SWAPPED and MODE[0] == "old":
        old = getattr(OLD, name)
        old.restype, old.argtypes = found.restype, found.argtypes
        return old
    return found


def main() -> None:
    cpu_kernels.CpuKernels._function = function  # type: ignore[method-assign]
    options = ExecutionOptions(lean=LeanMode.AUTO, attention=AttentionMode.AUTO)
    target = TargetModel.load(
        os.environ["FILE"], "cpu", "bfloat16", weights="auto", execution=options
    )
    print(target.plan.describe(), target.weights)
    context = int(os.environ.get("CONTEXT", 200))
    prompt = [(7 + 31 * i) % 40000 + 100 for i in range(context + 20)]
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:context])
    blocks, per = int(sys.argv[1]), 10
    for width in (int(w) for w in os.environ.get("WIDTHS", "1,2,4,8").split(",")):
        step = VerifyPass.sequences([context], [prompt[context : context + width]])
        times: dict[str, list[float]] = {"old": [], "new": []}
        logits = {}
        for block in range(blocks):
            for mode in ("old", "new") if block % 2 else ("new", "old"):
                MODE[0] = mode
                for _ in range(per):
                    started = time.perf_counter()
                    rows = target.forward(cache, step)[0]
                    computed = torch.stack([rows[i] for i in range(width)])
                    times[mode].append(time.perf_counter() - started)
                logits.setdefault(mode, computed)
        old, new = (statistics.median(times[m]) * 1e3 for m in ("old", "new"))
        assert torch.equal(logits["old"], logits["new"])
        print(f"width {width}: old {old:.2f} ms  new {new:.2f} ms  new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
