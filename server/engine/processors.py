"""Logits processors: what changes a row's logits before the target's choice, per tree node.

A drafted position's distribution depends on every token before it: the request's output so
far and, inside a round's walk, the draft tokens on the node's own tree path. So a processor
is called at each verified node with both (`output`, `path`), never with the pending token's
context alone: penalizing from the round's start would score a node that follows drafted
copies of a token as if they were not there, and the round would no longer decode as plain
decoding with the same processors does (tests/server/engine/test_processors.py).

Order (as `penalties` builds it, after any grammar mask): logit_bias, then the repetition
penalty, then the presence and frequency penalties, as transformers' `generate` (sequence_bias
before repetition_penalty) and vLLM (logit bias before its penalties) apply them; the warpers
(temperature, top-k, top-p, min-p) follow in engine.sampling.

Example: repetition_penalty=2 with output [5] and path [7]: a node's logits at tokens 5 and 7
(and at the prompt's tokens) are halved where positive, doubled where negative.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch


class RowProcessor(Protocol):
    """Changes one row's logits before the target's choice; applied at every verified node."""

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        """scores: float32 [vocab] raw logits of the row (a copy the processor may change in
        place); output: the request's tokens emitted before this round; path: the draft tokens
        accepted earlier in this round's walk (the node's own path from the pending token,
        pending excluded). Returns the processed logits ([vocab], float32)."""
        ...


class _OutputCounts:
    """How often each token occurs in output + path, kept incrementally for the output (it
    only grows between rounds; the path is added per call, a few tokens)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self._counted = 0

    def of(self, output: Sequence[int], path: Sequence[int]) -> Counter[int]:
        if len(output) < self._counted:  # another output: start again
            self._counts, self._counted = Counter(), 0
        self._counts.update(output[self._counted :])
        self._counted = len(output)
        if not path:
            return self._counts
        counts = self._counts.copy()
        counts.update(path)
        return counts


class RepetitionPenalty:
    """Keskar et al. 2019 (CTRL), as transformers' RepetitionPenaltyLogitsProcessor: a logit of
    a token seen in the prompt or the output is divided by `penalty` where positive, multiplied
    where negative."""

    def __init__(self, penalty: float, prompt: Sequence[int]) -> None:
        self.penalty = penalty
        self._prompt = frozenset(prompt)
        self._prompt_ids: torch.Tensor | None = None  # made once, on the rows' device
        self._counts = _OutputCounts()

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        if self._prompt_ids is None:  # a long prompt's ids are not rebuilt at every node
            self._prompt_ids = torch.tensor(
                sorted(self._prompt), dtype=torch.long, device=scores.device
            )
        new = [t for t in self._counts.of(output, path) if t not in self._prompt]
        ids = self._prompt_ids
        if new:
            ids = torch.cat([ids, torch.tensor(new, dtype=torch.long, device=scores.device)])
        picked = scores[ids]
        scores[ids] = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)
        return scores


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties, over the generated tokens only:
    logit[t] -= frequency * count(t) + presence * (count(t) > 0)."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency
        self._counts = _OutputCounts()

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        counts = self._counts.of(output, path)
        if not counts:
            return scores
        ids = torch.tensor(list(counts), dtype=torch.long, device=scores.device)
        times = torch.tensor(list(counts.values()), dtype=scores.dtype, device=scores.device)
        scores[ids] -= self.frequency * times + self.presence
        return scores


class LogitBias:
    """OpenAI's logit_bias: a fixed amount added to the logits of chosen token ids."""

    def __init__(self, bias: Mapping[int, float], device: torch.device) -> None:
        self._ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self._amounts = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        scores[self._ids] += self._amounts
        return scores


def penalties(
    *,
    prompt: Sequence[int],
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    logit_bias: Mapping[int, float],
    device: torch.device,
) -> tuple[RowProcessor, ...]:
    """The processors a request's parameters ask for, in order; () for the defaults (then the
    walk reads the raw rows: no copy, no extra work)."""
    processors: list[RowProcessor] = []
    if logit_bias:
        processors.append(LogitBias(logit_bias, device))
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(repetition_penalty, prompt))
    if presence_penalty or frequency_penalty:
        processors.append(PresenceFrequencyPenalty(presence_penalty, frequency_penalty))
    return tuple(processors)


def processed(
    row: torch.Tensor,
    processors: Sequence[RowProcessor],
    output: Sequence[int],
    path: Sequence[int],
) -> torch.Tensor:
    """A float32 copy of `row` [vocab] after every processor, in order."""
    scores = row.float().clone()
    for processor in processors:
        scores = processor.process(scores, output, path)
    return scores
