"""Products for a few rows at memory speed on AVX-512 CPUs: bfloat16 weights on CPUs with
AVX512-BF16 (csrc/gemv.c), int8 weights on any with AVX-512 F/BW/VL/DQ (csrc/gemv_int8.c),
and the screened output layer's approximate int8 x int8 product with AVX512-VNNI
(csrc/gemv_u8s8.c).

torch's bfloat16 `F.linear` reads a one-row pass's weights at a third of the memory's speed on
the CPUs kenspec targets (docs/design.md, "The target's step"); these kernels stream them once.
Each is compiled with the machine's C compiler the first time it is needed and kept under
`~/.cache/kenspec/kernels/<hash>/` (a restart loads it in milliseconds), and called through
ctypes. `load()`, `load_int8()` and `load_u8s8()` are None where they cannot run: the CPU lacks the
instructions, no compiler, or a build that fails (then the server uses torch's kernels).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("kenspec.kernels")

SOURCE = Path(__file__).with_name("csrc") / "gemv.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp")
LAYER_SOURCE = Path(__file__).with_name("csrc") / "step.c"  # layer.c and gemv.c, and the pass
INT8_SOURCE = Path(__file__).with_name("csrc") / "gemv_int8.c"
INT8_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-fopenmp")
INT8_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
U8S8_SOURCE = Path(__file__).with_name("csrc") / "gemv_u8s8.c"
U8S8_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp")
U8S8_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
CACHE = Path(os.environ.get("KENSPEC_KERNEL_CACHE", "~/.cache/kenspec/kernels")).expanduser()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Gemv:
    """y = x @ w^T for contiguous bfloat16 x [rows, k] and w [out, k], y [rows, out]."""

    library: ctypes.CDLL
    path: Path

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        self.library.kenspec_gemv_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, weight.shape[0]
        )
        return out

    def int8_widened(
        self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """(x @ values^T) * scales for bf16 x [rows, k], int8 values [out, k] and bf16 scales
        [out] (gemv.c's kenspec_gemv_int8_bf16), bf16 [rows, out]."""
        rows, k = x.shape
        out = torch.empty(rows, values.shape[0], dtype=torch.bfloat16)
        failed = self.library.kenspec_gemv_int8_bf16(
            x.data_ptr(), values.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, k,
            values.shape[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_int8_bf16: no memory for the widened weights")
        return out


@dataclass(frozen=True)
class GemvInt8:
    """y = (x @ q^T) * scales for int8 q [out, k], x [rows, k], scales [out] and y [rows, out]
    in one dtype, float32 or bfloat16; contiguous. bfloat16 takes csrc/gemv.c's kernel where
    the CPU has AVX512-BF16 (`widened`: the weights widened to bfloat16, summed as the bf16
    GEMV sums, fast for any row count), else csrc/gemv_int8.c's (float32 sums)."""

    library: ctypes.CDLL
    path: Path
    widened: Gemv | None = None  # csrc/gemv.c's, with kenspec_gemv_int8_bf16 (Gemv.int8_widened)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # (a no-op for the fast step's inputs; the kernel reads raw rows)
        if x.dtype == torch.bfloat16 and self.widened is not None:
            return self.widened.int8_widened(x, weight, scales)
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        failed = self.library.kenspec_gemv_int8(
            x.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(),
            rows, k, weight.shape[0], int(x.dtype == torch.bfloat16),
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_int8: no memory for the widened activations")
        return out


@dataclass(frozen=True)
class LayerKernels:
    """The fast step's per-layer work between its products, for contiguous bfloat16
    activations (csrc/layer.c): each call replaces several torch operations."""

    library: ctypes.CDLL
    path: Path

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
        self.library.kenspec_add_rmsnorm(
            hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
            normed.data_ptr(), rows, n, eps,
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
        self.library.kenspec_rotary_cache(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0], *heads,
            keys.data_ptr(), values.data_ptr(), rows.data_ptr(), positions.data_ptr(),
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
        failed = self.library.kenspec_attention(
            qkv.data_ptr(), out.data_ptr(), qkv.shape[0], *heads, keys.data_ptr(),
            values.data_ptr(), rows.data_ptr(), keys.shape[2], mask.data_ptr(),
            int(mask.dtype == torch.bfloat16), mask_rows.data_ptr(), mask.shape[-1], scale,
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_attention: no memory for a query's scores")

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate) * up for gate_up [rows, 2n] (gate first)."""
        self.library.kenspec_silu_mul(gate_up.data_ptr(), out.data_ptr(), *out.shape)

    def top_probs(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids [rows, width] (int32) of each float32 logits row's `width` largest logits,
        best first, and their probabilities [rows, width] (layer.c's kenspec_top_probs; as
        torch.topk of the row's softmax, in one read of the row after its maximum's)."""
        if logits.dtype != torch.float32 or not 1 <= width <= 16:
            raise ValueError(f"top_probs takes float32 logits and width 1..16, not {width}")
        logits = logits.contiguous()
        rows, vocab = logits.shape
        ids = torch.empty(rows, width, dtype=torch.int32)
        probs = torch.empty(rows, width, dtype=torch.float32)
        self.library.kenspec_top_probs(
            logits.data_ptr(), rows, vocab, width, ids.data_ptr(), probs.data_ptr()
        )
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
        """layer.c's kenspec_screen: the candidates of a screened argmax (engine.screened_head)
        into out (int32, ascending); their count (more than out holds: out is partial), or
        -1 where a bound is not finite. weight and residue: the bound's term for quantized
        activations (GemvU8S8), if any."""
        count: int = self.library.kenspec_screen(
            approximate.data_ptr(), error.data_ptr(), norm,
            None if weight is None else weight.data_ptr(), residue, approximate.shape[-1],
            out.data_ptr(), out.shape[0],
        )  # fmt: skip
        return count

    def decoder_pass(self, *arguments: object) -> None:
        """csrc/step.c's kenspec_decoder_pass (its arguments as LlamaStep passes them): every
        layer of a pass whose products all take the GEMV, in one call."""
        if self.library.kenspec_decoder_pass(*arguments):
            raise MemoryError("kenspec_decoder_pass: no memory for the pass's buffers")


@dataclass(frozen=True)
class GemvU8S8:
    """Approximate products of bfloat16 rows with an int8 layer, the rows quantized to 8 bits
    as well (csrc/gemv_u8s8.c, AVX512-VNNI): for the screened output layer's verify passes."""

    library: ctypes.CDLL
    path: Path

    def prepare(self, values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row of int8 values [out, k] (bf16 scales [out]): its scale as float32 and the
        sum of its values (int32), which __call__ takes."""
        out, k = values.shape
        scale = torch.empty(out, dtype=torch.float32)
        offset = torch.empty(out, dtype=torch.int32)
        self.library.kenspec_u8s8_prepare(
            values.data_ptr(), scales.data_ptr(), k, out, scale.data_ptr(), offset.data_ptr()
        )
        return scale, offset

    def __call__(
        self, x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate (x @ values^T) * scale, float32 [rows, out], for contiguous bf16 x
        [rows, k]; and each row's quantization residue |x - t p|_2 (float64 [rows])."""
        rows, k = x.shape
        y = torch.empty(rows, values.shape[0], dtype=torch.float32)
        residue = torch.empty(rows, dtype=torch.float64)
        failed = self.library.kenspec_gemv_u8s8(
            x.data_ptr(), values.data_ptr(), scale.data_ptr(), offset.data_ptr(), y.data_ptr(),
            residue.data_ptr(), rows, k, values.shape[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("kenspec_gemv_u8s8: no memory for the quantized rows")
        return y, residue


class DecoderLayer(ctypes.Structure):
    """csrc/step.c's kenspec_layer: one layer's weights, biases, norms and cache."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "qkv", "qkv_scales", "qkv_bias", "out", "out_scales", "out_bias", "gate_up",
            "gate_up_scales", "down", "down_scales", "input_norm", "post_norm", "keys", "values",
        )
    ]  # fmt: skip


@cache
def load() -> Gemv | None:
    """The compiled bfloat16 kernel, built once per machine and source; None where it cannot
    run."""
    if "avx512_bf16" not in cpu_flags():
        return None
    built = _library(SOURCE, FLAGS)
    if built is None:
        return None
    function = built[0].kenspec_gemv_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    widened = built[0].kenspec_gemv_int8_bf16
    widened.restype = ctypes.c_int
    widened.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    return Gemv(*built)


@cache
def load_layer() -> LayerKernels | None:
    """The compiled per-layer kernels, built once per machine and source; None where they
    cannot run (as `load`: they need AVX512-BF16)."""
    if "avx512_bf16" not in cpu_flags():
        return None
    built = _library(LAYER_SOURCE, FLAGS)
    if built is None:
        return None
    library = built[0]
    pointer, size, real = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    signatures = {
        "kenspec_add_rmsnorm": (None, [pointer] * 4 + [size] * 2 + [real]),
        "kenspec_rotary_cache": (None, [pointer] * 3 + [size] * 4 + [pointer] * 4 + [size]),
        "kenspec_attention": (
            ctypes.c_int,
            [pointer] * 2 + [size] * 4 + [pointer] * 3 + [size, pointer, ctypes.c_int]
            + [pointer, size, real],
        ),
        "kenspec_silu_mul": (None, [pointer] * 2 + [size] * 2),
        "kenspec_top_probs": (None, [pointer] + [size] * 3 + [pointer] * 2),
        "kenspec_screen": (size, [pointer] * 2 + [real, pointer, real, size, pointer, size]),
        "kenspec_decoder_pass": (
            ctypes.c_int,
            [ctypes.POINTER(DecoderLayer), size] + [pointer] * 3 + [size] * 6 + [ctypes.c_int]
            + [real] + [pointer] * 4 + [size, pointer, ctypes.c_int, pointer, size, real],
        ),
    }  # fmt: skip
    for name, (result, arguments) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    return LayerKernels(*built)


@cache
def load_u8s8() -> GemvU8S8 | None:
    """The compiled approximate int8 x int8 product, built once per machine and source; None
    where it cannot run (a CPU without AVX512-VNNI and -BW, or no compiler)."""
    if not U8S8_CPU_FLAGS.issubset(cpu_flags()):
        return None
    built = _library(U8S8_SOURCE, U8S8_FLAGS)
    if built is None:
        return None
    library = built[0]
    library.kenspec_u8s8_prepare.restype = None
    library.kenspec_u8s8_prepare.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
    )
    library.kenspec_gemv_u8s8.restype = ctypes.c_int
    library.kenspec_gemv_u8s8.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3
    return GemvU8S8(*built)


@cache
def load_int8() -> GemvInt8 | None:
    """The compiled int8 kernel, built once per machine and source; None where it cannot run
    (a CPU without AVX-512 F/BW/VL/DQ, as many AMD ones before Zen 4: torch's kernel then)."""
    if not INT8_CPU_FLAGS.issubset(cpu_flags()):
        return None
    built = _library(INT8_SOURCE, INT8_FLAGS)
    if built is None:
        return None
    function = built[0].kenspec_gemv_int8
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    bf16 = load()
    return GemvInt8(*built, widened=bf16)


def _library(source: Path, flags: tuple[str, ...]) -> tuple[ctypes.CDLL, Path] | None:
    """The source compiled with flags, loaded, and its path; None (and a warning) where that
    fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("gemv_unavailable", source=source.name, reason="no C compiler (cc or gcc)")
        return None
    try:
        path = _build(compiler, source, flags)
        return ctypes.CDLL(str(path)), path
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("gemv_unavailable", source=source.name, reason=str(error))
        return None


def _build(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library for this source, compiler and flags, built if not cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    # every source beside it, its own among them: a source may include another (step.c
    # includes gemv.c and layer.c)
    sources = [other.read_text() for other in sorted(source.parent.glob("*.[ch]"))]
    key = hashlib.sha256("\0".join([*sources, compiler, version, *flags]).encode()).hexdigest()[:16]
    target = CACHE / key / f"{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [
                compiler,
                *flags,
                f"-I{source.parent}",
                "-shared",
                "-fPIC",
                str(source),
                "-o",
                str(built),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        built.replace(target)  # atomic: a concurrent start-up loads one or the other
    log.info("gemv_built", path=str(target))
    return target
