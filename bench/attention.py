"""`python -m bench.attention`: attention kernels for a few queries per row over long caches.

One row of `width` queries (1: a decode step; 4, 8, 17: verify passes) against a cache of each
length, for the default model's shape (SmolLM2-135M: 9 query heads over 3 key/value heads,
head_dim 64, 30 layers), in bf16 and float32. Each layer has its own keys and values, views of
a cache longer than the pass as SlotCache gives them (so 30 layers stream from memory as a
real pass does); the mask is the packed pass's own (engine.packing.pack). Kernels:

- sdpa_expand: K/V repeated to 9 heads, then SDPA (what transformers' SDPA attention does);
- sdpa_gqa: SDPA with enable_gqa (kenspec's SDPA path);
- grouped: attention.grouped_attention (bf16: keys and values converted into float32
  buffers kept from call to call, as a target's kernels keep them; float32 math);
- grouped_native (bf16 only): grouped_attention with upcast=False, products in bf16 in place.

Reports, per dtype, width and length, the median over `--repeats` of one pass through all
layers, in ms (for width 1, ms per token; per token of a wider pass: divide by the width),
the kernels alternating. JSON lines with --out.

    python -m bench.attention
    python -m bench.attention --dtypes bfloat16 --widths 1 --lengths 4000 --threads 2
    python -m bench.attention --lengths 64 128 --widths 1 4 --layers 2 --repeats 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import machine
from kenspec.server.engine.attention import grouped_attention, sdpa_attention
from kenspec.server.engine.kernels import ScratchBuffers
from kenspec.server.engine.packed_pass import pack

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_expand(query, key, value, mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


KERNEL_NAMES = ("sdpa_expand", "sdpa_gqa", "grouped", "grouped_native")


def kernels_by_name(scratch: ScratchBuffers) -> dict[str, Kernel]:
    """The kernels of KERNEL_NAMES, the grouped ones converting into `scratch`'s buffers."""

    def grouped(query, key, value, mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return grouped_attention(query, key, value, mask, scratch=scratch)

    def grouped_native(query, key, value, mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return grouped_attention(query, key, value, mask, upcast=False)

    return {
        "sdpa_expand": sdpa_expand,
        "sdpa_gqa": sdpa_attention,
        "grouped": grouped,
        "grouped_native": grouped_native,
    }


@torch.inference_mode()
def time_kernels(
    dtype: torch.dtype,
    width: int,
    length: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    repeats: int,
    kernels: Sequence[str],
) -> dict[str, float]:
    """Median seconds of one pass through `layers` layers, per kernel (alternating)."""
    capacity = length + max(256, length // 2)  # the cache is longer than the pass
    caches = [
        tuple(
            torch.randn(1, kv_heads, capacity, head_dim, dtype=dtype)[:, :, : length + width]
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    query = torch.randn(1, heads, width, head_dim, dtype=dtype)
    mask = pack([length], [[1] * width], dtype, torch.device("cpu")).packing.mask
    by_name = kernels_by_name(ScratchBuffers())
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    for repeat in range(repeats + 1):  # the first warms up and is dropped
        order = list(kernels) if repeat % 2 else list(reversed(kernels))
        for name in order:
            kernel = by_name[name]
            started = time.perf_counter()
            for key, value in caches:
                kernel(query, key, value, mask)
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values[1:]) for name, values in samples.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[150, 1000, 2000, 4000, 6500])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 17])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--kernels", nargs="+", default=list(KERNEL_NAMES), choices=list(KERNEL_NAMES)
    )
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--out", type=Path, help="append JSON lines here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    about = machine()
    print(f"{about['cpu']}, {about['cores']} threads, torch {about['torch']}")
    print(
        f"{args.heads} query heads / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"{args.layers} layers: ms per pass (median of {args.repeats})"
    )
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        names = [n for n in args.kernels if n != "grouped_native" or dtype != torch.float32]
        print(
            f"\n{dtype_name:9s} {'width':>5s} {'length':>6s} "
            + " ".join(f"{n:>14s}" for n in names)
        )
        for width in args.widths:
            for length in args.lengths:
                seconds = time_kernels(
                    dtype,
                    width,
                    length,
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    layers=args.layers,
                    repeats=args.repeats,
                    kernels=names,
                )
                ms = {name: round(s * 1000, 3) for name, s in seconds.items()}
                print(
                    f"{dtype_name:9s} {width:5d} {length:6d} "
                    + " ".join(f"{ms[n]:14.3f}" for n in names)
                )
                if args.out:
                    record = {
                        "dtype": dtype_name,
                        "width": width,
                        "length": length,
                        "layers": args.layers,
                        "ms_per_pass": ms,
                        "ms_per_token": {n: round(v / width, 3) for n, v in ms.items()},
                        "machine": about,
                    }
                    with args.out.open("a") as out:
                        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
