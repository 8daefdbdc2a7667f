"""A draft head chain's cost, C (csrc/head.c) against the Python steps around the same GEMVs.

    PYTHONPATH=. .venv/bin/python bench/results/draft-head-c-chain/chain_cost.py

Loads the server's default runtime with --draft-head, then times `DraftHead.chain` (4 tokens,
2 alternatives, no gate) both ways with the head's weights in cache (medians of 300), and
counts how often the two give the same tokens on 200 random hidden states.
"""

import time

import numpy as np
import torch

from kenspec.server.engine import draft_head
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import Settings

HEADS: list[draft_head.DraftHead] = []
_init = draft_head.DraftHead.__init__


def _kept(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, **kwargs)
    HEADS.append(self)


def median_ms(call, repeats: int = 300) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def main() -> None:
    draft_head.DraftHead.__init__ = _kept  # type: ignore[method-assign]
    load_runtime(Settings.of(calibration_cache="none", draft_head=True))
    head = HEADS[0]
    c_path = head._c
    assert c_path is not None, "no C chain on this CPU"
    feature = torch.randn(head.net.hidden)
    for steps in (1, 4):
        head._c = c_path
        c_ms = median_ms(lambda: head.chain(feature, 42, steps, min_prob=0.0, alternatives=2))
        head._c = None
        py_ms = median_ms(lambda: head.chain(feature, 42, steps, min_prob=0.0, alternatives=2))
        print(f"chain of {steps}: C {c_ms:.3f} ms, Python steps {py_ms:.3f} ms")
    generator = torch.Generator().manual_seed(0)
    same = 0
    for _ in range(200):
        f = torch.randn(head.net.hidden, generator=generator) * 3
        token = int(torch.randint(0, head._embed.shape[0], (1,), generator=generator))
        head._c = None
        python = head.chain(f, token, 4, min_prob=0.0)
        head._c = c_path
        same += head.chain(f, token, 4, min_prob=0.0).tokens == python.tokens
    print(f"same tokens: {same} of 200 chains")


if __name__ == "__main__":
    main()
