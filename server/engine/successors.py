"""Successor index: for each n-gram context, its next words sorted by probability.

KenLM's Python API scores words but cannot list them, and scanning the whole vocabulary per
drafted token would cost milliseconds. The index holds, for every context that appears in the
model, the words that follow it explicitly, best first; with the backoff weights this finds
the exact argmax over the vocabulary by looking at a handful of candidates (see KenLMDraft).
It is built from the ARPA n-grams and stored beside a binary model as `successors.npz`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kenspec.server.engine.arpa import SENTENCE_START, UNKNOWN, NgramTable, word_to_id


@dataclass(frozen=True, slots=True)
class SuccessorIndex:
    order: int
    spans: dict[tuple[int, ...], tuple[int, int]]  # context -> [start, end) in words/logprobs
    words: list[int]  # successors, grouped by context, best first (ties: smaller id first)
    logprobs: list[float]  # log10 p(word | context)
    backoffs: dict[tuple[int, ...], float]  # log10 backoff of each n-gram that has one

    @classmethod
    def from_tables(cls, tables: list[NgramTable]) -> SuccessorIndex:
        spans: dict[tuple[int, ...], tuple[int, int]] = {}
        words: list[int] = []
        logprobs: list[float] = []
        backoffs: dict[tuple[int, ...], float] = {}
        for table in tables:
            _add_successors(table, spans, words, logprobs)
            has_backoff = np.nonzero(table.backoffs)[0]
            keys = map(tuple, table.ids[has_backoff].tolist())
            backoffs.update(zip(keys, table.backoffs[has_backoff].tolist(), strict=True))
        return cls(len(tables), spans, words, logprobs, backoffs)

    def save(self, path: str | Path, tables: list[NgramTable]) -> None:
        """Store the n-gram tables the index is built from (compact; rebuilt at load)."""
        arrays: dict[str, np.ndarray] = {}
        for order, table in enumerate(tables, start=1):
            arrays[f"ids_{order}"] = table.ids
            arrays[f"logprobs_{order}"] = table.logprobs
            arrays[f"backoffs_{order}"] = table.backoffs
        np.savez_compressed(path, allow_pickle=False, **arrays)  # numeric: nothing to pickle

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> SuccessorIndex:
        return cls.from_tables(load_tables(path, vocab_size))


def load_tables(path: str | Path, vocab_size: int | None = None) -> list[NgramTable]:
    with np.load(path) as data:
        orders = sorted(int(key.split("_")[1]) for key in data.files if key.startswith("ids_"))
        tables = [
            NgramTable(data[f"ids_{o}"], data[f"logprobs_{o}"], data[f"backoffs_{o}"])
            for o in orders
        ]
    _check_vocabulary(tables[0], vocab_size)
    return tables


def _check_vocabulary(unigrams: NgramTable, vocab_size: int | None) -> None:
    if vocab_size is None or len(unigrams.ids) == 0:
        return
    largest = int(unigrams.ids.max())
    if largest >= vocab_size:
        word_to_id(str(largest), vocab_size)  # raises DraftFormatError with the explanation


def _add_successors(
    table: NgramTable,
    spans: dict[tuple[int, ...], tuple[int, int]],
    words: list[int],
    logprobs: list[float],
) -> None:
    predicted = table.ids[:, -1]
    keep = (predicted != SENTENCE_START) & (predicted != UNKNOWN)  # never drafted
    ids, scores = table.ids[keep], table.logprobs[keep]
    contexts = ids[:, :-1]
    # Group by context, then best first; np.lexsort sorts by its last key first.
    order = np.lexsort((ids[:, -1], -scores, *contexts.T[::-1]))
    ids, scores, contexts = ids[order], scores[order], contexts[order]
    if len(ids) == 0:
        return
    changes = np.any(contexts[1:] != contexts[:-1], axis=1) if contexts.shape[1] else None
    starts = [0] if changes is None else [0, *(np.nonzero(changes)[0] + 1).tolist()]
    ends = [*starts[1:], len(ids)]
    offset = len(words)
    for start, end, context in zip(starts, ends, contexts[starts].tolist(), strict=True):
        spans[tuple(context)] = (offset + start, offset + end)
    words.extend(ids[:, -1].tolist())
    logprobs.extend(scores.tolist())
