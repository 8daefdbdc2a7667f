"""The target's decoder without transformers' layers: a lean loop for the Llama family.

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

It serves only what it reproduces (`check`): Llama, Mistral and Qwen2 models without sliding
windows, on a CPU, in bfloat16 (or with int8/int4 weights, whose activations may be float32).
float32 weights keep the eager forward, so float32 output stays identical to transformers'
`generate`. In bfloat16 a product summed by another kernel differs in its last bits, as any
two GEMM kernels do; passes narrower than the plan's `row_invariant_below` compute each row as
a one-token pass does, so there speculation's greedy output is plain decoding's, bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from kenspec.server.engine.architecture import attention_shape
from kenspec.server.engine.attention import packed_attention
from kenspec.server.engine.forward.cpu_kernels import CpuKernels, DecoderLayer, PassArgs
from kenspec.server.engine.forward.plan import ExecutionPlan, Kernel, RowPlan
from kenspec.server.engine.forward.products import Linear, Product, lay_out, quantized_kind
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.packing import Packing
from kenspec.server.engine.quantize import GroupedLinear, Int4Linear, Int8Linear

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
_FUSED_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
_LINEARS = frozenset({nn.Linear, Int8Linear, Int4Linear, GroupedLinear})


# csrc/step.c's kenspec_pass.quant for the lean weights' kinds it computes (int4: not)
_QUANT = {"": 0, "int8": 1, "gguf": 2}
_AVX2_QUANT = frozenset({"", "gguf"})  # ... and layer_avx2.c's


class Unsupported(ValueError):
    """The model is not one the lean forward reproduces (the reason is the message)."""


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


class LeanWeights:
    """A Llama-family model's decoder as products (q/k/v and gate/up each joined into one;
    the model's layers become views of them) and the modules the loop calls."""

    def __init__(self, model: PreTrainedModel) -> None:
        check(model)
        inner = model.base_model
        self.embed: nn.Module = inner.get_submodule("embed_tokens")
        self.rotary: nn.Module = inner.get_submodule("rotary_emb")
        self.norm: nn.Module = inner.get_submodule("norm")
        shape = attention_shape(model)
        decoder = inner.get_submodule("layers")
        assert isinstance(decoder, nn.ModuleList)
        self.layers = [_layer(layer, shape) for layer in decoder]
        self.products = [p for la in self.layers for p in (la.qkv, la.out, la.gate_up, la.down)]
        self.scaling = shape[2] ** -0.5  # transformers' Llama attention scale
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        # The fused loop's norm weights in the order it applies them, the final norm's last
        self.norm_weights = [_weight(norm) for norm in (*norms, self.norm)]
        self.eps = float(getattr(self.norm, "variance_epsilon", 0.0))
        self.quantized = quantized_kind(self.products)

    def fusable(self, model: PreTrainedModel) -> bool:
        """Whether csrc/layer.c computes what this model's modules do: bfloat16 activations
        and weights, transformers' Llama RMSNorm (one epsilon), SiLU, a head dim it takes."""
        norms = [self.norm] + [n for la in self.layers for n in (la.input_norm, la.post_norm)]
        eps = {getattr(norm, "variance_epsilon", None) for norm in norms}
        return (
            model.dtype == torch.bfloat16
            and all(type(norm).__name__ in _FUSED_NORMS for norm in norms)
            and all(
                _weight(n).dtype == torch.bfloat16 and _weight(n).is_contiguous() for n in norms
            )
            and len(eps) == 1
            and getattr(model.config, "hidden_act", None) == "silu"
            and all(la.heads[2] % 32 == 0 and la.heads[2] <= 256 for la in self.layers)
            and all(la.heads[0] % la.heads[1] == 0 for la in self.layers)
        )


def _layer(layer: nn.Module, heads: tuple[int, int, int]) -> _Layer:
    attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
    return _Layer(
        input_norm=layer.get_submodule("input_layernorm"),
        post_norm=layer.get_submodule("post_attention_layernorm"),
        qkv=Product.of([_linear(attn, n) for n in ("q_proj", "k_proj", "v_proj")]),
        out=Product.of([_linear(attn, "o_proj")]),
        gate_up=Product.of([_linear(mlp, "gate_proj"), _linear(mlp, "up_proj")]),
        down=Product.of([_linear(mlp, "down_proj")]),
        heads=heads,
        act=mlp.get_submodule("act_fn"),
        attention=attn,
    )


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
        # csrc/step.c's description of every layer (its cache pointers set per pass)
        self._layers = self._describe_layers() if self.fused is not None else None
        lay_out(weights.products, self.plan)

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
        if self.fused is not None:
            return self._fused_pass(self.fused, input_ids, position_ids, cache, packing)
        w = self.weights
        hidden = w.embed(input_ids)  # [1, tokens, hidden]
        cos, sin = w.rotary(hidden, position_ids)  # [1, tokens, dim]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [tokens, 1, dim]: over every head
        tokens = hidden.shape[1]
        for index, layer in enumerate(w.layers):
            x = layer.input_norm(hidden)[0]
            heads, kv_heads, dim = layer.heads
            qkv = self.run(layer.qkv, x)
            # Rotary on the queries and keys at once, as transformers' apply_rotary_pos_emb
            # computes each (the same elementwise operations on the same values).
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, heads, tokens, dim]
            k = qk[:, heads:].transpose(0, 1)[None]
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).transpose(0, 1)[None]
            keys, values = cache.update(k, v, index)
            attended, _ = packed_attention(
                layer.attention, q, keys, values, packing.mask, w.scaling, packing=packing
            )
            hidden = hidden + self.run(layer.out, attended.reshape(tokens, heads * dim))[None]
            x = layer.post_norm(hidden)[0]
            gate, up = self.run(layer.gate_up, x).chunk(2, dim=-1)
            hidden = hidden + self.run(layer.down, layer.act(gate) * up)[None]
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
        cos, sin = w.rotary(hidden[None], position_ids)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, dim]
        tokens = hidden.shape[0]
        normed = torch.empty_like(hidden)
        mask = packing.mask
        narrow = mask.is_contiguous()
        mask_rows = packing.tokens.contiguous()
        if narrow and self._layers is not None and self._all_gemv(tokens):
            self._whole_pass(fused, hidden, normed, cos, sin, cache, mask, mask_rows)
            return normed
        eps, weights = w.eps, w.norm_weights
        fused.add_rmsnorm(hidden, None, weights[0], normed, eps)
        for index, layer in enumerate(w.layers):
            heads, kv_heads, dim = layer.heads
            qkv = self.run(layer.qkv, normed)
            like = qkv.new_empty(1, kv_heads, 1, dim)
            keys, values, rows, positions = cache.layer_for_kernel(index, like)
            fused.rotary_cache(qkv, cos, sin, layer.heads, keys, values, rows, positions)
            if narrow:
                attended = hidden.new_empty(tokens, heads * dim)
                fused.attention(
                    qkv, attended, layer.heads, keys, values, rows, mask, mask_rows, w.scaling
                )
            else:
                q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]
                bound_keys, bound_values = cache.bound_rows(index)
                out, _ = packed_attention(
                    layer.attention, q, bound_keys, bound_values, mask, w.scaling,
                    packing=packing,
                )  # fmt: skip
                attended = out.reshape(tokens, heads * dim)
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

    def _all_gemv(self, tokens: int) -> bool:
        """Whether every decoder product of a `tokens`-row pass takes a GEMV that
        csrc/step.c runs (bf16 weights, int8 ones widened to bf16, a file's own groups; or
        bf16 weights through AMX tiles); on AVX2, layer_avx2.c's pass: bf16 weights or a
        file's own groups."""
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
            described.post_norm = w.norm_weights[2 * index + 1].data_ptr()
        return layers

    def _whole_pass(
        self,
        fused: CpuKernels,
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
        layers, w = self._layers, self.weights
        assert layers is not None
        tokens = hidden.shape[0]
        heads, kv_heads, dim = w.layers[0].heads
        like = hidden.new_empty(1, kv_heads, 1, dim)
        rows = positions = keys = torch.empty(0)
        for index in range(len(w.layers)):
            keys, values, rows, positions = cache.layer_for_kernel(index, like)
            layers[index].keys, layers[index].values = keys.data_ptr(), values.data_ptr()
        arguments = PassArgs(
            layers=layers, count=len(w.layers), final_norm=w.norm_weights[-1].data_ptr(),
            hidden=hidden.data_ptr(), normed=normed.data_ptr(), tokens=tokens,
            size=hidden.shape[1], heads=heads, kv_heads=kv_heads, dim=dim,
            intermediate=w.layers[0].down.in_features, quant=_QUANT[w.quantized],
            eps=w.eps, cos=cos.data_ptr(), sin=sin.data_ptr(), cache_rows=rows.data_ptr(),
            positions=positions.data_ptr(), capacity=keys.shape[2], mask=mask.data_ptr(),
            mask_bf16=int(mask.dtype == torch.bfloat16), mask_rows=mask_rows.data_ptr(),
            kv_length=mask.shape[-1], scale=w.scaling,
            bf16_product=fused.amx_product if self.plan.kernel(tokens) is Kernel.AMX else None,
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
        raise Unsupported(
            "the linear layers are not all of one kind (bf16, int8, int4 or the file's own)"
        )
