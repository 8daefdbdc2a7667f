"""Recycled target predictions: the target's own top next tokens after each token, reused as drafts.

Token Recycling (Luo et al. 2024): every verification pass computes next-token logits for the
pending token and for the drafts it reads; those rows are the target's predictions after each
of those tokens, and they are thrown away once the round has accepted. Kept instead in a
table keyed by the token they follow (vocabulary x `width` ids and probabilities, shared by
every request, the newest row for a token overwriting the older), they give a draft for free:
from the stream's last token, follow the table's best next token, then the best after that.

Keyed by one token, a row forgets the context it was computed in, so the chain is a bigram of
the target's recent predictions: it knows the target's current phrasing, which the static
draft never saw, but not what came two tokens back. The speculator weighs it by its measured
acceptance like any other source.

Memory: vocabulary x width x 8 bytes (49k x 8 x 8 = 3 MB for the default model). Recording
costs one top-k over the rows a pass already computed; a lookup reads two lists per drafted
token.
Thread safety: `record` runs on the engine thread, `chain` on the draft thread; a chain that
reads a row while it is overwritten gets either row's ids, each a valid draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

WIDTH = 8  # next tokens kept per token, as in Token Recycling's adjacency matrix

# (float32 logits [rows, vocab] on the host, width, out) -> ids [rows, width] (int32) and their
# probabilities [rows, width], best first, written to `out` when given (contiguous tensors of
# rows * width): forward.cpu_kernels.CpuKernels.top_probs
TopProbs = Callable[
    [torch.Tensor, int, tuple[torch.Tensor, torch.Tensor] | None],
    tuple[torch.Tensor, torch.Tensor],
]


class RecycledPredictions:
    """The target's top-`width` next tokens (and their probabilities) after each token id."""

    def __init__(
        self, vocab_size: int, width: int = WIDTH, *, top_probs: TopProbs | None = None
    ) -> None:
        """top_probs: a kernel for the rows' top ids and probabilities on the host (one read
        of a row where torch's topk and logsumexp take ~100 us); torch's otherwise."""
        if vocab_size < 1 or width < 1:
            raise ValueError(f"need vocab_size and width >= 1, got {vocab_size}, {width}")
        self.vocab_size = vocab_size
        self.width = width
        self._top_probs = top_probs
        self._ids = torch.full((vocab_size, width), -1, dtype=torch.int32)  # -1: never seen
        self._probs = torch.zeros((vocab_size, width), dtype=torch.float32)
        # The best next token per token again, as Python lists: a chain reads them per token.
        self._best = [-1] * vocab_size
        self._best_prob = [0.0] * vocab_size

    def empty_like(self) -> RecycledPredictions:
        """A table of the same shape and kernel that has seen nothing (another tenant's)."""
        return RecycledPredictions(self.vocab_size, self.width, top_probs=self._top_probs)

    def record(self, token_ids: Sequence[int], rows: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Keep the top next tokens of logit rows: (i, logits) is the target's prediction after
        token_ids[i]. Rows after a token outside the table's vocabulary are ignored."""
        pairs = [(i, row) for i, row in rows if 0 <= token_ids[i] < self.vocab_size]
        if not pairs:
            return
        first = pairs[0][1]
        width = min(self.width, first.shape[-1])
        on_host = first.device.type == "cpu" and width <= 16
        kernel = self._top_probs if on_host else None
        if kernel is not None and len(pairs) == 1 and first.dtype == torch.float32:
            # A plain round's one row, written straight into its table row (~60 us less a
            # round than through new tensors and an indexed write).
            key = token_ids[pairs[0][0]]
            ids_row, probs_row = self._ids[key, :width], self._probs[key, :width]
            kernel(first.reshape(1, -1), width, (ids_row, probs_row))
            self._best[key], self._best_prob[key] = int(ids_row[0]), float(probs_row[0])
            return
        logits = _stacked([row for _, row in pairs]).float()  # [rows, vocab]
        if kernel is not None:
            ids, probs = kernel(logits, width, None)
        else:
            # The top logits are the top probabilities: softmax only those (no [rows, vocab]
            # copy).
            top = torch.topk(logits, width, dim=-1)
            probs = torch.exp(top.values - torch.logsumexp(logits, dim=-1, keepdim=True))
            # The table lives on the host: rows from an accelerator come over as [rows, width]
            # ids and probabilities (two small copies), never as vocabulary rows.
            ids, probs = top.indices.to("cpu", torch.int32), probs.cpu()
        keys = torch.tensor([token_ids[i] for i, _ in pairs], dtype=torch.long)
        self._ids[keys, :width] = ids
        self._probs[keys, :width] = probs
        for key, best, prob in zip(
            keys.tolist(), ids[:, 0].tolist(), probs[:, 0].tolist(), strict=True
        ):
            self._best[key], self._best_prob[key] = best, prob

    def next_tokens(self, token_id: int) -> list[tuple[int, float]]:
        """The recorded (next token, probability) pairs after token_id, best first."""
        if not 0 <= token_id < self.vocab_size:
            return []
        ids, probs = self._ids[token_id].tolist(), self._probs[token_id].tolist()
        return [(t, p) for t, p in zip(ids, probs, strict=True) if t >= 0]

    def chain(
        self, last_token: int, k: int, min_prob: float = 0.0
    ) -> tuple[list[int], list[float]]:
        """Up to k tokens following the best recorded next token from last_token, stopping at a
        token never recorded or a path probability below min_prob."""
        tokens: list[int] = []
        probs: list[float] = []
        token, path = last_token, 1.0
        while len(tokens) < k and 0 <= token < self.vocab_size:
            following = self._best[token]
            path *= self._best_prob[token]
            if following < 0 or path < min_prob:
                break
            tokens.append(following)
            probs.append(path)
            token = following
        return tokens, probs


def _stacked(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """rows [vocab] as one [rows, vocab] tensor: a view where they lie one after another in
    one tensor already (a pass's rows computed in one product: no 2.4 MB copy for 12 rows of
    49k float32 logits), else stacked."""
    first = rows[0]
    size = first.shape[-1]
    if (
        first.dim() == 1
        and first.stride(0) == 1
        and all(
            row.dtype == first.dtype
            and row.shape == first.shape
            and row.stride(0) == 1
            and row.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and row.storage_offset() == first.storage_offset() + i * size
            for i, row in enumerate(rows)
        )
    ):
        return first.as_strided((len(rows), size), (size, 1))
    return torch.stack(list(rows))
