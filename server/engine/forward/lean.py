"""The target's decoder without transformers' layers: a lean loop for Llama-style decoders.

A bfloat16 decoding step of a small model through transformers' eager layers spends about
half its time outside the weight products: ~500 small tensor operations and the Python around
them (docs/design.md, "The target's step"). `LeanDecoder` runs the same computation with
fewer: q/k/v as one product and gate/up as one (forward.products, each through the kernel its
plan names for the pass's row count), rotary and normalisation from the model's own modules,
kenspec's packed attention and cache as before.

Between the products, on CPUs with AVX512-BF16 and for bf16 activations, csrc/layer.c does
each layer's other work in five calls (the plan's `fused_layer`): the residual add with the
next RMSNorm, rotary with the cache write, attention (each query on its own), SiLU(gate) * up;
and where every product of a pass takes the GEMV, csrc/step.c runs all layers in one call. On
CPUs with AVX2 but not AVX512-BF16, csrc/layer_avx2.c does both for bf16 weights and a GGUF
file's own groups.

It serves only what it reproduces (`check`), on a CPU, in bfloat16 (or with int8/int4 weights,
whose activations may be float32): Llama, Mistral and Qwen2; Qwen3 (RMSNorm over each head's
queries and keys before rotary); Phi-3 (q/k/v and gate/up already one layer each, rotary over
part of a head); Gemma 2 and 3 (norms of (1 + weight) around attention and the MLP as well as
before them, GELU, their own attention scale, soft-capped scores, and Gemma 3's rotary base per
layer type) - with their sliding windows, which packed attention applies per layer. The layer
kernels (`fused`) take the decoders whose rotary spans the head and whose norms are Llama's
RMSNorm - Llama, Mistral, Qwen2, Qwen3 and Phi-3 (Qwen3's head norms then run between the
kernels, and a model with head norms or windows takes the layer calls, not the whole pass in
one) - or Gemma 3's, which csrc/norms.c computes (`_gemma_pass`; on AVX2 layer_avx2.c, its
GELU too, and there all its layers in one call like Llama's); Gemma 2's soft-capped scores
keep its layers in Python.
float32 weights keep the eager forward, so float32 output stays identical to transformers'
`generate`. In bfloat16 a product summed by another kernel differs in its last bits, as any
two GEMM kernels do; passes narrower than the plan's `row_invariant_below` compute each row as
a one-token pass does, so there speculation's greedy output is plain decoding's, bit for bit.
"""

from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from kenspec.server.engine.architecture import attention_shape
from kenspec.server.engine.attention import attention_number, packed_attention
from kenspec.server.engine.forward.cpu_kernels import CpuKernels, DecoderLayer, PassArgs
from kenspec.server.engine.forward.plan import ExecutionPlan, Kernel, RowPlan
from kenspec.server.engine.forward.products import Linear, Product, lay_out, quantized_kind
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.packing import Packing
from kenspec.server.engine.quantize import GroupedLinear, Int4Linear, Int8Linear

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"})
# GGUF files name some families otherwise (general.architecture)
GGUF_FAMILIES = FAMILIES | {"gemma3"}
# transformers' RMSNorms that compute Llama's (x * rsqrt(mean(x^2) + eps) * weight), as
# csrc/layer.c's add_rmsnorm does; Gemma's multiply by (1 + weight) in float32
_FUSED_NORMS = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}
)
# ... and Gemma's: float32 throughout, times (1 + weight), as csrc/norms.c computes
_GEMMA_NORMS = frozenset({"Gemma3RMSNorm"})
_LINEARS = frozenset({nn.Linear, Int8Linear, Int4Linear, GroupedLinear})


# csrc/step.c's kenspec_pass.quant for the lean weights' kinds it computes (int4: not)
_QUANT = {"": 0, "int8": 1, "gguf": 2}
_AVX2_QUANT = frozenset({"", "gguf"})  # ... and layer_avx2.c's


class Unsupported(ValueError):
    """The model is not one the lean forward reproduces (the reason is the message)."""


@dataclass(eq=False)
class _Layer:
    attention: nn.Module  # the model's own, for packed_attention's arguments
    input_norm: nn.Module  # before attention
    mlp_norm: nn.Module  # before the MLP (Llama's post_attention_layernorm)
    qkv: Product
    out: Product
    gate_up: Product
    down: Product
    heads: tuple[int, int, int]  # query heads, key/value heads, head dim
    act: nn.Module
    scaling: float  # of the attention scores
    window: int | None = None  # sliding window (packed attention masks the keys before it)
    softcap: float | None = None  # of the attention scores (Gemma 2)
    head_norms: tuple[nn.Module, nn.Module] | None = None  # queries', keys' (Qwen3, Gemma 3)
    # Gemma's norms of the attention's and the MLP's outputs, before each residual add
    out_norms: tuple[nn.Module, nn.Module] | None = None
    rotary_type: str | None = None  # the layer type Gemma 3's rotary takes (its base)

    @property
    def plain(self) -> bool:
        """Whether csrc/step.c's whole pass computes this Llama-style layer: no head norms,
        window or soft-capping (Gemma 3's: LeanDecoder._one_call)."""
        return self.head_norms is None and self.window is None and self.softcap is None


# Rope types whose inverse frequencies do not depend on the sequence (transformers' "dynamic"
# and "longrope" rescale them past a length): their cos and sin are a function of the position.
STATIC_ROPE = frozenset({"default", "linear", "llama3"})
ROTARY_BLOCK = 64  # positions RotaryTable computes in one call of the model's module
ROTARY_TABLE_TOKENS = 512  # passes of more tokens call the module (see RotaryTable)


class RotaryTable:
    """Rotary's cos and sin by position, computed by the model's own module in blocks of
    ROTARY_BLOCK positions as passes reach them, and looked up: the module's call (transformers'
    rope wrapper and ~6 torch operations) was ~2% of a decoding step. The same values: each is
    an elementwise function of its position (the position times an inverse frequency, its cos
    or sin, times the attention scaling, rounded once to the hidden states' dtype), computed
    by the same vectorized loops in a block as in a pass of up to ROTARY_TABLE_TOKENS tokens
    (below torch's parallel grain: one loop, no scalar tail, a head's 64 or 128 values at a
    time); a wider pass, a position past the model's maximum or a rope type outside STATIC_ROPE
    calls the module. Checked value for value against the module (test_lean.py)."""

    def __init__(self, rotary: nn.Module, max_positions: int) -> None:
        self._rotary = rotary
        self._limit = max_positions
        self._cos: torch.Tensor | None = None  # [positions computed, dim]
        self._sin: torch.Tensor | None = None

    @classmethod
    def of(cls, rotary: nn.Module, config: PretrainedConfig) -> RotaryTable | None:
        """A table for the model's rotary module, or None where it is not one (a rope type
        that rescales with the length, a module taking a layer type)."""
        kind = getattr(rotary, "rope_type", None)  # (Gemma 3's: one per layer type)
        if not isinstance(kind, str) or kind not in STATIC_ROPE:
            return None
        limit = int(getattr(config, "max_position_embeddings", 0) or 0)
        return cls(rotary, limit) if limit > 0 else None

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's (cos, sin) [1, tokens, dim] for x [1, tokens, hidden] at position_ids
        [1, tokens]."""
        tokens = position_ids.shape[-1]
        top = int(position_ids.max()) if tokens else 0
        if tokens > ROTARY_TABLE_TOKENS or top >= self._limit or position_ids.shape[0] != 1:
            cos, sin = self._rotary(x, position_ids)
            return cos, sin
        if self._cos is None or self._cos.dtype != x.dtype or top >= self._cos.shape[0]:
            self._grow(x, top + 1)
        assert self._cos is not None and self._sin is not None
        ids = position_ids[0]
        return self._cos[ids][None], self._sin[ids][None]

    def _grow(self, x: torch.Tensor, needed: int) -> None:
        """Blocks up to `needed` positions (all anew where x's dtype is another)."""
        cosines: list[torch.Tensor] = []
        sines: list[torch.Tensor] = []
        if self._cos is not None and self._sin is not None and self._cos.dtype == x.dtype:
            cosines, sines = [self._cos], [self._sin]
        have = cosines[0].shape[0] if cosines else 0
        end = min(-(-needed // ROTARY_BLOCK) * ROTARY_BLOCK, self._limit)
        probe = x[:, :1]
        for start in range(have, end, ROTARY_BLOCK):
            stop = min(start + ROTARY_BLOCK, end)
            positions = torch.arange(start, stop, device=x.device)[None]
            cos, sin = self._rotary(probe.expand(1, stop - start, -1), positions)
            cosines.append(cos[0])
            sines.append(sin[0])
        self._cos, self._sin = torch.cat(cosines), torch.cat(sines)


class LeanWeights:
    """A Llama-family model's decoder as products (q/k/v and gate/up each joined into one;
    the model's layers become views of them) and the modules the loop calls."""

    def __init__(self, model: PreTrainedModel) -> None:
        check(model)
        inner = model.base_model
        self.embed: nn.Module = inner.get_submodule("embed_tokens")  # (Gemma's: scaled)
        self.rotary: nn.Module = inner.get_submodule("rotary_emb")
        self.rotary_table = RotaryTable.of(self.rotary, model.config)
        self.norm: nn.Module = inner.get_submodule("norm")
        shape = attention_shape(model)
        decoder = inner.get_submodule("layers")
        assert isinstance(decoder, nn.ModuleList)
        typed = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layers = [_layer(model.config, layer, shape, typed) for layer in decoder]
        self.products = [p for la in self.layers for p in (la.qkv, la.out, la.gate_up, la.down)]
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.mlp_norm)]
        # The fused loop's norm weights in the order it applies them, the final norm's last
        self.norm_weights = [_weight(norm) for norm in (*norms, self.norm)]
        self.eps = _epsilon(self.norm) or 0.0
        self.quantized = quantized_kind(self.products)
        # Gemma's layers: norms of the attention's and the MLP's outputs too
        self.gemma = any(layer.out_norms is not None for layer in self.layers)
        self._plain = all(layer.plain for layer in self.layers)  # (asked every pass)

    @property
    def plain(self) -> bool:
        """Whether csrc/step.c's whole pass computes every layer (see _Layer.plain)."""
        return self._plain

    def fusable(self, model: PreTrainedModel) -> bool:
        """Whether the layer kernels compute what this model's modules do: bfloat16
        activations and weights, one epsilon, rotary over whole heads, heads the attention
        kernel takes, no soft-capped scores; and the norms of one kind the kernels compute:
        Llama's RMSNorm with SiLU (csrc/layer.c; Qwen3's head norms run as the model's
        modules), or Gemma 3's everywhere, its head norms too (csrc/norms.c, its GELU the
        model's module; on AVX2 layer_avx2.c's, GELU too)."""
        layers = self.layers
        if self.gemma:
            if any(la.out_norms is None or la.head_norms is None for la in layers):
                return False
            around = [n for la in layers for n in (*(la.out_norms or ()), *(la.head_norms or ()))]
            kinds, activation = _GEMMA_NORMS, True
        else:
            around = []
            kinds = _FUSED_NORMS
            activation = getattr(model.config, "hidden_act", None) == "silu"
        norms = [self.norm, *(n for la in layers for n in (la.input_norm, la.mlp_norm)), *around]
        return (
            model.dtype == torch.bfloat16
            and activation
            and all(la.softcap is None for la in layers)
            and _rotary_dim(model) == layers[0].heads[2]
            and all(type(norm).__name__ in kinds for norm in norms)
            and all(
                _weight(n).dtype == torch.bfloat16 and _weight(n).is_contiguous() for n in norms
            )
            and len({_epsilon(norm) for norm in norms}) == 1
            and all(la.heads[2] % 32 == 0 and la.heads[2] <= 256 for la in layers)
            and all(la.heads[0] % la.heads[1] == 0 for la in layers)
        )


def _layer(
    config: PretrainedConfig, layer: nn.Module, heads: tuple[int, int, int], typed: bool
) -> _Layer:
    attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # norms around attention and the MLP
    if hasattr(attn, "sliding_window"):  # Qwen2, Qwen3, Gemma: per layer type
        window = getattr(attn, "sliding_window", None)
    else:  # Mistral, Phi-3: every layer, the config's
        window = getattr(config, "sliding_window", None)
    head_norms = None
    if hasattr(attn, "q_norm"):
        head_norms = (attn.get_submodule("q_norm"), attn.get_submodule("k_norm"))
    if (scaling := attention_number(getattr(attn, "scaling", None))) is None:
        raise Unsupported(f"{type(attn).__name__} keeps no attention scale (scaling)")
    out_norms = None
    if gemma:
        out_norms = tuple(
            layer.get_submodule(n)
            for n in ("post_attention_layernorm", "post_feedforward_layernorm")
        )
    return _Layer(
        input_norm=layer.get_submodule("input_layernorm"),
        mlp_norm=layer.get_submodule(
            "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        ),
        qkv=Product.of([_linear(attn, n) for n in _projections(attn, _QKV)]),
        out=Product.of([_linear(attn, "o_proj")]),
        gate_up=Product.of([_linear(mlp, n) for n in _projections(mlp, _GATE_UP)]),
        down=Product.of([_linear(mlp, "down_proj")]),
        heads=heads,
        act=_activation(mlp),
        attention=attn,
        scaling=scaling,
        window=int(window) if window else None,
        softcap=attention_number(getattr(attn, "attn_logit_softcapping", None)) or None,
        head_norms=head_norms,
        out_norms=out_norms,  # type: ignore[arg-type]  # (two names, two modules)
        rotary_type=getattr(attn, "layer_type", None) if typed else None,
    )


# The projections a layer computes as one product: q/k/v (Phi-3: already one layer) and the
# MLP's gate and up (gate first: the loop splits the product's output in two halves)
_QKV = (("qkv_proj",), ("q_proj", "k_proj", "v_proj"))
_GATE_UP = (("gate_up_proj",), ("gate_proj", "up_proj"))


def _projections(module: nn.Module, spellings: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """The names under which `module` holds the product's layers (the first spelling it has
    all of; check() refuses a layer with none)."""
    for names in spellings:
        if all(hasattr(module, name) for name in names):
            return names
    raise Unsupported(f"{type(module).__name__} has none of {spellings}")


def _gemma_weights(layer: _Layer) -> tuple[torch.Tensor, ...]:
    """A Gemma 3 layer's norm weights in the order _gemma_pass applies them: input,
    post-attention, pre-MLP, post-MLP, queries', keys' (fusable() checked each is there)."""
    assert layer.out_norms is not None and layer.head_norms is not None
    after_attention, after_mlp = layer.out_norms
    norms = (layer.input_norm, after_attention, layer.mlp_norm, after_mlp, *layer.head_norms)
    return tuple(_weight(norm) for norm in norms)


def _gelu_tanh(act: nn.Module) -> bool:
    """Whether an MLP's activation is GELU with tanh's approximation (transformers'
    gelu_pytorch_tanh: Gemma's), which csrc/layer_avx2.c's gelu_mul computes."""
    return type(act).__name__ in ("GELUTanh", "PytorchGELUTanh")


def _epsilon(norm: nn.Module) -> float | None:
    """An RMSNorm's epsilon: Llama's kind keeps it as variance_epsilon, Gemma's as eps."""
    value = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if value is None else float(value)


def _activation(mlp: nn.Module) -> nn.Module:
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)  # (Phi-3's)
    if not isinstance(act, nn.Module):
        raise Unsupported(f"{type(mlp).__name__} has no activation module")
    return act


def _rotary_dim(model: PreTrainedModel) -> int:
    """How many of a head's dimensions rotary turns (Phi-3, Phi-4: part of the head)."""
    shape = attention_shape(model)
    return int(shape[2] * float(getattr(model.config, "partial_rotary_factor", 1.0) or 1.0))


class LeanDecoder:
    """The decoder's passes through the lean loop, as the plan says (see the module doc)."""

    def __init__(
        self, weights: LeanWeights, plan: ExecutionPlan, kernels: CpuKernels | None
    ) -> None:
        self.weights = weights
        self.plan: RowPlan = plan.decoder
        self.kernels = kernels
        # (the plan takes the layer kernels only where they run: AVX512-BF16)
        self.fused = kernels if plan.fused_layer else None
        # _gemma_pass's norm weights by layer (see _gemma_weights)
        gemma_pass = self.fused is not None and weights.gemma
        self._gemma_norms = [_gemma_weights(la) for la in weights.layers] if gemma_pass else []
        # Gemma's GELU through layer_avx2.c where the layer kernels are AVX2's (else the
        # model's module): the loop and the whole pass compute it alike
        self._gelu = gemma_pass and self.fused is not None and self.fused.gelu
        # csrc/step.c's description of every layer (its cache pointers set per pass)
        self._layers = self._describe_layers() if self._one_call() else None
        lay_out(weights.products, self.plan)

    def _one_call(self) -> bool:
        """Whether a whole pass in one C call computes this model's layers (where its
        products all take the GEMV): Llama-style ones without head norms or windows (step.c,
        layer_avx2.c), or Gemma 3's where the layer kernels are AVX2's (layer_avx2.c: its
        norms, head norms, GELU with tanh's approximation, rotary tables and windows by
        layer); one attention scale for every layer."""
        w = self.weights
        if self.fused is None or len({layer.scaling for layer in w.layers}) != 1:
            return False
        if w.gemma:
            return self._gelu and all(_gelu_tanh(layer.act) for layer in w.layers)
        return w.plain

    def run(self, product: Product, x: torch.Tensor) -> torch.Tensor:
        return product.run(x, self.plan.kernel(x.shape[0]), self.kernels)

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of a packed pass (as the base model's
        last_hidden_state[0]); writes the pass's keys and values into the bound cache rows."""
        if self.fused is not None and self.weights.gemma:
            return self._gemma_pass(self.fused, input_ids, position_ids, cache, packing)
        if self.fused is not None:
            return self._fused_pass(self.fused, input_ids, position_ids, cache, packing)
        w = self.weights
        hidden = w.embed(input_ids)  # [1, tokens, hidden]
        rotary = _rotary(w, hidden, position_ids)
        tokens = hidden.shape[1]
        for index, layer in enumerate(w.layers):
            x = layer.input_norm(hidden)[0]
            heads, kv_heads, dim = layer.heads
            qkv = self.run(layer.qkv, x)
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            if layer.head_norms is not None:
                q_norm, k_norm = layer.head_norms
                qk = torch.cat((q_norm(qk[:, :heads]), k_norm(qk[:, heads:])), dim=1)
            qk = _rotate(qk, *rotary[layer.rotary_type])
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, heads, tokens, dim]
            k = qk[:, heads:].transpose(0, 1)[None]
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).transpose(0, 1)[None]
            keys, values = cache.update(k, v, index)
            attended, _ = packed_attention(
                layer.attention, q, keys, values, packing.mask, layer.scaling, packing=packing,
                sliding_window=layer.window, softcap=layer.softcap,
            )  # fmt: skip
            attention_out = self.run(layer.out, attended.reshape(tokens, heads * dim))[None]
            if layer.out_norms is not None:
                attention_out = layer.out_norms[0](attention_out)
            hidden = hidden + attention_out
            x = layer.mlp_norm(hidden)[0]
            gate, up = self.run(layer.gate_up, x).chunk(2, dim=-1)
            mlp_out = self.run(layer.down, layer.act(gate) * up)[None]
            if layer.out_norms is not None:
                mlp_out = layer.out_norms[1](mlp_out)
            hidden = hidden + mlp_out
        out: torch.Tensor = w.norm(hidden)[0]
        return out

    def _fused_pass(
        self,
        fused: CpuKernels,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """`__call__` with the work between the products in csrc/layer.c: per layer a residual
        add fused with each norm, rotary fused with the cache write, attention (each query on
        its own, in one order whatever the pass: a prompt's tokens get the same keys and values
        prefilled whole, in chunks or after a cached prefix; a mask laid out otherwise takes
        the attention packed_attention chooses) and SiLU(gate) * up."""
        w = self.weights
        hidden = w.embed(input_ids)[0].contiguous()  # [tokens, hidden], updated in place
        rotary = w.rotary_table if w.rotary_table is not None else w.rotary
        cos, sin = rotary(hidden[None], position_ids)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, dim]
        tokens = hidden.shape[0]
        normed = torch.empty_like(hidden)
        if self._in_one_call(tokens, packing):
            self._whole_pass(fused, hidden, normed, {None: (cos, sin)}, cache, packing)
            return normed
        eps, weights = w.eps, w.norm_weights
        fused.add_rmsnorm(hidden, None, weights[0], normed, eps)
        for index, layer in enumerate(w.layers):
            heads, kv_heads, dim = layer.heads
            qkv = self.run(layer.qkv, normed)
            if layer.head_norms is not None:  # (in place, before rotary: Qwen3)
                q_norm, k_norm = layer.head_norms
                qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
                qk[:, :heads] = q_norm(qk[:, :heads])
                qk[:, heads:] = k_norm(qk[:, heads:])
            attended = self._attend(fused, index, layer, qkv, cos, sin, cache, packing)
            fused.add_rmsnorm(
                hidden, self.run(layer.out, attended), weights[2 * index + 1], normed, eps
            )
            gate_up = self.run(layer.gate_up, normed)
            act = gate_up.new_empty(tokens, gate_up.shape[1] // 2)
            fused.silu_mul(gate_up, act)
            fused.add_rmsnorm(
                hidden, self.run(layer.down, act), weights[2 * index + 2], normed, eps
            )
        return normed

    def _gemma_pass(
        self,
        fused: CpuKernels,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """`__call__` for Gemma 3 with the work between the products in C: its norms and
        residual adds (csrc/norms.c: after attention the post-attention norm, the add and the
        pre-MLP norm in one call, after the MLP the post-MLP norm, the add and the next layer's
        input norm), head norms, rotary with the cache write and attention (layer.c's or
        layer_avx2.c's, a windowed layer's mask from the packing); GELU the model's, or
        layer_avx2.c's where its layer kernels run, and there every layer in one call where
        every product takes the GEMV."""
        w = self.weights
        hidden = w.embed(input_ids)[0].contiguous()  # [tokens, hidden] (scaled), in place
        rotary = {
            kind: (cos[:, 0].contiguous(), sin[:, 0].contiguous())
            for kind, (cos, sin) in _rotary(w, hidden[None], position_ids).items()
        }
        normed = torch.empty_like(hidden)
        tokens = hidden.shape[0]
        if self._in_one_call(tokens, packing):
            self._whole_pass(fused, hidden, normed, rotary, cache, packing)
            return normed
        eps, norms = w.eps, self._gemma_norms
        fused.gemma_add_norm(hidden, None, None, norms[0][0], normed, eps)
        for index, layer in enumerate(w.layers):
            _, post_attention, pre_mlp, post_mlp, q_weight, k_weight = norms[index]
            qkv = self.run(layer.qkv, normed)
            fused.gemma_head_norms(qkv, layer.heads, q_weight, k_weight, eps)
            cos, sin = rotary[layer.rotary_type]
            attended = self._attend(fused, index, layer, qkv, cos, sin, cache, packing)
            delta = self.run(layer.out, attended).contiguous()
            fused.gemma_add_norm(hidden, delta, post_attention, pre_mlp, normed, eps)
            gate_up = self.run(layer.gate_up, normed)
            if self._gelu:
                act = gate_up.new_empty(tokens, gate_up.shape[1] // 2)
                fused.gelu_mul(gate_up, act)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = layer.act(gate) * up
            delta = self.run(layer.down, act).contiguous()
            following = norms[index + 1][0] if index + 1 < len(norms) else w.norm_weights[-1]
            fused.gemma_add_norm(hidden, delta, post_mlp, following, normed, eps)
        return normed

    def _attend(
        self,
        fused: CpuKernels,
        index: int,
        layer: _Layer,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SlotCache,
        packing: Packing,
    ) -> torch.Tensor:
        """A fused layer's attention [tokens, heads * dim]: rotary on qkv's queries and keys
        with the cache write, then each query over its row's cache (layer.c's attention; a
        windowed layer reads the windowed mask), or packed attention where the mask is not laid
        out for the kernel."""
        heads, kv_heads, dim = layer.heads
        tokens, mask = qkv.shape[0], packing.mask
        like = qkv.new_empty(1, kv_heads, 1, dim)
        keys, values, rows, positions = cache.layer_for_kernel(index, like)
        fused.rotary_cache(qkv, cos, sin, layer.heads, keys, values, rows, positions)
        if mask.is_contiguous():
            attended = qkv.new_empty(tokens, heads * dim)
            layer_mask = packing.windowed_mask(layer.window) if layer.window else mask
            fused.attention(
                qkv, attended, layer.heads, keys, values, rows, layer_mask,
                packing.tokens.contiguous(), layer.scaling,
            )  # fmt: skip
            return attended
        q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]
        bound_keys, bound_values = cache.bound_rows(index)
        out, _ = packed_attention(
            layer.attention, q, bound_keys, bound_values, mask, layer.scaling,
            packing=packing, sliding_window=layer.window,
        )  # fmt: skip
        return out.reshape(tokens, heads * dim)

    def _in_one_call(self, tokens: int, packing: Packing) -> bool:
        """Whether a `tokens`-row pass runs as one C call (`_whole_pass`): the call computes
        the model's layers (`_one_call`), the mask is laid out for its attention, and every
        decoder product takes a GEMV that csrc/step.c runs (bf16 weights, int8 ones widened
        to bf16, a file's own groups; or bf16 weights through AMX tiles); on AVX2,
        layer_avx2.c's pass: bf16 weights or a file's own groups."""
        if self._layers is None or not packing.mask.is_contiguous():
            return False
        kernel, quantized = self.plan.kernel(tokens), self.weights.quantized
        if kernel is Kernel.AMX:
            return quantized == ""
        avx2 = self.fused is not None and not self.fused.bf16
        return kernel is Kernel.GEMV and quantized in (_AVX2_QUANT if avx2 else _QUANT)

    def _describe_layers(self) -> ctypes.Array[DecoderLayer]:
        def pointer(tensor: torch.Tensor | None) -> int | None:
            return None if tensor is None else tensor.data_ptr()

        w = self.weights
        layers = (DecoderLayer * len(w.layers))()
        for index, layer in enumerate(w.layers):
            described = layers[index]
            for name, product in (
                ("qkv", layer.qkv), ("out", layer.out), ("gate_up", layer.gate_up),
                ("down", layer.down),
            ):  # fmt: skip
                setattr(described, name, product.weight.data_ptr())
                setattr(described, f"{name}_scales", pointer(product.scales))
                if (grouped := product.grouped) is not None:  # a file's own groups
                    setattr(described, f"{name}_scales", grouped.scales.data_ptr())
                    setattr(described, f"{name}_mins", pointer(grouped.mins))
                    setattr(described, f"{name}_group", grouped.group)
                    setattr(described, f"{name}_bits", grouped.bits)
                    setattr(described, f"{name}_half", int(grouped.half))
                if name in ("qkv", "out"):
                    setattr(described, f"{name}_bias", pointer(product.bias))
                else:
                    assert product.bias is None  # check(): no biased MLP
            described.input_norm = w.norm_weights[2 * index].data_ptr()
            described.post_norm = w.norm_weights[2 * index + 1].data_ptr()  # (the MLP's)
            if w.gemma:  # (see _gemma_weights)
                _, after_attention, _, after_mlp, q_weight, k_weight = self._gemma_norms[index]
                described.attention_out_norm = after_attention.data_ptr()
                described.mlp_out_norm = after_mlp.data_ptr()
                described.q_norm, described.k_norm = q_weight.data_ptr(), k_weight.data_ptr()
        return layers

    def _whole_pass(
        self,
        fused: CpuKernels,
        hidden: torch.Tensor,
        normed: torch.Tensor,
        rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        cache: SlotCache,
        packing: Packing,
    ) -> None:
        """Every layer in one call (csrc/step.c; layer_avx2.c's): the kernels `_fused_pass`
        (or `_gemma_pass`) calls, in its order, for a pass whose products all take the GEMV;
        `rotary` the cos and sin [tokens, dim] of each layer's rotary_type."""
        layers, w = self._layers, self.weights
        assert layers is not None
        tokens = hidden.shape[0]
        heads, kv_heads, dim = w.layers[0].heads
        like = hidden.new_empty(1, kv_heads, 1, dim)
        caches, rows, positions = cache.kernel_layers(len(w.layers), like)
        for described, layer, (keys, values) in zip(layers, w.layers, caches, strict=True):
            described.keys, described.values = keys.data_ptr(), values.data_ptr()
            if w.gemma:  # each layer's rotary table and (windowed layers) mask
                cos, sin = rotary[layer.rotary_type]
                described.cos, described.sin = cos.data_ptr(), sin.data_ptr()
                window = packing.windowed_mask(layer.window) if layer.window else None
                described.mask = None if window is None else window.data_ptr()
        keys = caches[0][0]
        cos, sin = rotary[w.layers[0].rotary_type]
        mask, mask_rows = packing.mask, packing.tokens.contiguous()
        arguments = PassArgs(
            layers=layers, count=len(w.layers), final_norm=w.norm_weights[-1].data_ptr(),
            hidden=hidden.data_ptr(), normed=normed.data_ptr(), tokens=tokens,
            size=hidden.shape[1], heads=heads, kv_heads=kv_heads, dim=dim,
            intermediate=w.layers[0].down.in_features, quant=_QUANT[w.quantized],
            eps=w.eps, cos=cos.data_ptr(), sin=sin.data_ptr(), cache_rows=rows.data_ptr(),
            positions=positions.data_ptr(), capacity=keys.shape[2], mask=mask.data_ptr(),
            mask_bf16=int(mask.dtype == torch.bfloat16), mask_rows=mask_rows.data_ptr(),
            kv_length=mask.shape[-1], scale=w.layers[0].scaling,
            bf16_product=fused.amx_product if self.plan.kernel(tokens) is Kernel.AMX else None,
            gemma=int(w.gemma),
        )  # fmt: skip
        fused.decoder_pass(arguments)


def _weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise Unsupported(f"{type(module).__name__} has no weight tensor")
    return weight.detach()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(
    weights: LeanWeights, hidden: torch.Tensor, position_ids: torch.Tensor
) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin [tokens, 1, rotary dim] (over every head) by the layers' rotary_type: one
    pair for most models, one per layer type for Gemma 3 (local and global bases)."""
    pairs = {}
    for kind in {layer.rotary_type for layer in weights.layers}:
        args = (hidden, position_ids) if kind is None else (hidden, position_ids, kind)
        cos, sin = weights.rotary(*args)  # [1, tokens, rotary dim]
        pairs[kind] = (cos[0, :, None], sin[0, :, None])
    return pairs


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on queries and keys [tokens, heads, dim] at once, as transformers'
    apply_rotary_pos_emb computes each (the same elementwise operations on the same values);
    where cos is narrower than a head (Phi-3's partial rotary), on its first dimensions only."""
    turned = cos.shape[-1]
    if turned == qk.shape[-1]:
        return qk * cos + _rotate_half(qk) * sin
    part = qk[..., :turned]
    return torch.cat((part * cos + _rotate_half(part) * sin, qk[..., turned:]), dim=-1)


def _linear(module: nn.Module, name: str) -> Linear:
    layer = module.get_submodule(name)
    assert isinstance(layer, (nn.Linear, Int8Linear, Int4Linear, GroupedLinear))  # check()
    return layer


def check(model: PreTrainedModel) -> None:
    """Raise Unsupported unless the lean loop computes what the model's own forward does."""
    config = model.config
    if config.model_type not in FAMILIES:
        raise Unsupported(
            f"model type {config.model_type!r} (the lean forward serves {sorted(FAMILIES)})"
        )
    if getattr(config, "mlp_bias", False):
        raise Unsupported("biased MLP layers")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention")
    inner = model.base_model
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb"):
        raise Unsupported("no decoder layers or rotary embedding where Llama keeps them")
    kinds = set()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, names in ((attn, (*_projections(attn, _QKV), "o_proj")),
                              (mlp, (*_projections(mlp, _GATE_UP), "down_proj"))):  # fmt: skip
            for name in names:
                kinds.add(type(getattr(module, name, None)))
                if kinds - _LINEARS:
                    raise Unsupported(f"{name} is not a plain linear layer")
        _activation(mlp)
    if len(kinds) > 1:
        raise Unsupported(
            "the linear layers are not all of one kind (bf16, int8, int4 or the file's own)"
        )
