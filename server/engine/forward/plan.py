"""How a target's passes are computed, as values: what the server asked (`ExecutionOptions`)
and what was decided at load (`ExecutionPlan`).

A plan is built once, by `forward.choose.plan_execution`, from the CPU's features, the model's
shapes and (where asked) measurements; the target's `Forward` is built from it and neither
changes afterwards. Every kernel choice is an enum member, not a string.

Example: RowPlan(((1, Kernel.GEMV), (64, Kernel.PACKED))) computes passes of 1-63 rows with
the GEMV and wider ones with oneDNN; its describe() is "1:gemv 64:packed".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import StrEnum

from kenspec.server.engine.kernels import BatchInvariance, Kernels
from kenspec.server.engine.params import AttentionMode, Weights


class Kernel(StrEnum):
    """A product's kernel on a CPU (forward.products)."""

    STOCK = "stock"  # torch's F.linear (int8: torch's int8 kernel; int4: torch's int4 kernel)
    PACKED = "packed"  # oneDNN, with the weights laid out once for it
    GEMV = "gemv"  # kenspec's (csrc/gemv.c, gemv_int8.c): one summation order at any width
    AMX = "amx"  # kenspec's through AMX tiles (csrc/gemv_amx.c), bf16: its own one order
    DEQUANT = "dequant"  # int8 weights widened to the activations' dtype for torch's GEMM


class ForwardKind(StrEnum):
    """Which code runs the decoder."""

    EAGER = "eager"  # transformers' modules (any architecture kenspec serves)
    LEAN = "lean"  # kenspec's loop over Llama-style decoders' layers (forward.lean)


class LeanMode(StrEnum):
    """Where the lean forward runs, when it reproduces the model (forward.lean.check)."""

    OFF = "off"
    AUTO = "auto"  # on a CPU, for bfloat16 activations or quantized weights (--fast-step)
    ALWAYS = "always"  # float32 too (tests: the lean loop against transformers' layers)


class HeadKind(StrEnum):
    """How a pass's rows of logits are computed (forward.head)."""

    MODEL = "model"  # the model's own logits for every token of the pass
    LAZY = "lazy"  # from hidden states, as the walk reads them (a plain output layer, CPU)
    PASS = "pass"  # every row a sequence may read in one product, greedy tokens in one copy


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Which kernel takes a product of `rows` rows: the one chosen at the largest listed row
    count at or below it (below the first: stock)."""

    choices: tuple[tuple[int, Kernel], ...] = ((1, Kernel.STOCK),)  # (from rows, kernel)

    @classmethod
    def every(cls, kernel: Kernel) -> RowPlan:
        """One kernel for every row count."""
        return cls(((1, kernel),))

    def kernel(self, rows: int) -> Kernel:
        chosen = Kernel.STOCK
        for first, name in self.choices:
            if rows < first:
                break
            chosen = name
        return chosen

    def invariant_below(self, kernel: Kernel = Kernel.GEMV) -> int:
        """Passes of fewer rows than this take `kernel` whatever their row count (0: none)."""
        if not self.choices or self.choices[0] != (1, kernel):
            return 0
        return self.choices[1][0] if len(self.choices) > 1 else sys.maxsize

    def describe(self) -> str:
        """E.g. "1:gemv 2:packed 64:stock" (from which row count each kernel takes over)."""
        return " ".join(f"{first}:{name}" for first, name in self.choices)

    @property
    def kernels(self) -> frozenset[Kernel]:
        return frozenset(name for _, name in self.choices)


@dataclass(frozen=True, slots=True)
class ExecutionOptions:
    """What the server asks of a target's passes (settings.kernels); `plan_execution` decides
    within it. The defaults run transformers' forward and torch's kernels as shipped, with no
    measurement at load (tests; the server's flags ask for more).

    decoder, head_kernels, head, skinny_rows: fixed where they would be decided at load
    (tests, benchmarks): the lean forward's kernel plans, the head kind, the skinny rows.
    """

    lean: LeanMode = LeanMode.OFF  # int8/int4 weights take it whatever this says
    skinny_gemm: bool = False  # float32 on a CPU: W @ x^T at row counts measured faster
    attention: AttentionMode = AttentionMode.GROUPED
    batch_invariant: bool = False
    cpu_kernels: bool = True  # kenspec's C kernels where the CPU runs them
    fused_layer: bool = True  # csrc/layer.c between the lean products, where it serves
    screen: bool = True  # greedy tokens through the int8 screen, where it serves
    amx: bool = True  # the decoder's bf16 products through AMX tiles, where the CPU has them
    decoder: RowPlan | None = None
    head_kernels: RowPlan | None = None
    head: HeadKind | None = None
    skinny_rows: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Everything that decides how a target computes a pass, chosen once at load."""

    forward: ForwardKind
    head: HeadKind
    weights: Weights
    threads: int  # torch's (and the C kernels': one OpenMP runtime) CPU threads
    # The attention kernels by pass shape, and batch invariance's rules (None: off)
    attention: Kernels = field(default_factory=Kernels)
    decoder: RowPlan = field(default_factory=RowPlan)  # the lean forward's products
    head_kernels: RowPlan = field(default_factory=RowPlan)  # the lean output layer's
    # rows of logits computed in one product at about one row's cost (a LAZY head)
    together: int = 1
    screen: bool = False  # greedy tokens through the int8 screen (forward.screened_head)
    fused_layer: bool = False  # csrc/layer.c between the lean forward's products
    # kenspec's C kernels' build (a hash of csrc/ and the compiler; "": none loaded)
    kernel_build: str = ""
    skinny_rows: frozenset[int] = frozenset()  # eager float32: W @ x^T at these row counts

    @property
    def invariance(self) -> BatchInvariance | None:
        return self.attention.invariance

    @property
    def row_invariant_below(self) -> int:
        """Lean passes of fewer rows than this compute each row as a one-row pass does, in
        every product (0: none are; sys.maxsize: all are)."""
        if self.forward is not ForwardKind.LEAN:
            return 0
        # int4's decoder products are torch's int4 kernel (its one order); AMX's tiles sum in
        # theirs; every output layer of a lean forward is bf16 or int8, the GEMV's
        decoder = Kernel.STOCK if self.weights is Weights.INT4 else Kernel.GEMV
        if self.decoder.kernel(1) is Kernel.AMX:
            decoder = Kernel.AMX
        return min(
            self.decoder.invariant_below(decoder), self.head_kernels.invariant_below(Kernel.GEMV)
        )

    def describe(self) -> str:
        """One line naming every choice, e.g. for the log and the calibration cache's key:
        "lean; head lazy; decoder 1:gemv; output 1:gemv; together 12; screen; fused; ..."."""
        parts = [str(self.forward)] + [str(self.weights)] * (self.weights is not Weights.BF16)
        parts.append(f"head {self.head}")
        if self.forward is ForwardKind.LEAN:
            parts += [
                f"decoder {self.decoder.describe()}",
                f"output {self.head_kernels.describe()}",
            ]
            parts.append(f"together {self.together}")
            parts += ["screen"] * self.screen + ["fused"] * self.fused_layer
        if self.skinny_rows:
            parts.append(f"skinny {','.join(map(str, sorted(self.skinny_rows)))}")
        grouped = " ".join(f"{w}:{n}" for w, n in self.attention.grouped) or "sdpa"
        parts.append(f"attention {grouped}")
        if self.invariance is not None:
            parts.append(f"invariant {self.invariance.padding}")
        parts.append(f"threads {self.threads}")
        if self.kernel_build:
            parts.append(f"kernels {self.kernel_build}")
        return "; ".join(parts)
