"""`python -m bench.invariance`: where a token's numbers start to depend on its pass.

The same positions of one sequence are computed through the engine's own passes in several
layouts, and every layer's output at those positions is compared bit for bit:

- steps: one token per pass, as plain decoding runs;
- wide: all of them in one pass, as a verification of a draft does;
- batched: the wide pass beside other sequences' rows, as continuous batching runs it;
- chunked: the prompt prefilled in chunks of 3 tokens instead of one pass;
- tree: all of them in one pass as one branch of a token tree, each beside a sibling that is
  not on it, so the branch's tokens sit at every other cache slot (as a verified tree's
  accepted path often does); in the pass's last row, after the other sequences' rows.

Prints, per layout against `steps`, each module whose output differs (how many positions, the
largest difference) in forward order, then whether the next-token logits and their argmax
agree. With --batch-invariant, the engine's batch-invariant kernels are switched on first.

    python -m bench.invariance --dtype bfloat16
    python -m bench.invariance --dtype bfloat16 --batch-invariant
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kenspec.server.engine.forward.plan import ExecutionOptions
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import PassRow, VerifyPass
from kenspec.server.settings import DEFAULT_MODEL

PROMPT = "Explain in two sentences why the sky is blue."
LAYOUTS = ("wide", "batched", "chunked", "tree")  # each compared with "steps"
OTHERS = ("Write a haiku about autumn leaves.", "List three prime numbers and say why.")


@dataclass
class Capture:
    """Module outputs of the passes run while it is installed: name -> one tensor per pass."""

    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def install(self, model: torch.nn.Module) -> list:
        handles = []
        for name, module in model.named_modules():
            if not _interesting(name):
                continue
            self.order.append(name)

            def hook(module, args, output, name=name):  # type: ignore[no-untyped-def]
                tensor = output[0] if isinstance(output, tuple) else output
                if isinstance(tensor, torch.Tensor):
                    flat = tensor.detach().reshape(-1, tensor.shape[-1]).clone()
                    self.outputs.setdefault(name, []).append(flat)

            handles.append(module.register_forward_hook(hook))
        return handles


def _interesting(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in {
        "embed_tokens",
        "input_layernorm",
        "self_attn",
        "post_attention_layernorm",
        "mlp",
        "norm",
        "lm_head",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def run_layout(
    target: TargetModel,
    prompt: Sequence[int],
    tokens: Sequence[int],
    layout: str,
    others: Sequence[Sequence[int]],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Module outputs at the positions of `tokens` ([positions, features] per module) and
    their next-token logits, computed in `layout`."""
    batched = others if layout in ("batched", "tree") else []
    cache = target.new_cache(1 + len(batched))
    # The sequence's row: the first, but a tree goes last (its keys and queries at a row > 0).
    main = len(batched) if layout == "tree" else 0
    rows = [row for row in range(1 + len(batched)) if row != main]
    capture = Capture()
    if layout == "chunked":
        for start in range(0, len(prompt), 3):
            target.prefill(cache, main, start, prompt[start : start + 3])
    else:
        target.prefill(cache, main, 0, prompt)
    for row, other in zip(rows, batched, strict=True):
        target.prefill(cache, row, 0, other)
    handles = capture.install(target.model)
    logits = []
    try:
        if layout in ("steps", "chunked"):
            for offset, token in enumerate(tokens):
                passed = VerifyPass.sequences([len(prompt) + offset], [[token]])
                (row_logits,) = target.forward(cache, passed)
                logits.append(row_logits[0])
            per_pass = [[0]] * len(tokens)
        elif layout == "tree":  # the other sequences first, three tokens each
            nodes, parents = tree_with_siblings(tokens, target.vocab_size)
            # The tree's root is the row's first token; its other nodes, drafts under it.
            tree = PassRow(
                len(prompt), nodes[0], tuple(nodes[1:]), tuple(p - 1 for p in parents[1:])
            )
            others = [PassRow.sequence(len(o), [o[-1]] * 3) for o in batched]
            *_, row_logits = target.forward(cache, VerifyPass((*others, tree)))
            on_branch = list(range(0, len(nodes), 2))
            logits = [row_logits[i] for i in on_branch]
            per_pass = [[3 * len(batched) + i for i in on_branch]]
        else:
            lengths = [len(prompt)] + [len(o) for o in batched]
            token_rows = [list(tokens)] + [[o[-1]] * 3 for o in batched]
            row_logits = target.forward(cache, VerifyPass.sequences(lengths, token_rows))
            logits = [row_logits[0][i] for i in range(len(tokens))]
            per_pass = [list(range(len(tokens)))]
    finally:
        for handle in handles:
            handle.remove()
    outputs = {}
    for name in capture.order:
        passes = capture.outputs.get(name, [])
        if len(passes) != len(per_pass):
            continue  # not run per pass (e.g. the output layer, applied lazily)
        outputs[name] = torch.cat([out[i] for out, i in zip(passes, per_pass, strict=True)])
    return outputs, torch.stack([row.float() for row in logits])


def tree_with_siblings(tokens: Sequence[int], vocab: int) -> tuple[list[int], list[int]]:
    """A token tree whose branch is `tokens` (at nodes 0, 2, 4, ...), each token after the
    first beside a sibling that is not on it (at nodes 1, 3, ...): (nodes, parents)."""
    nodes, parents = [tokens[0]], [-1]
    for token in tokens[1:]:
        parent = len(nodes) - 1
        nodes += [(token + 1) % vocab, token]
        parents += [parent, parent]
    return nodes, parents


def compare(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> list[str]:
    lines = []
    for name, expected in reference.items():
        got = other.get(name)
        if got is None or got.shape != expected.shape:
            continue
        differing = (got != expected).any(-1)
        if differing.any():
            largest = (got.float() - expected.float()).abs().max().item()
            lines.append(
                f"    {name}: {int(differing.sum())}/{len(differing)} positions, max |diff| "
                f"{largest:.3g}"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=8, help="positions compared")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--prompt-words", type=int, default=0, help="lengthen the prompt by this many words"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    execution = ExecutionOptions(batch_invariant=args.batch_invariant)
    target = TargetModel.load(args.model, device="cpu", dtype=args.dtype, execution=execution)
    if target.plan.invariance is not None:
        print("padding:", target.plan.invariance.padding)
    filler = " ".join(f"word{i}" for i in range(args.prompt_words))
    prompt = target.encode_chat([{"role": "user", "content": f"{filler} {PROMPT}".strip()}])
    others = [target.encode_chat([{"role": "user", "content": o}]) for o in OTHERS]
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, prompt[:-1])
    tokens, last = [], prompt[-1]
    for offset in range(args.tokens):  # the greedy continuation, one token a pass
        (row,) = target.forward(cache, VerifyPass.sequences([len(prompt) - 1 + offset], [[last]]))
        last = int(row[0].argmax())
        tokens.append(last)
    reference, reference_logits = run_layout(target, prompt, tokens, "steps", others)
    print(f"model {target.name}, {target.dtype}, batch_invariant={args.batch_invariant}")
    for layout in LAYOUTS:
        outputs, logits = run_layout(target, prompt, tokens, layout, others)
        lines = compare(reference, outputs)
        same_logits = torch.equal(logits, reference_logits)
        same_argmax = torch.equal(logits.argmax(-1), reference_logits.argmax(-1))
        print(
            f"{layout} vs steps: {len(lines)} modules differ; logits identical: {same_logits}; "
            f"argmax identical: {same_argmax}"
        )
        for line in lines[:12]:
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
