"""Continuation prompts for Gemma 3 270M (a base model): the first words of paragraphs of prose.

At temperature 0 the base model loops on instructions (the sets in prompts/): it repeats the
prompt, or one line of its answer, within a few lines. It continues a passage of prose with
prose, so these prompt files are the opening words of real paragraphs, sent as raw prompts:

    opticks-train.txt  4 of every 5 paragraphs of Newton's Opticks (Project Gutenberg, public
                       domain): the draft's training prompts
    opticks-train.text the same paragraphs whole, one a line: the draft's --text and the
                       --suffix-corpus of the runs without a trained draft
    opticks-dev.txt    the 5th paragraphs, never trained on ("dev")
    opticks-grounded.txt  a 5th paragraph whole, then its first 12 words again:
                       the answer can copy from the prompt, as a grounded answer quotes its
                       source ("grounded")
    vim-ood.txt        paragraphs of the Vim user manual, usr_01..usr_12 ("ood")

The Opticks text ships inside the venv (apache-tvm-ffi's copy of libbacktrace's test data);
the Vim manual with Debian's vim. Rerun to remake the files:

    python bench/results/gemma3-270m/make_prompts.py OPTICKS.txt /usr/share/vim/vim90/doc
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "prompts"
WORDS = 40  # words of a paragraph given as the prompt
MIN_WORDS = 70  # paragraphs shorter than this are headings, captions or tables


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of prose, one line each, italics marks removed."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        words = block.replace("_", "").split()
        letters = sum(ch.isalpha() for ch in block)
        if len(words) >= MIN_WORDS and letters > 0.75 * len(block.replace(" ", "")):
            found.append(" ".join(words))
    return found


def opening(paragraph: str) -> str:
    return " ".join(paragraph.split()[:WORDS])


def main(opticks: Path, vim_doc: Path) -> int:
    text = opticks.read_text(encoding="utf-8")
    body = text[text.index("OPTICKS") :]
    book = paragraphs(body)
    train = [p for i, p in enumerate(book) if i % 5 != 4]
    dev = [p for i, p in enumerate(book) if i % 5 == 4]
    manual = []
    for number in range(1, 13):
        manual += paragraphs((vim_doc / f"usr_{number:02d}.txt").read_text(encoding="utf-8"))
    HERE.mkdir(exist_ok=True)
    files = {
        "opticks-train.txt": [opening(p) for p in train],
        "opticks-train.text": train,
        "opticks-dev.txt": [opening(p) for p in dev],
        "opticks-grounded.txt": [f"{p} {' '.join(p.split()[:12])}" for p in dev],
        "vim-ood.txt": [opening(p) for p in manual],
    }
    for name, lines in files.items():
        (HERE / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"{name}: {len(lines)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
