"""Train a learned draft head (server.engine.draft_head) from the target's own answers.

    python -m draft_tools head --model models/smollm2-135m-instruct \\
        --draft drafts/smollm2-135m --prompts prompts/train.txt

The draft folder's `corpus.ids.gz` holds the target's greedy answers to --prompts, one a
line in the prompts' order (what `draft_tools build` distils); the head learns from the
target's hidden states over them. Stages, each kept in DRAFT/work/head/ so a rerun resumes:

    features  the target's final hidden states over every prompt + answer (one forward each)
    train     the head, epoch by epoch (a checkpoint after each): cross-entropy of the next
              token over the reduced vocabulary and a regression on the target's next hidden
              state, over `--rollout` steps that feed the head its own features, as it drafts
    check     replay of the held-out answers (a hash split of the prompts): the head's chain
              alone, as a greedy server would verify it, tokens a round and acceptance by depth
    save      DRAFT/head.safetensors and head.json (the target's fingerprint, the check)

It runs on the CPU (the target too: the head serves beside a CPU target); the default model's
head took 17 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from kenspec.draft_tools.distill import read_prompts, render_prompt
from kenspec.server.engine.draft_head import (
    DraftHead,
    HeadNet,
    input_embedding,
    output_rows,
    reduced_vocabulary,
    save_head,
    target_fingerprint,
)

WORK = Path("work") / "head"


class HeadBuildError(RuntimeError):
    """Inputs the head cannot be trained from (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class Example:
    """One answer: ids[j] is the token at the j-th position from the prompt's last token,
    features[j] the target's final hidden state there (which chose ids[j + 1])."""

    ids: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, hidden] bf16


def heldout(prompt: str, fraction: float) -> bool:
    """Whether a prompt is held out for the check: a stable hash of its text."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


def read_answers(draft: Path) -> list[list[int]]:
    corpus = draft / "corpus.ids.gz"
    if not corpus.is_file():
        raise HeadBuildError(
            f"{corpus} not found: the head learns from the target's answers that "
            "`python -m draft_tools build` writes there"
        )
    with gzip.open(corpus, "rt") as lines:
        return [[int(word) for word in line.split()] for line in lines]


def extract(
    model: Any, tokenizer: Any, prompts: Sequence[str], answers: Sequence[Sequence[int]],
    *, batch: int = 8, say: Any = print,
) -> list[Example]:  # fmt: skip
    """The target's final hidden states over each prompt + answer, from the prompt's last
    token on (sequences of similar length batched, right-padded)."""
    rendered = [render_prompt(tokenizer, prompt) for prompt in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(rendered[i]) + len(answers[i]))
    examples: dict[int, Example] = {}
    started = time.perf_counter()
    with torch.inference_mode():
        for at in range(0, len(order), batch):
            chosen = order[at : at + batch]
            seqs = [rendered[i] + list(answers[i]) for i in chosen]
            width = max(len(seq) for seq in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, seq in enumerate(seqs):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(chosen):
                start, end = len(rendered[i]) - 1, len(seqs[row])
                examples[i] = Example(
                    ids[row, start:end].clone(), hidden[row, start:end].to(torch.bfloat16).clone()
                )
            if at // batch % 25 == 0:
                seconds = time.perf_counter() - started
                say(f"features: {at + len(chosen)}/{len(order)} ({seconds:.0f} s)")
    return [examples[i] for i in range(len(prompts))]


def _windows(examples: Sequence[Example], rollout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position with `rollout` steps after it: features [N, rollout + 1, hidden] and
    tokens [N, rollout + 2]."""
    features, tokens = [], []
    for example in examples:
        count = len(example.ids) - 1 - rollout
        if count <= 0:
            continue
        index = torch.arange(count)
        features.append(torch.stack([example.features[index + r] for r in range(rollout + 1)], 1))
        tokens.append(torch.stack([example.ids[index + r] for r in range(rollout + 2)], 1))
    if not features:
        raise HeadBuildError(f"no answer is longer than {rollout + 2} tokens to learn from")
    return torch.cat(features), torch.cat(tokens)


def losses(
    net: HeadNet,
    embed: torch.Tensor,
    rows: torch.Tensor,
    remap: torch.Tensor,
    features: torch.Tensor,
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The rollout's loss and each step's hits: step r feeds the head its own feature (the
    target's at step 0) and the true token, and is scored on the token after and on the
    target's next hidden state."""
    feature = features[:, 0].float()
    total = torch.zeros(())
    hits = []
    for step in range(features.shape[1] - 1):
        feature = net(feature, embed[tokens[:, step + 1]].float())
        logits = feature @ rows.t()
        wanted = remap[tokens[:, step + 2]]
        ce = functional.cross_entropy(logits, wanted, ignore_index=-1)
        regression = functional.smooth_l1_loss(feature, features[:, step + 1].float())
        total = total + (ce + 5.0 * regression) * 0.8**step
        hits.append(logits.argmax(-1) == wanted)
    return total, hits


def train(
    net: HeadNet,
    model: Any,
    keep: torch.Tensor,
    examples: Sequence[Example],
    *,
    epochs: int = 4,
    batch: int = 512,
    rollout: int = 3,
    lr: float = 1e-3,
    checkpoint: Path | None = None,
    seed: int = 0,
    say: Any = print,
    key: str = "",
) -> list[float]:
    """Train `net` in place; each epoch's mean loss. With a checkpoint, an interrupted run
    resumes after its last finished epoch (a checkpoint of another `key`, other settings or
    data, is not resumed)."""
    generator = torch.Generator().manual_seed(seed)
    embed = input_embedding(model)
    rows = output_rows(model, keep)
    remap = torch.full((embed.shape[0],), -1, dtype=torch.long)
    remap[keep] = torch.arange(len(keep))
    features, tokens = _windows(examples, rollout)
    steps_per_epoch = max(1, len(features) // batch)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.05
    )
    done, history = 0, []
    state = (
        torch.load(checkpoint, weights_only=False) if checkpoint and checkpoint.is_file() else None
    )
    if state is not None and state.get("key") != key:
        say("train: the checkpoint was made with other settings; starting over")
        state = None
    if state is not None:
        net.load_state_dict(state["net"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        done, history = state["epoch"], state["history"]
        say(f"train: resumed after epoch {done}")
    net.train()
    for epoch in range(done, epochs):
        started, total = time.perf_counter(), 0.0
        for _ in range(steps_per_epoch):
            picked = torch.randint(0, len(features), (batch,), generator=generator)
            loss, _ = losses(net, embed, rows, remap, features[picked], tokens[picked])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach())
        history.append(total / steps_per_epoch)
        say(f"train: epoch {epoch + 1}/{epochs} loss {history[-1]:.3f} "
            f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
        if checkpoint is not None:
            state = {
                "net": net.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "generator": generator.get_state(),
                "epoch": epoch + 1, "history": history, "key": key,
            }  # fmt: skip
            torch.save(state, checkpoint)
    net.eval()
    return history


def check(head: DraftHead, examples: Sequence[Example], k: int = 6) -> dict[str, Any]:
    """Replay held-out answers as a greedy server verifies the head's chain alone: each round
    drafts from the hidden state that chose the last token, accepts the matching prefix and
    emits one token of the target's."""
    k = min(k, head.max_tokens)
    rounds = tokens = 0
    drafted_at, accepted_at = [0] * k, [0] * k
    for example in examples:
        ids = example.ids.tolist()
        at = 0  # ids[at + 1] is the pending token; features[at] chose it
        while at + 1 < len(ids):
            chain = head.chain(example.features[at], ids[at + 1], k).tokens
            accepted = 0
            for depth, token in enumerate(chain):
                drafted_at[depth] += 1
                if at + 2 + depth >= len(ids) or ids[at + 2 + depth] != token:
                    break
                accepted_at[depth] += 1
                accepted += 1
            step = min(accepted + 1, len(ids) - 1 - at)
            rounds += 1
            tokens += step
            at += step
    return {
        "answers": len(examples),
        "tokens": tokens,
        "tokens_per_round": round(tokens / rounds, 4) if rounds else 0.0,
        "acceptance_by_depth": [
            round(a / d, 4) if d else 0.0 for a, d in zip(accepted_at, drafted_at, strict=True)
        ],
        "k": k,
    }


def build(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    """Every stage (see the module doc); the manifest written."""
    from kenspec.server.engine.forward.cpu_kernels import load_kernels
    from kenspec.server.engine.target import TargetModel

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [prompt for _, prompt in read_prompts(args.prompts)]
    answers = read_answers(args.draft)
    if len(prompts) != len(answers):
        raise HeadBuildError(
            f"--prompts {args.prompts} has {len(prompts)} prompts but {args.draft}/corpus.ids.gz "
            f"{len(answers)} answers: give the prompts the draft was distilled from, in order"
        )
    work = args.draft / WORK
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    target = TargetModel.load(args.model, device="cpu", dtype=args.dtype)
    model = target.model
    cached, fingerprint = work / "features.pt", target_fingerprint(model)
    data = _digest(prompts, answers)  # a rebuilt corpus or edited prompts: features anew
    stored = torch.load(cached) if cached.is_file() else None
    if stored is not None and (stored.get("target"), stored.get("data")) == (fingerprint, data):
        examples = [Example(ids, feats) for ids, feats in stored["examples"]]
        say(f"features: reused {cached}")
    else:
        examples = extract(model, target.tokenizer, prompts, answers, say=say)
        pairs = [(e.ids, e.features) for e in examples]
        torch.save({"target": fingerprint, "data": data, "examples": pairs}, cached)
    held = [heldout(prompt, args.heldout) for prompt in prompts]
    training = [e for e, h in zip(examples, held, strict=True) if not h]
    checking = [e for e, h in zip(examples, held, strict=True) if h]
    keep, covered = reduced_vocabulary(
        [a for a, h in zip(answers, held, strict=True) if not h], args.vocabulary
    )
    hidden = int(model.config.hidden_size)
    net = HeadNet(hidden, args.inner, float(getattr(model.config, "rms_norm_eps", 1e-5)))
    history = train(
        net, model, keep, training, epochs=args.epochs, rollout=args.rollout, batch=args.batch,
        checkpoint=work / "checkpoint.pt", seed=args.seed, say=say,
        key=repr((fingerprint, data, args.vocabulary, args.inner, args.epochs, args.rollout,
                  args.batch, args.seed, args.heldout)),
    )  # fmt: skip
    # (checked as the server drafts: through kenspec's bf16 GEMV where this CPU runs it)
    rows = output_rows(model, keep)
    head = DraftHead(net, keep, input_embedding(model), rows, kernels=load_kernels())
    report = check(head, checking) if checking else None
    manifest = save_head(
        args.draft, net, keep, model,
        target=str(args.model),
        covered=round(covered, 4),
        trained_on={"prompts": str(args.prompts), "answers": len(training),
                    "positions": sum(len(e.ids) - 1 for e in training)},
        epochs=args.epochs, rollout=args.rollout, losses=[round(x, 4) for x in history],
        heldout_check=report,
        seconds=round(time.perf_counter() - started, 1),
        trained_at=time.strftime("%Y-%m-%d"),
    )  # fmt: skip
    return manifest


def _digest(prompts: Sequence[str], answers: Sequence[Sequence[int]]) -> str:
    """What the features and a checkpoint were made from: the prompts and the answers."""
    digest = hashlib.sha256()
    for prompt, answer in zip(prompts, answers, strict=True):
        digest.update(prompt.encode() + b"\0" + " ".join(map(str, answer)).encode() + b"\n")
    return digest.hexdigest()[:16]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m draft_tools head",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="the target (a folder or GGUF)")
    parser.add_argument(
        "--draft", type=Path, required=True, help="the draft folder: reads corpus.ids.gz, "
        "writes head.safetensors and head.json",
    )  # fmt: skip
    parser.add_argument(
        "--prompts", type=Path, required=True, help="the prompts the corpus answers, in order"
    )
    parser.add_argument("--dtype", default="auto", help="as the server's --dtype (auto)")
    parser.add_argument("--vocabulary", type=int, default=2048, help="draft vocabulary (2048)")
    parser.add_argument("--inner", type=int, default=1024, help="the head's MLP width (1024)")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the answers (4)")
    parser.add_argument("--rollout", type=int, default=3, help="steps trained on own features")
    parser.add_argument("--batch", type=int, default=512, help="positions a training step (512)")
    parser.add_argument("--heldout", type=float, default=0.08, help="share held out to check")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("vocabulary", "inner", "epochs", "rollout", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.heldout < 1:
        parser.error("--heldout must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        manifest = build(args, say=lambda message: print(message, file=sys.stderr, flush=True))
    except HeadBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
