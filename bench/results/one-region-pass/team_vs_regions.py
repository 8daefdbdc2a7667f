"""One process, two kernel libraries: the decoder pass of OLD_LIBRARY (a build of the sources
before the change, e.g. ~/.cache/kenspec/kernels/<hash>/libkenspec.so of that commit) and of
this tree's, passes alternating in blocks of 10, medians a width; the greedy tokens compared.

    OLD_LIBRARY=... PYTHONPATH=. .venv/bin/python bench/results/one-region-pass/team_vs_regions.py 30
    WEIGHTS=bf16 OLD_LIBRARY=... PYTHONPATH=. .venv/bin/python ...   # the bf16-weight pass

The default model (its Q4_1 file's groups, or --weights bf16), one row after CONTEXT (200)
cached tokens, widths 1, 2, 3, 4, 8; every other kernel is this tree's.
"""

import ctypes
import logging
import os
import statistics
import sys
import time

import structlog

from kenspec.server.engine.forward import cpu_kernels
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.params import AttentionMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from kenspec.server.settings import DEFAULT_MODEL

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
OLD = ctypes.CDLL(os.environ["OLD_LIBRARY"])
MODE = ["new"]
original = cpu_kernels.CpuKernels._function


def function(self, name):  # type: ignore[no-untyped-def]
    found = original(self, name)
    if name == "kenspec_decoder_pass_avx2" and MODE[0] == "old":
        old = OLD.kenspec_decoder_pass_avx2
        old.restype, old.argtypes = found.restype, found.argtypes
        return old
    return found


def main() -> None:
    cpu_kernels.CpuKernels._function = function  # type: ignore[method-assign]
    options = ExecutionOptions(lean=LeanMode.AUTO, attention=AttentionMode.AUTO)
    weights = os.environ.get("WEIGHTS", "auto")
    target = TargetModel.load(
        str(DEFAULT_MODEL), "cpu", "bfloat16", weights=weights, execution=options
    )
    print(target.plan.describe(), target.weights)
    context = int(os.environ.get("CONTEXT", 200))
    prompt = [(7 + 31 * i) % 40000 for i in range(context + 20)]
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:context])
    blocks, per = int(sys.argv[1]), 10
    for width in (1, 2, 3, 4, 8):
        step = VerifyPass.sequences([context], [prompt[context : context + width]])
        times: dict[str, list[float]] = {"old": [], "new": []}
        tokens = {}
        for block in range(blocks):
            for mode in ("old", "new") if block % 2 else ("new", "old"):
                MODE[0] = mode
                for _ in range(per):
                    started = time.perf_counter()
                    token = target.forward(cache, step)[0].argmax(0)
                    times[mode].append(time.perf_counter() - started)
                tokens.setdefault(mode, token)
        old, new = (statistics.median(times[m]) * 1e3 for m in ("old", "new"))
        assert tokens["old"] == tokens["new"]
        print(f"width {width}: old {old:.2f} ms  new {new:.2f} ms  new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
