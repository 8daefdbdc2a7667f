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

from collections.abc import Callable, Sequence

import torch

from kenspec.api.outputs import TokenLogprob
from kenspec.server.engine.draft_tree import chain_parents
from kenspec.server.engine.params import SamplingParams
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.processors import RowProcessor

# float32 rounds every positive float64 up to this to 0 (2^-150: half its least denormal,
# a tie to the even 0); a divisor of float32 scores above it stays positive.
FLOAT32_ZERO_UP_TO = 2.0**-150


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature, top-k, top-p and min-p, in that order (as HF
    does).

    logits: [num_positions, vocab_size]; returns float32 probabilities of the same shape.
    """
    # Shifted by the row's best first (nothing below depends on a shift): a temperature so
    # small that a logit over it overflows (1e-45) still gives the best tokens, not NaN. One
    # that is 0 in float32 (5e-324: 0 / 0 is NaN) is its limit: the best tokens.
    scores = logits.float()
    scores = scores - scores.amax(dim=-1, keepdim=True)
    if params.temperature > FLOAT32_ZERO_UP_TO:
        scores = scores / params.temperature
    else:
        scores = torch.where(scores == 0.0, 0.0, float("-inf"))
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        scores = _mask_outside_nucleus(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        # Nguyen et al. 2024 (min-p sampling), as HF's MinPLogitsWarper: drop tokens less
        # likely than min_p times the best one (the best always stays), then renormalise.
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _mask_outside_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the fewest most likely tokens whose probability reaches top_p (Holtzman 2019)."""
    sorted_scores, sorted_ids = torch.sort(scores, descending=True, dim=-1)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the best always stays.
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, sorted_ids, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


TokenChoice = Callable[[int, Sequence[int]], int]
"""A walk's choice: (logits row, the node's path tokens) -> the target's token there (see
`walk`); the depth is len(path tokens)."""


def walk(
    draft_ids: Sequence[int], parents: Sequence[int], choose: TokenChoice
) -> tuple[list[int], list[int]]:
    """The lossless acceptance walk over a token tree; (emitted tokens, accepted node indices).

    Node i is draft_ids[i], a child of node parents[i] (-1: of the root, the pending token);
    logits row i + 1 scores what follows node i, row 0 what follows the root. From the root:
    y = choose(row, path tokens) (the argmax when greedy, a draw from p when sampling); if a child
    of the current node is y, move to it and repeat; else emit y and stop. At a leaf y is the
    bonus token. The emitted tokens are y_0, y_1, ..., each drawn from the target's
    distribution given the tokens before it, exactly as plain decoding draws them; which
    children exist only decides how many draws one pass can check. A chain is the tree whose
    every node has one child. Rows off the accepted path are never read.

    Example: tokens [5, 6, 7], parents [-1, -1, 1] (5 and 6 at the root, 7 after 6), the
    target choosing 6 at the root, then 7, then 11: ([6, 7, 11], [1, 2]).
    """
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(draft_ids, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, node)
    node, path, tokens = -1, list[int](), list[int]()
    while True:
        chosen = choose(node + 1, tokens)
        child = children.get(node, {}).get(chosen)
        if child is None:
            return [*tokens, chosen], path
        path.append(child)
        tokens.append(chosen)
        node = child


def accept_greedy(
    draft_ids: list[int], logits: Logits, parents: Sequence[int] | None = None
) -> list[int]:
    """Tokens a greedy round emits: the matching draft path plus the target's own next token.

    logits[i] scores the position of draft_ids[i] (logits[len(draft_ids)] the bonus position
    of a chain); rows past the first mismatch are never read.
    """
    tree = chain_parents(len(draft_ids)) if parents is None else parents
    return walk(draft_ids, tree, greedy_choice(logits))[0]


def accept_sampled(
    draft_ids: list[int],
    logits: Logits,
    params: SamplingParams,
    generator_at: Callable[[int], torch.Generator],
    parents: Sequence[int] | None = None,
) -> list[int]:
    """Tokens a sampled round emits: y_i ~ p_i (warped), accepted while y_i is a draft.

    Each y_i is drawn from the target's conditional distribution given the accepted prefix, so
    the emitted tokens are distributed exactly as plain sampling; nothing past the first
    mismatch is computed or drawn. y_i is drawn with generator_at(i).
    """
    tree = chain_parents(len(draft_ids)) if parents is None else parents
    return walk(draft_ids, tree, TokenChooser(logits, params, generator_at))[0]


class TokenChooser:
    """A walk's choice (a TokenChoice): the argmax when greedy, else y ~ p (warped) drawn with
    the generator of its depth; with processors, of the row they processed for the node's own
    path (after `output`, the request's tokens before this round). Without processors or
    logprobs, no row is copied (on an accelerator a greedy choice reads the pass's one copy).

    With `top_logprobs` (0-20), each choice also records its TokenLogprob, in the order the
    walk chose them (which is the order it emits them): the chosen token's log-probability
    under the distribution it was chosen from (greedy: the processed logits' log-softmax;
    sampled: log p after temperature, top-k, top-p and min-p) and that many alternatives.

    Example: greedy, top_logprobs=1, a row whose log-softmax is [-0.1, -2.4, ...]: choosing
    token 0 records TokenLogprob(0, -0.1, ((0, -0.1),)).
    """

    def __init__(
        self,
        logits: Logits,
        params: SamplingParams,
        generator_at: Callable[[int], torch.Generator],
        processors: Sequence[RowProcessor] = (),
        output: Sequence[int] = (),
        top_logprobs: int | None = None,
    ) -> None:
        self._logits = logits
        self._params = params
        self._generator_at = generator_at
        self._processors = processors
        self._output = output
        self._top = top_logprobs
        self.logprobs: list[TokenLogprob] = []  # one per choice, with top_logprobs

    def __call__(self, row: int, path: Sequence[int]) -> int:
        if not self._processors and self._top is None:
            if self._params.greedy:
                return self._logits.argmax(row)
            return _sample(self._logits[row], self._params, self._generator_at(len(path)))
        scores = self._logits[row]
        if self._processors:
            scores = scores.clone()
            for processor in self._processors:
                scores = processor.process(scores, self._output, path)
        if self._params.greedy:
            token = int(scores.argmax())
            if self._top is not None:
                self._record(token, torch.log_softmax(scores.float(), dim=-1))
            return token
        probs = warp_logits(scores[None], self._params)[0]
        generator = self._generator_at(len(path))
        token = int(torch.multinomial(probs, num_samples=1, generator=generator))
        if self._top is not None:
            self._record(token, probs.log())
        return token

    def _record(self, token: int, logprobs: torch.Tensor) -> None:
        """logprobs: [vocab] float32, -inf where the distribution rules a token out."""
        top: tuple[tuple[int, float], ...] = ()
        if self._top:
            values, ids = torch.topk(logprobs, self._top)
            top = tuple(
                (int(i), float(v))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                if v != float("-inf")
            )
        self.logprobs.append(TokenLogprob(token, float(logprobs[token]), top))


def greedy_choice(logits: Logits) -> TokenChoice:
    """A walk's choice at temperature 0: the row's argmax (on an accelerator, from the pass's
    one copy of its greedy tokens)."""
    return lambda row, _path: logits.argmax(row)


class PositionalGenerator:
    """Random draws keyed by (seed, output position), not by how many draws came before.

    Token t of an output is drawn with a generator seeded from (seed, t) alone, so a seeded
    request gives the same text whatever its rounds looked like: with or without drafts, alone
    or in a batch, before or after its breaker opened (vLLM and TGI keep one running generator
    per request, whose output then depends on how many draws each round made).
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        return self._generator.manual_seed(_splitmix64(self.seed ^ _splitmix64(position)))


def _splitmix64(value: int) -> int:
    """Steele et al.'s SplitMix64 finaliser: nearby inputs give unrelated 63-bit seeds."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (value ^ (value >> 31)) >> 1


def _sample(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    probs = warp_logits(row[None], params)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))
