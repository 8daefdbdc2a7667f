"""Self-distillation corpus: the target's own greedy answers, as token ids, to train the draft.

The best n-gram draft corpus is what the target itself writes on the workload's prompts
(docs/design.md, "The default draft"). This runs the target, batched and
greedy, on each prompt rendered as a chat user message (a raw prompt for a model without a chat
template, as the server takes it), and writes:

    corpus.ids    one answer per line, token ids as decimal words ("504 2251 30"): lmplz input
    corpus.jsonl  the same lines: prompt index, prompt, its rendered ids, stop reason, token
                  count, decoded text
    corpus.txt    the decoded answers, newlines shown as "\\n", for reading

The three files stay line-aligned. The run is resumable: prompts already in corpus.jsonl are
skipped, and a line half-written by an interrupted run is dropped.

    python -m draft_tools.distill --model models/smollm2-135m-instruct \\
        --prompts prompts/train.txt \\
        --out models/drafts/smollm2-135m/corpus.ids --max-new-tokens 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draft_tools.progress import bar

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Answer:
    index: int  # 0-based line number in the prompts file
    prompt: str
    token_ids: list[int]  # generated ids, without padding and without the final EOS
    stop: str  # "eos" or "length"
    text: str
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the target saw it


# --- pure helpers ---------------------------------------------------------------------------


def read_prompts(path: Path) -> list[tuple[int, str]]:
    """(line index, prompt) for every non-blank line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(i, line.strip()) for i, line in enumerate(lines) if line.strip()]


def plan_batches(lengths: dict[int, int], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped by similar length, longest first, so little padding is wasted
    and the slowest batches come first (an early, pessimistic ETA)."""
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to the longest row: decoder-only models continue from the last column.

    >>> left_pad([[5, 6, 7], [8]], pad_id=0)[0].tolist()
    [[5, 6, 7], [0, 0, 8]]
    """
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            input_ids[r, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[r, width - len(row) :] = 1
    return input_ids, attention_mask


def cut_answer(generated: Sequence[int], eos_ids: frozenset[int]) -> tuple[list[int], str]:
    """The answer up to (not including) the first EOS; after it generate() only pads.

    >>> cut_answer([504, 30, 2, 2, 2], frozenset({2}))
    ([504, 30], 'eos')
    """
    for position, token in enumerate(generated):
        if token in eos_ids:
            return list(generated[:position]), "eos"
    return list(generated), "length"


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no EOS token; answers would never end")
    return frozenset(ids)


def render_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as the server encodes it: a chat user message, or, for a model without a
    chat template (a base model), the raw prompt with the tokenizer's special tokens."""
    if not tokenizer.chat_template:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = [{"role": "user", "content": prompt}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


# --- generation -----------------------------------------------------------------------------


@torch.inference_mode()
def generate_batch(
    model: Any,
    rows: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_ids: frozenset[int],
    max_new_tokens: int,
) -> list[tuple[list[int], str]]:
    """Greedy answers for a batch of rendered prompts: [(answer ids, stop reason)]."""
    input_ids, attention_mask = left_pad(rows, pad_id)
    device = model.device
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    new_tokens = output[:, input_ids.shape[1] :].tolist()  # [batch, <= max_new_tokens]
    return [cut_answer(row, eos_ids) for row in new_tokens]


class CorpusWriter:
    """Appends answers to corpus.ids / .jsonl / .txt, keeping them line-aligned.

    corpus.jsonl is the record of what is done; it is written last, so after a crash the other
    two may hold a line more, which `open` trims.
    """

    def __init__(self, ids_path: Path) -> None:
        self.ids_path = ids_path
        self.jsonl_path = ids_path.with_suffix(".jsonl")
        self.txt_path = ids_path.with_suffix(".txt")
        self.done: set[int] = set()
        self._files: list[TextIO] = []

    def open(self) -> CorpusWriter:
        self.ids_path.parent.mkdir(parents=True, exist_ok=True)
        records = _complete_jsonl_lines(self.jsonl_path)
        self.done = {json.loads(line)["index"] for line in records}
        _keep_lines(self.jsonl_path, len(records))
        _keep_lines(self.ids_path, len(records))
        _keep_lines(self.txt_path, len(records))
        paths = (self.ids_path, self.txt_path, self.jsonl_path)
        self._files = [p.open("a", encoding="utf-8") for p in paths]
        return self

    def write(self, answer: Answer) -> None:
        ids_file, txt_file, jsonl_file = self._files
        ids_file.write(" ".join(map(str, answer.token_ids)) + "\n")
        txt_file.write(answer.text.replace("\r", "\\r").replace("\n", "\\n") + "\n")
        record = asdict(answer)
        record["n_tokens"] = len(record.pop("token_ids"))
        jsonl_file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.done.add(answer.index)

    def flush(self) -> None:
        for f in self._files:
            f.flush()

    def close(self) -> None:
        for f in self._files:
            f.close()


def _complete_jsonl_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    complete = lines[:-1]  # the last piece is "" or a line cut short by a crash
    for line in complete:
        json.loads(line)  # a broken line in the middle is corruption, not a crash: fail loudly
    return complete


def _keep_lines(path: Path, count: int) -> None:
    """Truncate `path` to its first `count` lines; it must have at least that many."""
    if not path.exists():
        if count:
            raise RuntimeError(f"{path} is missing but the corpus records {count} answers")
        return
    data = path.read_bytes()
    end = 0
    for _ in range(count):
        newline = data.find(b"\n", end)
        if newline < 0:
            raise RuntimeError(f"{path} has fewer than {count} lines; the corpus is inconsistent")
        end = newline + 1
    if end != len(data):
        with path.open("r+b") as f:
            f.truncate(end)


def keep_answers(ids_path: Path, prompts: Sequence[tuple[int, str]]) -> int:
    """Fit a corpus to another prompts file made with the same settings: answers to prompts
    still in it are kept, under their new line index; the others are dropped. Returns how many
    were kept. A greedy answer depends only on its prompt, so a grown file costs only its new
    prompts. Each file is replaced whole, corpus.jsonl last; remove the run's .meta.json first,
    so that a crash midway leaves a corpus that no run resumes."""
    CorpusWriter(ids_path).open().close()  # trims a half-written last line
    jsonl_path, txt_path = ids_path.with_suffix(".jsonl"), ids_path.with_suffix(".txt")
    records = [json.loads(line) for line in _complete_jsonl_lines(jsonl_path)]
    id_lines, txt_lines = _lines(ids_path), _lines(txt_path)
    free: dict[str, list[int]] = {}  # prompt -> its line indices not yet answered, in order
    for index, prompt in prompts:
        free.setdefault(prompt, []).append(index)
    kept: list[tuple[str, str, str]] = []
    for record, ids_line, txt_line in zip(records, id_lines, txt_lines, strict=True):
        if free.get(record["prompt"]):
            record["index"] = free[record["prompt"]].pop(0)
            kept.append((ids_line, txt_line, json.dumps(record, ensure_ascii=False) + "\n"))
    for column, path in enumerate((ids_path, txt_path, jsonl_path)):
        partial = path.with_suffix(path.suffix + ".tmp")
        partial.write_text("".join(row[column] for row in kept), encoding="utf-8")
        partial.replace(path)
    return len(kept)


def _lines(path: Path) -> list[str]:
    """Lines ending in "\\n" only (str.splitlines also breaks at \\f, \\u2028, ... in text)."""
    return [line + "\n" for line in path.read_bytes().decode("utf-8").split("\n")[:-1]]


def check_run_settings(meta_path: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume a corpus made with other settings: its lines would not mix."""
    if meta_path.exists():
        previous = json.loads(meta_path.read_text(encoding="utf-8"))
        if previous != settings:
            raise SystemExit(
                f"{meta_path} records other settings than this run:\n  {previous}\n  {settings}\n"
                "use a new --out, or delete the old corpus to start over"
            )
    else:
        meta_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


# --- driver ---------------------------------------------------------------------------------


def load_target(
    model_dir: Path, device: str, dtype: str, chat_template: str | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer); `chat_template` replaces the folder's, as the server's flag does."""
    resolved = "cuda" if device == "auto" and torch.cuda.is_available() else device
    if resolved == "auto":
        resolved = "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
    return model.to(resolved).eval(), tokenizer


def distill(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[tuple[int, str]],
    writer: CorpusWriter,
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool = True,
) -> tuple[int, int, float]:
    """Answer every prompt not yet in the corpus, `batch_size` prompts a pass (a bar with an
    ETA on a terminal unless not `progress`); returns (prompts, tokens, seconds)."""
    pending = {i: p for i, p in prompts if i not in writer.done}
    rendered = {i: render_prompt(tokenizer, p) for i, p in pending.items()}
    batches = plan_batches({i: len(ids) for i, ids in rendered.items()}, batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = eos_token_ids(model, tokenizer)
    print(
        f"{len(writer.done)} prompts done before, {len(pending)} to go in {len(batches)} "
        f"batches of <= {batch_size}",
        file=sys.stderr,
    )
    tokens, start = 0, time.monotonic()
    with bar(len(pending), "prompt", enabled=progress) as shown:
        for batch in batches:
            rows = [rendered[i] for i in batch]
            results = generate_batch(
                model, rows, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=max_new_tokens
            )
            for i, (ids, stop) in zip(batch, results, strict=True):
                text = tokenizer.decode(ids)
                writer.write(Answer(i, pending[i], ids, stop, text, rendered[i]))
            writer.flush()
            tokens += sum(len(ids) for ids, _ in results)
            shown.update(len(batch))
            shown.set_postfix(tok_s=f"{tokens / (time.monotonic() - start):.1f}", tokens=tokens)
    return len(pending), tokens, time.monotonic() - start


def check_batched(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int
) -> list[int]:
    """Greedy answers batched (left-padded) vs one at a time; returns each common prefix length.

    Padding changes the shapes of the matmuls, so logits can differ in the last bits and a
    near-tie can flip; in fp32 that should be rare.
    """
    rows = [render_prompt(tokenizer, p) for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kwargs = {"pad_id": pad_id, "eos_ids": eos_token_ids(model, tokenizer)}
    batched = generate_batch(model, rows, max_new_tokens=max_new_tokens, **kwargs)
    prefixes = []
    for prompt, row, (together, _) in zip(prompts, rows, batched, strict=True):
        [(alone, _)] = generate_batch(model, [row], max_new_tokens=max_new_tokens, **kwargs)
        same = next(
            (k for k, (a, b) in enumerate(zip(together, alone, strict=False)) if a != b),
            min(len(together), len(alone)),
        )
        equal = together == alone
        prefixes.append(len(alone) if equal else same)
        print(
            f"[{'same' if equal else 'DIFF'}] {prompt[:50]!r} ({len(row)} prompt tokens): "
            f"batched {len(together)} tokens, alone {len(alone)}, first {prefixes[-1]} identical"
        )
        if not equal:
            print(f"    batched: {tokenizer.decode(together[same : same + 12])!r}")
            print(f"    alone  : {tokenizer.decode(alone[same : same + 12])!r}")
    return prefixes


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m draft_tools.distill", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="one prompt per line")
    parser.add_argument("--out", type=Path, help="corpus.ids path (.jsonl/.txt alongside)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument(
        "--check-batched",
        type=int,
        metavar="N",
        help="compare batched and one-at-a-time greedy answers on the first N prompts; no --out",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.check_batched is None:
        parser.error("--out is required unless --check-batched is given")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = read_prompts(args.prompts)
    model, tokenizer = load_target(args.model, args.device, args.dtype)
    if args.check_batched is not None:
        chosen = [p for _, p in prompts[: args.check_batched]]
        check_batched(model, tokenizer, chosen, args.max_new_tokens)
        return 0
    settings = {
        "model": str(args.model.resolve()),
        "prompts_sha256": file_sha256(args.prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "decoding": "greedy",
    }
    writer = CorpusWriter(args.out).open()
    check_run_settings(args.out.with_suffix(".meta.json"), settings)
    try:
        count, tokens, seconds = distill(
            model,
            tokenizer,
            prompts,
            writer,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
        )
    finally:
        writer.close()
    rate = tokens / seconds if seconds else 0.0
    print(
        f"answered {count} prompts, {tokens} tokens in {seconds:.0f}s ({rate:.1f} tok/s); "
        f"corpus: {args.out} ({len(writer.done)} answers)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
