"""The lossless verification rule for a deterministic draft, as pure functions.

A KenLM draft proposes tokens, not a distribution: q is one-hot on the drafted token d. The
Leviathan et al. (2023, Alg. 1) rule "accept d with probability min(1, p(d)/q(d))" then reduces
to "accept d with probability p(d), else sample from p with d removed". The equivalent form used
here (HF assisted generation "case 2", TGI, vLLM's NO_DRAFT_PROBS path) is: at each drafted
position i draw y_i ~ p_i (y_i = argmax p_i when greedy); accept while y_i == d_i; at the first
mismatch emit y_i and stop; if every draft matches, also emit the bonus y_{k+1}. Output is then
distributed exactly as plain sampling from p, and identical to greedy decoding at temperature 0.

Example: drafts [5, 7, 9], target argmaxes [5, 7, 2, 4] -> emit [5, 7, 2] (2 accepted + 1 own).
"""

from __future__ import annotations

import torch

from server.engine.params import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p, in that order (as HF does).

    logits: [num_positions, vocab_size]; returns float32 probabilities of the same shape.
    """
    scores = logits.float() / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        scores = _mask_outside_nucleus(scores, params.top_p)
    return torch.softmax(scores, dim=-1)


def _mask_outside_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the fewest most likely tokens whose probability reaches top_p (Holtzman 2019)."""
    sorted_scores, sorted_ids = torch.sort(scores, descending=True, dim=-1)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best always stays.
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, sorted_ids, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def accept_greedy(draft_ids: list[int], logits: torch.Tensor) -> list[int]:
    """Tokens a greedy round emits: the matching draft prefix plus the target's own next token.

    logits: [len(draft_ids) + 1, vocab_size], row i scores the position of draft_ids[i].
    """
    targets = logits.argmax(dim=-1).tolist()
    return _emit(draft_ids, targets)


def accept_sampled(
    draft_ids: list[int], probs: torch.Tensor, generator: torch.Generator
) -> list[int]:
    """Tokens a sampled round emits: y_i ~ p_i, accepted while y_i equals the draft.

    probs: [len(draft_ids) + 1, vocab_size], already warped (see warp_logits). The samples past
    the first mismatch are drawn but discarded, so each emitted token is an independent draw
    from the target's conditional distribution.
    """
    targets = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1).tolist()
    return _emit(draft_ids, targets)


def _emit(draft_ids: list[int], targets: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == targets[accepted]:
        accepted += 1
    return [*draft_ids[:accepted], targets[accepted]]
