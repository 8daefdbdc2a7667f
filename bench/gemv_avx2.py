"""The AVX2 bf16 GEMV (csrc/gemv_avx2.c) against torch's bf16 `F.linear` and the AVX512-BF16
GEMV (csrc/gemv.c, where this CPU runs it), in GB/s of weights read, on SmolLM2-135M's decoder
products: 30 layers of qkv [960 x 576], out [576 x 576], gate_up [3072 x 576] and down
[576 x 1536] (212 MB, streamed from memory as a decoding step reads them); or (--head) its
output layer, [49152 x 576] (57 MB).

Each cell: the median over repeats of one pass over the whole stack, the kernels alternating
within each repeat so drift hits each alike. "F.linear, no oneDNN" is torch's own bf16 path
(what a CPU without AVX-512 BW/VL/DQ gets: oneDNN takes bf16 only with those); with
ATEN_CPU_CAPABILITY=avx2 in the environment it runs the code torch runs on such a CPU.

    .venv/bin/python -m bench.gemv_avx2 --threads 2 1 --rows 1 2 4 8 --repeats 9
    .venv/bin/python -m bench.gemv_avx2 --head --rows 1 2 4 8 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kenspec.server.engine.forward.cpu_kernels import load_kernels

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: [out, in]
HEAD = (49152, 576)

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _no_onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.backends.mkldnn.flags(enabled=False):
        return F.linear(x, weight)


def kernels_to_compare() -> dict[str, Product]:
    kernels = load_kernels()
    if kernels is None or not kernels.gemv_bf16:
        raise SystemExit("kenspec's kernels do not run on this CPU (no AVX2, or no compiler)")
    found: dict[str, Product] = {"avx2 gemv": kernels.gemv_avx2}
    if kernels.bf16:
        found["avx512-bf16 gemv"] = kernels.gemv
    found["F.linear"] = F.linear
    found["F.linear, no oneDNN"] = _no_onednn
    return found


@torch.inference_mode()
def measure(
    products: dict[str, Product], weights: list[torch.Tensor], rows: int, repeats: int
) -> dict[str, float]:
    """{kernel: GB/s of weights read}, the median of `repeats` passes over the stack."""
    inputs = {size: torch.randn(rows, size).bfloat16() for size in {w.shape[1] for w in weights}}
    size = sum(w.numel() * w.element_size() for w in weights)
    samples: dict[str, list[float]] = {name: [] for name in products}
    names = list(products)
    for repeat in range(repeats + 1):  # the first warms up and is dropped
        for name in names if repeat % 2 else reversed(names):
            product = products[name]
            started = time.perf_counter()
            for weight in weights:
                product(inputs[weight.shape[1]], weight)
            if repeat:
                samples[name].append(time.perf_counter() - started)
    return {name: size / statistics.median(s) / 1e9 for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--head", action="store_true", help="the output layer, not the decoder")
    args = parser.parse_args()
    products = kernels_to_compare()
    torch.manual_seed(0)
    shapes = [HEAD] if args.head else [shape for _ in range(LAYERS) for shape in SHAPES]
    weights = [torch.randn(*shape).bfloat16() for shape in shapes]
    size = sum(w.numel() * w.element_size() for w in weights)
    print(f"{len(weights)} products, {size / 1e6:.0f} MB of bf16 weights; GB/s (median)")
    header = f"{'threads':>7} {'rows':>4} " + " ".join(f"{name:>20}" for name in products)
    print(header)
    for threads in args.threads:
        torch.set_num_threads(threads)  # (the kernels' OpenMP is torch's)
        for rows in args.rows:
            rates = measure(products, weights, rows, args.repeats)
            cells = " ".join(f"{rates[name]:>20.1f}" for name in products)
            print(f"{threads:>7} {rows:>4} {cells}", flush=True)


if __name__ == "__main__":
    main()
