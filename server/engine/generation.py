"""One generation: draft, verify in one forward pass, keep what the target agrees with, repeat."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kenspec_api.outputs import BreakerState, FinishReason, Mode, Usage
from server.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from server.engine.params import InvalidParameter, SamplingParams, StoppingParams
from server.engine.recycled import RecycledPredictions, computed_rows
from server.engine.sampling import (
    HostArgmax,
    LogitRows,
    PositionalGenerator,
    chain_parents,
    chooser,
    token_choice,
    walk,
)
from server.engine.speculator import Speculator
from server.engine.target import TargetModel
from server.engine.tenant_index import SHARED_TENANT
from server.engine.token_tree import depths


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


class Generation:
    """Decodes one request round by round.

    Cache invariant (see TargetModel): the generation's cache row holds every token of
    prompt + output except the last one, `_pending`. A round feeds [pending, d_1..d_k], so the
    pass scores all k drafts plus the bonus position; the row's valid length then grows by
    1 + accepted, and the round's last emitted token becomes the new pending token. With k = 0
    the same loop is plain autoregressive decoding.

    A round is split in two around the forward pass so that a Batch can verify many
    generations in one pass: `plan()` drafts, the batch runs the pass, `complete()` accepts.
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
        self._prompt = list(prompt_ids)
        self._sampling = sampling
        self._stopping = stopping
        self.speculator = speculator
        self._on_finish = on_finish  # (prompt, output) of a finished generation, e.g. to learn
        self._recycled = recycled  # where the pass's computed logit rows are kept as drafts
        self.tenant = tenant  # whose cached prefixes it may reuse (and its own are stored as)
        self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self._draws = PositionalGenerator(self.seed, target.device)
        self._prefilled = 0  # tokens of prompt[:-1] already in the cache
        self._pending = prompt_ids[-1]
        self._drafts: list[int] = []
        self._parents: list[int] = []  # this round's token tree ([] for a chain)
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

    def plan(self) -> list[int]:
        """Draft this round's tokens; returns what the pass must score: [pending, *drafts],
        after the prompt tokens not yet in the cache, if any (a prompt prefilled in the same
        pass as its first round: `prefill_remaining` tokens whose logits are not needed)."""
        if self.finished:
            raise RuntimeError("plan() needs an unfinished generation")
        # With n tokens left to emit, more than n - 1 drafts could never all be used.
        remaining = self._stopping.max_new_tokens - len(self._output)
        tree = self.speculator.propose(limit=remaining - 1)
        self._drafts = list(tree.tokens)
        self._parents = [] if tree.is_chain else list(tree.parents)
        return self._feed()

    def draft_gains(self) -> list[float]:
        """Expected accepted tokens each of this round's drafts adds (see choose_drafts)."""
        return self.speculator.gains()

    def drafts_in_blocks(self, block: int) -> int:
        """How many of this round's first drafts have their cache slot in the same block of
        `block` keys as their position: a tree's node i is written at pending + 1 + i and is at
        pending + its depth (a chain's drafts, at both)."""
        if not self._parents:
            return len(self._drafts)
        pending = self.cache_length + self.prefill_remaining
        for node, depth in enumerate(depths(self._parents)):
            if (pending + 1 + node) // block != (pending + depth) // block:
                return node
        return len(self._parents)

    def truncate_drafts(self, count: int) -> list[int]:
        """Keep only the first `count` drafts of this round (a batch found more not worth it;
        a tree's first nodes are a tree)."""
        self.speculator.cut(len(self._drafts), min(count, len(self._drafts)))
        del self._drafts[count:]
        del self._parents[count:]
        return self._feed()

    def feed_parents(self) -> list[int] | None:
        """The token tree over what the pass scores (see plan), or None for a sequence: the
        prompt tail and the pending token each follow the one before, a draft its parent."""
        if not self._parents:
            return None
        pending = self.prefill_remaining  # the pending token's index in the feed
        return [*range(-1, pending), *(pending + 1 + parent for parent in self._parents)]

    def _feed(self) -> list[int]:
        return [
            *self._prompt[self._prefilled : len(self._prompt) - 1],
            self._pending,
            *self._drafts,
        ]

    def complete(self, logits: LogitRows) -> Round:
        """Accept against the pass's logits for [pending, *drafts]; emit the round."""
        drafts = self._drafts
        emitted, path = self._verify(drafts, logits)
        if self._recycled is not None:
            scored = [self._pending, *drafts]
            self._recycled.record(scored, computed_rows(logits, len(scored)))
        pending_at = self.cache_length + self.prefill_remaining  # the pending token's position
        self._prefilled += self.prefill_remaining  # the pass wrote the rest of the prompt
        # A tree's accepted nodes were written at pending + 1 + node; they belong at
        # pending + 1 + depth (their rotary positions already are): the batch moves them.
        self.kv_moves = [
            (pending_at + 1 + node, pending_at + 1 + depth)
            for depth, node in enumerate(path)
            if node != depth
        ]
        accepted = len(emitted) - 1
        self.speculator.record(len(drafts), accepted, path)
        return self._emit(emitted, drafted=len(drafts), accepted=accepted)

    def _verify(self, drafts: list[int], logits: LogitRows) -> tuple[list[int], list[int]]:
        """The walk over this round's drafts (a chain or a tree): (emitted, accepted nodes)."""
        parents = self._parents or chain_parents(len(drafts))
        if self._sampling.greedy and isinstance(logits, HostArgmax):
            # On an accelerator: the pass's greedy tokens, one copy for every sequence.
            return walk(drafts, parents, logits.argmax_ids(), token_choice)
        position = len(self._output)
        choose = chooser(self._sampling, lambda i: self._draws.at(position + i))
        return walk(drafts, parents, logits, choose)

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
            source=self.speculator.source if drafted else "",
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
