"""One generation: draft, verify in one forward pass, keep what the target agrees with, repeat."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence

import torch

from server.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from server.engine.params import InvalidParameter, SamplingParams, StoppingParams
from server.engine.rounds import FinishReason, Mode, Round, Usage
from server.engine.sampling import LogitRows, accept_greedy, accept_sampled
from server.engine.speculator import Speculator
from server.engine.target import TargetModel


class Generation:
    """Decodes one request round by round; `step()` runs exactly one verification.

    Cache invariant (see TargetModel): the cache holds every token of prompt + output except
    the last one, `_pending`. A round feeds [pending, d_1..d_k], so the pass scores all k drafts
    plus the bonus position; rejected drafts are cropped, and the round's last emitted token
    becomes the new pending token. With k = 0 the same loop is plain autoregressive decoding.
    """

    def __init__(
        self,
        target: TargetModel,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingParams,
        stopping: StoppingParams,
        speculator: Speculator,
    ) -> None:
        if not prompt_ids:
            raise InvalidParameter("prompt", "must contain at least one token")
        if len(prompt_ids) + stopping.max_new_tokens > target.max_context:
            raise InvalidParameter(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({stopping.max_new_tokens}) "
                f"exceeds the model's context of {target.max_context} tokens",
            )
        self._target = target
        self._prompt_len = len(prompt_ids)
        self._sampling = sampling
        self._stopping = stopping
        self._speculator = speculator
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator(device=target.device).manual_seed(self.seed)
        self._cache = target.new_cache()
        self._to_prefill: list[int] | None = list(prompt_ids[:-1])
        self._pending = prompt_ids[-1]
        self._detokenizer = IncrementalDetokenizer(target.tokenizer)
        self._stops = StopMatcher(stopping.stop)
        self._output: list[int] = []
        self._text = ""
        self._rounds = self._drafted = self._accepted = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __iter__(self) -> Iterator[Round]:
        while not self.finished:
            yield self.step()

    def step(self) -> Round:
        """Run one verification round (the first one also prefills the prompt)."""
        if self.finished:
            raise RuntimeError("generation already finished")
        if self._to_prefill is not None:
            self._target.prefill(self._cache, self._to_prefill)
            self._to_prefill = None
        # With n tokens left to emit, more than n - 1 drafts could never all be used.
        remaining = self._stopping.max_new_tokens - len(self._output)
        drafts = list(self._speculator.propose(limit=remaining - 1).token_ids)
        width = self._target.padded_width(1 + len(drafts), self._cache.get_seq_length())
        padding = [self._pending] * (width - 1 - len(drafts))  # scored, never read, cropped
        logits = self._target.forward(self._cache, [self._pending, *drafts, *padding])
        emitted = self._verify(drafts, logits)
        accepted = len(emitted) - 1
        self._target.rollback(self._cache, width - 1 - accepted)
        self._speculator.record(len(drafts), accepted)
        return self._emit(emitted, drafted=len(drafts), accepted=accepted)

    def close(self) -> None:
        """Free the KV cache (done automatically when the generation finishes)."""
        self._cache = None  # type: ignore[assignment]

    def _verify(self, drafts: list[int], logits: LogitRows) -> list[int]:
        if self._sampling.greedy:
            return accept_greedy(drafts, logits)
        return accept_sampled(drafts, logits, self._sampling, self._generator)

    def _emit(self, emitted: list[int], *, drafted: int, accepted: int) -> Round:
        """Append emitted tokens one by one, cutting at EOS, a stop sequence or the length limit."""
        kept: list[int] = []
        text_start = len(self._text)
        for token_id in emitted:
            kept.append(token_id)
            self._output.append(token_id)
            self.finish_reason = self._append_text(token_id)
            if self.finish_reason is not None:
                break
        self._pending = kept[-1]
        self._speculator.extend(kept)
        accepted = min(accepted, len(kept))  # drafts come first; a cut drops the rest
        self._rounds += 1
        self._drafted += drafted
        self._accepted += accepted
        if self.finished:
            self.close()
        return Round(
            index=self._rounds - 1,
            token_ids=tuple(kept),
            text=self._text[text_start:],
            drafted=drafted,
            accepted=accepted,
            mode=Mode.SPECULATIVE if drafted else Mode.AUTOREGRESSIVE,
            breaker_state=self._speculator.breaker_state,
            window_acceptance=self._speculator.window_acceptance,
            finish_reason=self.finish_reason,
            usage=self._usage() if self.finished else None,
        )

    def _append_text(self, token_id: int) -> FinishReason | None:
        checked = len(self._text)
        is_eos = not self._stopping.ignore_eos and token_id in self._target.eos_token_ids
        at_limit = len(self._output) >= self._stopping.max_new_tokens
        self._text += self._detokenizer.push(token_id)
        if is_eos or at_limit:
            self._text += self._detokenizer.flush()
        stop_at = self._stops.find(self._text, checked)
        if stop_at is not None:
            self._text = self._text[:stop_at]
            return FinishReason.STOP_SEQUENCE
        if is_eos:
            return FinishReason.EOS
        return FinishReason.LENGTH if at_limit else None

    def _usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._prompt_len,
            completion_tokens=len(self._output),
            drafted_tokens=self._drafted,
            accepted_tokens=self._accepted,
            rounds=self._rounds,
            seed=self.seed,
        )

    @property
    def output_ids(self) -> list[int]:
        return list(self._output)

    @property
    def text(self) -> str:
        return self._text
