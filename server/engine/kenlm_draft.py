"""KenLM n-gram draft over the target's token ids.

Formats accepted by `KenLMDraft.load`:
- an ARPA file (words are decimal token ids; see server/engine/arpa.py): index built at load;
- a draft directory written by `python -m draft_tools.train`: `draft.json` (order, vocabulary
  size, tokenizer fingerprint, how it was trained), a KenLM binary and `successors.npz`;
- a KenLM binary file with its index beside it as `<file>.successors.npz`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import kenlm

from kenspec.server.engine.arpa import SENTENCE_END, SENTENCE_START, DraftFormatError, read_arpa
from kenspec.server.engine.draft import Candidates, Chain, StaticSession
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.successors import SuccessorIndex

DRAFT_MANIFEST = "draft.json"
KENLM = Source("kenlm")  # where a KenLM chain comes from: acceptance is learned for it apart
# Slack for comparing the index's ARPA log-probs with KenLM's own floats when pruning.
_PRUNE_SLACK = 1e-3
# Contexts whose best next words are kept (then all are forgotten at once): a request's rounds
# ask again for what the last round asked (its chain's second step is the next round's first)
REMEMBERED = 4096
K = TypeVar("K")
V = TypeVar("V")


def _remember(memory: dict[K, V], key: K, value: V) -> None:
    """Keep `value` by `key`, forgetting everything first where REMEMBERED are kept."""
    if len(memory) >= REMEMBERED:
        memory.clear()
    memory[key] = value


def _word(token_id: int) -> str:
    return "</s>" if token_id == SENTENCE_END else str(token_id)


def tokenizer_fingerprint(vocabulary: dict[str, int]) -> str:
    """A short hash of a tokenizer's vocabulary, stored with a draft to catch mismatches."""
    items = "\n".join(f"{token}\t{index}" for token, index in sorted(vocabulary.items()))
    return hashlib.sha256(items.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class _Step:
    token_id: int
    logprob: float
    state: kenlm.State


class KenLMDraft:
    """Proposes the n-gram's most likely continuation, one exact argmax per token.

    The sentence starts at the first generated token: the draft is trained on the target's
    answers, so the prompt (chat template and all) is not part of its context.
    """

    def __init__(
        self,
        model: kenlm.Model,
        index: SuccessorIndex,
        *,
        name: str,
        min_draft_prob: float = 0.0,
        end_token_id: int | None = None,
    ) -> None:
        self._model = model
        self._index = index
        self._name = name
        self.min_draft_prob = min_draft_prob
        self.end_token_id = end_token_id  # what </s> is proposed as (the target's EOS)
        # top_next's answers and _state_after's states, by what determines them (the draft
        # thread's only; a lost race is a recomputation, never a wrong answer)
        self._tops: dict[tuple[tuple[int, ...], int, kenlm.State], tuple[_Step, ...]] = {}
        self._states: dict[tuple[int, ...], tuple[kenlm.State, tuple[int, ...]]] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def order(self) -> int:
        return int(self._model.order)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        vocab_size: int | None = None,
        fingerprint: str | None = None,
        min_draft_prob: float = 0.0,
        end_token_id: int | None = None,
    ) -> KenLMDraft:
        model_file, index = _load_files(Path(path), vocab_size, fingerprint)
        model = kenlm.Model(str(model_file))
        if model.order != index.order:
            raise DraftFormatError(
                f"{model_file} is a {model.order}-gram but its index has order {index.order}"
            )
        return cls(
            model, index, name=str(path), min_draft_prob=min_draft_prob, end_token_id=end_token_id
        )

    def start(self, prompt_ids: Sequence[int]) -> KenLMSession:
        return KenLMSession(self)

    def chain(self, context_ids: Sequence[int], k: int, min_prob: float | None = None) -> Chain:
        """Up to k greedy n-gram tokens after context_ids (the tokens generated so far).

        Stops early at </s> (proposed as end_token_id when set) and at the first step whose
        best candidate has probability below min_prob (confidence gating; min_draft_prob
        unless given).
        """
        gate = self.min_draft_prob if min_prob is None else min_prob
        state, history = self._state_after(context_ids)
        tokens: list[int] = []
        probs: list[float] = []
        while len(tokens) < k:
            step = self.best_next(state, history)
            if step is None or 10.0**step.logprob < gate:
                break
            if step.token_id == SENTENCE_END:
                if self.end_token_id is not None:
                    tokens.append(self.end_token_id)
                    probs.append(10.0**step.logprob)
                break
            tokens.append(step.token_id)
            probs.append(10.0**step.logprob)
            if step.token_id == self.end_token_id:
                break
            state, history = step.state, self._trim((*history, step.token_id))
        return Chain(tuple(tokens), tuple(probs), KENLM)

    def n_best(self, context_ids: Sequence[int], n: int) -> list[tuple[int, float]]:
        """The n most likely next tokens after context_ids and their probabilities, best first
        (</s> as end_token_id, or left out without one): candidates for a token tree."""
        state, history = self._state_after(context_ids)
        best: list[tuple[int, float]] = []
        for step in self.top_next(state, history, n):
            if step.token_id != SENTENCE_END:
                best.append((step.token_id, 10**step.logprob))
            elif self.end_token_id is not None:
                best.append((self.end_token_id, 10**step.logprob))
        return best

    def best_next(self, state: kenlm.State, history: tuple[int, ...]) -> _Step | None:
        """The vocabulary argmax of p(w | history), ties to the smaller id, from the index."""
        best = self.top_next(state, history, 1)
        return best[0] if best else None

    def top_next(self, state: kenlm.State, history: tuple[int, ...], n: int) -> list[_Step]:
        """The n best words of p(w | history), best first (ties: the smaller id), exactly.

        A word's probability comes from the longest context it follows explicitly, times the
        backoffs of the longer contexts (Katz backoff as KenLM stores it). So at each context
        length j, only words whose longest explicit context is exactly that one are new
        candidates; KenLM's ngram_length tells which words those are, and the sorted lists end
        the walk as soon as no word of this length can beat the n-th best found so far.
        """
        key = (history, n, state)
        known = self._tops.get(key)
        if known is not None:
            return list(known)
        best: list[_Step] = []
        backoff = 0.0
        for length in range(len(history), -1, -1):
            context = history[len(history) - length :]
            span = self._index.spans.get(context)
            if span is not None:
                self._top_at(state, length, span, backoff, best, n)
            backoff += self._index.backoffs.get(context, 0.0)
        _remember(self._tops, key, tuple(best))
        return best

    def _top_at(
        self,
        state: kenlm.State,
        length: int,
        span: tuple[int, int],
        backoff: float,
        best: list[_Step],
        n: int,
    ) -> None:
        """Merge into `best` (kept sorted, at most n) the words whose longest context has
        `length` words, walking this context's successors best first."""
        words, logprobs = self._index.words, self._index.logprobs
        for position in range(*span):
            if len(best) == n and backoff + logprobs[position] < best[-1].logprob - _PRUNE_SLACK:
                break
            word = words[position]
            out = kenlm.State()
            full = self._model.BaseFullScore(state, _word(word), out)
            if full.ngram_length != length + 1:
                continue  # scored by a longer context: that level already considered it
            best.append(_Step(word, full.log_prob, out))
            best.sort(key=lambda step: (-step.logprob, step.token_id))
            del best[n:]

    def _state_after(self, context_ids: Sequence[int]) -> tuple[kenlm.State, tuple[int, ...]]:
        """KenLM state and index history after the sentence so far (only n-1 words matter)."""
        window = self.order - 1
        starts = len(context_ids) < window  # the sentence's start is still in the window
        if starts:
            recent = tuple(context_ids)
            history = (SENTENCE_START, *recent)
        else:
            recent = tuple(context_ids[len(context_ids) - window :]) if window else ()
            history = recent
        known = self._states.get(history)
        if known is not None:
            return known
        state = kenlm.State()
        if starts:
            self._model.BeginSentenceWrite(state)
        else:
            self._model.NullContextWrite(state)
        for token_id in recent:
            out = kenlm.State()
            self._model.BaseScore(state, _word(token_id), out)
            state = out
        _remember(self._states, history, (state, history))
        return state, history

    def _trim(self, history: tuple[int, ...]) -> tuple[int, ...]:
        window = self.order - 1
        return history[len(history) - window :] if window else ()


class KenLMSession(StaticSession):
    """One generation's draft state: the tokens generated so far."""

    def __init__(self, draft: KenLMDraft) -> None:
        self._draft = draft
        self._generated: list[int] = []

    def propose(self, k: int) -> Candidates:
        return (self.chain(k),)

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        """Up to k tokens, gated at `min_prob` (None: the draft's min_draft_prob)."""
        return self._draft.chain(self._generated, k, min_prob=min_prob)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._generated.extend(token_ids)

    def n_best(self, n: int) -> list[tuple[int, float]]:
        """The n most likely next tokens now and their n-gram probabilities, best first."""
        return self._draft.n_best(self._recent(), n)

    def chain_after(self, drafted: Sequence[int], k: int) -> Chain:
        """The chain as if `drafted` were already accepted (the session is not changed)."""
        return self._draft.chain([*self._recent(), *drafted], k)

    def _recent(self) -> list[int]:
        """The tokens the n-gram's next word depends on (the last order - 1)."""
        window = self._draft.order - 1
        return self._generated[len(self._generated) - window :] if window else []


def _load_files(
    path: Path, vocab_size: int | None, fingerprint: str | None
) -> tuple[Path, SuccessorIndex]:
    if path.is_dir():
        return _load_directory(path, vocab_size, fingerprint)
    if not path.is_file():
        raise FileNotFoundError(f"draft {path} does not exist")
    sidecar = path.with_name(path.name + ".successors.npz")
    if sidecar.is_file():
        return path, SuccessorIndex.load(sidecar, vocab_size)
    if _is_arpa(path):
        return path, SuccessorIndex.from_tables(read_arpa(path, vocab_size))
    raise DraftFormatError(
        f"{path} is a binary KenLM model without its successor index {sidecar.name}; "
        "pass the draft directory written by `python -m draft_tools.train`"
    )


def _load_directory(
    path: Path, vocab_size: int | None, fingerprint: str | None
) -> tuple[Path, SuccessorIndex]:
    manifest_file = path / DRAFT_MANIFEST
    if not manifest_file.is_file():
        raise DraftFormatError(f"draft directory {path} has no {DRAFT_MANIFEST}")
    manifest = json.loads(manifest_file.read_text())
    if vocab_size is not None and manifest.get("vocab_size", vocab_size) != vocab_size:
        raise DraftFormatError(
            f"draft {path} was trained for a vocabulary of {manifest['vocab_size']} tokens, "
            f"the target has {vocab_size}"
        )
    expected = manifest.get("tokenizer_fingerprint")
    if fingerprint is not None and expected is not None and expected != fingerprint:
        raise DraftFormatError(
            f"draft {path} was trained with another tokenizer "
            f"(fingerprint {expected}, target {fingerprint})"
        )
    index = SuccessorIndex.load(path / manifest.get("successors", "successors.npz"), vocab_size)
    return path / manifest["model"], index


def _is_arpa(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(64).lstrip().startswith(b"\\data\\")
