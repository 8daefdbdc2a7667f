"""`python -m bench.context`: cost as the context grows, through gRPC, beside transformers.

For each prompt length (tokens of the chat prompt, about 150 to 6,500), a document cut to fit
(docs/design.md by default) follows an instruction to summarise it. One `kenspec serve`
serves, per length:
1. speculation on (AUTO), cold: time to first token (TTFT, the whole prompt prefilled) and
   decode tokens/s (tokens after the first over the time after the first);
2. speculation OFF, warm (the prompt is in the prefix cache if it fits): TTFT and decode tok/s;
3. OFF again: TTFT warm (the second look, for noise).
Then, with the server stopped, the model through transformers as shipped, greedy `generate`
of the same ids: TTFT (one new token) and decode tok/s ((n - 1) tokens over generate(n) -
generate(1)).

The memory-bound limit per length: bytes a decode step reads (every parameter, and the keys
and values of the context) over the bandwidth the shortest length's measured OFF step implies
(its bytes over its seconds per token): what the step would cost if it were bound by memory
traffic alone. A plot of decode tok/s against context goes beside the JSON (--plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient

INSTRUCTION = "Summarise the following document in a few sentences.\n\n"


def build_prompts(tokenizer, document: str, lengths: Sequence[int]) -> dict[int, str]:
    """{length: user message} whose chat prompt is about `length` tokens."""
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    overhead = len(_chat_ids(tokenizer, INSTRUCTION))
    prompts = {}
    for length in lengths:
        keep = max(1, length - overhead)
        if keep > len(doc_ids):
            raise ValueError(f"the document has {len(doc_ids)} tokens, fewer than {keep}")
        prompts[length] = INSTRUCTION + tokenizer.decode(doc_ids[:keep])
    return prompts


def _chat_ids(tokenizer, message: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def _timed(client: AsyncClient, prompt: str, new_tokens: int, speculation: str) -> dict:
    started = time.perf_counter()
    first = None
    tokens = rounds = 0
    async for round_ in client.generate(
        messages=[("user", prompt)],
        max_new_tokens=new_tokens,
        speculation=speculation,
        ignore_eos=True,
        timeout=1200,
    ):
        now = time.perf_counter()
        if first is None:
            first, first_tokens = now, len(round_.token_ids)
        tokens += len(round_.token_ids)
        rounds += 1
        last = now
    decode_tokens = tokens - first_tokens
    return {
        "ttft_s": first - started,
        "tokens": tokens,
        "rounds": rounds,
        "decode_tok_s": decode_tokens / (last - first) if last > first else None,
    }


async def serve(address: str, prompts: dict[int, str], new_tokens: int) -> dict[int, dict]:
    results = {}
    async with AsyncClient(address) as client:
        await _timed(client, "Hello", 4, "off")  # first-call overheads
        for length, prompt in prompts.items():
            results[length] = {
                "auto_cold": await _timed(client, prompt, new_tokens, "auto"),
                "off_warm": await _timed(client, prompt, new_tokens, "off"),
                "off_warm_again": await _timed(client, prompt, new_tokens, "off"),
            }
            print(f"[context] {length}: {json.dumps(_brief(results[length]))}", file=sys.stderr)
    return results


def run_transformers(model: str, prompts: dict[int, str], new_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)

    def generate(ids: torch.Tensor, n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        return time.perf_counter() - started

    generate(torch.tensor([_chat_ids(tokenizer, "Hello")]), 4)  # warm-up
    results = {}
    for length, prompt in prompts.items():
        ids = torch.tensor([_chat_ids(tokenizer, prompt)])
        ttft = statistics.median(generate(ids, 1) for _ in range(2))
        whole = generate(ids, new_tokens)
        results[length] = {
            "prompt_tokens": int(ids.shape[1]),
            "ttft_s": ttft,
            "decode_tok_s": (new_tokens - 1) / max(1e-9, whole - ttft),
        }
        print(f"[context] transformers {length}: {json.dumps(results[length])}", file=sys.stderr)
    return results


def memory_bound(
    config: dict,
    parameters: int,
    bytes_per_value: int,
    lengths: Sequence[int],
    reference_length: int,
    reference_tok_s: float,
) -> dict[int, float]:
    """{length: tok/s} if a step cost only its memory traffic, at the bandwidth the reference
    length's measured rate implies."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_position = 2 * config["num_hidden_layers"] * kv_heads * head_dim * bytes_per_value

    def step_bytes(length: int) -> int:
        return parameters * bytes_per_value + per_position * length

    bandwidth = step_bytes(reference_length) * reference_tok_s
    return {length: bandwidth / step_bytes(length) for length in lengths}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(int(n) for n in result["served"])
    served = result["served"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(
        lengths,
        [served[str(n)]["off_warm"]["decode_tok_s"] for n in lengths],
        "o-",
        label="kenspec, speculation OFF",
    )
    ax.plot(
        lengths,
        [served[str(n)]["auto_cold"]["decode_tok_s"] for n in lengths],
        "s-",
        label="kenspec, AUTO",
    )
    hf = result.get("transformers") or {}
    if hf:
        ax.plot(
            lengths,
            [hf[str(n)]["decode_tok_s"] for n in lengths],
            "^--",
            label="transformers generate",
        )
    bound = result["memory_bound_tok_s"]
    ax.plot(
        lengths, [bound[str(n)] for n in lengths], ":", color="gray", label="memory-bound limit"
    )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode tokens/s")
    model = Path(result["model"]).name
    ax.set_title(f"{model} ({result['dtype']}), {result['machine'].get('cpu', '')}"[:90])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _brief(runs: dict) -> dict:
    return {
        kind: {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}
        for kind, run in runs.items()
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.context", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[150, 1000, 2000, 4000, 6500])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--document", type=Path, default=REPO / "docs" / "design.md")
    parser.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--plot", type=Path, help="PNG of decode tok/s against context")
    parser.add_argument("server_args", nargs="*", help="after --: flags for the server")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = build_prompts(tokenizer, args.document.read_text(), args.lengths)
    server = ServerProcess(["--model", args.model, *args.server_args])
    try:
        loaded = server.logged("model_loaded") or {}
        served = asyncio.run(serve(server.address, prompts, args.new_tokens))
        events = {
            name: server.logged(name) for name in ("calibrated", "attention_kernels", "ready")
        }
    finally:
        server.stop()
    dtype = loaded.get("dtype", "float32")
    config = AutoConfig.from_pretrained(args.model).to_dict()
    result: dict = {
        "machine": machine(),
        "model": args.model,
        "dtype": dtype,
        "args": {k: str(v) for k, v in vars(args).items()},
        "server_events": events,
        "served": served,
    }
    if not args.no_transformers:
        result["transformers"] = run_transformers(args.model, prompts, args.new_tokens, dtype)
    from transformers import AutoModelForCausalLM

    parameters = sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(args.model).parameters()
    )
    shortest = min(args.lengths)
    result["memory_bound_tok_s"] = memory_bound(
        config,
        parameters,
        2 if dtype in ("bfloat16", "float16") else 4,
        args.lengths,
        shortest,
        served[shortest]["off_warm"]["decode_tok_s"],
    )
    result = json.loads(json.dumps(result))  # int keys as JSON has them, for plot()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    table = []
    for length in args.lengths:
        row = served[length] if length in served else result["served"][str(length)]
        hf = (result.get("transformers") or {}).get(str(length), {})
        table.append(
            {
                "prompt_tokens": length,
                "ttft_cold_s": round(row["auto_cold"]["ttft_s"], 3),
                "ttft_warm_s": round(row["off_warm_again"]["ttft_s"], 3),
                "off_tok_s": round(row["off_warm"]["decode_tok_s"], 1),
                "auto_tok_s": round(row["auto_cold"]["decode_tok_s"], 1),
                "hf_tok_s": round(hf["decode_tok_s"], 1) if hf else None,
                "hf_ttft_s": round(hf["ttft_s"], 3) if hf else None,
                "memory_bound_tok_s": round(result["memory_bound_tok_s"][str(length)], 1),
            }
        )
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
