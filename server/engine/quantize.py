"""Weights in int8: symmetric per-output-row quantization of a model's linear layers.

Row o of a weight W [out, in] is kept as int8 values q[o] and one scale s[o] in the
activations' dtype, W[o] ~ q[o] * s[o], with s[o] = max |W[o]| / 127 (rounded up to the dtype,
so no value needs clamping) and q = round(W / s): every weight within s[o] / 2 of the original.
A layer computes y = (x @ q^T) * s (+ bias), summed in float32 (`int8_linear`; the fast step's
kernels, engine.fast_step). The embedding lookup keeps the model's dtype: with tied weights
only the output layer's product is int8 (the fast step quantizes its own copy).

Example: W[o] = [0.5, -1.27, 0.01] -> s[o] = 0.01, q[o] = [50, -127, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

TORCH_INT8_K = 32  # torch's int8 kernel takes rows of a multiple of this many weights
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Int8Weight:
    values: torch.Tensor  # [out, in] int8, contiguous
    scales: torch.Tensor  # [out], the activations' dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scales [out, in] (exact in float32 and float64)."""
        return self.values.to(dtype) * self.scales.to(dtype)[:, None]


def quantize(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """weight [out, in] as int8 with one `dtype` scale per row (see the module's doc)."""
    with torch.no_grad():
        exact = weight.detach().float()
        absmax = exact.abs().amax(dim=1)
        scales = (absmax / 127).to(dtype)
        short = scales.float() * 127 < absmax  # rounded down by the dtype: one step up
        scales = torch.where(short, torch.nextafter(scales, scales.new_tensor(torch.inf)), scales)
        scales = torch.where(absmax > 0, scales, torch.ones_like(scales))  # all-zero rows
        values = torch.round(exact / scales.float()[:, None]).clamp_(-127, 127)
        return Int8Weight(values.to(torch.int8).contiguous(), scales.contiguous())


def int8_linear(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(x @ values^T) * scales (+ bias) for x [rows, in] in scales' dtype: torch's int8 kernel
    (any CPU), or a dequantized product where torch has none or would not take the shape."""
    kernel = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    # torch 2.13's bfloat16 kernel reads past rows whose length is no multiple of 16 (a crash)
    if kernel is not None and x.device.type == "cpu" and x.shape[1] % TORCH_INT8_K == 0:
        out: torch.Tensor = kernel(x, values, scales)
    else:
        out = (F.linear(x.float(), values.float()) * scales.float()).to(x.dtype)  # one rounding
    return out if bias is None else out.add_(bias)


class Int8Linear(nn.Module):
    """A linear layer whose weight is kept as int8 and per-row scales (see the module's doc)."""

    values: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.values.shape
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, layer: nn.Linear, dtype: torch.dtype) -> Int8Linear:
        return cls(quantize(layer.weight, dtype), layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = int8_linear(rows, self.values, self.scales, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def tied_head(model: PreTrainedModel) -> bool:
    """Whether the output layer shares its weight with the embedding."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embedding.weight


def quantize_model(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Replace every decoder linear layer (DECODER_LINEARS of base_model.layers) and an untied
    output layer with its Int8Linear; their bf16 or float32 weights are freed."""
    decoder = model.base_model.get_submodule("layers")
    assert isinstance(decoder, nn.ModuleList)
    for layer in decoder:
        for parent in (layer.get_submodule("self_attn"), layer.get_submodule("mlp")):
            for name in DECODER_LINEARS:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    setattr(parent, name, Int8Linear.of(linear, dtype))
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and not tied_head(model):
        model.set_output_embeddings(Int8Linear.of(head, dtype))
