"""The two ways a target computes a packed pass, behind one protocol.

`Forward.forward(cache, verify)` appends each row's tokens to its cache row and returns, per
row, the logits of its scored tokens (the pending token and its drafts); `prefill` writes
tokens without logits. Both implementations pack the pass the same way (`_PackedForward`) and
read logits through the plan's head (forward.head); they differ in what runs the decoder:

- `EagerForward`: transformers' own modules (every architecture kenspec serves), its linear
  layers switched once at build to the plan's padded (batch invariance) or skinny products;
- `LeanForward`: kenspec's loop over a Llama-family decoder (forward.lean) and its kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel

from kenspec.server.engine.forward.head import Head
from kenspec.server.engine.forward.lean import LeanDecoder
from kenspec.server.engine.forward.plan import ExecutionPlan
from kenspec.server.engine.invariant import use_padding
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.linear_kernels import use_skinny
from kenspec.server.engine.packed_pass import PackedPass, pack
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.verify_pass import VerifyPass


class Forward(Protocol):
    """How a target computes its passes (see the module doc)."""

    @property
    def plan(self) -> ExecutionPlan: ...

    @property
    def head(self) -> Head: ...

    def forward(self, cache: SlotCache, verify: VerifyPass) -> list[Logits]:
        """Each row's tokens into its cache row; per row, the logits of its scored tokens."""
        ...

    def prefill(self, cache: SlotCache, row: int, length: int, token_ids: Sequence[int]) -> None:
        """token_ids into cache row `row` after its first `length` positions; no logits."""
        ...


class _PackedForward:
    """What both forwards share: packing a pass, binding the cache, reading the head."""

    def __init__(self, model: PreTrainedModel, plan: ExecutionPlan, head: Head, max_context: int):
        self._model = model
        # (transformers' dtype and device properties walk the parameters: read once)
        self._dtype, self._device = model.dtype, model.device
        self._plan = plan
        self._head = head
        self._max_context = max_context

    @property
    def plan(self) -> ExecutionPlan:
        return self._plan

    @property
    def head(self) -> Head:
        return self._head

    @torch.inference_mode()
    def forward(self, cache: SlotCache, verify: VerifyPass) -> list[Logits]:
        """Rows may differ in length: the pass packs them into one sequence (see SlotCache),
        padded to verify.width if that is more."""
        rows = verify.rows
        packed = self._packed(
            cache,
            [row.cache_length for row in rows],
            [row.tokens for row in rows],
            verify.first_row,
            verify.width,
            parents=[row.feed_parents() for row in rows],
        )
        outputs = self._decode(packed, cache, logits=self.head.wants_model_logits)
        spans = [  # [begin, end) of each row's scored tokens among the pass's
            (start + len(row.prompt_tail), start + len(row.tokens))
            for start, row in zip(packed.starts, rows, strict=True)
        ]
        result = self.head.logits(outputs, spans, verify)
        if not self.head.wants_model_logits:  # outputs are the final hidden states
            for logits, (begin, end) in zip(result, spans, strict=True):
                logits.features = outputs[begin:end]
        return result

    @torch.inference_mode()
    def prefill(self, cache: SlotCache, row: int, length: int, token_ids: Sequence[int]) -> None:
        if token_ids:
            packed = self._packed(cache, [length], [token_ids], row, 0)
            self._decode(packed, cache, logits=False)

    def _packed(
        self,
        cache: SlotCache,
        lengths: Sequence[int],
        token_rows: Sequence[Sequence[int]],
        first_row: int,
        min_tokens: int,
        parents: Sequence[Sequence[int] | None] | None = None,
    ) -> PackedPass:
        """One packed pass's inputs, its rows bound in the cache."""
        invariance = self.plan.invariance
        if invariance is not None:  # once here, not in each linear layer (where room)
            tokens = sum(len(row) for row in token_rows)
            wanted = invariance.padding.rows(max(min_tokens, tokens))
            if lengths[-1] + len(token_rows[-1]) + wanted - tokens <= self._max_context:
                min_tokens = wanted  # pack pads the last row by wanted - tokens
        packed = pack(
            lengths,
            token_rows,
            self._dtype,
            self._device,
            pad_to=min_tokens,
            parents=parents,
            kernels=self.plan.attention,
        )
        cache.bind(first_row, packed)
        return packed

    def _decode(self, packed: PackedPass, cache: SlotCache, *, logits: bool) -> torch.Tensor:
        """The decoder's output [tokens, hidden] (or the model's logits [tokens, vocab])."""
        raise NotImplementedError


class EagerForward(_PackedForward):
    """Passes through transformers' modules (see the module doc)."""

    def __init__(self, model: PreTrainedModel, plan: ExecutionPlan, head: Head, max_context: int):
        super().__init__(model, plan, head, max_context)
        if plan.invariance is not None:
            use_padding(model, plan.invariance.padding)
        elif plan.skinny_rows:
            use_skinny(model, plan.skinny_rows)

    def _decode(self, packed: PackedPass, cache: SlotCache, *, logits: bool) -> torch.Tensor:
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
            out: torch.Tensor = self._model(**inputs).logits[0]
            return out
        hidden: torch.Tensor = self._model.base_model(**inputs).last_hidden_state[0]
        return hidden


class LeanForward(_PackedForward):
    """Passes through kenspec's lean loop (forward.lean)."""

    def __init__(
        self,
        model: PreTrainedModel,
        plan: ExecutionPlan,
        head: Head,
        max_context: int,
        decoder: LeanDecoder,
    ):
        super().__init__(model, plan, head, max_context)
        self._decoder = decoder

    @property
    def decoder(self) -> LeanDecoder:
        return self._decoder

    def _decode(self, packed: PackedPass, cache: SlotCache, *, logits: bool) -> torch.Tensor:
        assert not logits  # (the lean forward serves plain output layers only)
        return self._decoder(packed.input_ids, packed.positions, cache, packed.packing)
