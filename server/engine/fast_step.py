"""The target's step without transformers' layers: a lean forward for the Llama family.

A bfloat16 decoding step of a small model through transformers' eager layers spends about
half its time outside the weight products: ~500 small tensor operations and the Python around
them (docs/design.md, "The target's step"). `LlamaStep` runs the same computation with
fewer: q/k/v as one product and gate/up as one, rotary and normalisation from the model's
own modules, kenspec's packed attention and cache as before, and each product through the
kernel measured fastest for its row count (`Products`):

- `gemv`: csrc/gemv.c, one pass over the weights (cpu_gemv), on CPUs with AVX512-BF16; a
  row's sums do not depend on the row count, so the plan keeps it from one row up while it is
  within 5% of the fastest (RowPlan.fastest): a verify pass then computes each row as a
  one-token step does;
- `packed`: oneDNN with the weights laid out once at start-up for it (AMX where present);
- `stock`: torch's `F.linear`.

Between the products, on the same CPUs and for bf16 activations, csrc/layer.c does each
layer's other work in five calls (cpu_gemv.LayerKernels): the residual add with the next
RMSNorm, rotary with the cache write, attention (each query on its own), SiLU(gate) * up.

With int8 weights (engine.quantize: the model's layers are `Int8Linear`s) the products are
int8 and so are their kernels: `gemv`, on CPUs with AVX-512 (one summation order whatever
the row count: with bf16 activations and AVX512-BF16, csrc/gemv.c's sums over the weights
widened to bf16; else csrc/gemv_int8.c's float32 ones), `stock`, torch's int8 kernel on any
CPU (a GEMV: its cost grows with the rows), and `dequant`, the weight widened to the
activations' dtype for torch's GEMM and the product scaled after (for wide passes: a
prompt's prefill).

It serves only what it reproduces: Llama, Mistral and Qwen2 models (model types in
`FAMILIES`) without sliding windows, on a CPU, in bfloat16 (or with int8 weights, whose
activations may be float32 too). Anything else keeps the stock forward, and float32 weights
always do, so float32 output stays identical to transformers' `generate`. In bfloat16 a
product summed by another kernel differs in its last bits, as any two GEMM kernels do; passes
narrower than the plans' `invariant_below` compute each row as a one-token pass does, so
there speculation's greedy output is plain decoding's, bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from server.engine import cpu_gemv
from server.engine.attention import packed_attention
from server.engine.kv_cache import SlotCache
from server.engine.packing import Packing
from server.engine.params import MAX_DRAFT_TOKENS
from server.engine.quantize import (
    INT4_JOINED_ROWS,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    int4_linear,
    int8_linear,
    quantize,
)
from server.engine.screened_head import ScreenedHead

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 17, 24, 34, 64, 136)  # rows a pass's products take


class Unsupported(ValueError):
    """The model is not one LlamaStep reproduces (the reason is the message)."""


# Rows of logits computed in one product where it costs at most this much more than one row's.
# Computed lazily instead, a walk pays a second product whenever it reads past row 0: about
# half its rounds (55% on 30 dev chat prompts, 47% on 30 held-out ones), so one product of
# every row pays up to about 1.5 rows' cost (docs/design.md, "Lazy logits rows").
TOGETHER_SLACK = 0.5


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Which kernel takes a product of `rows` rows: the one measured fastest at the largest
    measured row count at or below it (below the first: stock)."""

    choices: tuple[tuple[int, str], ...] = ((1, "stock"),)  # (from rows, kernel), ascending

    def kernel(self, rows: int) -> str:
        chosen = "stock"
        for first, name in self.choices:
            if rows < first:
                break
            chosen = name
        return chosen

    @classmethod
    def fastest(
        cls,
        timings: dict[int, dict[str, float]],
        margin: float = 0.03,
        *,
        invariant: str | None = None,
        invariant_rows: int = 0,
        invariant_margin: float = 0.05,
    ) -> RowPlan:
        """The plan taking, at each measured row count, the fastest kernel (stock unless
        another is `margin` faster). timings: {rows: {kernel: seconds}}, stock included.

        invariant: a kernel whose rows' bits do not depend on the row count (the GEMVs). It
        takes every measured count up to `invariant_rows` from the first on, as long as it
        is within `invariant_margin` of the fastest there: a pass of fewer rows than the
        first count it leaves then computes each row as a one-row pass would, so a verify
        pass gives plain decoding's bits (docs/design.md, "One kernel for every width")."""
        choices: list[tuple[int, str]] = []
        prefix = invariant or ""  # "" once the invariant kernel's first rows have ended
        for count in sorted(timings):
            seconds = timings[count]
            best = min(seconds, key=seconds.__getitem__)
            keeps = prefix in seconds and count <= invariant_rows
            if keeps and seconds[prefix] <= seconds[best] * (1 + invariant_margin):
                if not choices:
                    choices.append((count, prefix))
                continue
            prefix = ""
            if seconds[best] > seconds["stock"] * (1 - margin):
                best = "stock"
            if not choices or choices[-1][1] != best:
                choices.append((count, best))
        return cls(tuple(choices))

    def invariant_below(self, kernel: str = "gemv") -> int:
        """Passes of fewer rows than this take `kernel` whatever their row count (0: none)."""
        if not self.choices or self.choices[0] != (1, kernel):
            return 0
        return self.choices[1][0] if len(self.choices) > 1 else sys.maxsize

    def describe(self) -> str:
        """E.g. "1:gemv 2:packed 64:stock" (from which row count each kernel takes over)."""
        return " ".join(f"{first}:{name}" for first, name in self.choices)

    @property
    def kernels(self) -> frozenset[str]:
        return frozenset(name for _, name in self.choices)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out and multiplies `dtype` weights on this CPU (its bf16 path
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere it refuses at the reorder)."""
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 32, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, 32, dtype=dtype), probe, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        return False
    return True


@dataclass(eq=False)
class Product:
    """x @ weight^T (+ bias) for x [rows, in]: one linear layer, or several side by side.
    With `scales`, weight is int8 and the product (x @ weight^T) * scales; with `int4`, the
    product is torch's int4 kernel's over those parts, side by side, and weight is the first
    part's packed values (engine.quantize)."""

    weight: torch.Tensor  # [out, in], contiguous
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's layout of weight, once a plan uses it
    scales: torch.Tensor | None = None  # [out], the activations' dtype: weight is int8
    int4: tuple[Int4Weight, ...] = ()  # one part where the layers' rows could be joined

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        if self.int4:
            return self.int4[0].scales_zeros.dtype
        return self.weight.dtype if self.scales is None else self.scales.dtype

    @property
    def in_features(self) -> int:
        return self.int4[0].shape[1] if self.int4 else self.weight.shape[1]

    @classmethod
    def of(cls, layers: Sequence[nn.Linear | Int8Linear | Int4Linear]) -> Product:
        """The layers' product. One layer's weight is used as it is; several are laid side by
        side once and each layer's weight becomes a view of its rows, so the model's own
        forward still computes what it did and no weight is held twice."""
        int8 = [layer for layer in layers if isinstance(layer, Int8Linear)]
        int4 = [layer for layer in layers if isinstance(layer, Int4Linear)]
        if int8 or int4:
            assert len(int8) == len(layers) or len(int4) == len(layers)  # check(): one kind
            return cls._of_int8(int8) if int8 else cls._of_int4(int4)
        return cls._of_linear([layer for layer in layers if isinstance(layer, nn.Linear)])

    @classmethod
    def _of_linear(cls, layers: Sequence[nn.Linear]) -> Product:
        with torch.no_grad():
            if len(layers) == 1:
                weight = layers[0].weight.detach().contiguous()
            else:
                weight = torch.cat([layer.weight.detach() for layer in layers])
                for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                    grad = layer.weight.requires_grad
                    layer.weight = nn.Parameter(weight[rows], requires_grad=grad)
            return cls(weight, _joined_bias(layers, weight))

    @classmethod
    def _of_int8(cls, layers: Sequence[Int8Linear]) -> Product:
        """As `of`, for int8 layers: one layer's values and scales as they are (quantize made
        them contiguous); several side by side, each layer's a view of their rows."""
        if len(layers) == 1:
            values, scales = layers[0].values, layers[0].scales
        else:
            values = torch.cat([layer.values for layer in layers])
            scales = torch.cat([layer.scales for layer in layers])
            for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                layer.values, layer.scales = values[rows], scales[rows]
        return cls(values, _joined_bias(layers, scales), scales=scales)

    @classmethod
    def _of_int4(cls, layers: Sequence[Int4Linear]) -> Product:
        """As `of`, for int4 layers: torch's layout keeps rows in blocks of INT4_JOINED_ROWS,
        so layers of a multiple of that many rows are joined (each layer's packed values and
        scales a view of theirs); others stay parts, each its own product."""
        parts = [Int4Weight(layer.packed, layer.scales_zeros) for layer in layers]
        if len(layers) > 1 and all(layer.out_features % INT4_JOINED_ROWS == 0 for layer in layers):
            packed = torch.cat([part.packed for part in parts])
            scales_zeros = torch.cat([part.scales_zeros for part in parts], dim=1)
            for layer, rows in zip(layers, _row_ranges(layers), strict=True):
                layer.packed, layer.scales_zeros = packed[rows], scales_zeros[:, rows]
            parts = [Int4Weight(packed, scales_zeros)]
        bias = _joined_bias(layers, parts[0].scales_zeros.new_empty(0))
        return cls(parts[0].packed, bias, int4=tuple(parts))

    @classmethod
    def quantized(cls, weight: torch.Tensor, dtype: torch.dtype) -> Product:
        """An int8 copy of weight [out, in] (an output layer tied to the embedding, which keeps
        its own dtype for the lookup)."""
        int8 = quantize(weight, dtype)
        return cls(int8.values, scales=int8.scales)

    def pack(self) -> None:
        if self.packed is None and self.scales is None and not self.int4:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def run(
        self,
        x: torch.Tensor,
        kernel: str,
        gemv: cpu_gemv.Gemv | None,
        gemv8: cpu_gemv.GemvInt8 | None = None,
    ) -> torch.Tensor:
        if self.int4:  # one kernel: torch's
            if len(self.int4) == 1:
                return int4_linear(x, self.weight, self.int4[0].scales_zeros, self.bias)
            parts = [int4_linear(x, part.packed, part.scales_zeros) for part in self.int4]
            return self._biased(torch.cat(parts, dim=1))
        if self.scales is not None:
            if kernel == "gemv" and gemv8 is not None:
                return self._biased(gemv8(x, self.weight, self.scales))
            if kernel == "dequant":  # a GEMM for wide passes: int8 values are exact in bf16
                return self._biased(F.linear(x, self.weight.to(x.dtype)).mul_(self.scales))
            return int8_linear(x, self.weight, self.scales, self.bias)
        if kernel == "gemv" and gemv is not None:
            return self._biased(gemv(x, self.weight))
        if kernel == "packed" and self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            assert isinstance(out, torch.Tensor)
            return out
        return F.linear(x, self.weight, self.bias)

    def _biased(self, out: torch.Tensor) -> torch.Tensor:
        """A kernel's product without bias, the bias added in place."""
        return out if self.bias is None else out.add_(self.bias)


def _row_ranges(layers: Sequence[nn.Linear | Int8Linear | Int4Linear]) -> list[slice]:
    """Each layer's rows among the layers' rows side by side."""
    ends = list(itertools.accumulate(layer.out_features for layer in layers))
    return [slice(end - layer.out_features, end) for layer, end in zip(layers, ends, strict=True)]


def _joined_bias(
    layers: Sequence[nn.Linear | Int8Linear | Int4Linear], like: torch.Tensor
) -> torch.Tensor | None:
    """The layers' biases side by side (zeros for a layer without one, in `like`'s dtype);
    None where no layer has one."""
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat(
        [
            layer.bias.detach() if layer.bias is not None else like.new_zeros(layer.out_features)
            for layer in layers
        ]
    )


@dataclass(eq=False)
class Products:
    """The step's products and the kernel plan they share."""

    products: list[Product] = field(default_factory=list)
    plan: RowPlan = field(default_factory=RowPlan)
    gemv: cpu_gemv.Gemv | None = None
    gemv8: cpu_gemv.GemvInt8 | None = None  # int8 products' (engine.quantize)

    def __call__(self, product: Product, x: torch.Tensor) -> torch.Tensor:
        return product.run(x, self.plan.kernel(x.shape[0]), self.gemv, self.gemv8)

    def add(self, layers: Sequence[nn.Linear | Int8Linear | Int4Linear]) -> Product:
        return self.append(Product.of(layers))

    def append(self, product: Product) -> Product:
        self.products.append(product)
        return product

    @property
    def int8(self) -> bool:
        return any(product.scales is not None for product in self.products)

    @property
    def int4(self) -> bool:
        return any(product.int4 for product in self.products)

    @property
    def quantized(self) -> str:
        """The products' weights: "int8", "int4", or "" (the model's dtype)."""
        return "int8" if self.int8 else "int4" if self.int4 else ""

    @property
    def invariant(self) -> str:
        """The kernel whose rows' bits do not depend on the row count: torch's for int4."""
        return "stock" if self.int4 else "gemv"

    def candidates(self) -> tuple[str, ...]:
        """Kernels this machine can run for these products on a CPU: for int8 weights torch's
        (stock), each weight widened to the activations' dtype for torch's GEMM (dequant) and
        the AVX-512 GEMV where it builds; for bfloat16 ones stock, oneDNN's and the GEMV."""
        if self.int4:
            return ("stock",)
        if self.int8:
            return ("stock", "dequant") + (("gemv",) if self.gemv8 is not None else ())
        found = ["stock"]
        if onednn_packs(torch.bfloat16):
            found.append("packed")
        if self.gemv is not None:
            found.append("gemv")
        return tuple(found)

    @torch.inference_mode()
    def measure(
        self, rows: Iterable[int] = MEASURED_ROWS, *, repeats: int = 3, margin: float = 0.03
    ) -> dict[int, dict[str, float]]:
        """Time every candidate kernel over the whole stack of products (which streams the
        weights from memory, as a step does) at each row count, alternating; the plan becomes
        the fastest at each (stock unless another is `margin` faster). {rows: {kernel: s}}.

        Each kernel's time is its fastest repeat: a neighbour's burst (another process
        streaming memory, a page fault) only ever adds time, and one noisy repeat in three
        moved medians far enough to end the GEMV's invariant rows at 2 or flip the output
        layer between kernels from one row count to the next."""
        kernels = self.candidates()
        if "packed" in kernels:
            for product in self.products:
                product.pack()
        timings: dict[int, dict[str, float]] = {}
        for count in rows:
            inputs = {
                size: torch.randn(count, size, dtype=self.products[0].dtype)
                for size in {p.in_features for p in self.products}
            }
            samples: dict[str, list[float]] = {name: [] for name in kernels}
            for repeat in range(repeats + 1):  # the first of each warms up and is dropped
                for name in kernels if repeat % 2 else reversed(kernels):
                    started = time.perf_counter()
                    for product in self.products:
                        product.run(inputs[product.in_features], name, self.gemv, self.gemv8)
                    samples[name].append(time.perf_counter() - started)
            timings[count] = {name: min(s[1:]) for name, s in samples.items()}
        invariant = self.invariant if self.invariant in kernels else None
        self.plan = RowPlan.fastest(
            timings, margin, invariant=invariant, invariant_rows=MAX_DRAFT_TOKENS + 1
        )
        if "packed" not in self.plan.kernels:
            for product in self.products:
                product.packed = None  # oneDNN's copy of the weights is not kept unused
        return timings


@dataclass(eq=False)
class _Layer:
    attention: nn.Module  # the model's own, for packed_attention's arguments
    input_norm: nn.Module
    post_norm: nn.Module
    qkv: Product
    out: Product
    gate_up: Product
    down: Product
    heads: tuple[int, int, int]  # query heads, key/value heads, head dim
    act: nn.Module


class LlamaStep:
    """The decoder of a Llama-family model as one lean loop (see the module's doc)."""

    def __init__(
        self,
        model: PreTrainedModel,
        gemv: cpu_gemv.Gemv | None,
        gemv8: cpu_gemv.GemvInt8 | None = None,
        fused: cpu_gemv.LayerKernels | None = None,
    ) -> None:
        check(model)
        config = model.config
        inner = model.base_model
        self.embed: nn.Module = inner.get_submodule("embed_tokens")
        self.rotary: nn.Module = inner.get_submodule("rotary_emb")
        self.norm: nn.Module = inner.get_submodule("norm")
        self.products = Products(gemv=gemv, gemv8=gemv8)
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.layers: list[_Layer] = []
        decoder = inner.get_submodule("layers")
        assert isinstance(decoder, nn.ModuleList)
        for layer in decoder:
            attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
            self.layers.append(
                _Layer(
                    input_norm=layer.get_submodule("input_layernorm"),
                    post_norm=layer.get_submodule("post_attention_layernorm"),
                    qkv=self.products.add(
                        [_linear(attn, n) for n in ("q_proj", "k_proj", "v_proj")]
                    ),
                    out=self.products.add([_linear(attn, "o_proj")]),
                    gate_up=self.products.add([_linear(mlp, "gate_proj"), _linear(mlp, "up_proj")]),
                    down=self.products.add([_linear(mlp, "down_proj")]),
                    heads=(heads, kv_heads, dim),
                    act=mlp.get_submodule("act_fn"),
                    attention=attn,
                )
            )
        self.scaling = dim**-0.5  # transformers' Llama attention scale
        # csrc/layer.c between the products, where it computes what the model's modules do
        self.fused = fused if fused is not None and _fusable(model, self) else None
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        # The fused loop's norm weights in the order it applies them, the final norm's last
        self._norm_weights = [_weight(norm) for norm in (*norms, self.norm)]
        self._eps = float(getattr(self.norm, "variance_epsilon", 0.0))
        # csrc/step.c's description of every layer (its cache pointers set per pass)
        self._decoder = self._describe_layers() if self.fused is not None else None
        self.head = Products(gemv=gemv, gemv8=gemv8)  # its own shape, its own plan
        head = model.get_output_embeddings()
        if isinstance(head, Int8Linear) or not self.products.quantized:
            assert isinstance(head, (nn.Linear, Int8Linear))
            self._head = self.head.add([head])
        else:  # tied to the embedding, which keeps the model's dtype: an int8 copy
            assert isinstance(head, nn.Linear)
            self._head = self.head.append(Product.quantized(head.weight, model.dtype))
        # rows of logits the output layer computes at about one row's cost (measure())
        self.together = 1
        # greedy tokens through an int8 copy of a bf16 output layer, exactly (screened_head)
        self.screen = (
            ScreenedHead(head.weight, gemv, cpu_gemv.load_layer(), cpu_gemv.load_u8s8())
            if gemv is not None
            and not self.products.quantized
            and isinstance(head, nn.Linear)
            and head.weight.dtype == torch.bfloat16
            else None
        )

    @property
    def weights(self) -> str:
        """How the decoder's weights are kept: int8, int4, or the model's dtype (bfloat16)."""
        return self.products.quantized or str(self._head.dtype).removeprefix("torch.")

    def measure(self) -> dict[str, dict[int, dict[str, float]]]:
        """Choose each product's kernel by row count (Products.measure), and how many rows of
        logits to compute together (`together`); the timings."""
        timings = {"decoder": self.products.measure(), "head": self.head.measure(repeats=5)}
        self.together = rows_at_one_rows_cost(timings["head"], self.head.plan)
        return timings

    def describe(self) -> str:
        """The weights, kernel plans and whether csrc/layer.c runs between the products (e.g.
        for the calibration cache's key)."""
        plans = f"decoder {self.products.plan.describe()}; head {self.head.plan.describe()}"
        plans = f"{self.products.quantized} {plans}" if self.products.quantized else plans
        if self.fused is None:
            return plans
        # the kernels' build (a hash of csrc/ and the compiler): a calibration measured with
        # other kernels is not reused
        return f"fused {self.fused.path.parent.name} {plans}"

    def screens(self, rows: int) -> ScreenedHead | None:
        """The screen for a greedy pass of `rows` rows of logits (None: no screen). Its exact
        logits are the GEMV's whatever the output layer's plan, so a screened token does not
        depend on what else is in the pass."""
        return self.screen if self.screen is not None and rows <= self.screen.rows else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's logits [rows, vocab] of hidden states [rows, hidden]."""
        return self.head(self._head, hidden.contiguous())

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of a packed pass (as the base model's
        last_hidden_state[0]); writes the pass's keys and values into the bound cache rows."""
        if self.fused is not None:
            return self._fused_pass(self.fused, input_ids, position_ids, cache, packing)
        hidden = self.embed(input_ids)  # [1, tokens, hidden]
        cos, sin = self.rotary(hidden, position_ids)  # [1, tokens, dim]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [tokens, 1, dim]: over every head
        tokens = hidden.shape[1]
        run = self.products
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)[0]
            heads, kv_heads, dim = layer.heads
            qkv = run(layer.qkv, x)
            # Rotary on the queries and keys at once, as transformers' apply_rotary_pos_emb
            # computes each (the same elementwise operations on the same values).
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, heads, tokens, dim]
            k = qk[:, heads:].transpose(0, 1)[None]
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).transpose(0, 1)[None]
            keys, values = cache.update(k, v, index)
            attended, _ = packed_attention(
                layer.attention, q, keys, values, packing.mask, self.scaling, packing=packing
            )
            hidden = hidden + run(layer.out, attended.reshape(tokens, heads * dim))[None]
            x = layer.post_norm(hidden)[0]
            gate, up = run(layer.gate_up, x).chunk(2, dim=-1)
            hidden = hidden + run(layer.down, layer.act(gate) * up)[None]
        out: torch.Tensor = self.norm(hidden)[0]
        return out

    def _fused_pass(
        self,
        fused: cpu_gemv.LayerKernels,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """`__call__` with the work between the products in csrc/layer.c: per layer a residual
        add fused with each norm, rotary fused with the cache write, attention (for passes of
        at most FUSED_WIDTH queries per row; wider ones, prefill chunks, take the attention
        kernels packed_attention chooses) and SiLU(gate) * up."""
        hidden = self.embed(input_ids)[0].contiguous()  # [tokens, hidden], updated in place
        cos, sin = self.rotary(hidden[None], position_ids)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, dim]
        tokens = hidden.shape[0]
        normed = torch.empty_like(hidden)
        mask = packing.mask
        narrow = packing.slots.shape[1] <= FUSED_WIDTH and mask.is_contiguous()
        mask_rows = packing.tokens.contiguous()
        if narrow and self._decoder is not None and self._all_gemv(tokens):
            self._whole_pass(fused, hidden, normed, cos, sin, cache, mask, mask_rows)
            return normed
        run, eps, weights = self.products, self._eps, self._norm_weights
        fused.add_rmsnorm(hidden, None, weights[0], normed, eps)
        for index, layer in enumerate(self.layers):
            heads, kv_heads, dim = layer.heads
            qkv = run(layer.qkv, normed)
            like = qkv.new_empty(1, kv_heads, 1, dim)
            keys, values, rows, positions = cache.layer_for_kernel(index, like)
            fused.rotary_cache(qkv, cos, sin, layer.heads, keys, values, rows, positions)
            if narrow:
                attended = hidden.new_empty(tokens, heads * dim)
                fused.attention(
                    qkv, attended, layer.heads, keys, values, rows, mask, mask_rows, self.scaling
                )
            else:
                q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]
                bound_keys, bound_values = cache.bound_rows(index)
                out, _ = packed_attention(
                    layer.attention, q, bound_keys, bound_values, mask, self.scaling,
                    packing=packing,
                )  # fmt: skip
                attended = out.reshape(tokens, heads * dim)
            fused.add_rmsnorm(hidden, run(layer.out, attended), weights[2 * index + 1], normed, eps)
            gate_up = run(layer.gate_up, normed)
            act = gate_up.new_empty(tokens, gate_up.shape[1] // 2)
            fused.silu_mul(gate_up, act)
            fused.add_rmsnorm(hidden, run(layer.down, act), weights[2 * index + 2], normed, eps)
        return normed

    def _all_gemv(self, tokens: int) -> bool:
        """Whether every decoder product of a `tokens`-row pass takes the GEMV (for int8
        weights, the one csrc/step.c runs: bf16 activations, the weights widened)."""
        if self.products.plan.kernel(tokens) != "gemv" or self.products.int4:
            return False
        if self.products.int8:
            return self.products.gemv8 is not None and self.products.gemv8.widened is not None
        return self.products.gemv is not None

    def _describe_layers(self) -> ctypes.Array[cpu_gemv.DecoderLayer]:
        def pointer(tensor: torch.Tensor | None) -> int | None:
            return None if tensor is None else tensor.data_ptr()

        layers = (cpu_gemv.DecoderLayer * len(self.layers))()
        for index, layer in enumerate(self.layers):
            described = layers[index]
            for name, product in (
                ("qkv", layer.qkv), ("out", layer.out), ("gate_up", layer.gate_up),
                ("down", layer.down),
            ):  # fmt: skip
                setattr(described, name, product.weight.data_ptr())
                setattr(described, f"{name}_scales", pointer(product.scales))
                if name in ("qkv", "out"):
                    setattr(described, f"{name}_bias", pointer(product.bias))
                else:
                    assert product.bias is None  # check(): no biased MLP
            described.input_norm = self._norm_weights[2 * index].data_ptr()
            described.post_norm = self._norm_weights[2 * index + 1].data_ptr()
        return layers

    def _whole_pass(
        self,
        fused: cpu_gemv.LayerKernels,
        hidden: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SlotCache,
        mask: torch.Tensor,
        mask_rows: torch.Tensor,
    ) -> None:
        """Every layer in one call (csrc/step.c): the kernels `_fused_pass` calls, in its
        order, for a pass whose products all take the GEMV."""
        layers = self._decoder
        assert layers is not None
        heads, kv_heads, dim = self.layers[0].heads
        like = hidden.new_empty(1, kv_heads, 1, dim)
        rows = positions = keys = torch.empty(0)
        for index in range(len(self.layers)):
            keys, values, rows, positions = cache.layer_for_kernel(index, like)
            layers[index].keys, layers[index].values = keys.data_ptr(), values.data_ptr()
        intermediate = self.layers[0].down.weight.shape[1]
        fused.decoder_pass(
            layers, len(self.layers), self._norm_weights[-1].data_ptr(), hidden.data_ptr(),
            normed.data_ptr(), hidden.shape[0], hidden.shape[1], heads, kv_heads, dim,
            intermediate, int(self.products.int8), self._eps, cos.data_ptr(), sin.data_ptr(),
            rows.data_ptr(), positions.data_ptr(), keys.shape[2], mask.data_ptr(),
            int(mask.dtype == torch.bfloat16), mask_rows.data_ptr(), mask.shape[-1],
            self.scaling,
        )  # fmt: skip


# The widest pass (queries per row) csrc/layer.c's attention takes: every verify pass, and
# prefill chunks beside running streams; wider prefill chunks take SDPA (flash attention).
FUSED_WIDTH = MAX_DRAFT_TOKENS + 1
_FUSED_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})


def _fusable(model: PreTrainedModel, step: LlamaStep) -> bool:
    """Whether csrc/layer.c computes what this model's modules do: bfloat16 activations and
    weights, transformers' Llama RMSNorm (one epsilon), SiLU, a head dimension it takes."""
    norms = [step.norm] + [n for layer in step.layers for n in (layer.input_norm, layer.post_norm)]
    eps = {getattr(norm, "variance_epsilon", None) for norm in norms}
    return (
        model.dtype == torch.bfloat16
        and all(type(norm).__name__ in _FUSED_NORMS for norm in norms)
        and all(_weight(n).dtype == torch.bfloat16 and _weight(n).is_contiguous() for n in norms)
        and len(eps) == 1
        and getattr(model.config, "hidden_act", None) == "silu"
        and all(layer.heads[2] % 32 == 0 and layer.heads[2] <= 256 for layer in step.layers)
        and all(layer.heads[0] % layer.heads[1] == 0 for layer in step.layers)
    )


def rows_at_one_rows_cost(
    timings: dict[int, dict[str, float]], plan: RowPlan, slack: float = TOGETHER_SLACK
) -> int:
    """The most rows, among the measured counts, whose product through `plan` costs at most
    `slack` more than one row's (1 where one row was not measured). The largest such count,
    not the last before the first count over: one noisy timing at 4 or 8 rows must not cut a
    dozen rows' single read into a read per block (docs/design.md, "Lazy logits rows")."""
    if 1 not in timings:
        return 1
    one = timings[1][plan.kernel(1)]
    within = [count for count in timings if timings[count][plan.kernel(count)] <= one * (1 + slack)]
    return max(within, default=1)


def _weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise Unsupported(f"{type(module).__name__} has no weight tensor")
    return weight.detach()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(module: nn.Module, name: str) -> nn.Linear | Int8Linear | Int4Linear:
    layer = module.get_submodule(name)
    assert isinstance(layer, (nn.Linear, Int8Linear, Int4Linear))  # check() saw to it
    return layer


_LINEARS = frozenset({nn.Linear, Int8Linear, Int4Linear})


def check(model: PreTrainedModel) -> None:
    """Raise Unsupported unless LlamaStep computes what the model's own forward does."""
    config = model.config
    if config.model_type not in FAMILIES:
        raise Unsupported(
            f"model type {config.model_type!r} (the fast step serves {sorted(FAMILIES)})"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise Unsupported("sliding-window attention")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("biased MLP layers")
    inner = model.base_model
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb"):
        raise Unsupported("no decoder layers or rotary embedding where Llama keeps them")
    kinds = set()
    for layer in layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            kinds.add(type(getattr(attn, name, None)))
            if kinds - _LINEARS:
                raise Unsupported(f"{name} is not a plain linear layer")
        for name in ("gate_proj", "up_proj", "down_proj"):
            kinds.add(type(getattr(layer.mlp, name, None)))
            if kinds - _LINEARS:
                raise Unsupported(f"mlp.{name} is not a plain linear layer")
    if len(kinds) > 1:
        raise Unsupported("the linear layers are not all of one kind (bf16, int8 or int4)")
