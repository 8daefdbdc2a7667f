"""What replicas share through the answer stream (server.answer_stream): one record per answer
learned, and the identity of the model and tokenizer that produced it.

A record is a Redis Stream entry of byte fields: the format, the replica that published it, the
model fingerprint, the tenant, and the answer's and prompt tail's token ids (little-endian
uint32). The fingerprint is in the stream's key and in every record: replicas of different
models read different streams, and a record that reached the wrong one anyway is dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kenspec.server.engine.kenlm_draft import tokenizer_fingerprint
from kenspec.server.engine.suffix_index import LEAD_TOKENS
from kenspec.server.engine.target import TargetModel

FORMAT = b"1"
MAX_ANSWER_TOKENS = 16_384  # an answer's last ids, as the index keeps a long answer's end
KEY_PREFIX = "kenspec:answers:"
_TENANT = re.compile(rb"t[0-9a-f]{16}|shared")  # what security.tenant_of names
_EMBEDDING_ROWS = 64  # rows of the input embedding the fingerprint samples


@dataclass(frozen=True, slots=True)
class AnswerRecord:
    """One learned answer, as TenantSuffixIndex.add takes it."""

    tenant: str
    answer: tuple[int, ...]
    prompt_tail: tuple[int, ...]

    @classmethod
    def of(cls, tenant: str, prompt: Sequence[int], answer: Sequence[int]) -> AnswerRecord:
        """Copied off the generation's lists (the engine thread keeps using them)."""
        return cls(tenant, tuple(answer[-MAX_ANSWER_TOKENS:]), tuple(prompt[-LEAD_TOKENS:]))


@dataclass(frozen=True, slots=True)
class Received:
    """A record read back: who published it, for which model, and the answer."""

    replica: bytes
    fingerprint: str
    record: AnswerRecord


def stream_key(fingerprint: str) -> str:
    return KEY_PREFIX + fingerprint


def encode(record: AnswerRecord, replica: str, fingerprint: str) -> dict[bytes, bytes]:
    return {
        b"v": FORMAT,
        b"r": replica.encode(),
        b"f": fingerprint.encode(),
        b"t": record.tenant.encode(),
        b"a": np.asarray(record.answer, dtype="<u4").tobytes(),
        b"p": np.asarray(record.prompt_tail, dtype="<u4").tobytes(),
    }


def decode(fields: Mapping[bytes, bytes], vocab_size: int) -> Received:
    """The entry's record; ValueError when it is not one this version wrote for a vocabulary
    of vocab_size (another format, a bad tenant, ids out of range, a truncated array)."""
    if fields.get(b"v") != FORMAT:
        raise ValueError(f"format {fields.get(b'v')!r}")
    tenant = fields.get(b"t", b"")
    if not _TENANT.fullmatch(tenant):
        raise ValueError("not a tenant id")
    answer = _ids(fields.get(b"a", b""), vocab_size, MAX_ANSWER_TOKENS)
    prompt = _ids(fields.get(b"p", b""), vocab_size, LEAD_TOKENS)
    fingerprint = fields.get(b"f", b"").decode("ascii", errors="replace")
    record = AnswerRecord(tenant.decode(), answer, prompt)
    return Received(fields.get(b"r", b""), fingerprint, record)


def _ids(raw: bytes, vocab_size: int, most: int) -> tuple[int, ...]:
    if len(raw) % 4 or len(raw) > 4 * most:
        raise ValueError("token ids of a wrong length")
    ids = np.frombuffer(raw, dtype="<u4")
    if ids.size and int(ids.max()) >= vocab_size:
        raise ValueError("a token id outside the vocabulary")
    return tuple(int(i) for i in ids)


def model_fingerprint(target: TargetModel) -> str:
    """16 hex digits that differ between models whose answers should not mix: the tokenizer's
    vocabulary and special tokens, the architecture (config class and shape), and a sample of
    the input embedding's weights rounded to bfloat16 (the same for a model loaded in float32
    or bfloat16, on any device; two fine-tunes of one base differ). Never the folder's path,
    which differs between machines."""
    tokenizer, config = target.tokenizer, target.model.config
    special = zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True)
    identity = {
        "vocabulary": tokenizer_fingerprint(tokenizer.get_vocab()),
        "special": sorted(special),
        "eos": tokenizer.eos_token_id,
        "config": type(config).__name__,
        "vocab_size": target.vocab_size,
        "shape": [
            getattr(config, name, None)
            for name in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        ],
        "embedding": _embedding_sample(target),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _embedding_sample(target: TargetModel) -> str:
    with torch.no_grad():
        weight = target.model.get_input_embeddings().weight[:_EMBEDDING_ROWS]
        rounded = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(rounded.numpy().tobytes()).hexdigest()
