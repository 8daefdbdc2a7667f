"""Self-distillation corpus: the target's own greedy answers, as token ids, to train the draft.

The best n-gram draft corpus is what the target itself writes on the workload's prompts
(docs/design.md, "The default draft"). This runs the target through the server's own engine
(greedy, --batch-size answers a pass with continuous batching, speculating from each prompt
and from the answers given before, as `--draft none` serves), on each prompt rendered as a chat
user message (a raw prompt for a model without a chat template, as the server takes it), and
writes:

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from kenspec.api.outputs import FinishReason
from kenspec.draft_tools.progress import bar
from kenspec.server.engine.generation import Generation, Round
from kenspec.server.engine.params import (
    InvalidParameter,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.speculative_engine import SpeculativeEngine
from kenspec.server.logs import configure_logging
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import parse_settings

DTYPES = ("bfloat16", "float16", "float32")


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


class PromptRefused(ValueError):
    """The engine refuses a prompt (too long for the model's context with max_new_tokens)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


@dataclass(frozen=True, slots=True)
class Target:
    """The server's engine over the target (no trained draft: the prompt's own tokens and the
    suffix index of the answers given so far draft), and the speculation it serves with."""

    engine: SpeculativeEngine
    speculation: SpeculationParams

    @property
    def tokenizer(self) -> Any:
        return self.engine.target.tokenizer


def answer_all(
    target: Target,
    rows: Mapping[int, Sequence[int]],
    max_new_tokens: int,
    on_answer: Callable[[int, list[int], str], None],
) -> None:
    """Greedy answers to every row (index -> rendered prompt ids) through the engine, its
    --max-batch-size rows a pass (continuous batching: a finished row's place is taken at
    once). on_answer(index, answer ids without the final EOS, "eos" or "length") in index
    order, as soon as an answer and all before it are done, so a corpus does not depend on
    which answer finished first."""
    done: dict[int, tuple[list[int], str]] = {}
    order = sorted(rows)
    failures: list[BaseException] = []

    def deliver(index: int, generation: Generation, item: Round | BaseException) -> None:
        if isinstance(item, BaseException):
            failures.append(item)
        elif item.finish_reason is not None:
            ids = generation.output_ids
            ended = item.finish_reason == FinishReason.EOS
            done[index] = (ids[:-1], "eos") if ended else (ids, "length")
            while order and order[0] in done:
                first = order.pop(0)
                on_answer(first, *done.pop(first))

    stopping = StoppingParams(max_new_tokens=max_new_tokens)
    generations = []
    for index in order:  # every prompt checked before any is answered
        try:
            generation = target.engine.start(
                rows[index],
                sampling=SamplingParams(),
                stopping=stopping,
                speculation=target.speculation,
            )
        except InvalidParameter as error:
            raise PromptRefused(index, str(error)) from None
        generations.append((index, generation))
    for index, generation in generations:
        target.engine.batch.add(generation, partial(deliver, index, generation))
    target.engine.batch.run_until_idle()
    if failures:
        raise failures[0]


def greedy_answers(
    target: Target, rows: Mapping[int, Sequence[int]], max_new_tokens: int
) -> dict[int, tuple[list[int], str]]:
    """answer_all's answers, collected: {index: (answer ids, stop)}."""
    answers: dict[int, tuple[list[int], str]] = {}
    answer_all(target, rows, max_new_tokens, lambda i, ids, stop: answers.update({i: (ids, stop)}))
    return answers


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
    model_dir: Path,
    device: str,
    dtype: str,
    *,
    rows: int,
    chat_template: Path | None = None,
    threads: int = 0,
) -> Target:
    """The engine the server would run on `model_dir` (greedy, float32 exact), `rows` answers
    a pass, with `chat_template` instead of the folder's as the server's flag gives it.
    Calibration is measured afresh and not kept (the cache is the server's)."""
    argv = ["--model", str(model_dir), "--draft", "none", "--device", device]
    argv += ["--dtype", dtype, "--max-batch-size", str(rows), "--threads", str(threads)]
    argv += ["--calibration-cache", "none"]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    settings = parse_settings(argv, env={})
    return Target(load_runtime(settings).engine, settings.speculation.request_defaults)


def distill(
    target: Target,
    prompts: Sequence[tuple[int, str]],
    writer: CorpusWriter,
    *,
    max_new_tokens: int,
    progress: bool = True,
) -> tuple[int, int, float]:
    """Answer every prompt not yet in the corpus (a bar with an ETA on a terminal unless not
    `progress`); returns (prompts, tokens, seconds)."""
    tokenizer = target.tokenizer
    pending = {i: p for i, p in prompts if i not in writer.done}
    rendered = {i: render_prompt(tokenizer, p) for i, p in pending.items()}
    rows = target.engine.batch.settings.max_rows
    print(
        f"{len(writer.done)} prompts done before, {len(pending)} to go, <= {rows} a pass",
        file=sys.stderr,
    )
    tokens, start = 0, time.monotonic()
    with bar(len(pending), "prompt", enabled=progress) as shown:

        def write(index: int, ids: list[int], stop: str) -> None:
            nonlocal tokens
            text = tokenizer.decode(ids)
            writer.write(Answer(index, pending[index], ids, stop, text, rendered[index]))
            writer.flush()
            tokens += len(ids)
            shown.update(1)
            shown.set_postfix(tok_s=f"{tokens / (time.monotonic() - start):.1f}", tokens=tokens)

        answer_all(target, rendered, max_new_tokens, write)
    return len(pending), tokens, time.monotonic() - start


def check_batched(target: Target, prompts: Sequence[str], max_new_tokens: int) -> list[int]:
    """Greedy answers batched vs one at a time; returns each common prefix length.

    Packed rows change the shapes of the matmuls, so logits can differ in the last bits and a
    near-tie can flip; in float32 that should be rare.
    """
    tokenizer = target.tokenizer
    rows = {i: render_prompt(tokenizer, p) for i, p in enumerate(prompts)}
    batched = greedy_answers(target, rows, max_new_tokens)
    prefixes = []
    for i, prompt in enumerate(prompts):
        (together, _), (single, _) = (
            batched[i],
            greedy_answers(target, {i: rows[i]}, max_new_tokens)[i],
        )
        same = next(
            (k for k, (a, b) in enumerate(zip(together, single, strict=False)) if a != b),
            min(len(together), len(single)),
        )
        equal = together == single
        prefixes.append(len(single) if equal else same)
        print(
            f"[{'same' if equal else 'DIFF'}] {prompt[:50]!r} ({len(rows[i])} prompt tokens): "
            f"batched {len(together)} tokens, alone {len(single)}, first {prefixes[-1]} identical"
        )
        if not equal:
            print(f"    batched: {tokenizer.decode(together[same : same + 12])!r}")
            print(f"    alone  : {tokenizer.decode(single[same : same + 12])!r}")
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
    parser.add_argument("--batch-size", type=int, default=16, help="answers a pass (16)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
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
    configure_logging(level="warning")  # the engine's warnings, on stderr
    prompts = read_prompts(args.prompts)
    target = load_target(
        args.model, args.device, args.dtype, rows=args.batch_size, threads=args.threads
    )
    if args.check_batched is not None:
        chosen = [p for _, p in prompts[: args.check_batched]]
        check_batched(target, chosen, args.max_new_tokens)
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
            target, prompts, writer, max_new_tokens=args.max_new_tokens
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
