"""A learned draft head: a small network over the target's own last hidden state.

KenLM, the request's context, the suffix index and the recycled predictions guess from text
already seen; on open-ended chat most of an answer is unseen text. The head reads what the
target itself computed instead (EAGLE, Li et al. 2024, in its smallest form): the target's
final hidden state `h_t` at the row that chose the pending token `x`, and `x`'s embedding,
give a feature meant to be the target's next hidden state; the target's own output layer,
cut to a reduced vocabulary (the tokens that make up ~93% of the target's answers), turns it
into the next token. The feature is fed back with that token for the token after, so one
pass's hidden state drafts a chain:

    z = fc([h_t, embed(x)]);  z = z + down(silu(gate(norm(z))) * up(norm(z)));  f = out_norm(z)
    next = keep[argmax(output_rows[keep] @ f)]

Its weights (`head.safetensors`, ~2.4M parameters for the default model) are trained by
`draft_tools head` from the target's own answers and saved beside the KenLM draft with a
manifest (`head.json`) naming the target they were trained for by fingerprint: the head reads
that target's hidden states and is refused for any other. It only proposes; verification
decides, so output is unchanged (greedy equals plain decoding, sampling keeps the target's
distribution).

Cost: per drafted token three small products and the reduced output layer, ~3.6M
multiply-adds on the engine thread (`chain`). Where kenspec's bf16 GEMV runs, a whole chain is
one call into its kernels (csrc/head.c: the products through that GEMV, the norms, silu and
softmax in C between them): a chain of 4 of the default model's head took 0.97 ms there against
2.9 ms as ~15 torch calls a step around the same products (2-core AVX2 EPYC, weights in cache).
Elsewhere torch's float32 products.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from transformers import PreTrainedModel

from kenspec.server.engine.forward.cpu_kernels import CpuKernels, HeadArgs

HEAD_WEIGHTS = "head.safetensors"
HEAD_MANIFEST = "head.json"
HEAD_FORMAT = 1
MIN_PROB = 0.2  # a head chain stops at the first token the head gives less than this
MAX_TOKENS = 4  # and after this many tokens (a fed-back feature drifts from the target's)
ALTERNATIVE_MIN_PROB = 0.1  # a next-best first token below this is no branch worth a node


class HeadFormatError(ValueError):
    """A head that cannot serve this target (the reason is the message)."""


def target_fingerprint(model: PreTrainedModel) -> str:
    """What a head is trained for: the target's shapes and the first rows of its input
    embedding (bf16 bytes, so float32 and bf16 loads of one model agree; kenspec never
    quantizes the embedding, so --weights int8/int4 loads agree too)."""
    config = model.config
    embed = input_embedding(model)
    digest = hashlib.sha256()
    digest.update(repr((config.hidden_size, config.num_hidden_layers, embed.shape[0])).encode())
    rows = embed[:64].detach().to("cpu", torch.bfloat16).contiguous()
    digest.update(rows.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def input_embedding(model: PreTrainedModel) -> torch.Tensor:
    """The target's input embedding weight [vocab, hidden] (not copied)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


def output_rows(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's output layer in float32 [len(ids), hidden]: a plain
    layer's, an int8 one's dequantized (engine.quantize), or the input embedding's where
    the model ties them."""
    output: Any = model.get_output_embeddings()
    weight = getattr(output, "weight", None) if output is not None else None
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.detach()[ids].float().contiguous()
    values, scales = getattr(output, "values", None), getattr(output, "scales", None)
    if isinstance(values, torch.Tensor) and isinstance(scales, torch.Tensor) and values.dim() == 2:
        rows = values[ids].float() * scales.reshape(-1)[ids].float()[:, None]
        return rows.contiguous()
    if output is None or getattr(model.config, "tie_word_embeddings", False):
        return input_embedding(model)[ids].float().contiguous()
    raise HeadFormatError(
        f"a draft head reads a plain or int8 output layer, not {type(output).__name__}"
    )


class HeadNet(nn.Module):
    """The head's network: [feature, embedding] -> the next feature (see the module doc)."""

    def __init__(self, hidden: int, inner: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.out_norm = nn.RMSNorm(hidden, eps=eps)

    @property
    def hidden(self) -> int:
        return self.fc.out_features

    @property
    def inner(self) -> int:
        return self.gate.out_features

    def forward(self, feature: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        z = self.fc(torch.cat([feature, embedded], dim=-1))
        x = self.norm(z)
        z = z + self.down(functional.silu(self.gate(x)) * self.up(x))
        out: torch.Tensor = self.out_norm(z)
        return out


@dataclass(frozen=True, slots=True)
class HeadChain:
    tokens: tuple[int, ...]
    probs: tuple[float, ...]  # the head's own probability of each token, over its vocabulary
    # the head's next best first tokens and their probabilities (a token tree's branches)
    alternatives: tuple[tuple[int, float], ...] = ()


class DraftHead:
    """A trained head bound to its target's embeddings (see the module doc)."""

    def __init__(
        self,
        net: HeadNet,
        keep: torch.Tensor,
        embed: torch.Tensor,
        rows: torch.Tensor,
        *,
        min_prob: float = MIN_PROB,
        max_tokens: int = MAX_TOKENS,
        manifest: dict[str, Any] | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        """keep: the reduced vocabulary's token ids [V]; embed: the target's input embedding
        [vocab, hidden] (shared, not copied); rows: its output layer's rows of `keep`
        [V, hidden] in float32 (`output_rows`); kernels: kenspec's CPU kernels, whose bf16
        GEMV then runs the head's products (its weights kept in bf16 too; torch's float32
        products otherwise: several times slower for one row)."""
        # (on the target's device: a GPU target's hidden states stay where they are)
        self.net = net.float().eval().requires_grad_(False).to(embed.device)
        self.keep = keep.to(torch.long)
        self._keep_ids = self.keep.tolist()
        self._embed = embed.detach()
        self._rows = rows  # [V, hidden]
        self.min_prob = min_prob
        self.max_tokens = max_tokens
        self.manifest = manifest or {}
        self._kernels = kernels if kernels is not None and kernels.gemv_bf16 else None
        self._bf16 = _Bf16Weights.of(self.net, rows) if self._kernels is not None else None
        # the whole chain in one C call (csrc/head.c) where the embedding is one it reads
        self._c: _CHead | None = None
        if self._kernels is not None and self._bf16 is not None:
            self._c = _CHead.of(self.net, self._bf16, self.keep, self._embed, self._kernels)

    @property
    def uses_kernels(self) -> bool:
        """Whether its products run through kenspec's bf16 GEMV."""
        return self._kernels is not None

    @property
    def runs_in_c(self) -> bool:
        """Whether a chain is one call into kenspec's kernels (csrc/head.c)."""
        return self._c is not None

    @property
    def vocabulary(self) -> int:
        return len(self._keep_ids)

    def chain(
        self,
        feature: torch.Tensor,
        token: int,
        k: int,
        min_prob: float | None = None,
        alternatives: int = 0,
    ) -> HeadChain:
        """Up to min(k, max_tokens) tokens after `token`, from the target's hidden state
        `feature` [hidden] at the row that chose it; stops at the first below `min_prob`.
        With `alternatives`, also the next best first tokens (at least ALTERNATIVE_MIN_PROB;
        none when the first token itself is under the gate)."""
        gate = self.min_prob if min_prob is None else min_prob
        if self._c is not None and self._kernels is not None:
            steps = min(k, self.max_tokens)
            f = feature.reshape(-1).float().contiguous()
            made, made_probs, firsts = self._kernels.head_chain(
                self._c.args, f, token, steps, gate, alternatives
            )
            branches = tuple((i, p) for i, p in firsts if p >= ALTERNATIVE_MIN_PROB)
            return HeadChain(tuple(made), tuple(made_probs), branches if made else ())
        tokens: list[int] = []
        probs: list[float] = []
        others: list[tuple[int, float]] = []
        with torch.inference_mode():
            f = feature.reshape(1, -1).float()
            for depth in range(min(k, self.max_tokens)):
                f, logits = self._step(f, token)
                wanted = 1 + (alternatives if depth == 0 else 0)
                top = torch.topk(logits, min(wanted, logits.shape[-1]))
                # probabilities of the top tokens: exp(logit - logsumexp)
                top_probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1)).tolist()
                ids = [self._keep_ids[i] for i in top.indices.tolist()]
                if top_probs[0] < gate:
                    break
                if depth == 0:  # (branches beside a first token that passed the gate)
                    others = [
                        (i, p) for i, p in zip(ids[1:], top_probs[1:], strict=True)
                        if p >= ALTERNATIVE_MIN_PROB
                    ]  # fmt: skip
                token = ids[0]
                tokens.append(token)
                probs.append(top_probs[0])
        return HeadChain(tuple(tokens), tuple(probs), tuple(others))

    def _step(self, feature: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next feature [1, hidden] (float32) and the reduced vocabulary's logits [V]."""
        if self._kernels is None or self._bf16 is None:
            f = self.net(feature, self._embed[token : token + 1].float())
            return f, functional.linear(f, self._rows)[0].float()
        gemv, w, net = self._kernels.gemv, self._bf16, self.net
        x = torch.cat([feature, self._embed[token : token + 1].float()], dim=-1)
        z = gemv(x.bfloat16(), w.fc).float() + w.fc_bias
        gate, up = gemv(net.norm(z).bfloat16(), w.gate_up).float().chunk(2, dim=-1)
        z = z + gemv((functional.silu(gate) * up).bfloat16(), w.down).float()
        f = net.out_norm(z)
        return f, gemv(f.bfloat16(), w.rows)[0].float()

    # --- files -------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        folder: Path,
        model: PreTrainedModel,
        *,
        kernels: CpuKernels | None = None,
    ) -> DraftHead | None:
        """The head in a draft folder, for `model` (None: the folder has none);
        HeadFormatError if it was trained for another target or is not one kenspec reads."""
        manifest_file = folder / HEAD_MANIFEST
        if not manifest_file.is_file():
            return None
        from safetensors.torch import load_file

        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") != HEAD_FORMAT:
            raise HeadFormatError(
                f"{manifest_file}: head format {manifest.get('format')!r}, kenspec reads "
                f"{HEAD_FORMAT}; rebuild it with `python -m draft_tools head`"
            )
        fingerprint = target_fingerprint(model)
        if manifest.get("target_fingerprint") != fingerprint:
            raise HeadFormatError(
                f"the draft head in {folder} was trained for another target "
                f"({manifest.get('target')!r}, fingerprint {manifest.get('target_fingerprint')}; "
                f"this target's is {fingerprint}): rebuild it for this model with "
                "`python -m draft_tools head`, or serve with --draft-head off"
            )
        tensors = load_file(str(folder / manifest.get("weights", HEAD_WEIGHTS)))
        keep = tensors.pop("keep")
        net = HeadNet(int(manifest["hidden"]), int(manifest["inner"]), float(manifest["eps"]))
        net.load_state_dict({name: t.float() for name, t in tensors.items()})
        embed = input_embedding(model)
        rows = output_rows(model, keep.to(torch.long))
        return cls(net, keep, embed, rows, manifest=manifest, kernels=kernels)


@dataclass(frozen=True, slots=True)
class _Bf16Weights:
    """The head's products in bf16 for the GEMV ([out, in] each; gate and up joined)."""

    fc: torch.Tensor
    fc_bias: torch.Tensor  # float32
    gate_up: torch.Tensor
    down: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, net: HeadNet, rows: torch.Tensor) -> _Bf16Weights:
        def bf16(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().to(torch.bfloat16).contiguous()

        bias = net.fc.bias
        return cls(
            fc=bf16(net.fc.weight),
            fc_bias=(bias.detach().float() if bias is not None else torch.zeros(net.hidden)),
            gate_up=bf16(torch.cat([net.gate.weight, net.up.weight])),
            down=bf16(net.down.weight),
            rows=bf16(rows),
        )


@dataclass(frozen=True)
class _CHead:
    """The head as csrc/head.c reads it: HeadArgs and the tensors it points into (kept alive
    here; the embedding is the target's own)."""

    args: HeadArgs
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def of(
        cls,
        net: HeadNet,
        weights: _Bf16Weights,
        keep: torch.Tensor,
        embed: torch.Tensor,
        kernels: CpuKernels,
    ) -> _CHead | None:
        """None where the embedding is not a CPU bf16 or float32 table it can read in place."""
        if embed.device.type != "cpu" or embed.dtype not in (torch.bfloat16, torch.float32):
            return None
        if not embed.is_contiguous():
            return None

        def float32(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().float().contiguous()

        tensors = (
            weights.fc, float32(weights.fc_bias), float32(net.norm.weight), weights.gate_up,
            weights.down, float32(net.out_norm.weight), weights.rows,
            keep.to(torch.int64).contiguous(), embed,
        )  # fmt: skip
        fc, bias, norm, gate_up, down, out_norm, rows, ids, table = tensors
        eps = net.norm.eps  # (None: torch's default, float32's epsilon)
        args = HeadArgs(
            hidden=net.hidden, inner=net.inner, vocab=int(ids.numel()),
            eps=float(torch.finfo(torch.float32).eps if eps is None else eps),
            fc=fc.data_ptr(), fc_bias=bias.data_ptr(),
            norm=norm.data_ptr(), gate_up=gate_up.data_ptr(), down=down.data_ptr(),
            out_norm=out_norm.data_ptr(), rows=rows.data_ptr(), keep=ids.data_ptr(),
            embed=table.data_ptr(), embed_rows=int(table.shape[0]),
            embed_bf16=int(table.dtype == torch.bfloat16), product=kernels.gemv_address,
        )  # fmt: skip
        return cls(args, tensors)


def save_head(
    folder: Path, net: HeadNet, keep: torch.Tensor, model: PreTrainedModel, **fields: Any
) -> dict[str, Any]:
    """Write a head (weights in bfloat16, its vocabulary) and its manifest into `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to(torch.bfloat16).contiguous() for name, t in net.state_dict().items()
    }
    tensors["keep"] = keep.to(torch.int32).contiguous()
    save_file(tensors, str(folder / HEAD_WEIGHTS))
    manifest = {
        "format": HEAD_FORMAT,
        "weights": HEAD_WEIGHTS,
        "target_fingerprint": target_fingerprint(model),
        "hidden": net.hidden,
        "inner": net.inner,
        "eps": net.norm.eps,
        "vocabulary": int(keep.numel()),
        **fields,
    }
    (folder / HEAD_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def reduced_vocabulary(answers: Sequence[Sequence[int]], size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens most frequent in `answers` and the share of answer tokens they cover."""
    counts = Counter(token for answer in answers for token in answer)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:size]
    total = sum(counts.values())
    covered = sum(counts[token] for token in ranked)
    return torch.tensor(ranked, dtype=torch.long), covered / total if total else 0.0
