"""Which passes take grouped attention: measured on the device at start-up (server.runtime).

`measure_grouped` times SDPA and grouped_attention on the model's attention shape for a few
query widths and cache lengths; `choose_grouped` turns the timings into the {width:
min_length} table a target's Kernels take (Kernels.with_grouped), so each device gets the
faster kernel per width (docs/design.md, "Attention for a few queries over a long cache").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from kenspec.server.engine.attention import grouped_attention, sdpa_attention
from kenspec.server.engine.kernels import Kernels
from kenspec.server.engine.packing import attention_mask

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def measure_grouped(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    widths: Sequence[int] = (1, 4, 8, 16, 32),
    kv_lengths: Sequence[int] = (128, 512, 2048),
    repeats: int = 5,
    calls: int = 4,
    kernels: Kernels | None = None,
) -> tuple[dict[int, int], dict[tuple[int, int], tuple[float, float]]]:
    """Where grouped_attention ran no slower than SDPA: ({width: min_length} for
    Kernels.with_grouped, {(width, length): (SDPA seconds, grouped seconds)}).

    One row of each width over a cache of each length (random keys and values, views of a
    cache twice as long, as SlotCache gives them), causal mask; each sample times `calls`
    calls, the kernels alternating; medians of `repeats` after a warm-up. grouped_attention
    runs as `kernels` (the target's: its upcast and scratch buffers) have it run in a pass.
    See choose_grouped.
    """
    device = torch.device(device)
    chosen = Kernels() if kernels is None else kernels

    def grouped(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> Tensor:
        return grouped_attention(
            query, key, value, mask, upcast=chosen.upcast, scratch=chosen.scratch
        )

    timings: dict[tuple[int, int], tuple[float, float]] = {}
    for width in widths:
        for kv_length in kv_lengths:
            shape = (1, kv_heads, 2 * kv_length, head_dim)
            inputs = (
                torch.randn(1, heads, width, head_dim, dtype=dtype, device=device),
                torch.randn(shape, dtype=dtype, device=device)[:, :, :kv_length],
                torch.randn(shape, dtype=dtype, device=device)[:, :, :kv_length],
                attention_mask(
                    torch.arange(kv_length - width, kv_length, device=device)[None],
                    kv_length,
                    dtype,
                ),
            )
            timings[width, kv_length] = _medians(
                (sdpa_attention, grouped), inputs, device, repeats=repeats, calls=calls
            )
    return choose_grouped(timings), timings


def _medians(
    kernels: tuple[Kernel, Kernel],
    inputs: tuple[Tensor, Tensor, Tensor, Tensor],
    device: torch.device,
    *,
    repeats: int,
    calls: int,
) -> tuple[float, float]:
    """Median seconds a call of each kernel on `inputs`, alternating which runs first; the
    first sample of each warms up and is dropped."""
    samples: list[list[float]] = [[], []]
    for repeat in range(repeats + 1):
        for index in (0, 1) if repeat % 2 else (1, 0):
            started = time.perf_counter()
            for _ in range(calls):
                kernels[index](*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples[index].append((time.perf_counter() - started) / calls)
    return statistics.median(samples[0][1:]), statistics.median(samples[1][1:])


# How much faster than SDPA grouped attention must time to take a shape: a near tie goes to
# SDPA, so that start-up noise cannot move a plan from one start to the next.
MARGIN = 0.15


def choose_grouped(
    timings: Mapping[tuple[int, int], tuple[float, float]], margin: float = MARGIN
) -> dict[int, int]:
    """{width: min_length} (Kernels.with_grouped) from {(width, length): (SDPA s, grouped s)}: the
    widths, from the narrowest, where grouped wins (by `margin`) at the longest length
    measured, each from the shortest length at which it wins at that and every longer length.
    A width between two measured takes the wider one's length; one past the last winner takes
    SDPA."""

    def wins(width: int, length: int) -> bool:
        sdpa_s, grouped_s = timings[width, length]
        return grouped_s <= sdpa_s * (1 - margin)

    widths = sorted({width for width, _ in timings})
    lengths = sorted({length for _, length in timings})
    chosen: dict[int, int] = {}
    for width in widths:
        if not wins(width, lengths[-1]):
            break
        min_length = lengths[-1]
        for length in reversed(lengths[:-1]):
            if not wins(width, length):
                break
            min_length = length
        chosen[width] = min_length
    return chosen
