"""kenspec's CPU kernels: one shared object built from csrc/, called through ctypes.

torch's bfloat16 `F.linear` reads a one-row pass's weights at a third of the memory's speed on
the CPUs kenspec targets (docs/design.md, "The target's step"); these kernels stream them once,
and do a layer's work between its products in a few calls (csrc/kenspec.h lists them). Each
source is compiled once, with the instructions it needs, and linked into one library
(forward.kernel_build, the recipe). `load_kernels` takes the library the wheel ships
(`PREBUILT`, built at install) where it was built from these sources; else it compiles one with
the machine's compiler the first time a process asks and keeps it under
`~/.cache/kenspec/kernels/<key>/` (a restart loads it in milliseconds). `CpuKernels.isa` says
which of its sources this CPU can run; a method whose source it cannot run raises instead of
executing an illegal instruction. A CPU with AVX2 and FMA but no AVX512-BF16 gets the bf16
GEMV and the layer kernels (csrc/gemv_avx2.c, layer_avx2.c: `gemv_bf16`, `layer_kernels`), the
rest where its AVX-512 runs it.

A decoder pass's arguments cross to C as one struct (`PassArgs`, csrc/kenspec.h's
`kenspec_pass`); at load the library reports each struct's size and member offsets and the
ctypes mirrors are checked against them, so a member added on one side only fails there.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import structlog
import torch

from kenspec.server.engine.forward import kernel_build
from kenspec.server.engine.forward.kernel_build import CPU_FLAGS, USES, Build
from kenspec.server.engine.forward.kernel_build import SOURCES as SOURCES
from kenspec.server.engine.forward.kernel_build import Isa as Isa
from kenspec.server.engine.quantize import GroupedWeight

log = structlog.get_logger("kenspec.kernels")

# The library the wheel ships (setup.py): <key>/libkenspec.so and its build.json
PREBUILT = Path(__file__).resolve().parent / "_prebuilt"
CACHE = Path(os.environ.get("KENSPEC_KERNEL_CACHE", "~/.cache/kenspec/kernels")).expanduser()

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class DecoderLayer(ctypes.Structure):
    """csrc/kenspec.h's kenspec_layer: one layer's weights, biases, norms and cache."""

    _fields_ = [
        (name, _P)
        for name in (
            "qkv", "qkv_scales", "qkv_bias", "out", "out_scales", "out_bias", "gate_up",
            "gate_up_scales", "down", "down_scales", "input_norm", "post_norm", "keys", "values",
            "qkv_mins", "out_mins", "gate_up_mins", "down_mins",
        )
    ] + [
        (f"{product}_{what}", _L)
        for what in ("group", "bits", "half")
        for product in ("qkv", "out", "gate_up", "down")
    ] + [
        (name, _P)
        for name in (
            "attention_out_norm", "mlp_out_norm", "q_norm", "k_norm", "cos", "sin", "mask",
        )
    ]  # fmt: skip


class PassArgs(ctypes.Structure):
    """csrc/kenspec.h's kenspec_pass: one decoder pass's layers, buffers and shapes."""

    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayer)), ("count", _L), ("final_norm", _P),
        ("hidden", _P), ("normed", _P), ("tokens", _L), ("size", _L), ("heads", _L),
        ("kv_heads", _L), ("dim", _L), ("intermediate", _L), ("quant", _I), ("eps", _F),
        ("cos", _P), ("sin", _P), ("cache_rows", _P), ("positions", _P), ("capacity", _L),
        ("mask", _P), ("mask_bf16", _I), ("mask_rows", _P), ("kv_length", _L), ("scale", _F),
        ("bf16_product", _P), ("gemma", _I),
    ]  # fmt: skip


class HeadArgs(ctypes.Structure):
    """csrc/kenspec.h's kenspec_head: a learned draft head's weights, vocabulary, the target's
    input embedding and the bf16 GEMV its products run through (engine.draft_head)."""

    _fields_ = [
        ("hidden", _L), ("inner", _L), ("vocab", _L), ("eps", _F), ("fc", _P), ("fc_bias", _P),
        ("norm", _P), ("gate_up", _P), ("down", _P), ("out_norm", _P), ("rows", _P),
        ("keep", _P), ("embed", _P), ("embed_rows", _L), ("embed_bf16", _I), ("product", _P),
    ]  # fmt: skip


_ATTENTION = [_P] * 2 + [_L] * 4 + [_P] * 3 + [_L, _P, _I, _P, _L, _F]  # kenspec_attention's
_GROUPED = [_P, _P, _I, _P, _P, _L, _P, _L, _L, _L]  # kenspec_gemv_grouped's
# name: (result, arguments, the instructions it runs)
_SIGNATURES: dict[str, tuple[type | None, list[Any], Isa | None]] = {
    "kenspec_gemv_bf16": (None, [_P] * 3 + [_L] * 3, Isa.BF16),
    "kenspec_gemv_bf16_avx2": (None, [_P] * 3 + [_L] * 3, Isa.AVX2),
    "kenspec_gemv_amx": (_I, [_P] * 3 + [_L] * 3, Isa.AMX),
    "kenspec_amx_init": (_I, [], Isa.AMX),
    "kenspec_gemv_int8_bf16": (_I, [_P] * 4 + [_L] * 3, Isa.BF16),
    "kenspec_gemv_grouped": (_I, _GROUPED, Isa.BF16),
    "kenspec_gemv_grouped_avx2": (_I, [*_GROUPED, _I], Isa.AVX2),
    "kenspec_exact_candidates": (_L, [_P] * 2 + [_L, _P, _L, _P], Isa.BF16),
    "kenspec_gemv_int8": (_I, [_P] * 4 + [_L] * 3 + [_I], Isa.AVX512),
    "kenspec_u8s8_prepare": (None, [_P] * 2 + [_L] * 2 + [_P] * 2, Isa.VNNI),
    "kenspec_gemv_u8s8": (_I, [_P] * 6 + [_L] * 3, Isa.VNNI),
    "kenspec_add_rmsnorm": (None, [_P] * 4 + [_L] * 2 + [_F], Isa.BF16),
    "kenspec_rotary_cache": (None, [_P] * 3 + [_L] * 4 + [_P] * 4 + [_L], Isa.BF16),
    "kenspec_attention": (_I, _ATTENTION, Isa.BF16),
    "kenspec_silu_mul": (None, [_P] * 2 + [_L] * 2, Isa.BF16),
    "kenspec_top_probs": (None, [_P] + [_L] * 3 + [_P] * 2, Isa.BF16),
    "kenspec_screen": (_L, [_P] * 2 + [_F, _P, _F, _L, _P, _L], Isa.BF16),
    "kenspec_decoder_pass": (_I, [ctypes.POINTER(PassArgs)], Isa.BF16),
    "kenspec_add_rmsnorm_avx2": (None, [_P] * 4 + [_L] * 2 + [_F], Isa.AVX2),
    "kenspec_rotary_cache_avx2": (None, [_P] * 3 + [_L] * 4 + [_P] * 4 + [_L], Isa.AVX2),
    "kenspec_attention_avx2": (_I, _ATTENTION, Isa.AVX2),
    "kenspec_silu_mul_avx2": (None, [_P] * 2 + [_L] * 2, Isa.AVX2),
    "kenspec_gelu_mul_avx2": (None, [_P] * 2 + [_L] * 2, Isa.AVX2),
    "kenspec_gemma_head_norms_avx2": (None, [_P] + [_L] * 4 + [_P] * 2 + [_F], Isa.AVX2),
    "kenspec_gemma_add_norm_avx2": (None, [_P] * 5 + [_L] * 2 + [_F], Isa.AVX2),
    "kenspec_top_probs_avx2": (None, [_P] + [_L] * 3 + [_P] * 2, Isa.AVX2),
    "kenspec_decoder_pass_avx2": (_I, [ctypes.POINTER(PassArgs)], Isa.AVX2),
    "kenspec_layout": (_L, [_I, ctypes.POINTER(_L), _L], None),
    "kenspec_gemma_head_norms": (None, [_P] + [_L] * 4 + [_P] * 2 + [_F], None),
    "kenspec_gemma_add_norm": (None, [_P] * 5 + [_L] * 2 + [_F], None),
    "kenspec_head_chain": (_L, [ctypes.POINTER(HeadArgs), _P, _L, _L, _F, _L] + [_P] * 4, None),
}


class KernelUnavailable(RuntimeError):
    """A kernel was called on a CPU without the instructions it is compiled for."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isa(flags: frozenset[str]) -> frozenset[Isa]:
    """The library's instruction sets a CPU with these flags runs."""
    return frozenset(isa for isa, needed in CPU_FLAGS.items() if needed <= flags)


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library, and which of its instruction sets this CPU runs (see the module
    doc). Tensors passed in must be contiguous and of the dtypes each method names."""

    library: ctypes.CDLL
    path: Path
    isa: frozenset[Isa]  # built into the library and run by this CPU
    record: Build | None = None  # its build.json (None: every instruction set built)
    source: str = "compiled"  # prebuilt (the wheel's), cache or compiled (at this start-up)

    @property
    def built(self) -> frozenset[Isa]:
        """The instruction sets built into the library."""
        return frozenset(Isa) if self.record is None else self.record.isa

    @property
    def bf16(self) -> bool:
        """AVX512-BF16's kernels run here: its bf16 GEMV, the layer kernels, the whole
        decoder pass and the screen's exact candidates."""
        return Isa.BF16 in self.isa

    @property
    def gemv_bf16(self) -> bool:
        """A bf16 GEMV (`gemv`) runs here: AVX512-BF16's, else AVX2's."""
        return self.bf16 or Isa.AVX2 in self.isa

    @property
    def layer_kernels(self) -> bool:
        """The layer kernels and the whole decoder pass of bf16 weights run here:
        AVX512-BF16's (csrc/layer.c, step.c), else AVX2's (csrc/layer_avx2.c): wherever a
        bf16 GEMV does (each instruction set builds both or neither)."""
        return self.gemv_bf16

    @property
    def grouped(self) -> bool:
        """The grouped GEMV of a GGUF file's own groups (`gemv_grouped`) runs here:
        AVX512-BF16's (csrc/gemv_grouped.c), else AVX2's (gemv_grouped_avx2.c), wherever a
        bf16 GEMV does."""
        return self.gemv_bf16

    @property
    def grouped_half(self) -> bool:
        """The grouped GEMV here reads float16 scales and offsets (AVX2's; AVX512-BF16's
        reads float32 only)."""
        return self.grouped and not self.bf16

    @property
    def grouped_quads(self) -> bool:
        """The grouped GEMV here reads 4-bit weights laid out in quads of k (GroupedWeight.
        quads: AVX2's, each row's 4 weights beside its 4 8-bit x's); AVX512-BF16's reads
        pairs."""
        return self.grouped and not self.bf16

    def _layer(self, name: str, *arguments: object) -> object:
        """A layer kernel by layer.c's (or norms.c's) name: AVX512-BF16's (norms.c's) where
        it runs, else AVX2's."""
        return self._call(name if self.bf16 else f"{name}_avx2", *arguments)

    @property
    def amx(self) -> bool:
        """AMX-BF16's tile product (`gemv_amx`) runs here: the CPU has it, the library was
        built with it and Linux granted this process the tile state (`load_kernels` asks)."""
        return Isa.AMX in self.isa

    @property
    def amx_product(self) -> int:
        """kenspec_gemv_amx's address, for a decoder pass's bf16 products (PassArgs)."""
        address = ctypes.cast(self.library.kenspec_gemv_amx, ctypes.c_void_p).value
        assert address is not None and self.amx
        return address

    @property
    def int8(self) -> bool:
        """The int8 GEMV with float32 (or bf16) activations runs here."""
        return Isa.AVX512 in self.isa

    @property
    def vnni(self) -> bool:
        """The screened output layer's int8 x int8 product runs here."""
        return Isa.VNNI in self.isa

    def _function(self, name: str) -> Any:
        """The library's function `name`; KernelUnavailable where it does not run here."""
        needed = _SIGNATURES[name][2]
        if needed is not None and needed not in self.isa:
            lacks = "this CPU lacks" if needed in self.built else "the library was built without"
            raise KernelUnavailable(f"{name} needs {needed}, which {lacks}")
        return getattr(self.library, name)

    def _call(self, name: str, *arguments: object) -> object:
        return self._function(name)(*arguments)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T for bf16 x [rows, k] and weight [out, k]: bf16 [rows, out], through
        AVX512-BF16's GEMV where it runs, else AVX2's (each sums in its own one order: the
        same bits for a row whatever the row count, on one machine)."""
        if not self.bf16 and Isa.AVX2 in self.isa:
            return self.gemv_avx2(x, weight)
        return self._gemv("kenspec_gemv_bf16", x, weight)

    @property
    def gemv_address(self) -> int:
        """The address of the bf16 GEMV `gemv` runs here (a C caller's product: HeadArgs)."""
        name = "kenspec_gemv_bf16_avx2" if not self.bf16 else "kenspec_gemv_bf16"
        address = ctypes.cast(self._function(name), ctypes.c_void_p).value
        assert address is not None
        return address

    def head_chain(
        self,
        head: HeadArgs,
        feature: torch.Tensor,
        token: int,
        steps: int,
        min_prob: float,
        alternatives: int,
    ) -> tuple[list[int], list[float], list[tuple[int, float]]]:
        """A learned draft head's chain (csrc/head.c): up to `steps` tokens after `token` from
        the float32 hidden state `feature` [hidden], their probabilities, and the next best
        first tokens with theirs (where the first token passed `min_prob`)."""
        out = (ctypes.c_int64 * max(steps, 1))()
        probs = (ctypes.c_float * max(steps, 1))()
        others = (ctypes.c_int64 * max(alternatives, 1))()
        other_probs = (ctypes.c_float * max(alternatives, 1))()
        made = self._call(
            "kenspec_head_chain", ctypes.byref(head), feature.data_ptr(), token, steps, min_prob,
            alternatives, out, probs, others, other_probs,
        )  # fmt: skip
        assert isinstance(made, int)
        if made < 0:
            raise MemoryError("kenspec_head_chain: no memory for its scratch")
        firsts = [(int(others[j]), float(other_probs[j])) for j in range(alternatives)]
        return list(out[:made]), list(probs[:made]), [(t, p) for t, p in firsts if t >= 0]

    def gemv_amx(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`gemv`'s product through AMX tiles (csrc/gemv_amx.c): its own one order, the
        same bits for a row whatever the row count; weight's in-features a multiple of 32."""
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        failed = self._call(
            "kenspec_gemv_amx", x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k,
            weight.shape[0],
        )  # fmt: skip
        if failed == -2:
            raise ValueError(f"kenspec_gemv_amx takes in-features in multiples of 32, not {k}")
        if failed:
            raise MemoryError("kenspec_gemv_amx: no memory for the pass's tiles")
        return out

    def gemv_avx2(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`gemv` through csrc/gemv_avx2.c, whatever else runs here."""
        return self._gemv("kenspec_gemv_bf16_avx2", x, weight)

    def _gemv(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        self._call(name, x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, weight.shape[0])
        return out

    def exact_candidates(
        self, x: torch.Tensor, weight: torch.Tensor, candidates: torch.Tensor, row: torch.Tensor
    ) -> int:
        """For bf16 x [k] and the rows `candidates` (int32, ascending) of weight [vocab, k]:
        each candidate's logit as `gemv` computes it, written into row[candidate] (float32
        [vocab]); the candidate with the largest, the earliest among equals (-1: none)."""
        best = self._call(
            "kenspec_exact_candidates", x.data_ptr(), weight.data_ptr(), weight.shape[1],
            candidates.data_ptr(), candidates.shape[0], row.data_ptr(),
        )  # fmt: skip
        assert isinstance(best, int)
        return best

    def gemv_int8(
        self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """(x @ values^T) * scales for int8 values [out, k] and x [rows, k], scales [out] in
        one dtype, float32 or bfloat16; out in that dtype. bfloat16 on a CPU with
        AVX512-BF16: the weights widened to bf16, summed as `gemv` sums (`widened`); else
        float32 sums (csrc/gemv_int8.c)."""
        x = x.contiguous()
        if x.dtype == torch.bfloat16 and self.bf16:
            return self.widened(x, values, scales)
        rows, k = x.shape
        out = torch.empty(rows, values.shape[0], dtype=x.dtype)
        failed = self._call(
            "kenspec_gemv_int8", x.data_ptr(), values.data_ptr(), scales.data_ptr(),
            out.data_ptr(), rows, k, values.shape[0], int(x.dtype == torch.bfloat16),
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_int8: no memory for the widened activations")
        return out

    def gemv_grouped(self, x: torch.Tensor, weight: GroupedWeight) -> torch.Tensor:
        """x @ W^T for bf16 x [rows, in] and a GGUF file's own quantized weight W [out, in]
        (engine.quantize.GroupedWeight: q * s + m per group, the file's values exactly),
        summed in one order whatever the row count (csrc/gemv_grouped.c where AVX512-BF16
        runs, else gemv_grouped_avx2.c: each its own order; AVX2's sums in integers with x
        per group as int16 for int8 weights and as int8 for 4-bit ones (llama.cpp's 8-bit
        activations), a row holding inf or NaN giving NaN, and also reads float16 scales and
        offsets): bf16 [rows, out]."""
        x = x.contiguous()
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        name = "kenspec_gemv_grouped" if self.bf16 else "kenspec_gemv_grouped_avx2"
        arguments = [
            x.data_ptr(), weight.values.data_ptr(), weight.bits, weight.scales.data_ptr(),
            None if weight.mins is None else weight.mins.data_ptr(), weight.group,
            out.data_ptr(), rows, k, weight.shape[0],
        ]  # fmt: skip
        if weight.half and not self.grouped_half:
            raise ValueError(f"{name} takes float32 scales, not float16")
        if weight.bits == 4 and weight.quads != self.grouped_quads:
            layout = "quads" if self.grouped_quads else "pairs"
            raise ValueError(f"{name} takes 4-bit weights laid out in {layout} of k")
        failed = self._call(name, *arguments, *([] if self.bf16 else [int(weight.half)]))
        if failed == -2:
            raise MemoryError(f"{name}: no memory for the pass's rows and groups' sums")
        if failed:
            raise ValueError(
                f"{name} does not take {weight.bits}-bit groups of {weight.group} over {k} inputs"
            )
        return out

    def widened(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(x @ values^T) * scales for bf16 x [rows, k], int8 values [out, k] and bf16 scales
        [out] (csrc/gemv.c's kenspec_gemv_int8_bf16): bf16 [rows, out]."""
        rows, k = x.shape
        out = torch.empty(rows, values.shape[0], dtype=torch.bfloat16)
        failed = self._call(
            "kenspec_gemv_int8_bf16", x.data_ptr(), values.data_ptr(), scales.data_ptr(),
            out.data_ptr(), rows, k, values.shape[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_int8_bf16: no memory for the widened weights")
        return out

    def add_rmsnorm(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        normed: torch.Tensor,
        eps: float,
    ) -> None:
        """hidden += delta (None: nothing to add), in place; normed = RMSNorm(hidden)."""
        rows, n = hidden.shape
        self._layer(
            "kenspec_add_rmsnorm", hidden.data_ptr(), None if delta is None else delta.data_ptr(),
            weight.data_ptr(), normed.data_ptr(), rows, n, eps,
        )  # fmt: skip

    def gemma_head_norms(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """Gemma 3's q_norm and k_norm on qkv's query and key heads, in place (norms.c;
        layer_avx2.c's where AVX512-BF16 is not: the layer kernels' instruction set)."""
        self._layer(
            "kenspec_gemma_head_norms", qkv.data_ptr(), qkv.shape[0], *heads,
            q_weight.data_ptr(), k_weight.data_ptr(), eps,
        )  # fmt: skip

    def gemma_add_norm(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        delta_weight: torch.Tensor | None,
        weight: torch.Tensor,
        normed: torch.Tensor,
        eps: float,
    ) -> None:
        """Gemma's residual step: hidden += norm(delta) in place (None: nothing to add; delta
        is scratch: norms.c's overwrites it), then normed = norm(hidden) (norms.c; AVX2's as
        `gemma_head_norms`)."""
        rows, n = hidden.shape
        self._layer(
            "kenspec_gemma_add_norm", hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            None if delta_weight is None else delta_weight.data_ptr(),
            weight.data_ptr(), normed.data_ptr(), rows, n, eps,
        )  # fmt: skip

    def rotary_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: tuple[int, int, int],
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotary on qkv's query and key heads in place; keys and values into the cache."""
        self._layer(
            "kenspec_rotary_cache", qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
            *heads, keys.data_ptr(), values.data_ptr(), rows.data_ptr(), positions.data_ptr(),
            keys.shape[2],
        )  # fmt: skip

    def attention(
        self,
        qkv: torch.Tensor,
        out: torch.Tensor,
        heads: tuple[int, int, int],
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor,
        mask_rows: torch.Tensor,
        scale: float,
    ) -> None:
        """out [tokens, heads * dim]: each token's queries over its row's cache (layer.c)."""
        failed = self._layer(
            "kenspec_attention", qkv.data_ptr(), out.data_ptr(), qkv.shape[0], *heads,
            keys.data_ptr(), values.data_ptr(), rows.data_ptr(), keys.shape[2], mask.data_ptr(),
            int(mask.dtype == torch.bfloat16), mask_rows.data_ptr(), mask.shape[-1], scale,
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_attention: no memory for a query's scores")

    @property
    def gelu(self) -> bool:
        """`gelu_mul` runs here and the lean loop takes it for Gemma's GELU: where the layer
        kernels are AVX2's (AVX512-BF16's layer.c has none: the model's own module there)."""
        return self.layer_kernels and not self.bf16

    def gelu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = gelu_tanh(gate) * up for gate_up [rows, 2n] (gate first; layer_avx2.c)."""
        self._call("kenspec_gelu_mul_avx2", gate_up.data_ptr(), out.data_ptr(), *out.shape)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate) * up for gate_up [rows, 2n] (gate first)."""
        self._layer("kenspec_silu_mul", gate_up.data_ptr(), out.data_ptr(), *out.shape)

    def top_probs(
        self,
        logits: torch.Tensor,
        width: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids [rows, width] (int32) of each float32 logits row's `width` largest logits,
        best first, and their probabilities [rows, width] (as torch.topk of the row's
        softmax, in one read of the row after its maximum's): layer.c's, else
        layer_avx2.c's. `out`: contiguous int32 and float32 tensors of rows * width elements
        to write them to (a table's rows: no copies), returned."""
        if logits.dtype != torch.float32 or not 1 <= width <= 16:
            raise ValueError(f"top_probs takes float32 logits and width 1..16, not {width}")
        logits = logits.contiguous()
        rows, vocab = logits.shape
        if out is None:
            ids = torch.empty(rows, width, dtype=torch.int32)
            probs = torch.empty(rows, width, dtype=torch.float32)
        else:
            ids, probs = out
            wanted = ((torch.int32, rows * width), (torch.float32, rows * width))
            if any(
                (tensor.dtype, tensor.numel()) != shape or not tensor.is_contiguous()
                for tensor, shape in zip(out, wanted, strict=True)
            ):
                raise ValueError(f"top_probs writes contiguous int32 and float32 [{rows}, {width}]")
        self._layer(
            "kenspec_top_probs", logits.data_ptr(), rows, vocab, width, ids.data_ptr(),
            probs.data_ptr(),
        )  # fmt: skip
        return ids, probs

    def screen(
        self,
        approximate: torch.Tensor,
        error: torch.Tensor,
        norm: float,
        out: torch.Tensor,
        weight: torch.Tensor | None = None,
        residue: float = 0.0,
    ) -> int:
        """The candidates of a screened argmax (forward.screened_head) into out (int32,
        ascending); their count (more than out holds: out is partial), or -1 where a bound
        is not finite. weight and residue: the bound's term for quantized activations."""
        count = self._call(
            "kenspec_screen", approximate.data_ptr(), error.data_ptr(), norm,
            None if weight is None else weight.data_ptr(), residue, approximate.shape[-1],
            out.data_ptr(), out.shape[0],
        )  # fmt: skip
        assert isinstance(count, int)
        return count

    def u8s8_prepare(self, values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row of int8 values [out, k] (bf16 scales [out]): its scale as float32 and the
        sum of its values (int32), which `u8s8` takes."""
        out, k = values.shape
        scale = torch.empty(out, dtype=torch.float32)
        offset = torch.empty(out, dtype=torch.int32)
        self._call(
            "kenspec_u8s8_prepare", values.data_ptr(), scales.data_ptr(), k, out,
            scale.data_ptr(), offset.data_ptr(),
        )  # fmt: skip
        return scale, offset

    def u8s8(
        self, x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate (x @ values^T) * scale, float32 [rows, out], for bf16 x [rows, k], the
        rows quantized to 8 bits too; and each row's quantization residue |x - t p|_2
        (float64 [rows])."""
        rows, k = x.shape
        y = torch.empty(rows, values.shape[0], dtype=torch.float32)
        residue = torch.empty(rows, dtype=torch.float64)
        failed = self._call(
            "kenspec_gemv_u8s8", x.data_ptr(), values.data_ptr(), scale.data_ptr(),
            offset.data_ptr(), y.data_ptr(), residue.data_ptr(), rows, k, values.shape[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_u8s8: no memory for the quantized rows")
        return y, residue

    def decoder_pass(self, arguments: PassArgs) -> None:
        """Every layer of a pass whose products all take the GEMV, in one call (step.c; on
        AVX2, layer_avx2.c's: bf16 weights or a file's own groups, Gemma 3's layers too)."""
        failed = self._layer("kenspec_decoder_pass", ctypes.byref(arguments))
        if failed == -2:
            raise ValueError(
                "the decoder pass does not take these layers (AVX2's: bf16 weights or a file's"
                " own groups through its own GEMV; AVX512-BF16's: no Gemma layers)"
            )
        if failed:
            raise MemoryError("kenspec_decoder_pass: no memory for the pass's buffers")


@cache
def load_kernels() -> CpuKernels | None:
    """The library, and a "kernels" log line saying which (module doc): the wheel's where it
    was built from these sources, else one compiled here (cached); None where this CPU runs
    none of it (neither AVX-512 nor AVX2 with FMA) or none is shipped or can be built (no
    compiler, a failed build: the server then uses torch's kernels)."""
    cpu = supported_isa(cpu_flags())
    if not cpu:
        lacking = ", ".join(sorted(CPU_FLAGS[Isa.AVX512]))
        avx2 = ", ".join(sorted(CPU_FLAGS[Isa.AVX2]))
        return _report(
            None, f"CPU lacks AVX-512 ({lacking}) and AVX2 ({avx2}): no kernel runs here"
        )
    notes: list[str] = []
    hashed = kernel_build.source_hash(SOURCES)
    found = _prebuilt(hashed, notes)
    if found is not None:
        try:
            return _report(_open(*found, cpu, "prebuilt"), *notes, cpu=cpu)
        except OSError as error:
            notes.append(f"prebuilt library not loaded: {error}")
    compiler = kernel_build.find_compiler()
    if compiler is None:
        return _report(None, *notes, "no C compiler on PATH ($CC, cc or gcc)")
    try:
        directory, record, cached = kernel_build.cached_build(CACHE, compiler)
        kernels = _open(directory, record, cpu, "cache" if cached else "compiled")
    except (OSError, ValueError, subprocess.CalledProcessError, kernel_build.BuildError) as error:
        reason = getattr(error, "stderr", None) or str(error)
        return _report(None, *notes, f"build with {compiler} failed: {str(reason)[-2000:]}")
    return _report(kernels, *notes, cpu=cpu)


def _prebuilt(hashed: str, notes: list[str]) -> tuple[Path, Build] | None:
    """The shipped library's directory and record where the record names these sources'
    hash; else None, with why in notes."""
    records = sorted(PREBUILT.glob(f"*/{kernel_build.RECORD}"))
    if not records:
        notes.append("no prebuilt library")
        return None
    for path in records:
        try:
            record = kernel_build.read_record(path.parent)
        except (OSError, ValueError) as error:
            notes.append(f"prebuilt {path.parent.name} not used: {error}")
            continue
        if record.source_hash == hashed:
            return path.parent, record
        notes.append(
            f"prebuilt {path.parent.name} not used: built from other sources (hash "
            f"{record.source_hash[:16]}, these {hashed[:16]})"
        )
    return None


def _open(directory: Path, record: Build, cpu: frozenset[Isa], source: str) -> CpuKernels:
    """The library in directory, declared and its structs checked (OSError where it does not
    load)."""
    path = directory / kernel_build.LIBRARY
    library = ctypes.CDLL(str(path))
    declare(library, record.isa)
    check_layout(library)
    runs = cpu & record.isa
    if Isa.AMX in runs and not grant_amx(library):
        runs -= {Isa.AMX}  # (_report says why)
    return CpuKernels(library, path, runs, record, source)


def grant_amx(library: ctypes.CDLL) -> bool:
    """Ask Linux for AMX's tile state for this process (once is enough; again is harmless):
    True where granted. A kernel before 5.16, or a sandbox that filters arch_prctl, refuses."""
    return bool(library.kenspec_amx_init() == 0)


def _report(
    kernels: CpuKernels | None, *notes: str, cpu: frozenset[Isa] = frozenset()
) -> CpuKernels | None:
    """Log the one "kernels" line: which library runs, from where, what of it runs on this
    CPU (whose instruction sets are `cpu`), and why (what is not used, and for what reason);
    kernels, or None where none of the library runs here."""
    reasons = list(notes)
    if kernels is not None:
        assert kernels.record is not None  # (_open gives every library its record)
        avx2 = kernels.gemv_bf16 and not kernels.bf16
        if avx2:
            reasons.append("AVX2 bf16 and grouped GEMV and layer kernels")
        uses = {**USES, Isa.BF16: _WITHOUT_BF16} if avx2 else USES
        missing = kernels.record.missing()
        for isa, error in sorted(missing.items()):
            reasons.append(f"library built without {isa} ({error}): {uses[isa]} not used")
        for isa in sorted(cpu - kernels.built - missing.keys()):  # (an older recipe's)
            reasons.append(f"library built without {isa} (no source of it): {uses[isa]} not used")
        for isa in sorted(kernels.built - kernels.isa):
            if isa in cpu:  # (AMX: the CPU has it, Linux did not grant the tile state)
                reasons.append(f"Linux refused {isa}'s tile state: {uses[isa]} not used")
            else:
                reasons.append(f"CPU lacks {isa}: {uses[isa]} not used")
        if kernels.isa:
            log.info(
                "kernels",
                source=kernels.source,
                library=str(kernels.path),
                build=kernels.path.parent.name,
                compiler=kernels.record.version,
                isa=sorted(map(str, kernels.isa)),
                reason="; ".join(reasons) or "all of it runs here",
            )
            return kernels
        reasons.append("none of the library runs on this CPU")
    log.warning("kernels", source="none", library=None, isa=[], reason="; ".join(reasons))
    return None


# What a CPU without AVX512-BF16 loses where AVX2's bf16 GEMV runs (for the log).
_WITHOUT_BF16 = "int8 screen"


def declare(library: ctypes.CDLL, built: frozenset[Isa] = frozenset(Isa)) -> None:
    """The argument and result types of every exported function (_SIGNATURES) of the
    instruction sets built into the library."""
    for name, (result, arguments, isa) in _SIGNATURES.items():
        if isa is None or isa in built:
            function = getattr(library, name)
            function.restype, function.argtypes = result, arguments


class LayoutMismatch(RuntimeError):
    """A ctypes struct does not match its C declaration in csrc/kenspec.h."""


def check_layout(library: ctypes.CDLL) -> None:
    """Raise LayoutMismatch unless DecoderLayer and PassArgs have the C structs' sizes and
    member offsets (kenspec_layout)."""
    for which, mirror in enumerate((DecoderLayer, PassArgs, HeadArgs)):
        room = len(mirror._fields_) + 1
        offsets = (ctypes.c_long * room)()
        size = library.kenspec_layout(which, offsets, room)
        ours = [getattr(mirror, field[0]).offset for field in mirror._fields_]
        theirs = list(offsets)
        if size != ctypes.sizeof(mirror) or theirs != [*ours, -1]:
            raise LayoutMismatch(
                f"{mirror.__name__} ({ctypes.sizeof(mirror)} bytes, offsets {ours}) does not "
                f"match csrc/kenspec.h ({size} bytes, offsets {theirs[:-1]})"
            )
