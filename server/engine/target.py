"""The target model: a local Hugging Face causal LM that verifies drafts with a rolling KV cache."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kenspec.server.engine.architecture import (
    UnsupportedArchitecture,
    attention_shape,
    check_packed_passes,
    refuse_unsupported,
    served_context,
)
from kenspec.server.engine.attention import PACKED_ATTENTION
from kenspec.server.engine.forward.choose import build_forward
from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.lean import FAMILIES, GGUF_FAMILIES, Unsupported, check
from kenspec.server.engine.forward.passes import Forward
from kenspec.server.engine.forward.plan import ExecutionOptions, ExecutionPlan, LeanMode
from kenspec.server.engine.gguf_model import (
    DEFAULT_GGUF_CACHE,
    GgufRefused,
    cached_folder,
    find_gguf,
    kept_source,
    read_architecture,
)
from kenspec.server.engine.gguf_weights import FileWeights, FileWeightsError, apply_file_weights
from kenspec.server.engine.kernels import Kernels
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.params import Weights
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.quantize import exact_grouped_products, int4_refusal, quantize_model
from kenspec.server.engine.verify_pass import VerifyPass

# A pass may run past the last valid position by its padding (at most one verify width).
_MAX_PASS_OVERHANG = 128
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


STOCK = ExecutionOptions()  # transformers' forward and torch's kernels, nothing measured


class TargetLoadError(RuntimeError):
    """The target model directory is missing, incomplete, not a causal LM, or an architecture
    kenspec's engine cannot serve exactly."""


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 arithmetic (avx512_bf16 or AMX), where bf16 is faster than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise TargetLoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device, avx2_step: bool = False) -> torch.dtype:
    """auto: bf16 on CUDA, on CPUs with native bf16 (verify passes cost ~1 step) and where
    kenspec's AVX2 kernels compute the model's bf16 step (`avx2_step`: see `_avx2_step`);
    else fp32."""
    if dtype == "auto":
        fast = device.type == "cuda" or cpu_has_native_bf16() or avx2_step
        return torch.bfloat16 if fast else torch.float32
    if dtype not in _DTYPES:
        raise TargetLoadError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class TargetModel:
    """A causal LM and its tokenizer; all forward passes go through here.

    The cache protocol: a generation's row of a SlotCache holds every accepted token but the
    last one (the "pending" token). A round feeds [pending, d_1..d_k] and gets k+1 next-token
    distributions; the row's valid length then grows by 1 + accepted, so rejected drafts are
    dropped without copying anything and no accepted token is recomputed.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    max_context: int
    # How its passes are computed: the plan chosen at load and the code that runs it
    # (engine.forward); fixed for the target's life.
    passes: Forward
    # What a GGUF file's own quantization serves (--weights gguf, or auto on a GGUF file)
    file_weights: FileWeights | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        gguf_cache: str | Path = DEFAULT_GGUF_CACHE,
        weights: str = "auto",
        execution: ExecutionOptions = STOCK,
        chat_template: str | None = None,
    ) -> TargetModel:
        """Load a Hugging Face folder, or a GGUF file (or a folder holding one), dequantized to
        `dtype` once and kept as a folder under `gguf_cache` (see gguf_model); with `weights`
        int8 or int4, its linear layers quantized (engine.quantize), gguf (and auto where the
        grouped GEMV computes it: see _resolve_weights) a GGUF file's own quantized tensors
        served as it keeps them (engine.gguf_weights), the file named as `path` or the one a
        folder converted from it keeps (gguf_model.kept_source); its passes planned within
        `execution` and built (engine.forward). chat_template: a Jinja template its tokenizer
        renders chats with instead of its own (or the one a model without one gets)."""
        try:
            kept = Weights(weights)
        except ValueError:
            known = ", ".join(Weights)
            raise TargetLoadError(f"weights {weights!r} is not one of {known}") from None
        resolved_device = resolve_device(device)
        name = str(Path(path))
        gguf_file = _gguf_file(Path(path))
        # The file whose own weights may be served: the GGUF file itself, or the one a folder
        # converted from it keeps (the default model: gguf_model.kept_source).
        weights_file = gguf_file or kept_source(Path(path))
        avx2_step = dtype == "auto" and _avx2_step(
            Path(path), gguf_file, resolved_device, execution
        )
        resolved_dtype = resolve_dtype(dtype, resolved_device, avx2_step)
        kept = _resolve_weights(kept, weights_file, resolved_device, resolved_dtype, execution)
        directory = _model_folder(Path(path), gguf_file, resolved_dtype, Path(gguf_cache))
        config = AutoConfig.from_pretrained(directory)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=resolved_dtype)
        except ValueError as error:
            raise TargetLoadError(
                f"{directory} is not a causal language model "
                f"(model_type={config.model_type!r}): {error}"
            ) from error
        tokenizer = AutoTokenizer.from_pretrained(directory)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        model.to(resolved_device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
        if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
            raise TargetLoadError(f"{name}: its output layer is not a linear layer")
        file_weights = None
        if kept is Weights.GGUF:
            # Before the load-time check: it runs the model, and run on the dequantized layers
            # it would read their pages of the cached folder's file into memory for good
            # (transformers keeps the file mapped).
            assert weights_file is not None  # _resolve_weights saw to it
            file_weights = _file_weights(model, name, weights_file, execution)
            if not file_weights.quantized_layers and file_weights.output is None:
                kept, file_weights = Weights.BF16, None  # a float file: nothing to keep
        try:
            refuse_unsupported(model)
            with exact_grouped_products(model):
                windows = check_packed_passes(model, PACKED_ATTENTION, Kernels())
        except UnsupportedArchitecture as error:
            raise TargetLoadError(f"{name}: {error}") from None
        if kept in (Weights.INT8, Weights.INT4):
            _quantize(model, name, kept)
        max_context = served_context(config, windows)
        passes = build_forward(
            model,
            execution,
            weights=kept,
            attention_shape=attention_shape(model),
            max_context=max_context,
            file_output=None if file_weights is None else file_weights.output,
        )
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            device=resolved_device,
            dtype=resolved_dtype,
            eos_token_ids=_eos_ids(model, tokenizer),
            max_context=max_context,
            passes=passes,
            file_weights=file_weights,
        )

    @property
    def plan(self) -> ExecutionPlan:
        """How its passes are computed (engine.forward.plan)."""
        return self.passes.plan

    @property
    def quantized(self) -> Weights:
        """int8, int4: its linear layers are (engine.quantize); bf16: as `dtype` loaded them."""
        return self.plan.weights

    @property
    def weights(self) -> str:
        """How the linear layers' weights are kept: int8, int4, a GGUF file's own ("gguf Q4_1
        (210 layers), output Q8_0"), or the dtype (bfloat16)."""
        if self.file_weights is not None:
            return self.file_weights.describe()
        if self.quantized is not Weights.BF16:
            return str(self.quantized)
        return str(self.dtype).removeprefix("torch.")

    def synchronize(self) -> None:
        """Wait for the device's queued kernels (CUDA), so that a timer read after a pass
        measures the pass, not its launch; nothing on a CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def tree_key_block(self) -> int:
        """Batch-invariant mode: a token tree's node is verified only where its cache slot and
        its position lie in one block of this many keys (0: anywhere; Kernels.tree_key_block)."""
        return self.plan.attention.tree_key_block

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim) of every attention layer."""
        return attention_shape(self.model)

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes of keys and values one position holds in a cache (all layers)."""
        _, kv_heads, head_dim = self.attention_shape
        element = torch.empty((), dtype=self.dtype).element_size()
        layers: int = self.model.config.num_hidden_layers
        return 2 * layers * kv_heads * head_dim * element

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's size)."""
        return int(self.model.get_output_embeddings().out_features)

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode_chat_text(self.chat_text(messages))

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat rendered by the model's template, ready to tokenize (with `tools`: the
        functions it may call, as OpenAI's API writes them); ValueError when there is no
        template or the template refuses the messages (many raise on roles that do not
        alternate, or a system message they do not support)."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.name} has no chat template; send a raw prompt instead")
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                tools=[dict(tool) for tool in tools] if tools else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template refused the messages: {error}") from None
        assert isinstance(text, str)  # tokenize=False: the rendered text
        return text

    def encode_chat_text(self, text: str) -> list[int]:
        """Token ids of a rendered chat (its template wrote the special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def new_cache(self, rows: int = 1) -> SlotCache:
        """A KV cache for up to `rows` sequences of at most the model's context (+ one pass)."""
        return SlotCache(rows, self.max_context + _MAX_PASS_OVERHANG)

    def forward(self, cache: SlotCache, verify: VerifyPass) -> list[Logits]:
        """Append each row's tokens to its cache row (see VerifyPass); per row, the logits of
        its scored tokens (the pending token and its drafts), as the plan computes them.

        Rows may differ in length: the pass packs them into one sequence (see SlotCache), padded
        to verify.width if that is more."""
        return self.passes.forward(cache, verify)

    def prefill(self, cache: SlotCache, row: int, length: int, token_ids: Sequence[int]) -> None:
        """Write token_ids into cache row `row` after its first `length` positions; no logits."""
        self.passes.prefill(cache, row, length, token_ids)


def _quantize(model: PreTrainedModel, name: str, weights: Weights) -> None:
    """Int8 or int4 weights (engine.quantize), where the lean forward serves the model; else
    TargetLoadError saying why not."""
    flag = f"--weights {weights}"
    if model.device.type != "cpu":
        raise TargetLoadError(f"{flag} runs on a CPU only, not {model.device.type}")
    if model.dtype not in (torch.bfloat16, torch.float32):
        raise TargetLoadError(
            f"{flag} computes in bfloat16 or float32 (--dtype), not "
            f"{str(model.dtype).removeprefix('torch.')}"
        )
    try:
        check(model)
    except Unsupported as reason:
        raise TargetLoadError(
            f"{name}: {flag} runs through the lean forward (--fast-step), which does not serve "
            f"this model: {reason}"
        ) from None
    if weights == "int4" and (refusal := int4_refusal(model)) is not None:
        raise TargetLoadError(f"{name}: {flag} cannot keep this model's layers: {refusal}")
    quantize_model(model, model.dtype, weights)


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names (gguf_model.find_gguf); None for a Hugging Face folder."""
    try:
        return find_gguf(path)
    except GgufRefused as error:
        raise TargetLoadError(str(error)) from None


def _resolve_weights(
    weights: Weights,
    gguf_file: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    execution: ExecutionOptions,
) -> Weights:
    """auto: the GGUF file's own quantization where it is served fast (a GGUF file, or a
    folder keeping the one it was converted from; a CPU whose grouped GEMV computes it,
    AVX512-BF16 or AVX2; bfloat16), else the weights as loaded. gguf: the file's own wherever
    it can be served (float32 too: its weights dequantized for every product, exact but
    slow), or TargetLoadError saying why it cannot be."""
    if weights not in (Weights.AUTO, Weights.GGUF):
        return weights
    why = None
    if gguf_file is None:
        why = "the model is not a GGUF file (nor a folder keeping the one it was made from)"
    elif device.type != "cpu":
        why = f"it runs on a CPU only, not {device.type}"
    elif dtype not in (torch.bfloat16, torch.float32):
        why = f"it computes in bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
    elif execution.batch_invariant:
        why = "batch-invariant mode pads the model's own layers"
    if weights is Weights.GGUF:
        if why is not None:
            raise TargetLoadError(f"--weights gguf serves a GGUF file's own quantization: {why}")
        return Weights.GGUF
    kernels = load_kernels() if execution.cpu_kernels else None
    fast = dtype == torch.bfloat16 and kernels is not None and kernels.grouped
    return Weights.GGUF if why is None and fast else Weights.BF16


def _file_weights(
    model: PreTrainedModel, name: str, gguf_file: Path, execution: ExecutionOptions
) -> FileWeights:
    """The file's own tensors in the model (engine.gguf_weights), computed by the grouped GEMV
    from the first pass where it runs."""
    kernels = load_kernels() if execution.cpu_kernels and model.device.type == "cpu" else None
    try:
        return apply_file_weights(model, gguf_file, kernels)
    except FileWeightsError as error:
        raise TargetLoadError(f"{name}: {error}") from None


def _avx2_step(
    path: Path, gguf_file: Path | None, device: torch.device, execution: ExecutionOptions
) -> bool:
    """Whether kenspec's AVX2 kernels (csrc/gemv_avx2.c, layer_avx2.c) would compute this
    model's bf16 step on this CPU (one without native bf16): the options ask for the lean
    forward and C kernels, they load here, and the model is of a family the lean forward
    serves. There a bf16 step reads half of float32's bytes through C for every layer: on a
    Zen 3 EPYC, SmolLM2-135M decoded at 65.6 tokens/s in bf16 against 17.1 in float32."""
    if device.type != "cpu" or cpu_has_native_bf16() or not execution.cpu_kernels:
        return False  # (auto is bf16 on a CPU with native bf16 whatever this says)
    if execution.batch_invariant or execution.lean is LeanMode.OFF:
        return False
    kernels = load_kernels()
    if kernels is None or not kernels.layer_kernels:
        return False
    if gguf_file is not None:
        return read_architecture(gguf_file) in GGUF_FAMILIES
    return _model_type(path) in FAMILIES


def _model_type(path: Path) -> str | None:
    """The model's type as its config.json names it; None where it cannot be read (the load
    then says why)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _model_folder(path: Path, gguf_file: Path | None, dtype: torch.dtype, gguf_cache: Path) -> Path:
    """The Hugging Face folder to load: `path` itself, or its GGUF file's converted copy."""
    if gguf_file is not None:
        try:
            return cached_folder(gguf_file, dtype, gguf_cache)
        except GgufRefused as error:
            raise TargetLoadError(str(error)) from None
    _check_model_dir(path)
    return path


def _check_model_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise TargetLoadError(f"model directory {directory} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise TargetLoadError(
            f"{directory} has no config.json; expected a Hugging Face model folder or a GGUF file"
        )
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except json.JSONDecodeError as error:
        raise TargetLoadError(f"{config_file} is not valid JSON: {error}") from error
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())  # GPT2LMHeadModel among them
    if architectures and not any(
        name.endswith("ForCausalLM") or name in causal for name in architectures
    ):
        raise TargetLoadError(
            f"{directory} holds {', '.join(architectures)}, not a causal language model"
        )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(int(token) for token in generation_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
