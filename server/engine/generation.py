"""One request's state: its prompt, output, pending token, stops and finish (engine.round
drives its rounds)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kenspec.api.outputs import BreakerState, FinishReason, Mode, TokenLogprob, Usage
from kenspec.server.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from kenspec.server.engine.grammar import GrammarState
from kenspec.server.engine.params import (
    MAX_TOP_LOGPROBS,
    InvalidParameter,
    ProcessorParams,
    SamplingParams,
    StoppingParams,
)
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.processors import RowProcessor, penalties
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.sampling import PositionalGenerator, TokenChooser
from kenspec.server.engine.speculator import Proposal, Speculator
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.tenant_index import SHARED_TENANT
from kenspec.server.engine.verify_pass import PassRow


@dataclass(frozen=True, slots=True)
class Round:
    """One verification: the tokens it added to the output and how the draft did.

    accepted counts draft tokens the target agreed with that made it into the output; the round
    also adds one token of the target's own unless a stop condition cut it off earlier.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    drafted: int
    accepted: int
    mode: Mode
    breaker_state: BreakerState
    window_acceptance: float
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    source: str = ""  # where the drafts came from ("kenlm", "suffix:8", ...); "" if none
    choice: int = 0  # which of the request's n choices this round belongs to
    # one per token of token_ids, when the request asked for logprobs
    logprobs: tuple[TokenLogprob, ...] | None = None


class Generation:
    """One request's state across its rounds: prompt, output, pending token, stops, finish.

    Cache invariant (see TargetModel): the generation's cache row holds every token of
    prompt + output except the last one, `_pending`. A round feeds [pending, d_1..d_k], so the
    pass scores all k drafts plus the bonus position; the row's valid length then grows by
    1 + accepted, and the round's last emitted token becomes the new pending token. With k = 0
    the same loop is plain autoregressive decoding.

    A Batch verifies many generations in one pass (engine.round): `propose()` drafts (a
    `Proposal`), `pass_row()` lays out what the pass scores, the walk uses `token_choice()`,
    `accept()` emits the round of the proposal the batch kept.
    """

    def __init__(
        self,
        target: TargetModel,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingParams,
        stopping: StoppingParams,
        speculator: Speculator,
        on_finish: Callable[[Sequence[int], Sequence[int]], None] | None = None,
        recycled: RecycledPredictions | None = None,
        tenant: str = SHARED_TENANT,
        grammar: GrammarState | None = None,
        processing: ProcessorParams | None = None,
        top_logprobs: int | None = None,
        choice: int = 0,
    ) -> None:
        if not prompt_ids:
            raise InvalidParameter("prompt", "must contain at least one token")
        if len(prompt_ids) + stopping.max_new_tokens > target.max_context:
            raise InvalidParameter(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({stopping.max_new_tokens}) "
                f"exceeds the model's context of {target.max_context} tokens",
            )
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameter(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"
            )
        processing = processing or ProcessorParams()
        processing.check_vocabulary(target.vocab_size)
        self._target = target
        self._prompt = list(prompt_ids)
        self._sampling = sampling
        self._stopping = stopping
        self.speculator = speculator
        self._on_finish = on_finish  # (prompt, output) of a finished generation, e.g. to learn
        self.recycled = recycled  # where its passes' computed logit rows are kept as drafts
        self.tenant = tenant  # whose cached prefixes it may reuse (and its own are stored as)
        self.grammar = grammar  # what the output must match (engine.grammar), if anything
        # Applied in order at every verified node: the grammar's mask first, then the
        # request's penalties and logit_bias (each from the node's own path).
        self._processors: tuple[RowProcessor, ...] = (
            *((grammar,) if grammar is not None else ()),
            *penalties(
                prompt=self._prompt,
                repetition_penalty=processing.repetition_penalty,
                presence_penalty=processing.presence_penalty,
                frequency_penalty=processing.frequency_penalty,
                logit_bias=dict(processing.logit_bias),
                device=target.device,
            ),
        )
        self._top_logprobs = top_logprobs  # None: no logprobs; else alternatives per token
        self.choice = choice
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self._draws = PositionalGenerator(self.seed, target.device)
        self._prefilled = 0  # tokens of prompt[:-1] already in the cache
        self._pending = prompt_ids[-1]
        self.kv_moves: list[tuple[int, int]] = []  # cache positions the last round moved
        self._detokenizer = IncrementalDetokenizer(target.tokenizer)
        self._stops = StopMatcher(stopping.stop)
        self._output: list[int] = []
        self._text = ""
        self._rounds = self._drafted = self._accepted = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt(self) -> list[int]:
        return self._prompt

    @property
    def prefill_remaining(self) -> int:
        return len(self._prompt) - 1 - self._prefilled

    @property
    def cache_length(self) -> int:
        """Valid positions in the cache row: everything but the pending token."""
        return self._prefilled + len(self._output)

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens whose keys/values the cache row holds, in order."""
        return (self._prompt + self._output)[: self.cache_length]

    def next_prefill(self, limit: int) -> tuple[int, list[int]]:
        """The next at most `limit` prompt tokens to prefill, and the position they start at."""
        start = self._prefilled
        return start, self._prompt[start : min(start + limit, len(self._prompt) - 1)]

    def prefilled(self, count: int) -> None:
        self._prefilled += count

    @property
    def draft_limit(self) -> int:
        """The most drafts a round could use: with n tokens left to emit, n - 1."""
        return self._stopping.max_new_tokens - len(self._output) - 1

    def propose(self) -> Proposal:
        """This round's drafts (see Speculator.propose)."""
        if self.finished:
            raise RuntimeError("propose() needs an unfinished generation")
        return self.speculator.propose(limit=self.draft_limit, constraint=self.grammar)

    def pass_row(self, proposal: Proposal) -> PassRow:
        """This generation's row of a verify pass with the drafts `proposal`: the prompt tokens
        not yet in the cache, if any (a prompt prefilled in the same pass as its first round),
        then the pending token and the drafts."""
        tree = proposal.tree
        return PassRow(
            cache_length=self.cache_length,
            pending=self._pending,
            drafts=tree.tokens,
            parents=None if tree.is_chain else tree.parents,
            prompt_tail=tuple(self._prompt[self._prefilled : len(self._prompt) - 1]),
        )

    @property
    def argmax_only(self) -> bool:
        """Whether its walks read only greedy tokens of a pass's logits, never a whole row
        (greedy, without logprobs or processors)."""
        return self._sampling.greedy and not self._processors and self._top_logprobs is None

    def token_choice(self, logits: Logits) -> TokenChooser:
        """The target's choice at each depth of this round's walk: the argmax when greedy, else
        a draw keyed by the output position it fills (see PositionalGenerator); it records
        each choice's logprobs when the request asked for them."""
        position = len(self._output)
        return TokenChooser(
            logits,
            self._sampling,
            lambda depth: self._draws.at(position + depth),
            self._processors,
            self._output,
            self._top_logprobs,
        )

    def accept(
        self,
        proposal: Proposal,
        row: PassRow,
        emitted: list[int],
        path: list[int],
        logprobs: Sequence[TokenLogprob] = (),
    ) -> Round:
        """The pass wrote `row`, the drafts of `proposal` (as the batch cut it), and the walk
        accepted the nodes `path`: emit `emitted` (with their `logprobs`, one per emitted token,
        when the request asked for them)."""
        self._prefilled += len(row.prompt_tail)  # the pass wrote the rest of the prompt
        # A tree's accepted nodes were written at pending + 1 + node; they belong at
        # pending + 1 + depth (their rotary positions already are): the batch moves them.
        pending_at = row.pending_position
        self.kv_moves = [
            (pending_at + 1 + node, pending_at + 1 + depth)
            for depth, node in enumerate(path)
            if node != depth
        ]
        return self._emit(
            emitted,
            drafted=len(row.drafts),
            accepted=len(emitted) - 1,
            source=proposal.source,
            logprobs=logprobs,
        )

    def _emit(
        self,
        emitted: list[int],
        *,
        drafted: int,
        accepted: int,
        source: str,
        logprobs: Sequence[TokenLogprob] = (),
    ) -> Round:
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
        if self.grammar is not None:
            self.grammar.advance(kept)
        self.speculator.extend(kept)
        if self.finish_reason is not None and self._on_finish is not None:
            self._on_finish(self._prompt, self._output)
        accepted = min(accepted, len(kept))  # drafts come first; a cut drops the rest
        self._rounds += 1
        self._drafted += drafted
        self._accepted += accepted
        return Round(
            index=self._rounds - 1,
            token_ids=tuple(kept),
            text=self._text[text_start:],
            drafted=drafted,
            accepted=accepted,
            mode=Mode.SPECULATIVE if drafted else Mode.AUTOREGRESSIVE,
            breaker_state=self.speculator.breaker_state,
            window_acceptance=self.speculator.window_acceptance,
            finish_reason=self.finish_reason,
            usage=self._usage() if self.finished else None,
            source=source if drafted else "",
            choice=self.choice,
            logprobs=tuple(logprobs[: len(kept)]) if self._top_logprobs is not None else None,
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
            prompt_tokens=len(self._prompt),
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
