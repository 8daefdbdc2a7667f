"""The verification rule as pure functions, and its output distribution against the exact target."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from kenspec.server.engine import round as round_module
from kenspec.server.engine.draft import Candidates, Chain, DraftSession
from kenspec.server.engine.draft_tree import Source
from kenspec.server.engine.params import (
    InvalidParameter,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.sampling import accept_greedy, accept_sampled, warp_logits
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from tests.server.engine.drafts import FixedDraft, generate


def logits_with_argmax(argmaxes: list[int], vocab: int = 8, scale: float = 1.0) -> Logits:
    """Fake logits whose row i has its maximum at argmaxes[i] (as vLLM's tests build them)."""
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0 * scale
    return Logits.of(logits)


@pytest.mark.parametrize(
    ("drafts", "argmaxes", "emitted"),
    [
        ([], [3], [3]),  # autoregressive: the target's own token
        ([5, 7, 1], [5, 7, 1, 4], [5, 7, 1, 4]),  # all accepted + bonus
        ([5, 7, 1], [5, 7, 2, 4], [5, 7, 2]),  # first mismatch at position 3
        ([5, 7, 1], [6, 7, 1, 4], [6]),  # nothing accepted
        ([0], [0, 0], [0, 0]),
    ],
)
def test_accept_greedy(drafts: list[int], argmaxes: list[int], emitted: list[int]) -> None:
    assert accept_greedy(drafts, logits_with_argmax(argmaxes)) == emitted


def test_accept_sampled_with_one_hot_target_is_deterministic() -> None:
    logits = logits_with_argmax([5, 7, 2, 4], scale=100)  # all mass on the argmax after softmax
    generator = torch.Generator().manual_seed(0)
    draws = lambda _: generator  # noqa: E731
    assert accept_sampled([5, 7, 1], logits, SamplingParams(1.0), draws) == [5, 7, 2]


class CountingRows(Logits):
    """Logit rows that record which positions were read."""

    def __init__(self, logits: Logits) -> None:
        rows = torch.stack([logits[i] for i in range(len(logits))])
        super().__init__(len(logits), rows=rows)
        self.read: list[int] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        self.read.append(index)
        return super().__getitem__(index)


def test_rows_past_the_first_mismatch_are_never_read() -> None:
    rows = CountingRows(logits_with_argmax([5, 6, 1, 4]))
    assert accept_greedy([5, 7, 1], rows) == [5, 6]
    assert rows.read == [0, 1]
    rows = CountingRows(logits_with_argmax([5, 6, 1, 4], scale=100))
    generator = torch.Generator()
    assert accept_sampled([5, 7, 1], rows, SamplingParams(1.0), lambda _: generator) == [5, 6]
    assert rows.read == [0, 1]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.5), {0}),  # p(0) = 0.5 already reaches top_p
        (SamplingParams(temperature=1.0, top_p=0.75), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.99), {0, 1, 2}),
    ],
)
def test_warp_logits_filters(params: SamplingParams, kept: set[int]) -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp_logits(logits, params)[0]
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == kept
    assert probs.sum().item() == pytest.approx(1.0)


def test_warp_logits_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    hot = warp_logits(logits, SamplingParams(temperature=2.0))[0, 0].item()
    cold = warp_logits(logits, SamplingParams(temperature=0.5))[0, 0].item()
    assert hot < torch.softmax(logits, -1)[0, 0].item() < cold


def test_a_temperature_too_small_for_the_logits_samples_the_best_tokens() -> None:
    """1e-45 (a denormal: a logit of 10 over it overflows to inf, which made NaN
    probabilities and an INTERNAL error, found by the gRPC fuzzing) and 5e-324 (0 in float32:
    0 / 0 made NaN, found by the HTTP fuzzing): the best token, or an even draw among tied
    best ones, as the limit of softmax(logits / t) is."""
    logits = torch.tensor([[10.0, 3.0, 10.0, -5.0, float("-inf")]])
    for temperature in (5e-324, 7e-46, 1.401298464324817e-45, 1e-30):
        probs = warp_logits(logits, SamplingParams(temperature=temperature))[0]
        assert probs.tolist() == [0.5, 0.0, 0.5, 0.0, 0.0]
        filtered = warp_logits(logits, SamplingParams(temperature=temperature, top_p=0.4))[0]
        assert sorted(filtered.tolist()) == [0.0] * 4 + [1.0] and filtered[[0, 2]].sum() == 1


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SamplingParams(temperature=-0.1), "temperature"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(top_k=-1), "top_k"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(seed=-1), "seed"),
        (lambda: StoppingParams(max_new_tokens=0), "max_new_tokens"),
        (lambda: StoppingParams(stop=("",)), "stop[0]"),
        (lambda: SpeculationParams(num_draft_tokens=0), "num_draft_tokens"),
    ],
)
def test_invalid_parameters_name_the_field(build, field: str) -> None:
    with pytest.raises(InvalidParameter) as error:
        build()
    assert error.value.field == field
    assert field in str(error.value)


# --- distribution tests -------------------------------------------------------------------------

SAMPLES = 3000
PROMPT = "the cat"


def exact_joint(target: TargetModel, prompt_ids: list[int], params: SamplingParams) -> dict:
    """p(y1, y2) = p(y1) p(y2 | y1) from the model's own logits, after the same warping."""
    vocab = target.vocab_size
    first = warp_logits(_last_logits(target, prompt_ids), params)[0]
    joint = {}
    for y1 in range(vocab):
        if first[y1] == 0:
            continue
        second = warp_logits(_last_logits(target, [*prompt_ids, y1]), params)[0]
        for y2 in range(vocab):
            joint[(y1, y2)] = first[y1].item() * second[y2].item()
    return joint


def _last_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    return target.forward(target.new_cache(), VerifyPass.sequences([0], [ids]))[0][len(ids) - 1][
        None
    ]


def speculative_samples(
    target, prompt_ids, params, draft, *, tree_budget: int = 1, processing=None
) -> list[tuple[int, int]]:
    samples = []
    for seed in range(SAMPLES):
        sampling = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        generation = generate(
            target,
            draft,
            prompt_ids,
            max_new_tokens=2,
            k=2,
            sampling=sampling,
            ignore_eos=True,
            tree_budget=tree_budget,
            processing=processing,
        )
        list(generation)
        samples.append(tuple(generation.output_ids[:2]))
    return samples


def chi_square_pvalue(samples: list[tuple[int, int]], joint: dict) -> float:
    """Pearson chi-square of the samples against joint, pooling cells expected below 5."""
    counts = {cell: 0 for cell in joint}
    for cell in samples:
        counts[cell] = counts.get(cell, 0) + 1
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, probability in joint.items():
        if probability * SAMPLES >= 5:
            observed.append(counts[cell])
            expected.append(probability * SAMPLES)
        else:
            pooled_observed += counts[cell]
            pooled_expected += probability * SAMPLES
    pooled_observed += sum(c for cell, c in counts.items() if cell not in joint)
    observed.append(pooled_observed)
    expected.append(max(pooled_expected, 1e-9))
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def likely_draft(target: TargetModel, prompt_ids: list[int], params: SamplingParams) -> FixedDraft:
    """A draft of the most likely first token then the second most likely next one:
    accepted often, rejected often, so both branches of the rule are exercised."""
    first = warp_logits(_last_logits(target, prompt_ids), params)[0]
    y1 = int(first.argmax())
    second = warp_logits(_last_logits(target, [*prompt_ids, y1]), params)[0]
    y2 = int(torch.topk(second, 2).indices[1])
    return FixedDraft([y1, y2])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1", "t0.7-topk6-topp0.9"],
)
def test_speculative_sampling_follows_target_distribution(word_target, params) -> None:
    prompt_ids = word_target.encode_prompt(PROMPT)
    joint = exact_joint(word_target, prompt_ids, params)
    draft = likely_draft(word_target, prompt_ids, params)
    samples = speculative_samples(word_target, prompt_ids, params, draft)
    accepted_first = sum(1 for s in samples if s[0] == draft.tokens[0]) / SAMPLES
    assert 0.05 < accepted_first < 0.95, "the draft must be neither always nor never accepted"
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_distribution_check_rejects_an_always_accept_rule(word_target, monkeypatch) -> None:
    """The same check on a wrong rule (accept every draft) must fail: the test has power."""
    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt(PROMPT)
    joint = exact_joint(word_target, prompt_ids, params)
    draft = likely_draft(word_target, prompt_ids, params)

    def always_accept(drafts, parents, choose):  # a chain's drafts, all kept, then a draw
        return [*drafts, choose(len(drafts), list(drafts))], list(range(len(drafts)))

    # A deliberately wrong acceptance rule in the round, to show the test has power.
    monkeypatch.setattr(round_module, "walk", always_accept)
    samples = speculative_samples(word_target, prompt_ids, params, draft)
    assert chi_square_pvalue(samples, joint) < 1e-6


def test_same_seed_same_output_whatever_runs_in_between(tiny_target) -> None:
    prompt_ids = tiny_target.encode_prompt("The quick brown fox")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    draft = FixedDraft([5, 6, 7])
    first = generate(tiny_target, draft, prompt_ids, sampling=params, k=3)
    other = generate(
        tiny_target, draft, prompt_ids, sampling=SamplingParams(temperature=1.0, seed=9)
    )
    list(first)
    interleaved = generate(tiny_target, draft, prompt_ids, sampling=params, k=3)
    for _ in itertools.zip_longest(interleaved, other):  # advance both generations in turns
        pass
    assert first.output_ids == interleaved.output_ids
    assert generate(tiny_target, draft, prompt_ids, sampling=params).seed == 1234
    unseeded = generate(tiny_target, draft, prompt_ids, sampling=SamplingParams(temperature=1.0))
    assert 0 <= unseeded.seed < 2**63


def test_context_draft_sampling_follows_target_distribution(word_target) -> None:
    """The same check with the context draft: 'the' was followed by 'cat' earlier in the
    prompt, so the context proposes 'cat', and the n-gram stand-in continues."""
    from kenspec.server.engine.context_draft import ContextDraft

    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt("the cat runs and the")
    joint = exact_joint(word_target, prompt_ids, params)
    draft = ContextDraft(likely_draft(word_target, prompt_ids, params), min_match=1, max_match=3)
    assert draft.start(prompt_ids).propose(2)[0].tokens[0] == word_target.encode_prompt("cat")[0]
    samples = speculative_samples(word_target, prompt_ids, params, draft)
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_suffix_index_sampling_follows_target_distribution(word_target) -> None:
    """The same check with drafts from the global suffix index: an earlier answer held
    'and the dog sleeps', a 2-token match where the prompt's own context has 1."""
    from kenspec.server.engine.context_draft import ContextDraft
    from kenspec.server.engine.suffix_index import SuffixIndex

    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt("the cat runs and the")
    index = SuffixIndex()
    index.add(word_target.encode_prompt("red and the dog sleeps"))
    joint = exact_joint(word_target, prompt_ids, params)
    draft = ContextDraft(None, min_match=1, max_match=3, suffix=index)
    chain = draft.start(prompt_ids).propose(2)[0]
    assert chain.source == Source("suffix", 2)
    assert list(chain.tokens) == word_target.encode_prompt("dog sleeps")
    samples = speculative_samples(word_target, prompt_ids, params, draft)
    assert chi_square_pvalue(samples, joint) > 1e-3


class TwoChains(DraftSession):
    """Two chains from the root: the most likely first token and the second most likely one,
    each followed by its most likely next token (a 2-token answer keeps only the root's two
    children: a tree is never deeper than the tokens left to emit, minus one)."""

    name = "two-chains"

    def __init__(self, first: tuple[int, int], second: tuple[int, int]) -> None:
        self.first, self.second = first, second

    def start(self, prompt_ids):  # type: ignore[no-untyped-def]
        return self

    def propose(self, k: int) -> Candidates:
        return (
            Chain(self.first[:k], (1.0,) * k, Source("a")),
            Chain(self.second[:k], (1.0,) * k, Source("b")),
        )

    def extend(self, token_ids) -> None:  # type: ignore[no-untyped-def]
        pass


def two_chains(target: TargetModel, prompt_ids: list[int], params: SamplingParams) -> TwoChains:
    first = warp_logits(_last_logits(target, prompt_ids), params)[0]
    y1, z1 = (int(t) for t in torch.topk(first, 2).indices)
    follow = [
        int(warp_logits(_last_logits(target, [*prompt_ids, y]), params)[0].argmax())
        for y in (y1, z1)
    ]
    return TwoChains((y1, follow[0]), (z1, follow[1]))


def test_token_tree_sampling_follows_target_distribution(word_target) -> None:
    """Sampling over a token tree (two branches at the root) gives the target's joint
    distribution, and both branches are taken."""
    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt(PROMPT)
    joint = exact_joint(word_target, prompt_ids, params)
    draft = two_chains(word_target, prompt_ids, params)
    samples = speculative_samples(word_target, prompt_ids, params, draft, tree_budget=4)
    firsts = [s[0] for s in samples]
    assert firsts.count(draft.first[0]) > 0.05 * SAMPLES
    assert firsts.count(draft.second[0]) > 0.05 * SAMPLES
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_distribution_check_rejects_taking_the_best_child_whatever_was_drawn(
    word_target, monkeypatch
) -> None:
    """A wrong tree rule, moving to the best-scored child without drawing y, must fail."""
    params = SamplingParams(temperature=1.0)
    prompt_ids = word_target.encode_prompt(PROMPT)
    joint = exact_joint(word_target, prompt_ids, params)
    draft = two_chains(word_target, prompt_ids, params)

    def best_child(drafts, parents, choose):  # node 0, then a draw after it
        return [drafts[0], choose(1, [drafts[0]])], [0]

    monkeypatch.setattr(round_module, "walk", best_child)
    samples = speculative_samples(word_target, prompt_ids, params, draft, tree_budget=4)
    assert chi_square_pvalue(samples, joint) < 1e-6
