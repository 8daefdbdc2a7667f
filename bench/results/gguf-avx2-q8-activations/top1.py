"""Each position's top-1 token of the evaluation lines, through kenspec's float32 dequantized
file (fp32) and its served file (gguf), with each line's token ids: the input of top1_llama.py.

    TAG=new .venv/bin/python bench/results/gguf-avx2-q8-activations/top1.py  # /tmp/top1_new.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.perplexity import TEXTS, load, score

MODEL = ".cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    lines = [line for text in TEXTS for line in text.read_text().splitlines() if line.strip()]
    out: dict[str, list] = {}
    for mode in ("fp32", "gguf"):
        target = load(MODEL, mode)
        out["ids"], out[mode] = [], []
        for line in lines:
            ids = target.encode_prompt(line)
            if len(ids) >= 2:
                out["ids"].append(ids)
                out[mode].append(score(target, ids)[1])
    Path(f"/tmp/top1_{os.environ['TAG']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
