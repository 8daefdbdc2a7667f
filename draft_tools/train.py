"""Train a KenLM draft for a target model, and measure it: the single steps that
`python -m draft_tools build` (draft_tools/build.py) runs in one command.

    python -m draft_tools.train text    --model M --text corpus.txt --out corpus.ids
    python -m draft_tools.train distill --model M --prompts train.txt --out corpus.ids
    python -m draft_tools.train train   --model M --corpus corpus.ids --order 4 --out drafts/d
    python -m draft_tools.train eval    --model M --draft drafts/d --answers dev.ids

`text` tokenizes a plain-text corpus (one document per line) with the target's tokenizer;
`distill` runs the target itself on a prompt file (self-distillation: the draft learns the
target's own habits; see draft_tools/distill.py); `train` runs lmplz and build_binary and writes
the draft directory (binary model, successor index, draft.json); `eval` replays held-out greedy
answers (a corpus written by `distill` on a dev prompt file) and reports tokens per round and
per-position acceptance.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from kenspec.draft_tools.progress import bar
from kenspec.draft_tools.replay import ReplayStats, replay
from kenspec.server.engine.arpa import read_arpa
from kenspec.server.engine.context_draft import LONG_DRAFT_TOKENS, ContextDraft
from kenspec.server.engine.draft import Draft
from kenspec.server.engine.kenlm_draft import DRAFT_MANIFEST, KenLMDraft, tokenizer_fingerprint
from kenspec.server.engine.params import SpeculationParams
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculative_engine import ContextSettings
from kenspec.server.engine.successors import SuccessorIndex
from kenspec.server.engine.suffix_index import SuffixIndex
from kenspec.server.settings import REPO_ROOT

MODEL_FILE = "model.bin"
INDEX_FILE = "successors.npz"


def kenlm_tool(name: str, tools_dir: str | None = None) -> Path:
    """lmplz / build_binary: --tools, $KENSPEC_TOOLS_DIR/kenlm/bin, <repo>/tools/kenlm/bin, PATH."""
    candidates = [Path(tools_dir) / name] if tools_dir else []
    if os.environ.get("KENSPEC_TOOLS_DIR"):
        candidates.append(Path(os.environ["KENSPEC_TOOLS_DIR"]) / "kenlm" / "bin" / name)
    candidates.append(REPO_ROOT / "tools" / "kenlm" / "bin" / name)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"KenLM's {name} not found; build it with `bash scripts/build_kenlm_tools.sh`"
    )


def tokenize_text(model: Path, text: Path, out: Path, progress: bool = False) -> int:
    """One line of token ids per non-empty line of text; returns the number of tokens.
    `progress`: a bar over the text's bytes on a terminal."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    count = 0
    with (
        text.open(encoding="utf-8") as source,
        out.open("w", encoding="utf-8") as sink,
        bar(text.stat().st_size, "B", enabled=progress, unit_scale=True) as shown,
    ):
        for line in source:
            shown.update(len(line.encode("utf-8")))
            if line.strip():
                ids = tokenizer(line.rstrip("\n"), add_special_tokens=False)["input_ids"]
                sink.write(" ".join(map(str, ids)) + "\n")
                count += len(ids)
    return count


def train(
    model: Path,
    corpus: Path,
    out: Path,
    *,
    order: int = 4,
    prune: Sequence[int] = (),
    memory: str = "25%",
    tools_dir: str | None = None,
    log: Path | None = None,
) -> dict:
    """lmplz -> ARPA -> build_binary (trie, unquantized: the index needs KenLM's exact floats).

    The tools' messages go to stderr, or to `log` when given."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, _messages(log) as messages:
        arpa = Path(scratch) / "model.arpa"
        command = [
            str(kenlm_tool("lmplz", tools_dir)),
            "-o",
            str(order),
            "-S",
            memory,
            "-T",
            scratch,
            "--discount_fallback",
        ]
        if prune:
            command += ["--prune", *map(str, prune)]
        with corpus.open("rb") as source, arpa.open("wb") as sink:
            subprocess.run(command, stdin=source, stdout=sink, stderr=messages, check=True)
        subprocess.run(
            [
                str(kenlm_tool("build_binary", tools_dir)),
                "-s",
                "trie",
                str(arpa),
                str(out / MODEL_FILE),
            ],
            check=True,
            stdout=subprocess.DEVNULL if log is None else messages,
            stderr=messages,
        )
        tables = read_arpa(arpa, vocab_size=len(tokenizer))
        SuccessorIndex.from_tables(tables).save(out / INDEX_FILE, tables)
    manifest = {
        "model": MODEL_FILE,
        "successors": INDEX_FILE,
        "order": order,
        "prune": list(prune),
        "vocab_size": _vocab_size(model, tokenizer),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer.get_vocab()),
        "target": str(model),
        "corpus": corpus.name,
        "corpus_lines": sum(1 for _ in corpus.open()),
        "corpus_tokens": sum(len(line.split()) for line in corpus.open()),
        "ngrams": [len(table.ids) for table in tables],
        "trained_at": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / DRAFT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _messages(log: Path | None) -> contextlib.AbstractContextManager[IO[bytes] | None]:
    return log.open("ab") if log is not None else contextlib.nullcontext()


def _vocab_size(model: Path, tokenizer) -> int:  # type: ignore[no-untyped-def]
    config = json.loads((model / "config.json").read_text())
    return int(config.get("vocab_size") or len(tokenizer))


def load_answers(model: Path, answers: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (as the target saw them: rendered by distill, or chat-rendered for a corpus
    written before it kept them) and answers of a `distill` corpus; EOS kept where it ended
    one."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    records = [json.loads(line) for line in answers.with_suffix(".jsonl").open()]
    id_lines = answers.read_text().splitlines()
    prompts, replies = [], []
    for record, line in zip(records, id_lines, strict=True):
        if record.get("prompt_ids"):
            prompts.append(record["prompt_ids"])
        else:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": record["prompt"]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        reply = [int(token) for token in line.split()]
        if record.get("stop") == "eos":
            reply.append(tokenizer.eos_token_id)
        replies.append(reply)
    return prompts, replies


def evaluate(
    model: Path,
    draft_path: Path | None,
    answers: Path,
    *,
    k: int,
    adaptive: bool,
    min_draft_prob: float,
    context: bool = False,
    min_match: int = 3,
    suffix: bool = False,
    learn: bool = False,
    recycled: bool = False,
    long_draft_tokens: int = LONG_DRAFT_TOKENS,
    tree_budget: int = 1,
) -> ReplayStats:
    """Replay held-out answers; draft_path None with context=True is prompt lookup alone.

    suffix: with context, also draft from a suffix index seeded with the draft folder's
    corpus; learn: the index learns each answer once replayed (requests in sequence);
    recycled: with context, also draft from the target's recycled predictions, recorded from a
    teacher-forced float32 pass over each prompt + answer (only the rows of accepted tokens:
    a live pass also records the rows of rejected drafts, so this slightly underestimates)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    draft: Draft | None = None
    if draft_path is not None:
        draft = KenLMDraft.load(
            draft_path,
            vocab_size=_vocab_size(model, tokenizer),
            fingerprint=tokenizer_fingerprint(tokenizer.get_vocab()),
            min_draft_prob=min_draft_prob,
            end_token_id=tokenizer.eos_token_id,
        )
    index = SuffixIndex.for_draft(draft_path)[0] if suffix else None
    prompts, replies = load_answers(model, answers)
    table, on_round = _recycler(model, prompts, replies) if recycled else (None, None)
    if context:
        max_match = max(ContextSettings().max_match, min_match)
        draft = ContextDraft(
            draft,
            min_match=min_match,
            max_match=max_match,
            suffix=index,
            recycled=table,
            long_draft_tokens=long_draft_tokens,
            branches=ContextSettings().branches if tree_budget > 1 else 0,
        )
    if draft is None:
        raise ValueError("nothing to evaluate: give a draft, or context=True")
    # Chains of k; the cap on a round's nodes lets every shape asked for through (a long
    # match's chain, a tree), as the server's default cap does its defaults.
    cap = max(k, long_draft_tokens if context else 0, tree_budget)
    params = SpeculationParams(num_draft_tokens=cap, chain_tokens=k, adaptive=adaptive)
    learner = index.add if learn and index is not None else None
    return replay(
        draft,
        prompts,
        replies,
        params,
        learn=learner,
        on_round=on_round,
        tree_budget=tree_budget,
    )


@functools.cache
def _float32_model(model: Path) -> PreTrainedModel:
    """The target in float32, loaded once per process (replays by budget reuse it)."""
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def _recycler(
    model: Path, prompts: list[list[int]], replies: list[list[int]]
) -> tuple[RecycledPredictions, Callable[[int, int, int], None]]:
    """A recycled-predictions table, and the replay callback that records into it the rows a
    live round would have read, from one teacher-forced pass per answer (computed on first use)."""
    target = _float32_model(model)
    table = RecycledPredictions(target.config.vocab_size)
    current: dict[int, torch.Tensor] = {}

    def logits_of(number: int) -> torch.Tensor:
        if number not in current:
            current.clear()
            sequence = torch.tensor([prompts[number] + replies[number]])
            with torch.inference_mode():
                current[number] = target(sequence).logits[0]
        return current[number]

    def on_round(number: int, position: int, emitted: int) -> None:
        sequence = prompts[number] + replies[number]
        first = len(prompts[number]) + position - 1  # the pending token's index
        rows = logits_of(number)
        table.record(
            sequence[first : first + emitted], [(i, rows[first + i]) for i in range(emitted)]
        )

    return table, on_round


def report(stats: ReplayStats, label: str = "", costs: Sequence[float] = ()) -> str:
    positions = " ".join(f"{p:.2f}" for p in stats.per_position)
    estimate = f" est.speedup={stats.estimated_speedup(*costs):.3f}" if costs else ""
    return (
        f"{label}answers={stats.answers} tokens={stats.tokens} rounds={stats.rounds} "
        f"speculative_rounds={stats.speculative_rounds}{estimate} "
        f"tokens/round={stats.tokens_per_round:.3f} acceptance={stats.acceptance:.3f} "
        f"per-position=[{positions}] draft={stats.microseconds_per_drafted_token:.1f}us/token"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m draft_tools.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("text", help="tokenize a text corpus into token-id sentences")
    text.add_argument("--model", type=Path, required=True)
    text.add_argument("--text", type=Path, required=True, help="one document per line")
    text.add_argument("--out", type=Path, required=True)
    commands.add_parser(
        "distill",
        help="self-distil a corpus (see python -m draft_tools.distill -h)",
        add_help=False,
    )
    fit = commands.add_parser("train", help="lmplz + build_binary + successor index")
    fit.add_argument("--model", type=Path, required=True)
    fit.add_argument("--corpus", type=Path, required=True, help="token-id sentences, one a line")
    fit.add_argument("--out", type=Path, required=True, help="draft directory to write")
    fit.add_argument("--order", type=int, default=4)
    fit.add_argument(
        "--prune",
        type=int,
        nargs="*",
        default=[],
        help="lmplz --prune thresholds per order, e.g. 0 0 1",
    )
    fit.add_argument("--memory", default="25%", help="lmplz -S")
    fit.add_argument("--tools", default=None, help="folder holding lmplz and build_binary")
    fit.add_argument(
        "--eval-answers",
        type=Path,
        default=None,
        help="a distill corpus of held-out answers to report acceptance on",
    )
    check = commands.add_parser("eval", help="held-out acceptance by replaying greedy answers")
    check.add_argument("--model", type=Path, required=True)
    check.add_argument("--draft", type=Path, required=True)
    check.add_argument("--answers", type=Path, required=True, help="corpus.ids from `distill`")
    check.add_argument("--k", type=int, default=4)
    check.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    check.add_argument("--min-draft-prob", type=float, default=0.0)
    check.add_argument("--min-match", type=int, default=1)
    check.add_argument(
        "--tree-budget",
        type=int,
        default=1,
        help="with --context, draft token trees of this many nodes (1: chains)",
    )
    check.add_argument(
        "--long-draft-tokens",
        type=int,
        default=LONG_DRAFT_TOKENS,
        help="with --context, how far a chain after a long exact match may draft (as the server)",
    )
    for flag, help_text in (
        ("--context", "combine with the request's own context (as --draft-context)"),
        (
            "--suffix",
            "with --context, also draft from a suffix index seeded with the draft's corpus",
        ),
        ("--learn", "the suffix index learns each answer once replayed (requests in sequence)"),
        ("--recycled", "with --context, also draft from the target's recycled predictions"),
    ):
        check.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=False, help=help_text
        )
    check.add_argument(
        "--cost-ms",
        type=float,
        nargs=2,
        default=(),
        metavar=("STEP", "VERIFY"),
        help="measured ms of a 1-token step and of a verify pass: estimate speedup",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["distill"]:
        from kenspec.draft_tools import distill

        return distill.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    if args.command == "text":
        count = tokenize_text(args.model, args.text, args.out)
        print(f"wrote {count} tokens to {args.out}")
    elif args.command == "train":
        manifest = train(
            args.model,
            args.corpus,
            args.out,
            order=args.order,
            prune=args.prune,
            memory=args.memory,
            tools_dir=args.tools,
        )
        print(json.dumps(manifest, indent=2))
        if args.eval_answers:
            for k, adaptive in ((4, False), (4, True)):
                stats = evaluate(
                    args.model,
                    args.out,
                    args.eval_answers,
                    k=k,
                    adaptive=adaptive,
                    min_draft_prob=0.0,
                )
                print(report(stats, f"k={k} adaptive={adaptive}: "))
    else:
        draft = None if str(args.draft).lower() == "none" else args.draft
        stats = evaluate(
            args.model,
            draft,
            args.answers,
            k=args.k,
            adaptive=args.adaptive,
            min_draft_prob=args.min_draft_prob,
            context=args.context,
            min_match=args.min_match,
            suffix=args.suffix,
            learn=args.learn,
            recycled=args.recycled,
            long_draft_tokens=args.long_draft_tokens,
            tree_budget=args.tree_budget,
        )
        print(report(stats, costs=args.cost_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
