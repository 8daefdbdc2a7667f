"""python -m draft_tools build|head|distill|train ...: the draft tools behind one entry point.

    python -m draft_tools build --model MODEL_DIR --prompts prompts.txt --out drafts/mymodel
    python -m draft_tools head --model MODEL_DIR --prompts prompts.txt --draft drafts/mymodel

`build` runs everything for a KenLM draft (see python -m draft_tools build -h); `head` trains
a learned head beside it from the same answers (draft_tools.head); `distill` and `train` are
the single steps of draft_tools.distill and draft_tools.train.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "build":
        from kenspec.draft_tools import build

        return build.main(rest)
    if command == "distill":
        from kenspec.draft_tools import distill

        return distill.main(rest)
    if command == "head":
        from kenspec.draft_tools import head

        return head.main(rest)
    if command == "train":
        from kenspec.draft_tools import train

        return train.main(rest)
    print(__doc__.strip(), file=sys.stderr)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
