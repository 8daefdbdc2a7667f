"""Where a one-token pass's time goes outside kenspec's kernels, in one process.

    PYTHONPATH=. .venv/bin/python bench/results/pass-outside-kernels/pass_phases.py

The default model (its Q4_1 file's groups, the server's plan), one row after 200 cached
tokens, 500 one-token passes (forward and the greedy token) twice; each phase's mean time a
pass, by wrapping the functions named (so a phase includes those it calls).
"""

import collections
import time

from kenspec.server.engine.forward import cpu_kernels, head, passes
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.params import AttentionMode
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from kenspec.server.settings import DEFAULT_MODEL

SECONDS: collections.Counter[str] = collections.Counter()


def timed(owner, name: str) -> None:  # type: ignore[no-untyped-def]
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        result = function(*args, **kwargs)
        SECONDS[name] += time.perf_counter() - started
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    options = ExecutionOptions(lean=LeanMode.AUTO, attention=AttentionMode.AUTO)
    target = TargetModel.load(str(DEFAULT_MODEL), "cpu", "bfloat16", execution=options)
    context = 200
    prompt = [(7 + 31 * i) % 40000 for i in range(context + 1)]
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:context])
    step = VerifyPass.sequences([context], [prompt[context:]])
    call = cpu_kernels.CpuKernels._call

    def kernel(self, name, *args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        result = call(self, name, *args)
        SECONDS[name] += time.perf_counter() - started
        return result

    cpu_kernels.CpuKernels._call = kernel  # type: ignore[method-assign]
    timed(passes.LeanForward, "_packed")
    timed(passes.LeanForward, "_decode")
    timed(head.Head, "logits")
    timed(Logits, "argmax")
    for _ in range(20):
        target.forward(cache, step)[0].argmax(0)
    passes_run = 500
    for _ in range(2):
        SECONDS.clear()
        started = time.perf_counter()
        for _ in range(passes_run):
            target.forward(cache, step)[0].argmax(0)
        total = time.perf_counter() - started
        each = {name: round(s / passes_run * 1e6) for name, s in SECONDS.items()}
        kernels = sum(s for name, s in SECONDS.items() if name.startswith("kenspec_"))
        outside = (total - kernels) / passes_run * 1e6
        print(f"pass {total / passes_run * 1e6:.0f} us, outside the kernels {outside:.0f} us", each)


if __name__ == "__main__":
    main()
