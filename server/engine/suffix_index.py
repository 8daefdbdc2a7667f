"""An index over what the target wrote: drafts from the longest exact match.

SuffixDecoding (Oliaro et al. 2024) and REST (He et al. 2024) draft from earlier outputs: when
the last tokens of a stream occurred in an earlier answer, what followed them there is a likely
continuation. The answers of one model to one workload repeat themselves far more than a
smoothed n-gram can use: a 4-gram forgets a 20-token match, and KenLM never learns from what
the server serves. The draft's distilled corpus is one such index, and each tenant's finished
answers another (`tenant_index.TenantSuffixIndex`, which keeps callers' answers apart).

Layout (the vLLM suffix speculator's hashed buckets, over segments for eviction):
- answers are appended, each after the last LEAD_TOKENS of its prompt (when given) and
  followed by a separator, to the open segment, a flat array of token ids; only the answer's
  tokens are indexed as continuations, the lead only as keys before them; a full segment is
  sealed and a new one opened; past `max_tokens` the oldest segment is dropped whole (oldest
  out, O(1));
- each segment maps the hash of every `KEY_LENGTHS`-gram to the most recent `slots` positions
  that followed it;
- a lookup gathers the positions that followed the stream's last 4 and last 2 tokens, extends
  each backwards to its exact match length (up to `max_match`, a binary search over slice
  comparisons in C), keeps the longest, and builds a chain by majority vote among them: at
  each step the most frequent next token, the candidates that disagree dropped.

Memory: about 150 MB per million indexed tokens (the default corpus, 186k tokens, took
28 MB); a lookup costs about 12 µs per drafted token on a 2-core EPYC (`draft_tools.train
eval` reports it).
Thread safety: one lock; `add` is called on the engine thread when a stream finishes
(microseconds per token), lookups on the draft thread.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypedDict, Unpack

SUFFIX_CORPUS = "corpus.ids.gz"  # in a draft folder: the distilled answers the index starts from
KEY_LENGTHS = (4, 2)  # longest first: a 4-token key finds long matches among common bigrams
LEAD_TOKENS = 16  # of a prompt's end, indexed before its answer
_SEPARATOR = -1  # between answers: no continuation runs from one answer into the next
TEXT_PIECE_TOKENS = 4096  # a plain-text corpus's passages are indexed in pieces of this many
_BLANK_LINES = re.compile(r"\n\s*\n")


class _Segment:
    """A flat array of answers and, per key hash, the positions that followed the key."""

    def __init__(self, slots: int) -> None:
        self.tokens = array("i")
        self.slots = slots
        self.buckets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, answer: Sequence[int], lead: Sequence[int] = ()) -> None:
        tokens, start = self.tokens, len(self.tokens)
        tokens.extend(lead)
        first = len(tokens)  # the answer's first token: the first continuation indexed
        tokens.extend(answer)
        tokens.append(_SEPARATOR)
        for position in range(max(first, start + 1), first + len(answer)):
            for length in KEY_LENGTHS:
                if position - length < start:
                    continue
                key = hash(tuple(tokens[position - length : position]))
                bucket = self.buckets.setdefault(key, [])
                bucket.append(position)
                if len(bucket) > self.slots:
                    del bucket[0]

    def match_length(self, position: int, context: array[int], max_match: int) -> int:
        """How many tokens before `position` equal the context's last ones (up to max_match)."""
        tokens = self.tokens
        low, high = 0, min(max_match, position, len(context))
        end = len(context)
        while low < high:  # tokens[position - n : position] == context[-n:] holds for n <= low
            middle = (low + high + 1) // 2
            if tokens[position - middle : position] == context[end - middle : end]:
                low = middle
            else:
                high = middle - 1
        return low


class IndexOptions(TypedDict, total=False):
    """SuffixIndex's keyword options, for the constructors that pass them on."""

    max_tokens: int
    max_match: int
    slots: int
    segment_tokens: int
    min_probability: float


class SuffixIndex:
    """Past answers of the target, for drafting by longest exact match (see module doc)."""

    def __init__(
        self,
        *,
        max_tokens: int = 1_000_000,
        max_match: int = 32,
        slots: int = 16,
        segment_tokens: int = 65_536,
        min_probability: float = 0.1,
    ) -> None:
        if max_tokens < segment_tokens:
            segment_tokens = max(1, max_tokens)
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.slots = slots
        self.min_probability = min_probability
        self.segment_tokens = segment_tokens
        self._segments: list[_Segment] = [_Segment(slots)]
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Token ids held (separators included)."""
        return sum(len(segment) for segment in self._segments)

    def add(self, answer: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Index one answer (a finished response's tokens) after the last LEAD_TOKENS of its
        prompt, if given: an answer's first tokens are then drafted from what earlier answers
        began with after the same words (the chat template's assistant header, the end of a
        recurring instruction). The oldest segment goes when full."""
        if len(answer) < 2 or self.max_tokens <= 0:
            return
        tiny = self.segment_tokens <= 2 * LEAD_TOKENS  # an index this small keeps answers only
        lead = () if tiny else prompt[-LEAD_TOKENS:]
        answer = answer[-(self.segment_tokens - len(lead) - 1) :]  # within one segment
        with self._lock:
            if len(self._segments[-1]) + len(lead) + len(answer) + 1 > self.segment_tokens:
                self._segments.append(_Segment(self.slots))
            self._segments[-1].append(answer, lead)
            self._trim()

    def bound(self, max_tokens: int, segment_tokens: int | None = None) -> None:
        """Hold at most max_tokens from now on (a tenant's share shrank): the oldest segments
        go at once, the open one too if it alone is over; new segments hold segment_tokens."""
        with self._lock:
            self.max_tokens = max_tokens
            wanted = self.segment_tokens if segment_tokens is None else segment_tokens
            self.segment_tokens = max(1, min(wanted, max_tokens))
            self._trim()

    def _trim(self) -> None:
        """Drop the oldest segments while over max_tokens (the lock held). The open segment
        never exceeds segment_tokens <= max_tokens after an add, so an add keeps its answer."""
        while self._segments and self.tokens > self.max_tokens:
            del self._segments[0]
        if not self._segments:
            self._segments.append(_Segment(self.slots))

    def add_all(self, answers: Iterable[Sequence[int]]) -> None:
        for answer in answers:
            self.add(answer)

    def propose(self, context: Sequence[int], k: int, min_match: int = 0) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest earlier exact match of the context's last
        tokens (majority vote among equally long matches), and that match length (0: none,
        or none of at least `min_match` tokens)."""
        return propose_across((self,), context, k, min_match)

    def may_match(self, context: Sequence[int], min_match: int) -> bool:
        """Whether `propose(context, k, min_match)` may find a match (the module's
        `may_match`)."""
        return may_match((self,), context, min_match)

    def _holds(self, key: int) -> bool:
        """Whether any segment indexed a continuation after a key of this hash (lock held)."""
        return any(key in segment.buckets for segment in self._segments)

    def _longest(
        self, tail: array[int], keys: tuple[int, ...] = KEY_LENGTHS
    ) -> tuple[int, list[tuple[array[int], int]]]:
        """The longest match length and its candidates (segment tokens, continuation start)
        among the positions that followed the tail's last `keys`-grams; the caller holds the
        lock."""
        best, found = 0, []
        for segment in self._segments:
            positions: set[int] = set()
            for length in keys:
                if len(tail) >= length:
                    positions.update(segment.buckets.get(hash(tuple(tail[-length:])), ()))
            for position in sorted(positions):  # oldest first: the vote's ties go to the newest
                matched = segment.match_length(position, tail, self.max_match)
                if matched > best:
                    best, found = matched, [(segment.tokens, position)]
                elif matched == best and matched:
                    found.append((segment.tokens, position))
        return best, found

    @classmethod
    def for_draft(
        cls, draft: Path | None, vocab_size: int | None = None, **options: Unpack[IndexOptions]
    ) -> tuple[SuffixIndex, Path | None]:
        """An index seeded with the draft folder's SUFFIX_CORPUS if it has one, else empty;
        and the corpus it was seeded from (None: none)."""
        corpus = draft / SUFFIX_CORPUS if draft is not None else None
        if corpus is not None and corpus.is_file():
            return cls.from_corpus(corpus, vocab_size, **options), corpus
        return cls(**options), None

    @classmethod
    def from_corpus(
        cls, path: Path, vocab_size: int | None = None, **options: Unpack[IndexOptions]
    ) -> SuffixIndex:
        """An index seeded with a corpus of token-id lines (`corpus.ids`, optionally gzipped).

        Raises CorpusError, naming the file and line, for a file that is not such a corpus
        (damaged, truncated, not gzip) or holds ids outside [0, vocab_size): a corpus of
        another tokenizer, whose drafts would all be wrong.
        """
        index = cls(**options)
        opener = gzip.open if path.suffix == ".gz" else open
        number = 0
        try:
            with opener(path, "rt", encoding="ascii") as lines:
                for line in lines:
                    number += 1
                    if line.strip():
                        index.add(_corpus_line(line, vocab_size))
        except (OSError, EOFError, UnicodeDecodeError, ValueError) as error:
            where = f"line {number}: " if number else ""
            raise CorpusError(
                f"suffix-index corpus {path} is unusable ({where}{error}); rebuild it with "
                "draft_tools, remove it, or start with --no-suffix-index"
            ) from error
        return index


def add_text_corpus(
    index: SuffixIndex, path: Path, encode: Callable[[list[str]], list[list[int]]]
) -> int:
    """Seed `index` with a plain-text file: each passage (its lines up to a blank line) encoded
    by `encode` (the target's tokenizer, many passages per call) and added as an answer, cut in
    pieces of at most TEXT_PIECE_TOKENS (an answer longer than a segment would lose its start).
    Returns the token ids added; CorpusError names a file that is unreadable or not UTF-8.

        >>> add_text_corpus(index, Path("notes.txt"), encode)  # "a b\nc\n\nd e" -> 2 passages
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CorpusError(f"suffix corpus {path} is unusable: {error}") from error
    passages = [block.strip() for block in _BLANK_LINES.split(text) if block.strip()]
    added = 0
    for ids in encode(passages):
        for start in range(0, len(ids), TEXT_PIECE_TOKENS):
            piece = ids[start : start + TEXT_PIECE_TOKENS]
            index.add(piece)
            added += len(piece)
    return added


class CorpusError(ValueError):
    """A suffix-index corpus that cannot be used (the message names the file)."""


def _corpus_line(line: str, vocab_size: int | None) -> list[int]:
    ids = [int(token) for token in line.split()]
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise ValueError(f"token id {bad} is outside the target's vocabulary of {vocab_size}")
    return ids


def propose_across(
    indices: Sequence[SuffixIndex], context: Sequence[int], k: int, min_match: int = 0
) -> tuple[list[int], int]:
    """SuffixIndex.propose over several indices as if they were one, the earlier ones older
    (a tenant's view: the seeded corpus, then its own answers): the longest match in any of
    them, the vote among every equally long one. Options (max_match, min_probability) are
    the first index's.

    Only `_search_keys(min_match)` are searched (an open breaker's copies ask for 4: the
    4-gram's few positions, not the common bigram's many)."""
    if not indices or k <= 0 or not _long_enough(context, min_match):
        return [], 0
    keys = _search_keys(min_match)
    first = indices[0]
    tail = array("i", context[-first.max_match :])
    with contextlib.ExitStack() as locks:  # in the given order; an add takes one lock only
        best, found = 0, []
        for index in indices:
            locks.enter_context(index._lock)
            matched, candidates = index._longest(tail, keys)
            if matched > best:
                best, found = matched, candidates
            elif matched == best and matched:
                found += candidates
        if best < min_match:
            return [], 0
        return _vote(found, k, first.min_probability), best


def may_match(indices: Sequence[SuffixIndex], context: Sequence[int], min_match: int) -> bool:
    """Whether `propose_across(indices, context, k, min_match)` may find a match: whether the
    key it would search (the context's last 4-gram for a match of 4 or more) was indexed in
    any segment: one dictionary lookup a segment, no positions compared. False means it would
    find none; True that it may (an answer's end leaves no continuation). Of several keys
    searched, the shortest: a position indexed under the longer is under it too."""
    if not indices or not _long_enough(context, min_match):
        return False
    length = min(_search_keys(min_match))
    key = hash(tuple(context[-length:]))
    for index in indices:
        with index._lock:
            if index._holds(key):
                return True
    return False


def _search_keys(min_match: int) -> tuple[int, ...]:
    """The key lengths a search for a match of at least `min_match` tokens reads: such a match
    ends with the context's last n-gram for every key length n up to min_match, so the longest
    of those alone; every key length when none is that short."""
    within = [length for length in KEY_LENGTHS if length <= min_match]
    return (max(within),) if within else KEY_LENGTHS


def _long_enough(context: Sequence[int], min_match: int) -> bool:
    """Whether the context holds the shortest key and the match asked for."""
    return len(context) >= max(min(KEY_LENGTHS), min_match)


def _vote(candidates: list[tuple[array[int], int]], k: int, min_probability: float) -> list[int]:
    """A chain by majority: at each step the most frequent next token among the candidates
    (oldest first) that agree with the chain so far, ties to the newest. The chain's
    probability is the product of each step's share of the candidates (SuffixDecoding's path
    probability); it stops below min_probability, and at an answer's end."""
    chain: list[int] = []
    probability = 1.0
    while candidates and len(chain) < k:
        step = len(chain)
        nexts = [
            (tokens[start + step], tokens, start)
            for tokens, start in candidates
            if tokens[start + step] != _SEPARATOR  # every answer ends with one: in range
        ]
        if not nexts:
            break
        counts = Counter(token for token, _, _ in nexts)
        newest = {token: order for order, (token, _, _) in enumerate(nexts)}
        token = max(counts, key=lambda t: (counts[t], newest[t]))
        probability *= counts[token] / len(candidates)
        if probability < min_probability:
            break
        chain.append(token)
        candidates = [(tokens, start) for t, tokens, start in nexts if t == token]
    return chain
