"""The target model: a local Hugging Face causal LM that verifies drafts with a rolling KV cache."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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

from server.engine.architecture import (
    UnsupportedArchitecture,
    check_packed_passes,
    refuse_unsupported,
    served_context,
)
from server.engine.attention import PACKED_ATTENTION
from server.engine.fast_step import LlamaStep, Unsupported, check
from server.engine.gguf_model import DEFAULT_GGUF_CACHE, GgufRefused, cached_folder, find_gguf
from server.engine.kernels import Kernels
from server.engine.kv_cache import SlotCache
from server.engine.packed_pass import pack
from server.engine.params import WEIGHTS
from server.engine.pass_logits import Logits, OutputLayer, capped, computed_logits, lazy_logits
from server.engine.quantize import int4_refusal, quantize_model
from server.engine.screened_head import ScreenedHead
from server.engine.verify_pass import VerifyPass

# A pass may run past the last valid position by its padding (at most one verify width).
_MAX_PASS_OVERHANG = 128
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Architectures whose logits are exactly the output layer of the base model's last hidden state
# (soft-capped by config.final_logit_softcapping where set): no bias or scaling. For these, rows
# of logits are computed one at a time and only when the verification needs them.
_PLAIN_HEAD_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "phi3", "gemma2"}
    | {"gemma3_text", "gpt2", "gpt_neox", "opt", "starcoder2", "gpt_bigcode", "mixtral"}
)


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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs with native bf16 (verify passes cost ~1 step), else fp32."""
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in _DTYPES:
        raise TargetLoadError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(slots=True)
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
    head_t: torch.Tensor | None = None  # transposed output layer for lazy logits (None: generic)
    softcap: float | None = None  # final_logit_softcapping, applied to the lazy rows
    plain_head: bool = False  # logits are the output layer of the hidden state (_PLAIN_HEAD_TYPES)
    # A pass's rows in one product, its greedy tokens in one copy (pass_logits): accelerators.
    pass_rows: bool = False
    # The kernels its passes take (attention's choice, batch-invariant mode), chosen at
    # start-up (server.runtime) and handed to attention by every pass (Packing.kernels).
    kernels: Kernels = field(default_factory=Kernels)
    # The lean decoder passes run through instead of the model's own (engine.fast_step), with
    # the output layer's product; None: transformers' forward (chosen at start-up, runtime).
    fast_step: LlamaStep | None = None
    # "int8" or "int4": the decoder's linear layers are (and an untied output layer is int8,
    # engine.quantize); only the fast step computes them at speed, so it is then always
    # chosen (runtime). "": as loaded, in `dtype`.
    quantized: str = ""

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        gguf_cache: str | Path = DEFAULT_GGUF_CACHE,
        weights: str = "bf16",
    ) -> TargetModel:
        """Load a Hugging Face folder, or a GGUF file (or a folder holding one), dequantized to
        `dtype` once and kept as a folder under `gguf_cache` (see gguf_model); with `weights`
        int8 or int4, its linear layers quantized (engine.quantize)."""
        if weights not in WEIGHTS:
            raise TargetLoadError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
        resolved_device = resolve_device(device)
        resolved_dtype = resolve_dtype(dtype, resolved_device)
        name = str(Path(path))
        directory = _model_folder(Path(path), resolved_dtype, Path(gguf_cache))
        config = AutoConfig.from_pretrained(directory)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=resolved_dtype)
        except ValueError as error:
            raise TargetLoadError(
                f"{directory} is not a causal language model "
                f"(model_type={config.model_type!r}): {error}"
            ) from error
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model.to(resolved_device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
        kernels = Kernels()
        try:
            refuse_unsupported(model)
            windows = check_packed_passes(model, PACKED_ATTENTION, kernels)
        except UnsupportedArchitecture as error:
            raise TargetLoadError(f"{name}: {error}") from None
        plain_head, head_t = _plain_head(model, Path(name))
        if weights != "bf16":
            _quantize(model, name, weights)
            head_t = None  # the fast step's int8 output layer computes the rows
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            device=resolved_device,
            dtype=resolved_dtype,
            eos_token_ids=_eos_ids(model, tokenizer),
            max_context=served_context(config, windows),
            head_t=head_t,
            softcap=getattr(config, "final_logit_softcapping", None),
            plain_head=plain_head,
            pass_rows=resolved_device.type != "cpu",
            kernels=kernels,
            quantized="" if weights == "bf16" else weights,
        )

    @property
    def weights(self) -> str:
        """How the linear layers' weights are kept: int8, int4, or the dtype (bfloat16)."""
        return self.quantized or str(self.dtype).removeprefix("torch.")

    def synchronize(self) -> None:
        """Wait for the device's queued kernels (CUDA), so that a timer read after a pass
        measures the pass, not its launch; nothing on a CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def tree_key_block(self) -> int:
        """Batch-invariant mode: a token tree's node is verified only where its cache slot and
        its position lie in one block of this many keys (0: anywhere; Kernels.tree_key_block)."""
        return self.kernels.tree_key_block

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim) of every attention layer."""
        config = self.model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if getattr(config, "multi_query", False):  # GPT-BigCode: one key/value head
            kv_heads = 1
        return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads

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

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode_chat_text(self.chat_text(messages))

    def chat_text(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat rendered by the model's template, ready to tokenize; ValueError when there
        is no template or the template refuses the messages (many raise on roles that do not
        alternate, or a system message they do not support)."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.name} has no chat template; send a raw prompt instead")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
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

    @torch.inference_mode()
    def forward(self, cache: SlotCache, verify: VerifyPass) -> list[Logits]:
        """Append each row's tokens to its cache row (see VerifyPass); per row, the logits of
        its scored tokens (the pending token and its drafts).

        Rows may differ in length: the pass packs them into one sequence (see SlotCache), padded
        to verify.width if that is more. Where the architecture allows it on a CPU, a row's
        logits are computed as they are read; on an accelerator, all rows in one product.
        """
        rows = verify.rows
        hidden, starts = self._run(
            cache,
            [row.cache_length for row in rows],
            [row.tokens for row in rows],
            verify.first_row,
            verify.width,
            logits=not self.plain_head if self.pass_rows else not self._lazy_rows,
            parents=[row.feed_parents() for row in rows],
        )
        spans = [  # [begin, end) of each row's scored tokens among the pass's
            (start + len(row.prompt_tail), start + len(row.tokens))
            for start, row in zip(starts, rows, strict=True)
        ]
        if self.pass_rows:
            return self._pass_rows(hidden, spans)
        if not self._lazy_rows:  # hidden holds the model's logits [tokens, vocab]
            return [Logits.of(hidden[begin:end].float()) for begin, end in spans]
        screen = self._screen(verify, sum(end - begin for begin, end in spans))
        if screen is not None:
            return screen.logits(hidden, spans)
        return lazy_logits(hidden, spans, self._output_layer())

    def _screen(self, verify: VerifyPass, rows: int) -> ScreenedHead | None:
        """The fast step's int8 screen of the output layer, for a greedy pass it takes."""
        if not verify.argmax_only or self.fast_step is None or self.softcap is not None:
            return None
        return self.fast_step.screens(rows)

    @property
    def _lazy_rows(self) -> bool:
        """Rows of logits computed from hidden states as read (a plain head on a CPU)."""
        return self.fast_step is not None or self.head_t is not None

    def _output_layer(self) -> OutputLayer:
        if self.fast_step is not None:  # (an int8 output layer has no weight to hand)
            step = self.fast_step
            return OutputLayer(None, None, self.softcap, step.logits, together=step.together)
        return OutputLayer(self._head_weight(), self.head_t, self.softcap)

    def _head_weight(self) -> torch.Tensor:
        """The output layer's weight [vocab, hidden_size]."""
        head: torch.nn.Module = self.model.get_output_embeddings()
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def _pass_rows(self, outputs: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Logits]:
        """On an accelerator: the rows the pass's sequences may read, in one product of the
        output layer (or cut from the model's logits), their greedy tokens copied in one go."""
        rows = torch.cat([outputs[begin:end] for begin, end in spans])  # [rows read, hidden]
        if self.plain_head:
            logits = capped(torch.nn.functional.linear(rows, self._head_weight()), self.softcap)
        else:
            logits = rows.float()
        return computed_logits(logits, [end - begin for begin, end in spans], one_copy=True)

    @torch.inference_mode()
    def prefill(self, cache: SlotCache, row: int, length: int, token_ids: Sequence[int]) -> None:
        """Write token_ids into cache row `row` after its first `length` positions; no logits."""
        if token_ids:
            self._run(cache, [length], [token_ids], row, 0, logits=False)

    def _run(
        self,
        cache: SlotCache,
        lengths: Sequence[int],
        token_rows: Sequence[Sequence[int]],
        first_row: int,
        min_tokens: int,
        *,
        logits: bool,
        parents: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """One packed pass: hidden states [tokens, hidden] (or logits [tokens, vocab]) and
        where each row's tokens start among them."""
        padding = self.kernels.pass_padding
        if padding is not None:  # once here, not in each linear layer (where room)
            tokens = sum(len(row) for row in token_rows)
            wanted = padding.rows(max(min_tokens, tokens))
            if lengths[-1] + len(token_rows[-1]) + wanted - tokens <= self.max_context:
                min_tokens = wanted  # pack pads the last row by wanted - tokens
        packed = pack(
            lengths,
            token_rows,
            self.dtype,
            self.device,
            pad_to=min_tokens,
            parents=parents,
            kernels=self.kernels,
        )
        cache.bind(first_row, packed)
        inputs = {
            "input_ids": packed.input_ids,
            # Passed as is (a 4D mask); packed_attention lays the queries out to match it.
            "attention_mask": packed.packing.mask,
            "position_ids": packed.positions,
            "cache": cache,
            "use_cache": True,
            "packing": packed.packing,
        }
        if logits:
            return self.model(**inputs).logits[0], packed.starts
        if self.fast_step is not None:
            return self.fast_step(
                packed.input_ids, packed.positions, cache, packed.packing
            ), packed.starts
        return self.model.base_model(**inputs).last_hidden_state[0], packed.starts


def _quantize(model: PreTrainedModel, name: str, weights: str) -> None:
    """Int8 or int4 weights (engine.quantize), where the fast step serves the model; else
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
            f"{name}: {flag} runs through the fast step, which does not serve this model: {reason}"
        ) from None
    if weights == "int4" and (refusal := int4_refusal(model)) is not None:
        raise TargetLoadError(f"{name}: {flag} cannot keep this model's layers: {refusal}")
    quantize_model(model, model.dtype, weights)


def _plain_head(model: PreTrainedModel, directory: Path) -> tuple[bool, torch.Tensor | None]:
    """Whether the logits are the output layer of the hidden state (_PLAIN_HEAD_TYPES, no
    bias), and the layer transposed for lazy logits where they are computed so (or None)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TargetLoadError(f"{directory}: its output layer is not a linear layer")
    plain_head = model.config.model_type in _PLAIN_HEAD_TYPES and head.bias is None
    # float32 only: in bf16 a GEMV against a transposed copy can be far slower than
    # transformers' own head (no native bf16 GEMV kernels on many CPUs). On a CPU only: an
    # accelerator computes a pass's rows in one product (pass_logits).
    if plain_head and model.dtype == torch.float32 and model.device.type == "cpu":
        return plain_head, head.weight.detach().t().contiguous()
    return plain_head, None


def _model_folder(path: Path, dtype: torch.dtype, gguf_cache: Path) -> Path:
    """The Hugging Face folder to load: `path` itself, or a GGUF file's converted copy."""
    try:
        gguf_file = find_gguf(path)
        if gguf_file is not None:
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
