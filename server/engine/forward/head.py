"""A pass's rows of logits from the decoder's output, as the plan's head kind says.

- MODEL: the decoder returned the model's own logits [tokens, vocab]; each row's are cut from
  them (a generic output layer; batch-invariant mode, whose padded layers compute them).
- LAZY (a plain output layer on a CPU): rows are computed from hidden states as the walk reads
  them (pass_logits.lazy_logits), up to the plan's `together` rows in one product; a greedy
  pass's tokens through the int8 screen where the plan has one (forward.screened_head).
- PASS (an accelerator): every row a sequence may read in one product of the output layer
  (or cut from the model's logits), their greedy tokens copied to the host in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from kenspec.server.engine.forward.plan import ExecutionPlan, HeadKind
from kenspec.server.engine.forward.screened_head import ScreenedHead
from kenspec.server.engine.pass_logits import (
    Logits,
    OutputLayer,
    capped,
    computed_logits,
    lazy_logits,
)
from kenspec.server.engine.verify_pass import VerifyPass

# Architectures whose logits are exactly the output layer of the base model's last hidden state
# (soft-capped by config.final_logit_softcapping where set): no bias or scaling. For these, rows
# of logits can be computed one at a time and only when the verification needs them.
PLAIN_HEAD_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "phi3", "gemma2"}
    | {"gemma3_text", "gpt2", "gpt_neox", "opt", "starcoder2", "gpt_bigcode", "mixtral"}
)

Spans = Sequence[tuple[int, int]]  # [begin, end) of each row's scored tokens in a pass


def plain_head(model: PreTrainedModel) -> bool:
    """Whether the logits are the output layer of the hidden state (PLAIN_HEAD_TYPES, no
    bias), so rows of logits can be computed from hidden states."""
    head = model.get_output_embeddings()
    return (
        isinstance(head, torch.nn.Linear)
        and model.config.model_type in PLAIN_HEAD_TYPES
        and head.bias is None
    )


class Head:
    """The output layer as a pass's logits are read from it (see the module doc)."""

    def __init__(
        self,
        model: PreTrainedModel,
        plan: ExecutionPlan,
        product: Callable[[torch.Tensor], torch.Tensor] | None = None,
        screen: ScreenedHead | None = None,
    ) -> None:
        """product: the lean forward's output layer (hidden [rows, hidden] -> logits through
        its kernels); None: the model's own weight. screen: the plan's int8 screen."""
        self.kind = plan.head
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        # (batch invariance: the model's own padded output layer computes every row)
        self.plain = plain_head(model) and plan.invariance is None
        self._output = model.get_output_embeddings()  # (the lean forward's: its product's)
        self._screen = screen
        self._layer: OutputLayer | None = None
        if self.kind is HeadKind.LAZY:
            # A one-row GEMV against the transposed layer (float32: no bf16 GEMV kernels on
            # many CPUs), unless the lean forward's product computes every row.
            transposed = None if product is not None else self._head_weight().t().contiguous()
            weight = None if product is not None else self._head_weight()
            self._layer = OutputLayer(
                weight, transposed, self.softcap, product, together=plan.together
            )

    @property
    def wants_model_logits(self) -> bool:
        """Whether the decoder must return the model's logits, not its last hidden states."""
        return self.kind is HeadKind.MODEL or (self.kind is HeadKind.PASS and not self.plain)

    @property
    def layer(self) -> OutputLayer | None:
        """A LAZY head's output layer (tests, the recycled predictions' rows)."""
        return self._layer

    def logits(self, outputs: torch.Tensor, spans: Spans, verify: VerifyPass) -> list[Logits]:
        """Per span of the pass's outputs [tokens, hidden or vocab], its rows of logits."""
        if self.kind is HeadKind.PASS:
            return self._pass_rows(outputs, spans)
        if self.kind is HeadKind.MODEL:
            return [Logits.of(outputs[begin:end].float()) for begin, end in spans]
        screen = self._screens(verify, sum(end - begin for begin, end in spans))
        if screen is not None:
            return screen.logits(outputs, spans)
        assert self._layer is not None
        return lazy_logits(outputs, spans, self._layer)

    def _screens(self, verify: VerifyPass, rows: int) -> ScreenedHead | None:
        """The int8 screen for a greedy pass of `rows` rows of logits (None: no screen). Its
        exact logits are the GEMV's whatever the output layer's plan, so a screened token does
        not depend on what else is in the pass."""
        screen = self._screen
        if screen is None or not verify.argmax_only or self.softcap is not None:
            return None
        return screen if rows <= screen.rows else None

    def _pass_rows(self, outputs: torch.Tensor, spans: Spans) -> list[Logits]:
        """On an accelerator: the rows the pass's sequences may read, in one product of the
        output layer (or cut from the model's logits), their greedy tokens copied in one go."""
        rows = torch.cat([outputs[begin:end] for begin, end in spans])  # [rows read, hidden]
        if self.plain:
            logits = capped(torch.nn.functional.linear(rows, self._head_weight()), self.softcap)
        else:
            logits = rows.float()
        return computed_logits(logits, [end - begin for begin, end in spans], one_copy=True)

    def _head_weight(self) -> torch.Tensor:
        """The output layer's weight [vocab, hidden_size] (an nn.Linear: TargetModel.load
        refuses any other, and only the eager heads read it)."""
        assert isinstance(self._output, torch.nn.Linear)
        return self._output.weight.detach()
