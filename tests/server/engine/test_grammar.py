"""Structured output: a grammar masks every verified node, prunes forbidden drafts before the
pass, drafts its forced tokens (jump-forward), and output stays plain decoding with it."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from kenspec.api.outputs import FinishReason
from kenspec.server.engine.draft import Candidates, Chain, DraftSession
from kenspec.server.engine.draft_tree import DraftTree, Source
from kenspec.server.engine.grammar import (
    GRAMMAR,
    JSON_OPTIONS,
    GrammarCompiler,
    GrammarSpec,
    unpack_bits,
)
from kenspec.server.engine.params import InvalidParameter, SamplingParams, SpeculationParams
from kenspec.server.engine.speculator import Speculator
from kenspec.server.engine.target import TargetModel
from tests import tiny
from tests.server.engine.drafts import FixedDraft, OracleDraft, generate

# Small enough that a random tiny model's masked output ends (EOS) within MAX_NEW_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 3},
    },
    "required": ["color", "ok", "n", "tag"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
MAX_NEW_TOKENS = 64
PROMPTS = tiny.PROMPTS[:8]


def compiler(target: TargetModel) -> GrammarCompiler:
    return GrammarCompiler(target.tokenizer, sorted(target.eos_token_ids), target.vocab_size)


def reference_masked_greedy(
    target: TargetModel, prompt_ids: Sequence[int], spec: GrammarSpec, max_new_tokens: int
) -> list[int]:
    """Plain greedy decoding with the grammar, without kenspec: the whole sequence through the
    model each step, its last logits masked by a fresh llguidance matcher's bitmask."""
    lltokenizer = llguidance.hf.from_tokenizer(
        target.tokenizer, n_vocab=target.vocab_size, eos_token=sorted(target.eos_token_ids)
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, lltokenizer.vocab_size)
    ids, output = list(prompt_ids), []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0, -1].float()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        logits[~unpack_bits(mask[0])[: logits.shape[0]]] = float("-inf")
        token = int(logits.argmax())
        output.append(token)
        if token in target.eos_token_ids:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return output


def assert_valid(text: str, finish: FinishReason | None) -> None:
    assert finish in (FinishReason.EOS, FinishReason.LENGTH)
    if finish == FinishReason.EOS:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_off_with_a_grammar_is_masked_greedy_decoding(tiny_target) -> None:
    for prompt in PROMPTS[:4]:
        ids = tiny_target.encode_prompt(prompt)
        off = generate(tiny_target, None, ids, enabled=False, grammar=SPEC, max_new_tokens=40)
        rounds = list(off)
        assert off.output_ids == reference_masked_greedy(tiny_target, ids, SPEC, 40)
        assert_valid(off.text, rounds[-1].finish_reason)


def test_greedy_output_with_a_grammar_is_identical_with_speculation_on(
    tiny_target, never_matching, partly_matching
) -> None:
    """Drafts that always match, never match, or are fixed garbage, chains and trees: the
    output is plain decoding's with the same grammar, token for token, and valid."""
    ended = 0
    for prompt in PROMPTS:
        ids = tiny_target.encode_prompt(prompt)
        off = generate(
            tiny_target, None, ids, enabled=False, grammar=SPEC, max_new_tokens=MAX_NEW_TOKENS
        )
        finish = list(off)[-1].finish_reason
        assert_valid(off.text, finish)
        ended += finish == FinishReason.EOS
        drafts = [
            (OracleDraft(off.output_ids), 1),
            (never_matching, 1),
            (partly_matching, 1),
            (partly_matching, 6),
            (FixedDraft([5, 6, 7, 8, 9]), 1),
        ]
        for draft, tree_budget in drafts:
            on = generate(
                tiny_target,
                draft,
                ids,
                grammar=SPEC,
                max_new_tokens=MAX_NEW_TOKENS,
                tree_budget=tree_budget,
            )
            rounds = list(on)
            assert on.output_ids == off.output_ids, (prompt, draft.name, tree_budget)
            assert rounds[-1].finish_reason == finish
    assert ended >= len(PROMPTS) // 2  # the test sees whole answers, not only cut ones


def test_sampled_outputs_are_valid_and_seeded_ones_equal_plain_sampling(
    tiny_target, partly_matching
) -> None:
    ids = tiny_target.encode_prompt(PROMPTS[0])
    ended = 0
    for seed in range(12):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        options = {"grammar": SPEC, "sampling": sampling, "max_new_tokens": MAX_NEW_TOKENS}
        on = generate(tiny_target, partly_matching, ids, **options)
        on_rounds = list(on)
        off = generate(tiny_target, None, ids, enabled=False, **options)
        list(off)
        assert on.output_ids == off.output_ids  # draws are keyed by output position
        assert_valid(on.text, on_rounds[-1].finish_reason)
        ended += on_rounds[-1].finish_reason == FinishReason.EOS
    assert ended >= 6


def test_forbidden_drafts_are_pruned_and_forced_tokens_drafted(tiny_target) -> None:
    """A draft of garbage: every node pruned before the pass (counted), so the rounds verify
    forced tokens alone, and take fewer passes than OFF (jump-forward)."""
    ids = tiny_target.encode_prompt(PROMPTS[1])
    garbage = tiny_target.tokenizer.encode("zzzz")
    off = generate(
        tiny_target, None, ids, enabled=False, grammar=SPEC, max_new_tokens=MAX_NEW_TOKENS
    )
    off_rounds = list(off)
    on = generate(
        tiny_target, FixedDraft(garbage), ids, grammar=SPEC, max_new_tokens=MAX_NEW_TOKENS
    )
    on_rounds = list(on)
    counters = on.generation.grammar.counters
    assert on.output_ids == off.output_ids
    assert counters.pruned >= len(garbage) and counters.forced > 0
    assert all(round_.source in ("", "grammar") for round_ in on_rounds)
    assert len(on_rounds) < len(off_rounds)
    assert off.generation.grammar.counters.forced == 0  # OFF drafts nothing, forced or not


def test_prune_drops_forbidden_nodes_their_subtrees_and_what_follows_eos(tiny_target) -> None:
    state = compiler(tiny_target).start(SPEC)
    encode = tiny_target.tokenizer.convert_tokens_to_ids
    brace, x = encode("{"), encode("x")
    eos = tiny_target.tokenizer.eos_token_id
    tree = DraftTree(
        tokens=(brace, x, brace, eos, x),
        parents=(-1, -1, 1, -1, 3),  # '{' ok; 'x' no, its child goes too; EOS no yet
        probs=(0.9, 0.5, 0.4, 0.3, 0.2),
        sources=((Source("a"),),) * 5,
    )
    assert state.prune(tree).tokens == (brace,)
    assert state.counters.pruned == 4
    done = compiler(tiny_target).start(GrammarSpec("regex", "ab"))
    a, b = encode("a"), encode("b")
    done.advance([a, b])
    after_end = DraftTree((eos, a), (-1, 0), (0.9, 0.8), ((Source("a"),),) * 2)
    assert done.prune(after_end).tokens == (eos,)  # EOS allowed at the end; nothing after it


def test_the_mask_follows_each_nodes_path_and_allows_eos_only_at_the_end(tiny_target) -> None:
    state = compiler(tiny_target).start(GrammarSpec("regex", "ab|ac"))
    encode = tiny_target.tokenizer.convert_tokens_to_ids
    a, b, c = encode("a"), encode("b"), encode("c")
    eos = tiny_target.tokenizer.eos_token_id
    vocab = tiny_target.vocab_size

    def allowed(path: Sequence[int]) -> set[int]:
        scores = state.process(torch.zeros(vocab), [], path)
        return set(torch.isfinite(scores).nonzero().flatten().tolist())

    assert a in allowed([]) and b not in allowed([]) and eos not in allowed([])
    assert {b, c} <= allowed([a]) and a not in allowed([a]) and eos not in allowed([a])
    assert allowed([a, b]) == {eos}
    assert a in allowed([])  # back to the root: rolled back, not re-compiled


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (GrammarSpec("json_schema", "{not json"), "response_format"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("lark", "start: missing_rule"), "missing_rule"),
    ],
)
def test_a_grammar_that_does_not_compile_is_an_invalid_parameter_naming_why(
    tiny_target, spec: GrammarSpec, reason: str
) -> None:
    with pytest.raises(InvalidParameter) as caught:
        compiler(tiny_target).start(spec)
    assert caught.value.field == "response_format" and reason in str(caught.value)


class Recording(DraftSession):
    """Proposes tokens 100, 101; records what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def propose(self, k: int) -> Candidates:
        self.calls.append(("propose", ()))
        return (Chain((100, 101), (0.9, 0.8), Source("a")),)

    def extend(self, token_ids: Sequence[int]) -> None:
        self.calls.append(("extend", tuple(token_ids)))


class Forcing:
    """A constraint forcing 7, 8 and allowing anything but 101."""

    def forced(self) -> tuple[int, ...]:
        return (7, 8)

    def prune(self, tree: DraftTree) -> DraftTree:
        keep = [n for n, token in enumerate(tree.tokens) if token != 101]
        return tree.subset(keep)


def test_the_learned_tree_is_drafted_after_the_forced_tokens_and_learned_alone() -> None:
    session = Recording()
    speculator = Speculator(session, SpeculationParams(num_draft_tokens=8))
    proposal = speculator.propose(limit=10, constraint=Forcing())
    tree = proposal.tree
    assert tree.tokens == (7, 8, 100) and tree.parents == (-1, 0, 1)
    assert tree.sources[:2] == ((GRAMMAR,), (GRAMMAR,)) and proposal.forced == 2
    assert session.calls == [("extend", (7, 8)), ("propose", ())]  # forced first, then drafted
    assert proposal.gains[:2] == [1.0, 1.0] and proposal.source == "a"
    assert proposal.cut(2).source == "grammar"  # only forced tokens kept
    speculator.record(proposal, 3, [0, 1, 2])
    speculator.extend([7, 8, 100, 5])
    assert session.calls[-1] == ("extend", (100, 5))  # the forced ones it held already
    own = speculator._own.counts((Source("a"), False))
    assert own == (1.0, 1.0)  # the learned node alone: one tried, one accepted
