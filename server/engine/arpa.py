"""Read n-gram tables from an ARPA file whose words are target token ids in decimal.

The draft format: KenLM is trained on sentences of token ids written as decimal words
("504 2251 30"), one answer per line, so words are ids of the target tokenizer. The only other
words are KenLM's <s>, </s> and <unk>, mapped to the negative ids below.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SENTENCE_START = -1  # <s>
SENTENCE_END = -2  # </s>
UNKNOWN = -3  # <unk>
_SPECIAL = {"<s>": SENTENCE_START, "</s>": SENTENCE_END, "<unk>": UNKNOWN}


class DraftFormatError(ValueError):
    """The n-gram model does not use the target's token ids as words."""


@dataclass(frozen=True, slots=True)
class NgramTable:
    """All n-grams of one order: ids [count, order], log10 probs and log10 backoffs [count]."""

    ids: np.ndarray
    logprobs: np.ndarray
    backoffs: np.ndarray


def word_to_id(word: str, vocab_size: int | None) -> int:
    special = _SPECIAL.get(word)
    if special is not None:
        return special
    if not word.isdigit():
        raise DraftFormatError(
            f"draft word {word!r} is not a token id: the n-gram model must be trained on the "
            "target tokenizer's token ids written as decimal strings"
        )
    token_id = int(word)
    if vocab_size is not None and token_id >= vocab_size:
        raise DraftFormatError(
            f"draft word {word} is outside the target vocabulary (size {vocab_size}): "
            "the draft was trained for a different tokenizer"
        )
    return token_id


def read_arpa(path: str | Path, vocab_size: int | None = None) -> list[NgramTable]:
    """Parse an ARPA file (plain or .gz) into one table per order, checking every word id."""
    tables: list[NgramTable] = []
    for order, rows in _sections(Path(path)):
        ids = np.empty((len(rows), order), dtype=np.int32)
        logprobs = np.empty(len(rows), dtype=np.float32)
        backoffs = np.zeros(len(rows), dtype=np.float32)
        for row, fields in enumerate(rows):
            logprobs[row] = float(fields[0])
            ids[row] = [word_to_id(word, vocab_size) for word in fields[1 : order + 1]]
            if len(fields) > order + 1:
                backoffs[row] = float(fields[order + 1])
        tables.append(NgramTable(ids=ids, logprobs=logprobs, backoffs=backoffs))
    if not tables:
        raise DraftFormatError(f"{path} has no n-gram sections; is it an ARPA file?")
    return tables


def _sections(path: Path) -> Iterator[tuple[int, list[list[str]]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        order = 0
        rows: list[list[str]] = []
        for raw in handle:
            line = raw.strip()
            if line.endswith("-grams:") and line.startswith("\\"):
                if order:
                    yield order, rows
                order, rows = int(line[1:].split("-")[0]), []
            elif line == "\\end\\":
                break
            elif order and line:
                rows.append(line.split())
        if order:
            yield order, rows
