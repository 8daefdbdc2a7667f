"""Request parameters for one generation, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class InvalidParameter(ValueError):
    """A request parameter is out of range; `field` names it for the API error."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


MAX_DRAFT_TOKENS = 64  # draft tokens one round may verify, whatever a request asks
DRAFT_TOKENS = 16  # the default cap: a round's token tree (16 nodes) or long match (16 tokens)
CHAIN_TOKENS = 6  # an ordinary chain's length k (a short match's, KenLM's)


class Weights(StrEnum):
    """How the target's linear layers are kept (--weights): as --dtype loads them, quantized
    by kenspec (engine.quantize), or as a GGUF file quantized them (engine.gguf_weights);
    auto: a GGUF file's own where it can be served so, else as loaded."""

    AUTO = "auto"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    GGUF = "gguf"


class AttentionMode(StrEnum):
    """Attention of passes with a few queries per row (--attention): grouped products where
    measured faster than SDPA, SDPA always, or grouped always (up to 16 queries per row)."""

    AUTO = "auto"
    SDPA = "sdpa"
    GROUPED = "grouped"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen from the target's distribution.

    temperature == 0 means greedy decoding; top_k == 0, top_p == 1 and min_p == 0 disable
    those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise InvalidParameter(
                "temperature", f"must be a finite number >= 0, got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidParameter("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidParameter("seed", f"must be in [0, 2^63), got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"must be in [0, 1] (0 disables it), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class ProcessorParams:
    """What changes the target's logits at every verified position before the choice
    (engine.processors), in this order: logit_bias ((token id, amount) pairs added to the
    logits), the repetition penalty (CTRL's, over prompt and output; 1 disables it), the
    presence and frequency penalties (OpenAI's, over the generated tokens; 0 disables them).
    Token ids are checked against the vocabulary when the generation starts.
    """

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidParameter(
                "repetition_penalty",
                f"must be a finite number > 0 (1 disables it), got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, f"must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameter(
                "logit_bias", f"{len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}"
            )
        for token_id, amount in self.logit_bias:
            if token_id < 0:
                raise InvalidParameter("logit_bias", f"token id {token_id} is negative")
            if not -100.0 <= amount <= 100.0:
                raise InvalidParameter(
                    f"logit_bias[{token_id}]", f"must be in [-100, 100], got {amount}"
                )

    def check_vocabulary(self, vocab_size: int) -> None:
        """InvalidParameter naming the first logit_bias id outside [0, vocab_size)."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidParameter(
                    "logit_bias",
                    f"token id {token_id} is not in the vocabulary (ids 0..{vocab_size - 1})",
                )


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """When generation ends. Stop strings are matched on the decoded text and not returned."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidParameter("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        for index, text in enumerate(self.stop):
            if not text:
                raise InvalidParameter(f"stop[{index}]", "must not be empty")


@dataclass(frozen=True, slots=True)
class SpeculationParams:
    """How much to draft. enabled=False is plain autoregressive decoding.

    `num_draft_tokens` is the cap on the draft tokens (nodes) one round verifies for the
    request, whatever drafted them: a token tree's nodes (`--tree-budget`), a chain after a
    long exact match (`--long-draft-tokens`) and an ordinary chain of k tokens are all cut to
    it, in one place (`Speculator.propose`). `chain_tokens` is k, an ordinary chain's length;
    adaptive k moves within [1, min(chain_tokens, num_draft_tokens)].

    Example: the defaults verify trees of up to 16 nodes, long matches of up to 16 tokens and
    chains of 6; num_draft_tokens=4 makes every round's draft at most 4 tokens.
    """

    enabled: bool = True
    num_draft_tokens: int = DRAFT_TOKENS
    chain_tokens: int = CHAIN_TOKENS
    adaptive: bool = False
    draft_context: bool | None = None  # also draft from the request's context; None: default

    def __post_init__(self) -> None:
        for name, value in (
            ("num_draft_tokens", self.num_draft_tokens),
            ("chain_tokens", self.chain_tokens),
        ):
            if not 1 <= value <= MAX_DRAFT_TOKENS:
                raise InvalidParameter(name, f"must be in [1, {MAX_DRAFT_TOKENS}], got {value}")

    @property
    def k(self) -> int:
        """The longest ordinary chain: chain_tokens, within the cap."""
        return min(self.chain_tokens, self.num_draft_tokens)
