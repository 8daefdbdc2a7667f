"""Tiny models and drafts built from configs in a temp dir, loaded through the real code paths."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "An n-gram model predicts the next word from the previous words.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u00e5ngstr\u00f6m.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u7d75\u6587\u5b57 \U0001f642 \U0001f680.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]
PROMPTS = [
    "The quick brown fox",
    "Speculative decoding",
    "An n-gram model",
    "Caf\u00e9 na\u00efve",
    "\u65e5\u672c\u8a9e",
    "def add(a, b):",
    "1 2 3",
    "Hello world",
    "the lazy dog jumps",
    "verifies them in",
    "predicts the next",
    "r\u00e9sum\u00e9 over",
    "quick quick quick",
    "dog fox dog fox",
    "one pass",
    "tokens and",
    "\U0001f642",
    "return a",
    "over the",
    "brown",
    "model predicts words",
    "A",
]


def build_byte_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE like SmolLM2's: multi-byte characters span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    return _wrap(tokenizer)


def build_word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a handful of words, for small-vocabulary statistics."""
    vocab = {token: index for index, token in enumerate([*SPECIALS, "<unk>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return _wrap(tokenizer, unk_token="<unk>")


def _wrap(tokenizer: Tokenizer, **extra: str) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        **extra,
    )
    wrapped.chat_template = CHATML
    return wrapped


def save_tiny_model(
    directory: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    context: int = 512,
) -> Path:
    """A random tiny Llama saved as safetensors with its tokenizer, like a real model folder."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return save_model(LlamaForCausalLM(config), tokenizer, directory)


def save_model(model, tokenizer: PreTrainedTokenizerFast, directory: Path) -> Path:  # type: ignore[no-untyped-def]
    """Save a random tiny model with its tokenizer, like a real model folder; its output
    layer sharpened first (8x the default init), so greedy text has structure."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_arpa(path: Path, ngrams: Sequence[dict[tuple[str, ...], tuple[float, float]]]) -> Path:
    """Write an ARPA file: ngrams[o-1] maps an o-gram of words to (log10 prob, log10 backoff)."""
    lines = ["", "\\data\\"]
    lines += [f"ngram {order}={len(table)}" for order, table in enumerate(ngrams, start=1)]
    for order, table in enumerate(ngrams, start=1):
        lines += ["", f"\\{order}-grams:"]
        for words, (logprob, backoff) in table.items():
            tail = f"\t{backoff:.6f}" if order < len(ngrams) else ""
            lines.append(f"{logprob:.6f}\t{' '.join(words)}{tail}")
    lines += ["", "\\end\\", ""]
    path.write_text("\n".join(lines))
    return path


def unigram_arpa(path: Path, probs: dict[int, float], vocab: Iterable[int]) -> Path:
    """A unigram-like model (plus one bigram: KenLM needs order 2) favouring the given tokens."""
    others = [token for token in vocab if token not in probs]
    rest = max(1e-6, 1.0 - sum(probs.values())) / max(1, len(others) + 1)
    table = {("<s>",): (-99.0, 0.0), ("</s>",): (math.log10(rest), 0.0)}
    table[("<unk>",)] = (-99.0, 0.0)
    for token in others:
        table[(str(token),)] = (math.log10(rest), 0.0)
    for token, prob in probs.items():
        table[(str(token),)] = (math.log10(prob), 0.0)
    # KenLM needs at least a bigram model; one bigram that repeats the unigram choice will do.
    best = max(probs, key=probs.__getitem__)
    bigrams = {("<s>", str(best)): (math.log10(probs[best]), 0.0)}
    return write_arpa(path, [table, bigrams])


def train_arpa(
    path: Path, sentences: Sequence[Sequence[int]], vocab: Iterable[int], order: int = 3
) -> Path:
    """A small backoff n-gram from token-id sentences (absolute discounting)."""
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]
    for sentence in sentences:
        words = ["<s>", *map(str, sentence), "</s>"]
        for n in range(1, order + 1):
            for start in range(len(words) - n + 1):
                counts[n - 1][tuple(words[start : start + n])] += 1
    tables: list[dict[tuple[str, ...], tuple[float, float]]] = []
    unigram_total = sum(counts[0].values())
    vocab_words = {str(token) for token in vocab} | {"</s>", "<unk>"}
    unigrams = {(w,): counts[0].get((w,), 0) for w in vocab_words}
    floor = 0.5
    total = unigram_total + floor * len(unigrams)
    tables.append({w: (math.log10((c + floor) / total), -0.3) for w, c in unigrams.items()})
    tables[0][("<s>",)] = (-99.0, -0.3)
    context_totals: list[dict[tuple[str, ...], int]] = []
    for n in range(2, order + 1):
        totals: dict[tuple[str, ...], int] = defaultdict(int)
        for gram, count in counts[n - 1].items():
            totals[gram[:-1]] += count
        context_totals.append(totals)
        tables.append(
            {
                gram: (math.log10(max(count - 0.5, 0.1) / totals[gram[:-1]]), -0.3)
                for gram, count in counts[n - 1].items()
            }
        )
    return write_arpa(path, tables)
