"""A GGUF file's weights served in the file's own quantization (--weights auto or gguf).

The model is loaded dequantized (gguf_model's cached folder: the tokenizer, the config, the
norms, the embedding for lookups); then each of the decoder's linear layers whose tensor the
file keeps quantized becomes a `GroupedLinear` holding the file's integers with their scales
and offsets (engine.gguf_quants reads them, engine.quantize keeps them), and the output
layer's product is the file's own tensor (`output.weight`, or `token_embd.weight` where the
model ties them). Nothing is re-quantized: the served weights are the file's, each exactly
as its dequantization computes it (checked at load against the loaded model's rows).

Where a tensor is F32/F16/BF16 the layer stays as loaded (in --dtype). The file's tensor
names and llama.cpp's rotary row order of q and k are undone as transformers undoes them on
load (its name map and tensor processor, applied to each row's index).

    >>> # the Q4_1 file of SmolLM2: every decoder layer Q4_1 (4-bit groups), output Q8_0
    >>> # describe(FileWeights(...)) == "gguf Q4_1 (210 layers), output Q8_0"
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import PreTrainedModel

from kenspec.server.engine.gguf_model import read_tensors
from kenspec.server.engine.gguf_quants import FOUR_BIT, READABLE, read_blocks
from kenspec.server.engine.quantize import GroupedLinear, GroupedWeight, decoder_linears, tied_head

if TYPE_CHECKING:
    from kenspec.server.engine.forward.cpu_kernels import CpuKernels

FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)
# Rows of each tensor compared with the loaded model's at load: row 1 moves under llama.cpp's
# rotary order of q and k, so a wrong order shows; few, because each row read from the cached
# folder's mapped file brings ~64 KB of it into memory for the process's life.
_CHECKED_ROWS = (1, -2)


class FileWeightsError(ValueError):
    """The file's tensors cannot be served as the file keeps them (the message says why)."""


@dataclass
class FileWeights:
    """What was taken from the file: the output layer's tensor (None: as loaded) and the
    count of decoder layers per GGUF type (those kept as loaded under their float type)."""

    output: GroupedWeight | None = None
    layers: Counter[str] = field(default_factory=Counter)
    output_type: str = ""

    @property
    def quantized_layers(self) -> int:
        return sum(n for kind, n in self.layers.items() if kind not in _FLOAT_NAMES)

    def describe(self) -> str:
        """E.g. "gguf Q4_1 (210 layers), output Q8_0"."""
        kinds = ", ".join(f"{kind} ({n} layers)" for kind, n in sorted(self.layers.items()))
        output = self.output_type or "as loaded"
        return f"gguf {kinds}, output {output}"


_FLOAT_NAMES = frozenset(t.name for t in FLOAT_TYPES)


def apply_file_weights(
    model: PreTrainedModel, path: Path, kernels: CpuKernels | None = None
) -> FileWeights:
    """Replace the model's decoder linear layers by the file's quantized tensors (computed by
    `kernels`' grouped GEMV where given), and read its output layer's; FileWeightsError where
    a tensor is missing, of a type not read, or does not match the loaded model. For AVX2's
    grouped GEMV the scales and offsets are kept in float16 where each is one exactly (Q4_1:
    5 bits a weight to read instead of 6); AVX512-BF16's reads float32."""
    try:
        architecture, tensors = read_tensors(path)
    except ValueError as error:
        raise FileWeightsError(str(error)) from None
    names, processor = _names(model, architecture)
    half = kernels is not None and kernels.grouped_half
    quads = kernels is not None and kernels.grouped_quads
    module_names = {module: name for name, module in model.named_modules()}
    found = FileWeights()
    for parent, name, linear in list(decoder_linears(model)):
        if not isinstance(linear, torch.nn.Linear):
            raise FileWeightsError(f"{name} is a {type(linear).__name__}, not the loaded layer")
        hf_name = f"{module_names[linear]}.weight"
        tensor = tensors.get(names.get(hf_name, ""))
        if tensor is None:
            raise FileWeightsError(f"{path}: no tensor for {hf_name}")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        found.layers[qtype.name] += 1
        if qtype in FLOAT_TYPES:
            continue
        weight = _grouped(tensor, qtype, processor, linear.weight.detach(), hf_name, half, quads)
        setattr(parent, name, GroupedLinear(weight, linear.bias, kernels))
    head = model.get_output_embeddings()
    source = "model.embed_tokens.weight" if tied_head(model) else f"{module_names[head]}.weight"
    tensor = tensors.get(names.get(source, ""))
    if tensor is None and tied_head(model):
        tensor = tensors.get("token_embd.weight")
    if tensor is not None:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        found.output_type = qtype.name
        weight = head.weight
        if qtype not in FLOAT_TYPES and isinstance(weight, torch.Tensor):
            found.output = _grouped(tensor, qtype, processor, weight.detach(), source, half, quads)
    return found


def _names(model: PreTrainedModel, architecture: str) -> tuple[dict[str, str], Any]:
    """{Hugging Face parameter name: GGUF tensor name}, and transformers' tensor processor for
    the architecture (which undoes llama.cpp's layouts on load)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    kind: Any = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    processor = kind(config=model.config.to_dict())
    # transformers builds gguf's name map afresh for every module it walks (the same map: ~9 s
    # for SmolLM2's ~400 modules); built once here, for this call (start-up runs one load).
    uncached = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(uncached)
    try:
        mapping: dict[str, str] = get_gguf_hf_weights_map(model, processor)
    finally:
        gguf.get_tensor_name_map = uncached
    return {hf: name for name, hf in mapping.items()}, processor


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray:
    """The file's row each loaded row comes from: transformers' processor applied to each
    row's index (llama.cpp keeps q and k in its rotary order; most tensors as they are)."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    processed = np.asarray(processor.process(weights=index, name=name).weights)
    order = processed.reshape(-1).astype(np.int64)
    if processed.shape != index.shape or sorted(order.tolist()) != list(range(rows)):
        raise FileWeightsError(f"{name}: the loader does more than reorder its rows")
    return order


def _grouped(
    tensor: Any,
    qtype: GGMLQuantizationType,
    processor: Any,
    loaded: torch.Tensor,
    hf_name: str,
    half: bool = False,
    quads: bool = False,
) -> GroupedWeight:
    """The file's tensor as a GroupedWeight in the loaded model's row order, checked against
    `loaded` (the model's dequantized weight) on a few rows; scales in float16 where `half`
    and exact, 4-bit values in quads where `quads` (GroupedWeight.of)."""
    if qtype not in READABLE:
        raise FileWeightsError(
            f"{hf_name} is {qtype.name}, which kenspec does not serve as the file keeps it; "
            "start with --weights bf16 to serve it dequantized"
        )
    rows, cols = loaded.shape
    blocks = read_blocks(np.asarray(tensor.data).reshape(rows, -1), qtype, cols)
    order = torch.from_numpy(_row_order(processor, tensor.name, rows))
    q = torch.from_numpy(blocks.values)[order]
    scales = torch.from_numpy(blocks.scales)[order]
    mins = None if blocks.mins is None else torch.from_numpy(blocks.mins)[order]
    _check_rows(q, scales, mins, blocks.group, loaded, hf_name)
    bits = 4 if qtype in FOUR_BIT else 8
    return GroupedWeight.of(q, scales, mins, blocks.group, bits, qtype.name, half, quads)


def _check_rows(
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    loaded: torch.Tensor,
    hf_name: str,
) -> None:
    """The file's weights on a few rows against the loaded model's: equal in float32 (both
    are the file's dequantization), within a bfloat16 rounding in bfloat16."""
    rows = loaded.shape[0]
    picked = torch.tensor(sorted({row % rows for row in _CHECKED_ROWS}))
    mine = q[picked].float() * scales[picked].repeat_interleave(group, dim=1)
    if mins is not None:
        mine += mins[picked].repeat_interleave(group, dim=1)
    mine = mine.to(loaded.dtype)
    theirs = loaded[picked]
    if not torch.equal(mine, theirs):
        worst = (mine.float() - theirs.float()).abs().max().item()
        raise FileWeightsError(
            f"{hf_name}: the file's weights read as kept differ from the loaded model's "
            f"(up to {worst:.3g}); serve it with --weights bf16"
        )
