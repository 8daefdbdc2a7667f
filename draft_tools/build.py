"""One command from a model to a draft: distil, fit and check a KenLM draft.

    python -m draft_tools build --model MODEL_DIR --prompts prompts.txt --out drafts/mymodel
    python -m draft_tools build --model model.gguf --prompts prompts.txt --out drafts/mymodel

Stages, each skipped on a rerun that finds it done with the same inputs (OUT/work/stages.json):

    model    a GGUF --model (a file, or a folder holding one): dequantized to float32 and kept
             under --gguf-cache, as the server keeps it (a rerun, and the server, read it at once)
    tools    find lmplz and build_binary (--tools, tools/kenlm/bin, PATH), or build them once
    split    hold out --heldout of the distinct prompts for the check, by a hash of their text
    distill  the target's greedy answers to the training prompts (resumes mid-way)
    heldout  ... and to the held-out prompts
    text     --text tokenized by the target's tokenizer, one document a line
    fit      lmplz + build_binary + successor index: OUT/model.bin, successors.npz, draft.json,
             and corpus.ids.gz (the corpus, which seeds the server's suffix index)
    check    replay the held-out answers: acceptance and tokens per round, as a greedy server
             would get them (exact at temperature 0, without running the target)

Prompts are rendered with the model's chat template (or --chat-template FILE), as the server
renders a chat request; a model without one (a base model) is given them as raw prompts. The
summary ends with the time each stage took; long stages draw a progress bar with an ETA on a
terminal (--quiet: none).

The folder OUT is what `kenspec serve --draft OUT` loads; OUT/work holds what a rerun
resumes from and is not needed to serve.

    python -m draft_tools build --kind head --model MODEL_DIR --prompts prompts.txt --out OUT

trains a learned head beside the n-gram from the same answers (OUT/corpus.ids.gz; see
`python -m draft_tools head -h`); the server drafts from both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kenspec.draft_tools import distill
from kenspec.draft_tools.kenlm_tools import ToolsError
from kenspec.draft_tools.stages import BuildError, gguf_model, read_prompt_lines, run
from kenspec.server.engine.gguf_model import DEFAULT_GGUF_CACHE
from kenspec.server.logs import configure_logging


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse bad inputs before any stage runs (a typo should not cost a distillation)."""
    model: Path = args.model
    if gguf_model(model) is None:
        if not model.is_dir():
            raise BuildError(f"--model {model}: no such file or folder")
        if not (model / "config.json").is_file():
            raise BuildError(
                f"--model {model} is not a model folder (it has no config.json) and holds no "
                "GGUF file"
            )
    if args.chat_template and not args.chat_template.is_file():
        raise BuildError(f"--chat-template {args.chat_template}: no such file")
    if args.out.exists() and not args.out.is_dir():
        raise BuildError(f"--out {args.out} is a file; give a folder for the draft")
    if args.text and not _has_text(args.text, "--text"):
        raise BuildError(f"--text {args.text} holds no text (blank lines are skipped)")
    for flag, path in (("--prompts", args.prompts), ("--heldout-prompts", args.heldout_prompts)):
        if path and not _has_text(path, flag):
            raise BuildError(f"{flag} {path} holds no prompts (one a line; blank lines skipped)")
    splits = args.prompts and args.heldout > 0 and not args.heldout_prompts
    if splits and len(set(read_prompt_lines(args.prompts, "--prompts"))) < 2:
        raise BuildError(
            f"--prompts {args.prompts} needs 2 distinct prompts or more to hold some out "
            "for the check; add prompts, or pass --heldout 0 to skip the check"
        )


def _has_text(path: Path, flag: str) -> bool:
    """Whether a UTF-8 text file has a non-blank line; read as a stream (corpora are big)."""
    if not path.is_file():
        raise BuildError(f"{flag} {path}: no such file")
    found = False
    try:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                found = found or bool(line.strip())
    except UnicodeDecodeError as error:
        raise BuildError(f"{flag} {path} is not UTF-8 text ({error.reason})") from error
    return found


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m draft_tools build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="the target: a Hugging Face folder, or a GGUF file (or a folder holding one)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the draft folder to write")
    parser.add_argument(
        "--gguf-cache",
        type=Path,
        default=Path(DEFAULT_GGUF_CACHE),
        help=f"where a GGUF --model is kept dequantized, as the server does ({DEFAULT_GGUF_CACHE})",
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        help="a Jinja chat template file to render the prompts with (as the server's flag)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars (none when stderr is no terminal)"
    )
    data = parser.add_argument_group("what to learn from (one or both)")
    data.add_argument("--prompts", type=Path, help="prompts of your workload, one a line")
    data.add_argument("--text", type=Path, help="plain text, one document a line")
    check = parser.add_argument_group("held-out check")
    check.add_argument(
        "--heldout",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="share of the distinct prompts held out to check the draft (0: no check)",
    )
    check.add_argument(
        "--heldout-prompts",
        type=Path,
        help="check on these prompts instead; train on all --prompts",
    )
    target = parser.add_argument_group("distillation")
    target.add_argument(
        "--max-new-tokens", type=int, default=256, help="longest answer to a prompt (256)"
    )
    target.add_argument(
        "--batch-size", type=int, default=16, help="answers a pass of the engine (16)"
    )
    target.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    target.add_argument("--dtype", default="float32", choices=distill.DTYPES)
    target.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    fit = parser.add_argument_group("n-gram")
    fit.add_argument("--order", type=int, default=4, help="n-gram order, 2..6 (4)")
    fit.add_argument("--prune", type=int, nargs="*", default=[], help="lmplz --prune per order")
    fit.add_argument(
        "--memory", default="25%", help="lmplz -S, its sorting memory: 25%% (default), 1G"
    )
    fit.add_argument("--tools", help="folder holding lmplz and build_binary")
    args = parser.parse_args(argv)
    if not (args.prompts or args.text):
        parser.error("give --prompts (distilled by the target), --text, or both")
    if not 0 <= args.heldout < 1:
        parser.error("--heldout must be in [0, 1)")
    if not 2 <= args.order <= 6:
        parser.error("--order must be in 2..6 (KenLM's tools are built for up to 6)")
    for flag in ("max_new_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    kind, rest = _kind(list(sys.argv[1:] if argv is None else argv))
    if kind not in ("kenlm", "head"):
        print(f"error: --kind must be kenlm or head, not {kind!r}", file=sys.stderr)
        return 2
    if kind == "head":  # the learned head, beside the draft in --out (draft_tools.head)
        from kenspec.draft_tools import head

        renamed = ["--draft" if word == "--out" else word for word in rest]
        return head.main([f"--draft={w[6:]}" if w.startswith("--out=") else w for w in renamed])
    args = parse_args(rest)
    configure_logging(level="warning")  # the engine's warnings on stderr; stdout: the summary
    try:
        check_inputs(args)
        report = run(args)
    except (BuildError, ToolsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(report)
    return 0


def _kind(argv: list[str]) -> tuple[str, list[str]]:
    """`--kind kenlm|head` (kenlm: the n-gram draft, the default) and the other arguments."""
    for index, word in enumerate(argv):
        if word == "--kind" and index + 1 < len(argv):
            return argv[index + 1], argv[:index] + argv[index + 2 :]
        if word.startswith("--kind="):
            return word.partition("=")[2], argv[:index] + argv[index + 1 :]
    return "kenlm", argv


if __name__ == "__main__":
    sys.exit(main())
