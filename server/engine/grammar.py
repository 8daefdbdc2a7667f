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

Grammars are the client's, so compiling one is guarded (GrammarCompiler.start):

- it runs in a thread of its own, never on the event loop nor the engine thread: a typical
  schema takes a millisecond, a hostile one (50,000 alternatives, a 100,000-value enum)
  seconds. Its stack is sized to the grammar: llguidance's compilers recurse once per level
  of a chain of $refs or Lark rules, a few KiB a level, so a 30 KB schema overflows the usual
  8 MiB and kills the process (SIGSEGV);
- llguidance's limits (LLParserLimits, its defaults) bound a compile and every step after;
  what exceeds them, and a grammar that matches no text at all ({"$ref": "#"}), is refused
  as InvalidParameter(the spec's field, llguidance's reason). The first steps, where such
  grammars fail (the forced text, the first mask), are taken in the compile's thread too;
- a grammar that fails later, its output under way (a limit reached further on, a branch that
  leads nowhere), ends its request with the same InvalidParameter, never a wrong token.

llguidance is the `grammar` extra (server.extras). The server does not import it: the first
compile does, in its thread (about a second, which the event loop does not wait for). Without
it, plain requests are served and one with a grammar is refused at `GrammarCompiler.start`
with ExtraMissing (UNIMPLEMENTED, HTTP 501), naming the extra to install.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from kenspec.server.engine.draft_tree import DraftTree, Source
from kenspec.server.engine.extras import GRAMMAR_FEATURE, ExtraMissing, missing_package
from kenspec.server.engine.params import InvalidParameter, StoppingParams

if TYPE_CHECKING:  # at run time, imported by _load_llguidance (the first compile)
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from llguidance._lib import JsonCompileOptions  # a stub-only type of llguidance's

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
# A compile's stack: this much per byte of the grammar's source, at least MIN_STACK. The
# deepest chains measured (Lark rules of 6 bytes each) need about 700 bytes a byte.
STACK_PER_BYTE = 2048
MIN_STACK = 16 << 20
MAX_GRAMMAR_BYTES = 2 << 20  # a larger source is refused: its stack would pass 4 GiB
COMPILE_THREADS = 2  # compiles at once (each keeps a core busy); more wait their turn
# CPU seconds one step of a grammar may take (the forced tokens, pruning a draft, a node's
# mask, taking a round's tokens), on the engine thread, which every request waits for: a
# typical step takes well under a millisecond; a literal of 100,000 bytes, 40 ms a mask.
STEP_LIMIT_S = 0.05
NO_TOKEN = "NoExtensionBias"  # llguidance's error when the grammar allows no token at all
REFUSED = "doesn't satisfy the grammar"  # llguidance's, for a token outside the grammar

T = TypeVar("T")


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
    second for a 49k vocabulary, by the first compile)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], vocab_size: int
    ) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._vocab_size = max(vocab_size, len(tokenizer))  # the logits' width
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._lltokenizer_lock = threading.Lock()
        self._threads = threading.Semaphore(COMPILE_THREADS)

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A request's state for `spec`. On an event loop's thread it is not compiled yet:
        `await state.prepare()` compiles it (the scheduler does, before the generation joins
        the batch); elsewhere it is compiled at once. Either raises InvalidParameter(spec.field,
        llguidance's reason) for a grammar that cannot be served (a bad regex, a schema
        keyword it does not enforce, such as uniqueItems; see the module doc). ExtraMissing
        if llguidance is not installed."""
        _check_llguidance(spec.field)
        tokenizer = self._tokenizer
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise InvalidParameter(spec.field, "structured output needs the model's fast tokenizer")
        size = len(spec.source.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise InvalidParameter(
                spec.field,
                f"{size} bytes exceed the largest grammar served, {MAX_GRAMMAR_BYTES} bytes",
            )
        stack = max(MIN_STACK, -(-size * STACK_PER_BYTE // MIN_STACK) * MIN_STACK)

        def compile_in_thread() -> Future[llguidance.LLMatcher]:
            return _in_thread(lambda: self._compile(spec, tokenizer), stack)

        eos = frozenset(self._eos)
        state = GrammarState(compile_in_thread, self._vocab_size, eos, spec.field)
        if not _on_event_loop():
            state.compile()
        return state

    def _compile(
        self, spec: GrammarSpec, tokenizer: PreTrainedTokenizerFast
    ) -> llguidance.LLMatcher:
        """The matcher for `spec`, past its first steps (on a compile thread, one of
        COMPILE_THREADS at a time)."""
        with self._threads:
            _load_llguidance()
            matcher = llguidance.LLMatcher(
                self._view(tokenizer), _grammar_text(spec), log_level=0, limits=_limits()
            )
            if matcher.is_error():
                raise InvalidParameter(spec.field, f"cannot compile: {_reason(matcher)}")
            _first_steps(matcher, self._vocab_size, spec.field)
            return matcher

    def _view(self, tokenizer: PreTrainedTokenizerFast) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built by the first compile."""
        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._lltokenizer


def _check_llguidance(field: str) -> None:
    """ExtraMissing, naming the `grammar` extra, if llguidance is not installed: looked up,
    not imported (GrammarCompiler.start runs on the event loop; the compile imports it; once
    imported, the look-up is sys.modules')."""
    missing = missing_package("grammar")
    if missing is not None:
        raise ExtraMissing(f"{field}: {GRAMMAR_FEATURE}", "grammar", missing)


def _load_llguidance() -> None:
    """Import llguidance for this module's functions (the name is theirs from then on)."""
    global llguidance
    import llguidance
    import llguidance.hf
    import llguidance.torch


@functools.cache
def _limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with errors that name the reason without a dump of the
    parser's state (they go to the client, in a 400)."""
    return llguidance.LLParserLimits(verbose_errors=False)


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
        raise InvalidParameter(spec.field, f"not a JSON schema: {error}") from None


def _first_steps(matcher: llguidance.LLMatcher, vocab: int, field: str) -> None:
    """Take the grammar's first steps, where hostile grammars fail: the mask at the start, the
    forced tokens (a const of a million bytes, a rule that never ends) and the mask after them
    (no token at all: it matches no text). InvalidParameter if llguidance gives up or a step
    takes over STEP_LIMIT_S; else the matcher is reset."""
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    mask = lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)  # noqa: E731
    _first_step(matcher, field, mask)
    forced = _first_step(matcher, field, matcher.compute_ff_tokens)
    _first_step(matcher, field, lambda: matcher.consume_tokens(forced), timed=False)
    _first_step(matcher, field, mask)
    matcher.reset()


def _first_step(
    matcher: llguidance.LLMatcher, field: str, step: Callable[[], T], timed: bool = True
) -> T:
    started = time.thread_time()
    done = step()
    if matcher.is_error():
        reason = _reason(matcher)
        if reason.startswith(NO_TOKEN):
            reason = "it matches no text (a $ref or rule that only leads to itself?)"
        raise InvalidParameter(field, f"cannot be served: {reason}")
    seconds = time.thread_time() - started
    if timed and seconds > STEP_LIMIT_S:
        raise InvalidParameter(field, f"cannot be served: {_too_slow(seconds)}")
    return done


def _too_slow(seconds: float) -> str:
    return (
        f"one step of the grammar took {seconds * 1000:.0f} ms of CPU, over the limit of "
        f"{STEP_LIMIT_S * 1000:.0f} ms (a long literal or repetition?)"
    )


def _reason(matcher: llguidance.LLMatcher) -> str:
    """Why the matcher stopped, as llguidance says (its state dump left out)."""
    return matcher.get_error().split("\n<", 1)[0].strip()


def _read(done: asyncio.Future[llguidance.LLMatcher]) -> None:
    if not done.cancelled():
        done.exception()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_STACK_SIZE = threading.Lock()  # threading.stack_size is the process's: set, start, restore


def _in_thread(function: Callable[[], T], stack_bytes: int) -> Future[T]:
    """`function()` in a new thread with a stack of `stack_bytes`; its outcome, as a future."""
    outcome: Future[T] = Future()

    def run() -> None:
        outcome.set_running_or_notify_cancel()
        try:
            outcome.set_result(function())
        except BaseException as error:
            outcome.set_exception(error)

    with _STACK_SIZE:
        previous = threading.stack_size(stack_bytes)
        try:
            threading.Thread(target=run, name="kenspec-grammar", daemon=True).start()
        finally:
            threading.stack_size(previous)
    return outcome


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
    """One request's matcher (see the module doc); a RowProcessor for its verified nodes.
    Made by GrammarCompiler.start, compiled by `compile()` or `await prepare()` (whichever
    comes first; a method that needs the matcher before that compiles it)."""

    def __init__(
        self,
        compile_in_thread: Callable[[], Future[llguidance.LLMatcher]],
        vocab: int,
        eos: frozenset[int],
        field: str,
    ) -> None:
        self._compile_in_thread = compile_in_thread
        self._field = field  # the request field its errors name
        self._compiling: Future[llguidance.LLMatcher] | None = None
        self._matcher: llguidance.LLMatcher | None = None
        self._path: list[int] = []  # tokens the matcher holds past the output
        self._output = 0  # tokens of output the matcher has taken (for error messages)
        # An EOS that ends _path is held, not consumed: the matcher takes none once the
        # grammar has stopped (a closed JSON value), and nothing follows EOS anyway.
        self._eos_held = False
        self._vocab = vocab  # tokens its masks cover
        self._eos = eos
        self._bitmask: torch.Tensor | None = None  # the masks' buffer, made by process()
        self.counters = GrammarCounters()

    def compile(self) -> None:
        """Compile, waiting here (off the event loop); InvalidParameter if it cannot be."""
        if self._matcher is None:
            self._matcher = self._started().result()

    async def prepare(self) -> None:
        """Compile without holding the event loop up; awaited by any number of callers, it
        compiles once (a caller that leaves does not stop it)."""
        if self._matcher is None:
            compiled = asyncio.wrap_future(self._started())
            compiled.add_done_callback(_read)  # (a failure nobody awaits any more is not logged)
            self._matcher = await asyncio.shield(compiled)

    def _started(self) -> Future[llguidance.LLMatcher]:
        if self._compiling is None:
            self._compiling = self._compile_in_thread()
        return self._compiling

    @property
    def _compiled(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self.compile()
        assert self._matcher is not None
        return self._matcher

    def forced(self) -> tuple[int, ...]:
        """Tokens the grammar forces after the output (jump-forward), canonically tokenized."""
        started = time.thread_time()
        self._seek(())
        forced = tuple(self._compiled.compute_ff_tokens())
        self._check()
        self.counters.forced += len(forced)
        self._spent(started)
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
        self._spent(started)
        return tree if len(keep) == len(tree) else tree.subset(keep)

    def _allows(self, token: int) -> bool:
        """Whether `token` may follow (EOS: whether the output matches; a matcher that has
        stopped, its value closed, validates no token, not even EOS)."""
        if token in self._eos:
            return self._compiled.is_accepting()
        return self._compiled.validate_tokens([token]) == 1

    def process(
        self, scores: torch.Tensor, output: Sequence[int], path: Sequence[int]
    ) -> torch.Tensor:
        """scores [vocab] with every token the grammar forbids after output + path at -inf
        (the matcher follows the output through `advance`, so `output` is not read)."""
        started = time.thread_time()
        self._seek(path)
        if self._bitmask is None:  # (after the compile: llguidance is imported)
            self._bitmask = llguidance.torch.allocate_token_bitmask(1, self._vocab)
        llguidance.torch.fill_next_token_bitmask(self._compiled, self._bitmask, 0)
        self._check()  # (a matcher that gave up allows EOS alone: never offered as a choice)
        penalty = mask_penalty(self._bitmask[0])[: scores.shape[0]]
        width = penalty.shape[0]
        scores[:width] += penalty.to(scores.device)
        scores[width:] = float("-inf")  # tokens past the grammar's vocabulary
        self.counters.masks += 1
        self._spent(started)
        return scores

    def advance(self, emitted: Sequence[int]) -> None:
        """The round emitted `emitted` (after the last output token): they are the output now."""
        started = time.thread_time()
        self._seek(emitted)
        self._path = []
        self._output += len(emitted)
        self._spent(started)

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a whole match (EOS allowed)."""
        self._seek(())
        return self._compiled.is_accepting()

    def _seek(self, path: Sequence[int]) -> None:
        """Move the matcher to output + path: roll back to the common prefix, consume the rest
        (an EOS, last in a path if anywhere, is held; see __init__)."""
        matcher = self._compiled
        common = 0
        for held, wanted in zip(self._path, path, strict=False):
            if held != wanted:
                break
            common += 1
        if common < len(self._path):
            consumed = len(self._path) - common - self._eos_held
            if consumed:
                matcher.rollback(consumed)
            del self._path[common:]
            self._eos_held = False
        rest = list(path[common:])
        ends = bool(rest) and rest[-1] in self._eos
        if ends:
            rest.pop()
        if rest and not matcher.consume_tokens(rest):
            self._check()
        self._path.extend(rest)
        if ends:
            if not matcher.is_accepting():
                raise RuntimeError("grammar refused EOS before the output matches it")
            self._path.append(path[-1])
            self._eos_held = True

    def _spent(self, started: float) -> None:
        """Count a call's CPU time since `started`; one over STEP_LIMIT_S ends the request
        (the engine thread, every request's, waited for it)."""
        seconds = time.thread_time() - started
        self.counters.seconds += seconds
        if seconds > STEP_LIMIT_S:
            raise InvalidParameter(self._field, f"{self._where()}, {_too_slow(seconds)}")

    def _where(self) -> str:
        tokens = self._output + len(self._path)
        return f"after {tokens} token{'' if tokens == 1 else 's'} of output"

    def _check(self) -> None:
        """Raise if the matcher has stopped: InvalidParameter when llguidance gave up on the
        grammar (a limit, a dead end), RuntimeError when it refused a token pruning and the
        masks allowed (a bug)."""
        matcher = self._compiled
        if not matcher.is_error():
            return
        reason = _reason(matcher)
        if REFUSED in reason:
            raise RuntimeError(f"grammar refused tokens the masks allowed: {reason}")
        if reason.startswith(NO_TOKEN):
            reason = "no text that begins with the output so far matches it"
        raise InvalidParameter(self._field, f"{self._where()}, {reason}")


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
