"""llama.cpp's top-1 token at each position of the token ids top1.py wrote (the same file,
in-process through llama-cpp-python), to /tmp/top1_llama.json.

    .peers/llama/bin/python bench/results/gguf-avx2-q8-activations/top1_llama.py
"""

import json
from pathlib import Path

import numpy as np
from llama_cpp import Llama

MODEL = ".cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    ids_per_line = json.loads(Path("/tmp/top1_new.json").read_text())["ids"]
    llm = Llama(model_path=MODEL, n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
    tops = []
    for ids in ids_per_line:
        llm.reset()
        llm.eval(ids)
        tops.append(np.asarray(llm.scores[: len(ids) - 1]).argmax(-1).tolist())
    Path("/tmp/top1_llama.json").write_text(json.dumps(tops))


if __name__ == "__main__":
    main()
