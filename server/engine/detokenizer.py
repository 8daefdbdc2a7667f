"""Incremental detokenization and stop-sequence matching on the generated text."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import cache

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_INCOMPLETE = "\ufffd"  # what a decoder prints for a multi-byte character cut in the middle


class IncrementalDetokenizer:
    """Turns tokens into text deltas whose concatenation equals decode(all tokens).

    Decodes a short window (as TGI and vLLM do) so each token costs O(1), and holds text back
    while it ends in U+FFFD: a character split across tokens is emitted whole, once complete.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._backend = _plain_backend_decode(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end of generation (an incomplete character)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(token_ids, True)
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


def _plain_backend_decode(
    tokenizer: PreTrainedTokenizerBase,
) -> Callable[[list[int], bool], str] | None:
    """The Rust backend's decode where transformers' decode of a list of ids is only that (a
    fast tokenizer neither subclassing decode nor cleaning up spaces): ~17 us a call against
    ~50 through transformers' wrapper, two calls a token. None: use the tokenizer's own."""
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or kind.decode is not PreTrainedTokenizerBase.decode
        or kind._decode is not PreTrainedTokenizerFast._decode
        or tokenizer.clean_up_tokenization_spaces
        or backend is None
    ):
        return None
    decode: Callable[[list[int], bool], str] = backend.decode
    return decode


class StopMatcher:
    """Finds the first stop string in text that grows by deltas, scanning only the new tail."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(stop) for stop in self._stops), default=0)

    def find(self, text: str, new_from: int) -> int | None:
        """Index in text where a stop string starts, given text[:new_from] was checked before."""
        if not self._stops:
            return None
        start = max(0, new_from - self._longest + 1)
        hits = [index for stop in self._stops if (index := text.find(stop, start)) >= 0]
        return min(hits, default=None)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenTexts:
    """Each token's own bytes and text, as logprobs show them (OpenAI's ``token`` and
    ``bytes``), cached per id: a byte-level BPE token's bytes (GPT-2's byte-to-character map
    undone, so a token holding half a character shows its half), a SentencePiece token's text
    with its word marker as a space (``<0x0A>`` as that byte), a special token's name. A
    token's text is its bytes decoded, U+FFFD where they are not UTF-8 on their own.

    Example (SmolLM2): token 2251 is "Ġwind": bytes b" wind", text " wind".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._special = frozenset(tokenizer.all_special_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = repr(getattr(backend, "decoder", None))
        self._byte_level = decoder.startswith("ByteLevel") or "ByteLevel" in decoder
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._compute(token_id)
        return found

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _compute(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):  # an id the tokenizer does not know
            return b""
        if token_id in self._special:
            return token.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(character in table for character in token):
                return bytes(table[character] for character in token)
        byte = _BYTE_TOKEN.fullmatch(token)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return token.replace("\u2581", " ").encode()


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (Radford et al. 2019,
    bytes_to_unicode): printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, characters, strict=True)}
