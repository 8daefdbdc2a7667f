"""The one place a target's execution is decided: `build_forward` plans (`plan_execution`)
and builds the `Forward` the plan describes; nothing changes either afterwards.

What decides what (docs/design.md, "The forward wing"):
- the forward: the lean loop where the server asks for it (--fast-step, or int8/int4 weights,
  which only it computes at speed) and it reproduces the model (forward.lean.check), on a CPU
  in bfloat16 or with quantized weights; else transformers' eager modules;
- the lean products' kernels, per row count, and the output layer's: by rule where kenspec's
  bf16 GEMV runs (AVX512-BF16's, else AVX2's: it, for every product at every width; one
  summation order, so a token's bits never depend on what shares its pass, and nothing timed
  at start-up can change the plan); on a CPU with AMX the decoder's products take AMX's tiles
  instead, at every width (their own one order; a verify pass then costs about a step);
  elsewhere measured on the model's own weights (forward.products), a kernel taking over only
  where it is MARGIN faster, unless the options fix them;
- the head: a LAZY output layer for the lean forward and for plain float32 heads on a CPU,
  PASS on an accelerator, else the MODEL's logits (forward.head); the int8 screen where the
  lean forward reads a bf16 output layer with kenspec's GEMV and the CPU has AVX512-BF16;
- attention: csrc/layer.c's (layer_avx2.c's on AVX2) for every pass of a fused lean forward;
  else grouped products where measured faster than SDPA (--attention auto), or fixed;
- batch invariance: padded linear layers and invariant attention, measured on this CPU's
  kernels (engine.invariant); it keeps the eager forward and the model's own head;
- skinny float32 products (W @ x^T) at the row counts measured faster (engine.linear_kernels).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import structlog
import torch
from torch import nn
from transformers import PreTrainedModel

from kenspec.server.engine.attention_choice import measure_grouped
from kenspec.server.engine.forward.cpu_kernels import CpuKernels, load_kernels
from kenspec.server.engine.forward.head import Head, plain_head
from kenspec.server.engine.forward.lean import LeanDecoder, LeanWeights, Unsupported
from kenspec.server.engine.forward.passes import EagerForward, Forward, LeanForward
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ExecutionPlan,
    ForwardKind,
    HeadKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.forward.products import (
    Product,
    fastest_plan,
    invariant_kernel,
    lay_out,
    rows_at_one_rows_cost,
    time_products,
)
from kenspec.server.engine.forward.screened_head import ScreenedHead
from kenspec.server.engine.invariant import choose_padding, short_key_counts, value_block
from kenspec.server.engine.kernels import BatchInvariance, Kernels
from kenspec.server.engine.linear_kernels import measure_skinny_rows
from kenspec.server.engine.params import MAX_DRAFT_TOKENS, AttentionMode, Weights
from kenspec.server.engine.quantize import GroupedWeight, Int8Linear

log = structlog.get_logger("kenspec.forward")


def build_forward(
    model: PreTrainedModel,
    options: ExecutionOptions,
    *,
    weights: Weights = Weights.BF16,
    attention_shape: tuple[int, int, int],
    max_context: int,
    file_output: GroupedWeight | None = None,
) -> Forward:
    """Plan the model's passes within `options` and build the Forward that runs them.
    file_output: the output layer as a GGUF file keeps it (--weights gguf), for the lean
    forward's output product."""
    started = time.perf_counter()
    kernels = load_kernels() if options.cpu_kernels and model.device.type == "cpu" else None
    lean = _lean_weights(model, options, weights)
    output = output_product(model, lean, file_output) if lean is not None else None
    plan, timings = plan_execution(
        model, options, weights, kernels, lean, output, attention_shape, max_context
    )
    forward: Forward
    if plan.forward is ForwardKind.LEAN:
        assert lean is not None and output is not None
        lay_out([output], plan.head_kernels)
        head = Head(model, plan, _output(output, plan, kernels), _screen(model, plan, kernels))
        forward = LeanForward(model, plan, head, max_context, LeanDecoder(lean, plan, kernels))
    else:
        forward = EagerForward(model, plan, Head(model, plan), max_context)
    log.info(
        "execution_plan",
        plan=plan.describe(),
        # passes of fewer tokens than this compute each row as a one-token pass would
        row_invariant_below=_rows(plan.row_invariant_below),
        seconds=round(time.perf_counter() - started, 2),
        ms=timings,
    )
    return forward


def plan_execution(
    model: PreTrainedModel,
    options: ExecutionOptions,
    weights: Weights,
    kernels: CpuKernels | None,
    lean: LeanWeights | None,
    output: Product | None,
    attention_shape: tuple[int, int, int],
    max_context: int,
) -> tuple[ExecutionPlan, dict[str, object]]:
    """The plan (see the module doc) and what was measured for it, for the log."""
    device = model.device
    timings: dict[str, object] = {}
    plan = ExecutionPlan(
        forward=ForwardKind.EAGER,
        head=_eager_head(model),
        weights=weights,
        threads=torch.get_num_threads(),
    )
    if options.batch_invariant:
        invariance = _invariance(model, attention_shape[2])
        head = HeadKind.PASS if device.type != "cpu" else HeadKind.MODEL
        return replace(plan, head=head, attention=Kernels().with_invariance(invariance)), {}
    if lean is not None and output is not None:
        plan, timings = _lean_plan(model, plan, options, lean, output, kernels)
    elif options.skinny_rows is not None:
        plan = replace(plan, skinny_rows=options.skinny_rows)
    elif options.skinny_gemm and device.type == "cpu" and model.dtype == torch.float32:
        rows, skinny = measure_skinny_rows(model)
        plan = replace(plan, skinny_rows=frozenset(rows))
        timings["skinny"] = {r: [_ms(p), _ms(s)] for r, (p, s) in skinny.items()}
    mode = options.attention
    if plan.fused_layer and mode is AttentionMode.AUTO:
        mode = AttentionMode.GROUPED  # (csrc/layer.c's attention takes every pass: unused)
    attention, attention_ms = _attention(model, mode, attention_shape, max_context)
    timings.update(attention_ms)
    if options.head is not None:
        plan = replace(plan, head=_fixed_head(model, options.head, plan))
    return replace(plan, attention=attention), timings


def _fixed_head(model: PreTrainedModel, head: HeadKind, plan: ExecutionPlan) -> HeadKind:
    """The head kind the options fix, where it can compute this model's logits."""
    if head is HeadKind.LAZY and not (plain_head(model) or plan.forward is ForwardKind.LEAN):
        raise ValueError(
            f"{model.config.model_type}: rows of logits from hidden states need a "
            "plain output layer"
        )
    if head is not HeadKind.LAZY and plan.forward is ForwardKind.LEAN:
        raise ValueError("the lean forward reads its output layer as rows are read (lazy)")
    return head


def _lean_weights(
    model: PreTrainedModel, options: ExecutionOptions, weights: Weights
) -> LeanWeights | None:
    """The lean forward's products, where it is asked for and serves the model."""
    # int8 and int4 are computed by the lean forward only; a GGUF file's own layers also by
    # transformers' modules (--no-fast-step, architectures the lean loop does not serve)
    quantized = weights in (Weights.INT8, Weights.INT4) or (
        weights is Weights.GGUF and options.lean is not LeanMode.OFF
    )
    cpu = model.device.type == "cpu"
    pays = quantized or (cpu and model.dtype == torch.bfloat16)
    wanted = (
        quantized or options.lean is LeanMode.ALWAYS or (options.lean is LeanMode.AUTO and pays)
    )
    if options.batch_invariant or not cpu or not wanted:
        return None
    try:
        return LeanWeights(model)
    except Unsupported as reason:
        log.info("lean_forward", used=False, reason=str(reason))
        return None


def output_product(
    model: PreTrainedModel, lean: LeanWeights, file_output: GroupedWeight | None = None
) -> Product:
    """The lean forward's output layer: the GGUF file's own tensor where given, as loaded,
    or an int8 copy where the decoder is quantized (int8, int4) and the layer is tied to the
    embedding (which keeps the model's dtype)."""
    if file_output is not None:
        return Product.of_file(file_output)
    head = model.get_output_embeddings()
    if isinstance(head, Int8Linear) or lean.quantized in ("", "gguf"):
        assert isinstance(head, (nn.Linear, Int8Linear))
        return Product.of([head])
    assert isinstance(head, nn.Linear)
    return Product.quantized(head.weight, model.dtype)


def _lean_plan(
    model: PreTrainedModel,
    plan: ExecutionPlan,
    options: ExecutionOptions,
    lean: LeanWeights,
    output: Product,
    kernels: CpuKernels | None,
) -> tuple[ExecutionPlan, dict[str, object]]:
    """The lean forward's kernels by row count, and how many rows of logits one product
    computes at about one row's cost. Where kenspec's bf16 GEMV runs (AVX512-BF16's or
    AVX2's), by rule: it for every product at every width (one summation order, so a token's
    bits never depend on its pass), GEMV_TOGETHER rows together (AVX2's: AVX2_GEMV_TOGETHER);
    the screen only with AVX512-BF16, the layer kernels with it or AVX2. Elsewhere measured
    (unless the options fix them), a kernel taking over only where it is MARGIN faster than
    the one before it in every repeat."""
    decoder, head_kernels = options.decoder, options.head_kernels
    timings: dict[str, object] = {}
    together = 1
    gemv_everywhere = _gemv_everywhere(lean, output, kernels)
    if lean.quantized == "gguf" and kernels is not None and kernels.grouped:
        # A file's own groups: the grouped GEMV at every width, by rule (a bf16 output layer:
        # the bf16 GEMV); a prompt's wide passes too (see GROUPED_TOGETHER)
        decoder = decoder or RowPlan.every(Kernel.GEMV)
        head_kernels = head_kernels or RowPlan.every(Kernel.GEMV)
        together = GROUPED_TOGETHER if output.grouped is not None else GEMV_TOGETHER
    if gemv_everywhere:
        every = RowPlan.every(Kernel.GEMV)
        if options.amx and _amx_serves(lean, kernels):
            decoder = decoder or RowPlan.every(Kernel.AMX)
        decoder, head_kernels = decoder or every, head_kernels or every
        if head_kernels == every:
            together = GEMV_TOGETHER if kernels is not None and kernels.bf16 else AVX2_GEMV_TOGETHER
    if decoder is None:
        measured = time_products(lean.products, kernels, repeats=MEASURE_REPEATS)
        decoder = _fastest(measured, lean.products)
        timings["decoder"] = _ms_table(measured)
    if head_kernels is None:
        measured = time_products([output], kernels, repeats=MEASURE_REPEATS)
        head_kernels = _fastest(measured, [output])
        together = rows_at_one_rows_cost(measured, head_kernels)
        timings["head"] = _ms_table(measured)
    # (the screen's int8 products and exact candidates are AVX512-BF16's, as the layer kernels)
    screen = options.screen and gemv_everywhere and kernels is not None and kernels.bf16
    layer_kernels = kernels is not None and kernels.layer_kernels
    fused = options.fused_layer and layer_kernels and lean.fusable(model)
    return replace(
        plan,
        kernel_build="" if kernels is None else kernels.path.parent.name,
        forward=ForwardKind.LEAN,
        head=HeadKind.LAZY,
        decoder=decoder,
        head_kernels=head_kernels,
        together=together,
        screen=screen,
        fused_layer=fused,
    ), timings


# Rows of logits kenspec's GEMV computes in one read of a bf16 output layer: it streams the
# layer once for every row, at about one row's cost up to a dozen rows on two cores (about
# 1.4 rows' on one; bench/results/verify-cost), where a walk that reads past row 0 would
# otherwise pay a second read.
GEMV_TOGETHER = 12
# ... AVX2's (csrc/gemv_avx2.c): bound by its FMAs past a few rows, where dpbf16 does four
# times the products an instruction. SmolLM2's output layer on one EPYC core: 4 rows at 1.4
# times one row's cost, 8 at 2.6, 12 at 3.8 (bench/gemv_avx2.py --head).
AVX2_GEMV_TOGETHER = 4
# A GGUF file's own groups (csrc/gemv_grouped.c) are computed by the grouped GEMV at every
# width, wide passes too: it is bound by its arithmetic, ~0.56 ms a row for SmolLM2's 4-bit
# decoder on two cores from 16 rows up, where torch's GEMM over the weights dequantized for
# each product took 2.2 ms a row at 256 rows (bench/results/gguf-weights). So one order at
# every width, a prompt's too. Rows of logits computed together: 4 rows of an int8 output
# layer cost ~1.3 times one, 8 rows ~1.85.
GROUPED_TOGETHER = 4
# Measured plans (CPUs without kenspec's bf16 GEMV, int8 and int4 weights): repeats of each
# kernel, alternating, and how much faster than the current choice another kernel must be in
# its best repeat to take a row count over (a neighbour's burst must not flip a plan).
MEASURE_REPEATS = 5
MARGIN = 0.10


def _gemv_everywhere(lean: LeanWeights, output: Product, kernels: CpuKernels | None) -> bool:
    """Whether kenspec's bf16 GEMV computes every product: bf16 weights (the decoder's and
    the output layer's) on a CPU with AVX512-BF16, or AVX2 and FMA."""
    bf16 = output.scales is None and output.weight.dtype == torch.bfloat16
    return kernels is not None and kernels.gemv_bf16 and not lean.quantized and bf16


def _amx_serves(lean: LeanWeights, kernels: CpuKernels | None) -> bool:
    """Whether AMX's tiles compute the decoder's bf16 products: the CPU has them (and the
    layer kernels), and every product's in-features are whole tiles (multiples of 32)."""
    return (
        kernels is not None
        and kernels.amx
        and kernels.bf16
        and all(product.in_features % 32 == 0 for product in lean.products)
    )


def _fastest(measured: dict[int, dict[Kernel, float]], products: list[Product]) -> RowPlan:
    return fastest_plan(
        measured,
        MARGIN,
        invariant=invariant_kernel(products),
        invariant_rows=MAX_DRAFT_TOKENS + 1,
        invariant_margin=MARGIN,
    )


def _eager_head(model: PreTrainedModel) -> HeadKind:
    """An accelerator's rows in one product; on a CPU a plain float32 output layer's rows as
    read (in bf16 a GEMV against a transposed copy can be far slower than transformers' own
    head: no native bf16 GEMV kernels on many CPUs); else the model's own logits."""
    if model.device.type != "cpu":
        return HeadKind.PASS
    return HeadKind.LAZY if plain_head(model) and model.dtype == torch.float32 else HeadKind.MODEL


def _invariance(model: PreTrainedModel, head_dim: int) -> BatchInvariance:
    """Batch-invariant mode's rules, measured (engine.invariant): the row padding that makes
    every linear layer invariant (left switched on in the model), the block of keys attention
    sums in order, the short key counts that sum as long ones."""
    padding = choose_padding(model)
    block = value_block(model.device, head_dim)
    return BatchInvariance(padding, block, short_key_counts(model.device, head_dim))


def _attention(
    model: PreTrainedModel, mode: AttentionMode, shape: tuple[int, int, int], max_context: int
) -> tuple[Kernels, dict[str, object]]:
    """Passes of a few queries per row through grouped products instead of SDPA, by width and
    from the context length where timed faster (engine.attention_choice); or (--attention)
    SDPA always, or grouped up to 16 queries per row at any length."""
    if mode is not AttentionMode.AUTO:
        return Kernels().with_grouped({} if mode is AttentionMode.SDPA else {16: 0}), {}
    lengths = [n for n in (128, 512, 2048) if n <= max_context] or [max_context]
    kernels = Kernels()
    chosen, timings = measure_grouped(
        *shape, model.dtype, model.device, kv_lengths=lengths, kernels=kernels
    )
    measured = {f"{w}x{n}": [_ms(a), _ms(b)] for (w, n), (a, b) in timings.items()}
    return kernels.with_grouped(chosen), {"attention": measured}


def _output(
    output: Product, plan: ExecutionPlan, kernels: CpuKernels | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [rows, hidden] -> the lean output layer's logits through its plan's kernels."""

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        return output.run(hidden, plan.head_kernels.kernel(hidden.shape[0]), kernels)

    return logits


def _screen(
    model: PreTrainedModel, plan: ExecutionPlan, kernels: CpuKernels | None
) -> ScreenedHead | None:
    if not plan.screen or kernels is None:
        return None
    head = model.get_output_embeddings()
    assert isinstance(head, nn.Linear)
    return ScreenedHead(head.weight, kernels)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _ms_table(timings: dict[int, dict[Kernel, float]]) -> dict[int, dict[str, float]]:
    return {rows: {str(k): _ms(s) for k, s in by.items()} for rows, by in timings.items()}


def _rows(count: int) -> int | str:
    return "all" if count == sys.maxsize else count
