"""Token trees: best-first construction, tree attention in packed passes, the acceptance walk,
the accepted path's keys and values made contiguous, and exact output with trees on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.draft import Chain
from kenspec.server.engine.draft_tree import Source, chain_parents
from kenspec.server.engine.params import SamplingParams
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.sampling import greedy_choice, walk
from kenspec.server.engine.speculative_engine import BreakerSettings
from kenspec.server.engine.token_tree import build_tree
from kenspec.server.engine.verify_pass import PassRow, VerifyPass
from tests.server.engine.drafts import Branching, generate

# -- construction ------------------------------------------------------------------------


def chain(tokens: Sequence[int], source: str) -> Chain:
    return Chain(tuple(tokens), (1.0,) * len(tokens), Source(source))


a, b, c, r = Source("a"), Source("b"), Source("c"), Source("r")
RATES = {a: 0.8, b: 0.5, c: 0.3}


def test_chains_merge_into_one_trie_best_path_first() -> None:
    """a: 1 2 3, b: 1 4, c: 5. Node 1 is proposed by a and b: 1 - 0.2 * 0.5 = 0.9; siblings
    exclude each other, the likelier first: 5 keeps min(0.3, 1 - 0.9) = 0.1."""
    tree = build_tree(
        [chain([1, 2, 3], "a"), chain([1, 4], "b"), chain([5], "c")],
        RATES.__getitem__,
        budget=10,
        max_depth=10,
        root_token=0,
        min_path_probability=0.0,
    )
    # Path probabilities: 1 -> 0.9; below it 2 -> 0.9 * 0.8 and 4 -> 0.9 * min(0.5, 0.2);
    # 3 -> 0.72 * 0.8; 5 -> 0.1.
    assert tree.tokens == (1, 2, 3, 4, 5)
    assert tree.parents == (-1, 0, 1, 0, -1)
    assert tree.probs == pytest.approx([0.9, 0.72, 0.576, 0.18, 0.1])
    assert tree.sources == ((a, b), (a,), (a,), (b,), (c,))
    assert list(tree.probs) == sorted(tree.probs, reverse=True)  # a prefix is the best subtree
    assert all(parent < node for node, parent in enumerate(tree.parents))


def test_budget_depth_and_minimum_probability_bound_the_tree() -> None:
    chains = [chain([1, 2, 3, 4], "a"), chain([5, 6], "c")]
    small = build_tree(chains, RATES.__getitem__, budget=2, max_depth=10, root_token=0)
    assert small.tokens == (1, 2)
    shallow = build_tree(chains, RATES.__getitem__, budget=10, max_depth=1, root_token=0)
    assert sorted(shallow.tokens) == [1, 5] and max(shallow.depths()) == 1
    likely = build_tree(
        chains, RATES.__getitem__, budget=10, max_depth=10, root_token=0, min_path_probability=0.25
    )
    # The root's children: 1 -> 0.8, 5 -> min(0.3, 1 - 0.8) = 0.2 (below the minimum); then
    # 2, 3, 4 -> 0.64, 0.51, 0.41.
    assert likely.tokens == (1, 2, 3, 4)


def test_expansion_adds_branches_below_any_node() -> None:
    """expand(token) gives a node's children: here, recycled predictions after each token."""
    table = {0: [(7, r)], 7: [(8, r)], 1: [(9, r)]}
    tree = build_tree(
        [chain([1], "a")],
        {a: 0.8, r: 0.5}.__getitem__,
        budget=5,
        max_depth=3,
        root_token=0,
        expand=lambda token: table.get(token, []),
        min_path_probability=0.0,
    )
    nodes = dict(zip(tree.tokens, zip(tree.parents, tree.sources, strict=True), strict=True))
    assert nodes[1] == (-1, (a,)) and nodes[7] == (-1, (r,))  # the root's children
    assert tree.tokens[nodes[9][0]] == 1 and tree.tokens[nodes[8][0]] == 7
    assert tree.reached([tree.tokens.index(1)]) == [
        i for i, p in enumerate(tree.parents) if p in (-1, tree.tokens.index(1))
    ]


# -- the walk ----------------------------------------------------------------------------


def one_hot_rows(argmaxes: list[int], vocab: int = 16) -> Logits:
    rows = torch.zeros(len(argmaxes), vocab)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return Logits.of(rows)


def test_the_walk_follows_the_child_the_target_chose_and_emits_its_own_token() -> None:
    # Tree: root -> 5 (node 0), root -> 6 (node 1), 6 -> 7 (node 2), 5 -> 9 (node 3).
    tokens, parents = [5, 6, 7, 9], [-1, -1, 1, 0]
    # Rows: after root, after node 0, 1, 2, 3. The target chooses 6, then 7, then 11 (bonus).
    logits = one_hot_rows([6, 9, 7, 11, 3])
    assert walk(tokens, parents, greedy_choice(logits)) == ([6, 7, 11], [1, 2])
    assert walk(tokens, parents, greedy_choice(one_hot_rows([4, 0, 0, 0, 0]))) == ([4], [])
    assert walk(tokens, parents, greedy_choice(one_hot_rows([5, 9, 0, 0, 2]))) == (
        [5, 9, 2],
        [0, 3],
    )
    assert chain_parents(3) == (-1, 0, 1)


# -- tree attention ----------------------------------------------------------------------


def test_a_tree_pass_scores_every_node_as_if_its_path_were_decoded_alone(tiny_target) -> None:
    """Each node attends to the cache and its own ancestors only, at depth positions: its
    logits equal a plain pass over prompt + the node's path. Packed beside a sequence row."""
    prompt = tiny_target.encode_prompt("the quick brown fox")
    other = tiny_target.encode_prompt("a second row of the same pass")
    tokens, parents = [11, 12, 13, 14, 15], [-1, -1, 0, 1, 2]  # two branches, one deeper
    cache = tiny_target.new_cache(2)
    tiny_target.prefill(cache, 0, 0, other[:-1])
    tiny_target.prefill(cache, 1, 0, prompt[:-1])
    tree = PassRow(len(prompt) - 1, prompt[-1], tuple(tokens), tuple(parents))
    logits = tiny_target.forward(cache, VerifyPass((PassRow(len(other) - 1, other[-1]), tree)))
    for node in range(-1, len(tokens)):
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        alone = tiny_target.forward(
            tiny_target.new_cache(), VerifyPass.sequences([0], [prompt + path])
        )[0]
        expected = alone[len(prompt) + len(path) - 1]
        assert torch.allclose(logits[1][node + 1], expected, atol=1e-4), node
    alone_other = tiny_target.forward(tiny_target.new_cache(), VerifyPass.sequences([0], [other]))[
        0
    ]
    assert torch.allclose(logits[0][0], alone_other[len(other) - 1], atol=1e-4)


# -- end to end --------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [2, 5, 12])
def test_greedy_output_is_exact_when_the_accepted_path_is_not_the_first_branch(
    tiny_target, references, budget
) -> None:
    """The tree's first branch is wrong at its root, the second right: every round accepts
    nodes stored out of place, which are moved to their contiguous positions before the next
    pass reads them. Output equals plain greedy decoding."""
    moved = 0
    for ids, expected in list(references.values())[:6]:
        draft = Branching(expected, tiny_target.vocab_size)
        generation = generate(
            tiny_target, draft, ids, max_new_tokens=len(expected), k=4, tree_budget=budget
        )
        rounds = []
        for round_ in generation:
            rounds.append(round_)
            moved += bool(generation.generation.kv_moves)
        assert generation.output_ids == expected
        assert all(r.source == "tree" for r in rounds if r.drafted)
        assert sum(r.accepted for r in rounds) > len(rounds)  # the right branch was followed
    assert moved > 0


def test_a_branch_source_that_raises_trips_the_draft_fault_breaker(tiny_target, references) -> None:
    ids, expected = next(iter(references.values()))
    draft = Branching(expected, tiny_target.vocab_size, fail=True)
    generation = generate(
        tiny_target,
        draft,
        ids,
        max_new_tokens=len(expected),
        tree_budget=8,
        breaker=BreakerSettings(fault_max=2),
    )
    assert [t for r in generation for t in r.token_ids] == expected
    assert generation.engine.draft_breaker_state is BreakerState.OPEN


def test_seeded_sampling_gives_the_same_text_with_trees_and_chains(tiny_target, references) -> None:
    """Draws are keyed by output position, so a seeded request's text does not depend on the
    drafts, trees included."""
    ids, expected = next(iter(references.values()))
    sampling = SamplingParams(temperature=1.0, seed=7)
    outputs = []
    for budget in (1, 6):
        generation = generate(
            tiny_target,
            Branching(expected, tiny_target.vocab_size),
            ids,
            max_new_tokens=16,
            sampling=sampling,
            tree_budget=budget,
        )
        list(generation)
        outputs.append(generation.output_ids)
    plain = generate(tiny_target, None, ids, max_new_tokens=16, sampling=sampling)
    list(plain)
    assert outputs[0] == outputs[1] == plain.output_ids


class NeverRight(Branching):
    """Both branches wrong at the root: every tree round accepts nothing."""

    def start(self, prompt_ids: Sequence[int]):  # type: ignore[no-untyped-def]
        wrong = [(token + 2) % self.vocab for token in self.reference]
        return Branching(wrong, self.vocab).start(prompt_ids)


def test_trees_that_never_match_open_the_acceptance_breaker(tiny_target, references) -> None:
    """Judged hit or miss over a window 4 times the chain's, a tree that never hits opens
    the request's breaker, and the request goes on decoding plainly."""
    ids, expected = next(iter(references.values()))
    generation = generate(
        tiny_target,
        NeverRight(expected, tiny_target.vocab_size),
        ids,
        max_new_tokens=len(expected),
        tree_budget=6,
        breaker=BreakerSettings(window_rounds=2, threshold=0.3, reset_timeout_s=60.0),
    )
    rounds = list(generation)
    assert generation.output_ids == expected
    assert all(r.accepted == 0 for r in rounds)
    speculative = [r for r in rounds if r.drafted]
    assert len(speculative) == 8  # 2 x 4 rounds fill the window, then the breaker opens
    assert rounds[-1].breaker_state is BreakerState.OPEN
