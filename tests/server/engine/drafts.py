"""Drafts with known behaviour for engine tests: oracle (always right), fixed, never matching."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from kenspec.server.engine.costs import Costs
from kenspec.server.engine.draft import Branching as TreeBranching
from kenspec.server.engine.draft import Candidates, Chain, DraftSession, StaticSession
from kenspec.server.engine.draft_head import DraftHead
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.generation import Generation, Round
from kenspec.server.engine.grammar import GrammarSpec
from kenspec.server.engine.kenlm_draft import KenLMDraft
from kenspec.server.engine.params import (
    DRAFT_TOKENS,
    ProcessorParams,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.recycled import RecycledPredictions
from kenspec.server.engine.speculative_engine import (
    BreakerSettings,
    ContextSettings,
    SpeculativeEngine,
)
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from tests import tiny


def reference_greedy(
    target: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int, **processors: object
) -> list[int]:
    """What plain transformers greedy decoding gives: the ground truth for exactness tests
    (`processors`: generate's own, e.g. repetition_penalty=1.3)."""
    input_ids = torch.tensor([list(prompt_ids)], device=target.device)
    output = target.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **processors,
    )
    return output[0, len(prompt_ids) :].tolist()


def plain_decoding(
    target: TargetModel, prompts: Sequence[str], max_new_tokens: int
) -> dict[str, tuple[list[int], list[int]]]:
    """{prompt: (its ids, the target's greedy output without speculation)}."""
    plain = {}
    for prompt in prompts:
        ids = target.encode_prompt(prompt)
        solo = generate(target, None, ids, max_new_tokens=max_new_tokens, enabled=False)
        for _ in solo:
            pass
        plain[prompt] = (ids, solo.output_ids)
    return plain


def last_rows(target: TargetModel, ids: Sequence[int], width: int) -> torch.Tensor:
    """The logits [width, vocab] of one pass over the last `width` of ids, the rest
    prefilled first (float32)."""
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, ids[: len(ids) - width])
    verify = VerifyPass.sequences([len(ids) - width], [ids[len(ids) - width :]])
    logits = target.forward(cache, verify)[0]
    return torch.stack([logits[i] for i in range(width)]).float()


class OracleDraft:
    """Proposes the target's own greedy continuation (from a reference run): always accepted."""

    name = "oracle"

    def __init__(self, continuation: Sequence[int]) -> None:
        self._continuation = list(continuation)

    def start(self, prompt_ids: Sequence[int]) -> _ListSession:
        return _ListSession(self._continuation)


class StaticDouble(StaticSession):
    """A test draft's session, usable as a context draft's static one: one chain, which
    ignores the gate; no n-best alternatives; nothing after drafted tokens."""

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        raise NotImplementedError

    def propose(self, k: int) -> Candidates:
        return (self.chain(k),)

    def n_best(self, n: int) -> list[tuple[int, float]]:
        return []

    def chain_after(self, drafted: Sequence[int], k: int) -> Chain:
        return Chain()


class _ListSession(StaticDouble):
    def __init__(self, continuation: list[int]) -> None:
        self._continuation = continuation
        self._position = 0

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        tokens = self._continuation[self._position : self._position + k]
        return Chain(tuple(tokens), tuple(1.0 for _ in tokens))

    def extend(self, token_ids: Sequence[int]) -> None:
        self._position += len(token_ids)


class FixedDraft(StaticDouble):
    """Always proposes the same tokens, whatever the context."""

    name = "fixed"

    def __init__(self, tokens: Sequence[int], source: str = "") -> None:
        self.tokens = tuple(tokens)
        self.source = source  # the proposals' source label (settable between rounds)

    def start(self, prompt_ids: Sequence[int]) -> FixedDraft:
        return self

    def chain(self, k: int, min_prob: float | None = None) -> Chain:
        tokens = self.tokens[:k]
        return Chain(tokens, tuple(1.0 for _ in tokens), Source.parse(self.source))

    def extend(self, token_ids: Sequence[int]) -> None:
        pass


def never_matching_kenlm(target: TargetModel, path: Path, avoid: set[int]) -> KenLMDraft:
    """A unigram ARPA whose best token is one the target's greedy outputs never contain."""
    vocab = range(len(target.tokenizer))
    banned = target.eos_token_ids | set(target.tokenizer.all_special_ids)
    token = next(t for t in vocab if t not in avoid and t not in banned)
    tiny.unigram_arpa(path, {token: 0.9}, vocab)
    return KenLMDraft.load(path, vocab_size=target.vocab_size)


class Collector:
    """A deliver callback: the rounds (or the error) one generation received."""

    def __init__(self) -> None:
        self.rounds: list[Round] = []
        self.error: BaseException | None = None

    def __call__(self, item: Round | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.rounds.append(item)

    @property
    def tokens(self) -> list[int]:
        return [token for round_ in self.rounds for token in round_.token_ids]


def start(
    target: TargetModel,
    draft,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 24,
    k: int = 4,
    enabled: bool = True,
    adaptive: bool = False,
    sampling: SamplingParams | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    breaker: BreakerSettings | None = None,
    clock: Callable[[], float] = time.monotonic,
    costs: Costs | None = None,
    timer: Callable[[], float] = time.perf_counter,
    recycled: RecycledPredictions | None = None,
    tree_budget: int = 1,
    grammar: GrammarSpec | None = None,
    processing: ProcessorParams | None = None,
    top_logprobs: int | None = None,
    head: DraftHead | None = None,
) -> tuple[SpeculativeEngine, Generation]:
    """A new engine (batch of its own) and a generation started on it, not yet run;
    `recycled`: the table its passes record into (the one a ContextDraft given as `draft`
    drafts from); `head`: a learned head the engine's context draft drafts from."""
    engine = SpeculativeEngine(
        target,
        draft,
        breaker,
        clock=clock,
        costs=costs,
        timer=timer,
        recycled=recycled,
        # (a head drafts through the engine's context draft: on where one is given)
        context=ContextSettings(enabled=head is not None, tree_budget=tree_budget),
        head=head,
    )
    generation = engine.start(
        prompt_ids,
        sampling=sampling or SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, stop=stop, ignore_eos=ignore_eos),
        # Chains of k; the cap lets trees and long matches through, as the defaults do.
        speculation=SpeculationParams(
            enabled=enabled,
            num_draft_tokens=max(k, DRAFT_TOKENS),
            chain_tokens=k,
            adaptive=adaptive,
        ),
        grammar=grammar,
        processing=processing,
        top_logprobs=top_logprobs,
    )
    return engine, generation


class Solo:
    """One generation run through its engine's batch on this thread, as the server runs it (a
    solo request is a batch of one): iterate for its rounds, or `step()` for the next one."""

    def __init__(self, engine: SpeculativeEngine, generation: Generation) -> None:
        self.engine = engine
        self.generation = generation
        self._rounds = engine.batch.rounds(generation)

    def __iter__(self) -> Iterator[Round]:
        return self._rounds

    def step(self) -> Round:
        return next(self._rounds)

    def __getattr__(self, name: str) -> object:  # seed, output_ids, text, finished, ...
        return getattr(self.generation, name)


def generate(target: TargetModel, draft, prompt_ids: Sequence[int], **options) -> Solo:
    """A generation on an engine of its own, run through the batch (see `start` for options)."""
    return Solo(*start(target, draft, prompt_ids, **options))


def fail_passes_fed(monkeypatch, poison: int) -> None:
    """Make every forward pass that feeds `poison` first in a row raise (a kernel failure).

    A round feeds its pending token first (after the prompt's tail, in a first round that
    prefills it), so a request whose prompt ends in `poison` fails from its first round on,
    and a batched pass that holds it fails as a whole.
    """
    original = TargetModel.forward

    def failing_forward(self, cache, verify):  # type: ignore[no-untyped-def]
        if any(row.pending == poison for row in verify.rows):
            raise RuntimeError("simulated kernel failure")
        return original(self, cache, verify)

    monkeypatch.setattr(TargetModel, "forward", failing_forward)


class Branching:
    """Two chains each round: `wrong` (the reference's next tokens, the first one changed) and
    the reference's own, as an alternative; optionally a raising expand."""

    name = "branching"

    def __init__(self, reference: Sequence[int], vocab: int, *, fail: bool = False) -> None:
        self.reference = list(reference)
        self.vocab = vocab
        self.fail = fail

    def start(self, prompt_ids: Sequence[int]) -> _BranchingSession:
        return _BranchingSession(self)


class _BranchingSession(DraftSession, TreeBranching):
    def __init__(self, draft: Branching) -> None:
        self._draft = draft
        self._position = 0

    def propose(self, k: int) -> Candidates:
        right = self._draft.reference[self._position : self._position + k]
        if not right:
            return (Chain(),)
        wrong = [(right[0] + 1) % self._draft.vocab, *right[1:]]
        return (
            Chain(tuple(wrong), (1.0,) * len(wrong), Source("wrong")),
            Chain(tuple(right), (1.0,) * len(right), Source("right")),
        )

    def branching(self) -> TreeBranching:
        return self

    @property
    def root_token(self) -> int:
        return -1  # this double knows no stream: the root's token is none

    def expand(self, token: int) -> list[tuple[int, Source]]:
        if self._draft.fail:
            raise RuntimeError("corrupt branch table")
        return []

    def extend(self, token_ids: Sequence[int]) -> None:
        self._position += len(token_ids)


def wide_pass_rows(target: TargetModel, text: str, width: int = 7) -> list[torch.Tensor]:
    """The last `width` tokens' logits of `text` after a prefill of the rest, from one pass
    of `width` tokens and from `width` one-token passes (each [width, vocab])."""
    ids = target.encode_prompt(text)
    rows = []
    for widths in ((width,), (1,) * width):
        cache = target.new_cache(1)
        target.prefill(cache, 0, 0, ids[:-width])
        at, logits = len(ids) - width, []
        for step in widths:
            (out,) = target.forward(cache, VerifyPass.sequences([at], [ids[at : at + step]]))
            logits += [out[i] for i in range(step)]
            at += step
        rows.append(torch.stack(logits))
    return rows


def assert_speculation_is_plain_decoding(
    target: TargetModel, prompts: Sequence[str], arpa: Path, max_new_tokens: int = 24
) -> None:
    """Greedy speculation gives plain decoding's tokens for each prompt, whatever the draft
    proposes: always right (chains of 4), never right (a KenLM draft of unseen tokens written
    to `arpa`), or token trees partly right."""
    plain = plain_decoding(target, prompts, max_new_tokens=max_new_tokens)
    seen = {token for _, output in plain.values() for token in output}
    never = never_matching_kenlm(target, arpa, seen)
    for ids, expected in plain.values():
        for draft, options in (
            (OracleDraft(expected), {"k": 4}),
            (never, {"k": 4}),
            (Branching(expected, target.vocab_size), {"k": 4, "tree_budget": 12}),
        ):
            solo = generate(target, draft, ids, max_new_tokens=max_new_tokens, **options)
            for _ in solo:
                pass
            assert solo.output_ids == expected, draft.name
