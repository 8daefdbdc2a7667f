"""llama.cpp's side of `bench.peers`, run by the interpreter of a venv holding llama-cpp-python.

Standard library and llama_cpp only: this file is executed by the peer's own Python, never
imported by kenspec. It reads one JSON job on stdin ({"model", "prompts", "max_tokens",
"threads", "lookup", "raw"}) and writes one JSON line per prompt: time to first token and the
decode rate of a greedy chat completion through the GGUF file's own chat template (with "raw":
a completion of the prompt as it is), the context reset
between prompts (so no prompt reuses the previous one's cache). With "lookup" > 0, llama.cpp's
prompt-lookup decoding drafts that many tokens (LlamaPromptLookupDecoding).
With "quantize_bf16": write a BF16 copy of "model" there (same values) and exit.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.load(sys.stdin)
    import llama_cpp

    if job.get("quantize_bf16"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
        params.allow_requantize = True
        code = llama_cpp.llama_model_quantize(
            job["model"].encode(), job["quantize_bf16"].encode(), params
        )
        print(json.dumps({"quantized": job["quantize_bf16"], "code": code}), flush=True)
        return 0 if code == 0 else 1
    draft = None
    if job.get("lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=job["lookup"])
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=4096,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
        draft_model=draft,
    )
    for prompt in job["prompts"]:
        llm.reset()
        started = time.perf_counter()
        first = last = None
        pieces = 0
        if job.get("raw"):  # the prompt completed as it is
            chunks = llm.create_completion(
                prompt, max_tokens=job["max_tokens"], temperature=0.0, stream=True
            )
        else:
            chunks = llm.create_chat_completion(
                [{"role": "user", "content": prompt}],
                max_tokens=job["max_tokens"],
                temperature=0.0,
                stream=True,
            )
        for chunk in chunks:
            choice = chunk["choices"][0]
            if choice.get("text") or choice.get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                pieces += 1
        tokens = llm.n_tokens  # prompt + completion now in the context
        completion = pieces  # one streamed piece per generated token
        print(
            json.dumps(
                {
                    "ttft_s": (first or started) - started,
                    "completion_tokens": completion,
                    "decode_tok_s": (completion - 1) / (last - first)
                    if first and last and last > first
                    else None,
                    "context_tokens": tokens,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
