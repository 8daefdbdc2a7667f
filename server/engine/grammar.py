"""Structured output: a grammar (llguidance) constrains every verified node of a round.

A request with a grammar (a JSON schema, any JSON object, a regex or a Lark grammar) gets a
`GrammarState`: an llguidance matcher at the request's output so far. It acts three times a
round, and never decides a token itself (the masked target does), so output stays exactly
plain decoding with the same grammar:

- before the pass, `forced()`: the tokens the grammar leaves no choice about (jump-forward:
  the canonical tokens of its forced bytes). The speculator drafts them at the front of the
  tree, and builds the learned tree after them (`Speculator.propose`);
- `prune(tree)`: a node the grammar forbids after its own path is dropped with its subtree
  before the pass (the masked target could never choose it), so no pass slot is spent on it;
- at every verified node, `process(scores, output, path)` (a RowProcessor): the logits of
  every token the grammar forbids after output + path become -inf, EOS included until the
  grammar accepts (the grammar decides when the answer may end);
- after the walk, `advance(emitted)` moves the matcher on by the round's tokens.

A tree's nodes each need the matcher state after their own path: one matcher follows the
path being looked at, rolled back to the longest common prefix and advanced by the rest
(`_seek`; the walk's paths only grow, so that is one token per verified node, and a tree's
pruning visits its nodes in order, parents first). llguidance's rollback costs well under a
microsecond (bench/results/structured-output/NOTES.md).

Example: schema {"type": "object", "properties": {"name": {"type": "string"}}, "required":
["name"], "additionalProperties": false} with SmolLM2's tokenizer: before any output,
forced() is ('{"', 'name', '":') as tokens; after '{"name": "Al' nothing is forced, and EOS is
masked until the closing '"}' is out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from server.engine.draft_tree import DraftTree, Source
from server.engine.params import InvalidParameter, StoppingParams

if TYPE_CHECKING:  # a stub-only type of llguidance's
    from llguidance._lib import JsonCompileOptions

GRAMMAR = Source("grammar")  # the source of jump-forward drafts: tokens the grammar forces
# JSON as most chat models write it: one space after ':' and ','; no other whitespace, so
# a schema's keys and punctuation are forced bytes (jump-forward drafts them). A schema may
# override these with llguidance's "x-guidance" key.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match: `kind`, and its `source` text (a JSON schema as
    JSON, a regex, a Lark grammar; "" for json_object, any JSON object). `field`: the request
    field it comes from, named by its errors; `stops`: stop sequences may end the output
    before the grammar does (tool calls, whose text around the calls is free)."""

    kind: GrammarKind
    source: str = ""
    field: str = "response_format"
    stops: bool = False


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer (its llguidance view is built once, about a
    second for a 49k vocabulary, on the first request that asks for a grammar)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], vocab_size: int
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._vocab_size = max(vocab_size, len(tokenizer))  # the logits' width
        self._lltokenizer: llguidance.LLTokenizer | None = None

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A request's state for `spec`, compiled (about a millisecond for a typical schema);
        InvalidParameter("response_format", llguidance's reason) for a grammar it cannot
        compile (a bad regex, a schema keyword it does not enforce, such as uniqueItems)."""
        if self._lltokenizer is None:
            if not isinstance(self._tokenizer, PreTrainedTokenizerFast):
                raise InvalidParameter(
                    spec.field, "structured output needs the model's fast tokenizer"
                )
            self._lltokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
            )
        matcher = llguidance.LLMatcher(self._lltokenizer, _grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidParameter(spec.field, f"cannot compile: {matcher.get_error()}")
        return GrammarState(matcher, self._lltokenizer.vocab_size, frozenset(self._eos))


def check_stopping(stopping: StoppingParams, spec: GrammarSpec) -> None:
    """What a grammar cannot be combined with: stop sequences (one could cut the output short
    of a match, which `stop` would then report as whole), unless the spec allows them, and
    ignore_eos (the grammar decides where the output ends)."""
    if stopping.stop and not spec.stops:
        raise InvalidParameter(
            "stop", f"cannot be combined with {spec.field}: a stop could cut the output short"
        )
    if stopping.ignore_eos:
        raise InvalidParameter(
            "ignore_eos", f"cannot be combined with {spec.field}: the grammar decides the end"
        )


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as error:
        raise InvalidParameter("response_format", f"not a JSON schema: {error}") from None


@dataclass(slots=True)
class GrammarCounters:
    """What the grammar did for one request: pass slots it saved and drafts it gave."""

    masks: int = 0  # verified nodes masked
    pruned: int = 0  # draft nodes dropped before the pass (with their subtrees)
    forced: int = 0  # jump-forward tokens offered as drafts
    # CPU seconds of the engine's thread in the grammar (forced tokens, pruning, masks,
    # advancing): what it costs, without the waits a shared machine adds to wall time
    seconds: float = 0.0


class GrammarState:
    """One request's matcher (see the module doc); a RowProcessor for its verified nodes."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos: frozenset[int]) -> None:
        self._matcher = matcher
        self._path: list[int] = []  # tokens the matcher holds past the output
        # An EOS that ends _path is held, not consumed: the matcher takes none once the
        # grammar has stopped (a closed JSON value), and nothing follows EOS anyway.
        self._eos_held = False
        self._vocab = vocab  # tokens its masks cover
        self._eos = eos
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        self.counters = GrammarCounters()

    def forced(self) -> tuple[int, ...]:
        """Tokens the grammar forces after the output (jump-forward), canonically tokenized."""
        started = time.thread_time()
        self._seek(())
        forced = tuple(self._matcher.compute_ff_tokens())
        self.counters.forced += len(forced)
        self.counters.seconds += time.thread_time() - started
        return forced

    def prune(self, tree: DraftTree) -> DraftTree:
        """`tree` without the nodes the grammar forbids after their own path, nor their
        subtrees (parents come first, so a node is looked at after its parent)."""
        started = time.thread_time()
        paths: dict[int, tuple[int, ...]] = {-1: ()}
        keep: list[int] = []
        for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            if parent not in paths or (parent >= 0 and tree.tokens[parent] in self._eos):
                continue  # its parent was dropped, or is EOS: nothing follows the end
            self._seek(paths[parent])
            if self._allows(token):
                paths[node] = (*paths[parent], token)
                keep.append(node)
        self.counters.pruned += len(tree) - len(keep)
        self.counters.seconds += time.thread_time() - started
        return tree if len(keep) == len(tree) else tree.subset(keep)

    def _allows(self, token: int) -> bool:
        """Whether `token` may follow (EOS: whether the output matches; a matcher that has
        stopped, its value closed, validates no token, not even EOS)."""
        if token in self._eos:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        """scores [vocab] with every token the grammar forbids after output + path at -inf
        (the matcher follows the output through `advance`, so `output` is not read)."""
        started = time.thread_time()
        self._seek(path)
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        penalty = mask_penalty(self._bitmask[0])[: scores.shape[0]]
        width = penalty.shape[0]
        scores[:width] += penalty.to(scores.device)
        scores[width:] = float("-inf")  # tokens past the grammar's vocabulary
        self.counters.masks += 1
        self.counters.seconds += time.thread_time() - started
        return scores

    def advance(self, emitted: Sequence[int]) -> None:
        """The round emitted `emitted` (after the last output token): they are the output now."""
        started = time.thread_time()
        self._seek(emitted)
        self._path = []
        self.counters.seconds += time.thread_time() - started

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a whole match (EOS allowed)."""
        self._seek(())
        return self._matcher.is_accepting()

    def _seek(self, path: Sequence[int]) -> None:
        """Move the matcher to output + path: roll back to the common prefix, consume the rest
        (an EOS, last in a path if anywhere, is held; see __init__)."""
        common = 0
        for held, wanted in zip(self._path, path, strict=False):
            if held != wanted:
                break
            common += 1
        if common < len(self._path):
            consumed = len(self._path) - common - self._eos_held
            if consumed:
                self._matcher.rollback(consumed)
            del self._path[common:]
            self._eos_held = False
        rest = list(path[common:])
        ends = bool(rest) and rest[-1] in self._eos
        if ends:
            rest.pop()
        if rest and not self._matcher.consume_tokens(rest):
            # pruning and the masks keep every path inside the grammar: this is a bug
            raise RuntimeError(f"grammar refused tokens {rest}: {self._matcher.get_error()}")
        self._path.extend(rest)
        if ends:
            if not self._matcher.is_accepting():
                raise RuntimeError("grammar refused EOS before the output matches it")
            self._path.append(path[-1])
            self._eos_held = True


_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1  # [byte, bit]: is it set
_PENALTIES = torch.zeros(256, 8).masked_fill_(~_BITS, float("-inf"))  # 0 where set, else -inf


def unpack_bits(bitmask: torch.Tensor) -> torch.Tensor:
    """An int32 bitmask [words] (bit i of word w: token 32w + i) as bools [32 * words].
    (llguidance's own unpacking is a torch.compile kernel: seconds to compile on first use.)"""
    return _BITS[bitmask.view(torch.uint8).long()].reshape(-1)


def mask_penalty(bitmask: torch.Tensor) -> torch.Tensor:
    """The bitmask as float32 [32 * words] to add to logits: 0 where allowed (x + 0 is x
    exactly), -inf where not. One gather and one add: a third of a boolean masked_fill's
    time on a 49k vocabulary."""
    return _PENALTIES[bitmask.view(torch.uint8).long()].reshape(-1)


def schema_text(schema: object) -> str:
    """A JSON schema (already parsed) as the JSON text a GrammarSpec holds."""
    return json.dumps(schema, separators=(",", ":"))
