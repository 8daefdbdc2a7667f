"""The learned draft head: its chain, its files, the hidden state it is fed, and exactness."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import pytest
import structlog
import torch

from kenspec.api.outputs import BreakerState
from kenspec.server.engine import context_draft, draft_head
from kenspec.server.engine.breaker import AcceptanceBreaker
from kenspec.server.engine.draft import UNNAMED, Candidates, Chain, DraftSession
from kenspec.server.engine.draft_head import (
    HEAD_MANIFEST,
    DraftHead,
    HeadChain,
    HeadFormatError,
    HeadNet,
    output_rows,
    reduced_vocabulary,
    save_head,
)
from kenspec.server.engine.draft_tree import DraftTree
from kenspec.server.engine.params import SpeculationParams
from kenspec.server.engine.speculator import REST_AFTER, REST_EVERY, Proposal, Speculator
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import generate

MAX_NEW = 24


def _head(target: TargetModel, *, seed: int = 0, vocabulary: int = 64, **options) -> DraftHead:
    """An untrained head over `target` (random weights, a random reduced vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = target.model.config.hidden_size
    torch.manual_seed(seed)
    net = HeadNet(hidden, 32)
    keep = torch.randperm(target.vocab_size, generator=generator)[:vocabulary]
    embed = target.model.get_input_embeddings().weight
    return DraftHead(net, keep, embed, output_rows(target.model, keep), **options)


def test_a_chain_is_gated_by_probability_and_length(tiny_target) -> None:
    head = _head(tiny_target, max_tokens=3)
    feature = torch.randn(tiny_target.model.config.hidden_size)
    kept = set(head.keep.tolist())
    every = head.chain(feature, 5, k=8, min_prob=0.0)
    assert len(every.tokens) == 3  # max_tokens, below k
    assert set(every.tokens) <= kept
    assert head.chain(feature, 5, k=2, min_prob=0.0).tokens == every.tokens[:2]
    assert head.chain(feature, 5, k=8, min_prob=1.01).tokens == ()
    gated = head.chain(feature, 5, k=8, min_prob=every.probs[0] + 1e-6)
    assert gated.tokens == ()  # the first token under the gate ends the chain at once
    # Each token is the reduced vocabulary's argmax of the fed-back feature, as written out.
    f, token = feature[None].float(), 5
    for drafted in every.tokens:
        f = head.net(f, tiny_target.model.get_input_embeddings().weight[token][None].float())
        logits = f @ output_rows(tiny_target.model, head.keep).t()
        token = int(head.keep[int(logits.argmax())])
        assert token == drafted


def test_alternatives_are_the_next_best_first_tokens(tiny_target, monkeypatch) -> None:
    head = _head(tiny_target)
    feature = torch.randn(tiny_target.model.config.hidden_size)
    monkeypatch.setattr(draft_head, "ALTERNATIVE_MIN_PROB", 0.0)
    found = head.chain(feature, 5, k=3, min_prob=0.0, alternatives=2)
    assert len(found.alternatives) == 2
    probs = [found.probs[0], *(p for _, p in found.alternatives)]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-6
    assert found.tokens[0] not in {token for token, _ in found.alternatives}
    assert head.chain(feature, 5, k=3, min_prob=0.0).alternatives == ()
    monkeypatch.setattr(draft_head, "ALTERNATIVE_MIN_PROB", 1.0)
    assert head.chain(feature, 5, k=3, min_prob=0.0, alternatives=2).alternatives == ()
    monkeypatch.setattr(draft_head, "ALTERNATIVE_MIN_PROB", 0.0)
    gated = head.chain(feature, 5, k=3, min_prob=1.01, alternatives=2)  # the first gated off
    assert gated.tokens == () and gated.alternatives == ()


def test_the_reduced_vocabulary_is_the_most_frequent_tokens() -> None:
    keep, covered = reduced_vocabulary([[5, 5, 7, 9], [5, 7, 11]], 2)
    assert keep.tolist() == [5, 7] and covered == pytest.approx(5 / 7)


def test_a_saved_head_loads_for_its_target_only(tiny_target, tiny_model_dir, tmp_path) -> None:
    head = _head(tiny_target)
    save_head(tmp_path, head.net, head.keep, tiny_target.model, target="tiny")
    loaded = DraftHead.load(tmp_path, tiny_target.model)
    assert loaded is not None and loaded.keep.tolist() == head.keep.tolist()
    feature = torch.randn(tiny_target.model.config.hidden_size)
    # (weights are stored in bfloat16: the loaded head is the bf16-rounded one)
    rounded = HeadNet(head.net.hidden, head.net.inner)
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in head.net.state_dict().items()})
    same = DraftHead(
        rounded, head.keep, tiny_target.model.get_input_embeddings().weight,
        output_rows(tiny_target.model, head.keep),
    )  # fmt: skip
    assert loaded.chain(feature, 3, 4, 0.0) == same.chain(feature, 3, 4, 0.0)
    # Another model of the same shapes and tokenizer is another target.
    other_dir = tiny.save_tiny_model(tmp_path / "other", tiny.build_byte_tokenizer(), seed=7)
    other = TargetModel.load(other_dir, device="cpu", dtype="float32")
    with pytest.raises(HeadFormatError, match="trained for another target"):
        DraftHead.load(tmp_path, other.model)
    # A bfloat16 load of the same model is the same target.
    bf16 = TargetModel.load(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert DraftHead.load(tmp_path, bf16.model) is not None
    manifest = json.loads((tmp_path / HEAD_MANIFEST).read_text())
    (tmp_path / HEAD_MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(HeadFormatError, match="head format 99"):
        DraftHead.load(tmp_path, tiny_target.model)
    assert DraftHead.load(tmp_path / "other", tiny_target.model) is None  # no head there


class RecordingHead(DraftHead):
    """A head that records what it is fed and drafts `chain` (or its own net's chain)."""

    def __init__(self, base: DraftHead, chain: Sequence[int] | None = None) -> None:
        super().__init__(base.net, base.keep, base._embed, base._rows, min_prob=0.0)
        self.fed: list[tuple[torch.Tensor, int]] = []
        self.threads: set[int] = set()
        self.fixed = chain

    def chain(
        self,
        feature: torch.Tensor,
        token: int,
        k: int,
        min_prob: float | None = None,
        alternatives: int = 0,
    ) -> HeadChain:
        self.fed.append((feature.clone(), token))
        self.threads.add(threading.get_ident())
        if self.fixed is not None:
            return HeadChain(tuple(self.fixed[:k]), tuple(0.9 for _ in self.fixed[:k]))
        return super().chain(feature, token, k, min_prob, alternatives)


@pytest.fixture
def head_always(monkeypatch) -> None:
    """The head drafts whatever the context matched (the tiny model repeats itself)."""
    monkeypatch.setattr(context_draft, "HEAD_AFTER_MATCH", 10**6)


@pytest.mark.parametrize("tree_budget", [1, 16])
def test_the_head_is_fed_the_hidden_state_that_chose_the_last_token(
    tiny_target, references, head_always, tree_budget: int
) -> None:
    ids, expected = references[tiny.PROMPTS[1]]
    head = RecordingHead(_head(tiny_target))
    generation = generate(
        tiny_target, None, ids, max_new_tokens=MAX_NEW, k=4, head=head, tree_budget=tree_budget
    )
    rounds = list(generation)
    assert generation.output_ids == expected
    assert len(head.fed) == len(rounds) - 1  # every round after the first
    # On the engine's thread (here the test's), never the draft thread: kenspec's kernels on a
    # second thread slow every later pass (ContextSession.observe).
    assert head.threads == {threading.get_ident()}
    with torch.inference_mode():
        full = torch.tensor([list(ids) + expected])
        hidden = tiny_target.model.base_model(input_ids=full).last_hidden_state[0]
    emitted = 0
    for (feature, token), round_ in zip(head.fed, rounds, strict=False):
        emitted += len(round_.token_ids)
        # The last token emitted so far, and the state at the position before it (its row).
        assert token == expected[emitted - 1]
        torch.testing.assert_close(feature, hidden[len(ids) + emitted - 2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree_budget", [1, 16])
@pytest.mark.parametrize("kind", ["untrained", "right", "wrong"])
def test_greedy_output_with_a_head_is_plain_greedy(
    tiny_target, references, head_always, kind: str, tree_budget: int
) -> None:
    drafted = accepted = 0
    head_rounds: list[int] = []  # accepted drafts of the rounds that verified the head's chain
    for ids, expected in list(references.values())[:10]:
        base = _head(tiny_target, seed=len(ids))
        # "right": the reference's next tokens after the position fed (always accepted);
        # "wrong": a token the reference never has next (never accepted)
        head = RecordingHead(base)
        if kind != "untrained":
            head = _Scripted(base, tiny_target, ids, expected, right=kind == "right")
        generation = generate(
            tiny_target, None, ids, max_new_tokens=MAX_NEW, k=4, head=head,
            tree_budget=tree_budget,
        )  # fmt: skip
        rounds = list(generation)
        assert generation.output_ids == expected
        head_rounds += [r.accepted for r in rounds if r.source == "head"]
        drafted += rounds[-1].usage.drafted_tokens
        accepted += rounds[-1].usage.accepted_tokens
    assert drafted > 0
    if kind == "right" and tree_budget == 1:
        assert accepted == drafted
    if kind == "right" and tree_budget > 1:  # (a tree's other branches are the context's)
        assert accepted >= 0.9 * drafted
    if kind == "wrong" and tree_budget == 1:  # (the context's own chains are accepted)
        assert head_rounds and not any(head_rounds)


class _Scripted(RecordingHead):
    """Drafts the reference's own next tokens (right) or a token it never has (wrong), after
    finding where it is by the hidden state it is fed (the nearest row of the reference's)."""

    def __init__(self, base: DraftHead, target: TargetModel, ids: list[int], expected: list[int],
                 right: bool) -> None:  # fmt: skip
        super().__init__(base)
        self.sequence, self.right, self.prompt = [*ids, *expected], right, len(ids)
        with torch.inference_mode():
            full = torch.tensor([self.sequence])
            self.hidden = target.model.base_model(input_ids=full).last_hidden_state[0]
        self.unused = next(t for t in range(target.vocab_size) if t not in expected)

    def chain(
        self,
        feature: torch.Tensor,
        token: int,
        k: int,
        min_prob: float | None = None,
        alternatives: int = 0,
    ) -> HeadChain:
        row = int((self.hidden - feature).norm(dim=-1).argmin())  # it chose sequence[row + 1]
        assert self.sequence[row + 1] == token
        following = self.sequence[row + 2 : row + 2 + k]
        if not self.right:
            following = [self.unused] * len(following)
        return HeadChain(tuple(following), tuple(0.9 for _ in following))


def test_the_kernels_path_computes_what_the_network_does(tiny_target) -> None:
    """With kenspec's bf16 GEMV the head's products run in bf16: the logits of each step are
    the float32 network's within bf16 rounding, the features fed back too."""
    from kenspec.server.engine.forward.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.gemv_bf16:
        pytest.skip("this CPU runs no bf16 GEMV of kenspec's (neither AVX512-BF16 nor AVX2)")
    plain = _head(tiny_target, vocabulary=128)
    fast = DraftHead(plain.net, plain.keep, plain._embed, plain._rows, kernels=kernels)
    assert fast.uses_kernels and not plain.uses_kernels
    feature = torch.randn(1, tiny_target.model.config.hidden_size)
    f_plain = f_fast = feature
    for token in (5, 17, 42):
        f_plain, logits_plain = plain._step(f_plain, token)
        f_fast, logits_fast = fast._step(f_fast, token)
        torch.testing.assert_close(logits_fast, logits_plain, atol=0.05, rtol=0.02)
        torch.testing.assert_close(f_fast, f_plain, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("embedding", ["float32", "bfloat16"])
def test_the_chain_in_c_is_the_kernels_paths_chain(tiny_target, embedding: str) -> None:
    """csrc/head.c's chain (one call) against the kernels path's steps in Python: each token it
    drafts is the Python step's best within bf16 rounding, fed the tokens C chose, with the
    same probability; its gate, length and alternatives as the Python chain's."""
    from kenspec.server.engine.forward.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.gemv_bf16:
        pytest.skip("this CPU runs no bf16 GEMV of kenspec's (neither AVX512-BF16 nor AVX2)")
    plain = _head(tiny_target, vocabulary=128, max_tokens=4)
    embed = plain._embed.to(getattr(torch, embedding)).contiguous()
    fast = DraftHead(plain.net, plain.keep, embed, plain._rows, kernels=kernels, max_tokens=4)
    assert fast.runs_in_c and not plain.runs_in_c
    stepper = DraftHead(plain.net, plain.keep, embed, plain._rows, kernels=kernels)
    stepper._c = None  # the same products, step by step in Python
    ids = plain.keep.tolist()
    generator = torch.Generator().manual_seed(3)
    for trial in range(20):
        feature = torch.randn(tiny_target.model.config.hidden_size, generator=generator) * 2
        token = 5 + trial
        chain = fast.chain(feature, token, k=8, min_prob=0.0, alternatives=2)
        assert len(chain.tokens) == 4  # max_tokens
        f = feature[None]
        for drafted, prob in zip(chain.tokens, chain.probs, strict=True):
            f, logits = stepper._step(f, token)
            probs = torch.softmax(logits.float(), dim=-1)
            assert logits[ids.index(drafted)] >= logits.max() - 0.05
            assert prob == pytest.approx(float(probs[ids.index(drafted)]), abs=0.02)
            token = drafted
        python = stepper.chain(feature, 5 + trial, k=8, min_prob=0.0, alternatives=2)
        if python.tokens == chain.tokens:  # (a near tie may take another branch)
            assert [t for t, _ in chain.alternatives] == [t for t, _ in python.alternatives]
    # The gate: the first token under it ends the chain at once, with no alternatives.
    feature = torch.randn(tiny_target.model.config.hidden_size, generator=generator)
    first = fast.chain(feature, 5, k=8, min_prob=0.0)
    gated = fast.chain(feature, 5, k=8, min_prob=first.probs[0] + 0.01, alternatives=2)
    assert gated == HeadChain((), (), ())
    assert fast.chain(feature, 5, k=2, min_prob=0.0).tokens == first.tokens[:2]


def test_no_head_chain_after_a_long_match(tiny_target, references) -> None:
    """A context match of HEAD_AFTER_MATCH tokens or more drafts without the head's products."""
    ids, expected = references[tiny.PROMPTS[1]]
    head = RecordingHead(_head(tiny_target))
    generation = generate(tiny_target, None, ids, max_new_tokens=MAX_NEW, k=4, head=head)
    rounds = list(generation)
    assert generation.output_ids == expected
    assert 0 < len(head.fed) < len(rounds) - 1  # (the tiny model repeats itself: long matches)


def test_a_head_that_raises_stops_drafting_and_the_answer_goes_on(
    tiny_target, references, head_always
) -> None:
    class Failing(RecordingHead):
        def chain(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().chain(*args, **kwargs)
            raise RuntimeError("simulated head failure")

    ids, expected = references[tiny.PROMPTS[2]]
    head = Failing(_head(tiny_target))
    with structlog.testing.capture_logs() as logs:
        generation = generate(tiny_target, None, ids, max_new_tokens=MAX_NEW, k=4, head=head)
        list(generation)
    assert generation.output_ids == expected
    assert len(head.fed) == 1  # tried once, then given no more
    assert [log["event"] for log in logs].count("draft_observe_failed") == 1


def test_no_state_while_grammar_tokens_are_held_ahead_or_the_breaker_is_open(clock) -> None:
    """Forced tokens the session was given ahead of the output were chosen by no row: the head
    is given no state until the output has caught up."""

    class Session(DraftSession):
        def __init__(self) -> None:
            self.observed = 0

        def propose(self, k: int) -> Candidates:
            return (Chain(),)

        def extend(self, token_ids) -> None:  # type: ignore[no-untyped-def]
            pass

        @property
        def wants_features(self) -> bool:
            return True

        def observe(self, feature: torch.Tensor) -> None:
            self.observed += 1

    class Forcing:
        def forced(self) -> tuple[int, ...]:
            return (7, 8)

        def prune(self, tree):  # type: ignore[no-untyped-def]
            return tree

    session = Session()
    speculator = Speculator(session, SpeculationParams())
    speculator.observe(torch.zeros(4))
    assert session.observed == 1
    # (while a request's acceptance breaker is open its drafts are not used: no state either)
    breaker = AcceptanceBreaker(threshold=0.9, window_rounds=1, reset_timeout_s=60.0, clock=clock)
    breaker.record(4, 0)
    assert breaker.state is BreakerState.OPEN
    shut = Session()
    Speculator(shut, SpeculationParams(), acceptance=breaker).observe(torch.zeros(4))
    assert shut.observed == 0
    speculator.propose(limit=8, constraint=Forcing())  # 7 and 8 given to the session ahead
    speculator.extend([7])  # the output caught up with one of them
    speculator.observe(torch.zeros(4))
    assert session.observed == 1
    speculator.extend([8])
    speculator.observe(torch.zeros(4))
    assert session.observed == 2
    # A starved request's next round rests (REST_EVERY): no state for a round that drafts none.
    starved = Session()
    resting = Speculator(starved, SpeculationParams())
    cut = Proposal.of(DraftTree.chain((5, 6), (0.5, 0.25), UNNAMED)).cut(0)  # none kept
    for _ in range(REST_AFTER):
        resting.record(cut, 0)
    assert resting.propose(limit=8).rested
    resting.observe(torch.zeros(4))
    assert starved.observed == 0
    resting.record(resting.propose(limit=8), 0)  # one rested round ...
    resting.observe(torch.zeros(4))
    assert starved.observed == 0
    for _ in range(REST_EVERY - 2):  # ... the others, until a round that drafts
        resting.record(resting.propose(limit=8), 0)
    assert not resting.propose(limit=8).rested
    resting.observe(torch.zeros(4))
    assert starved.observed == 1
