"""`python -m bench.grammar_engines`: llguidance, xgrammar and outlines-core on this CPU.

For every schema of bench.schemas and the target's tokenizer, each engine compiles the
schema (coverage: does it compile; time), then walks one token stream its grammar accepts:
at every step it computes the allowed-token mask (timed: the per-token cost that a masked
verification pays at each verified node), then advances by one allowed token drawn with a
fixed seed (ending early where only EOS is allowed). Also timed: rolling one token back
(what a draft tree's walk needs to move between sibling paths) and, where the engine has it,
the forced continuation (jump-forward). Medians per schema, then over schemas. The token
streams differ between engines (each draws from its own mask), so compare the medians, not
single steps. Run it under `nice`: on a shared machine the absolute figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.schemas import CASES, INT

MAX_STEPS = 96  # tokens walked per schema


def _us(start: float) -> float:
    return (time.perf_counter() - start) * 1e6


class _Walk:
    """The per-step timings of one engine on one schema."""

    def __init__(self) -> None:
        self.compile_ms = 0.0
        self.mask_us: list[float] = []
        self.advance_us: list[float] = []
        self.rollback_us: list[float] = []
        self.forced_us: list[float] = []


class _Stream:
    """Which token to advance by: the allowed token that spells the most of what is left of
    the schema's example (compact JSON), so the walk crosses keys, values and brackets as an
    answer does; where none does (an engine's own whitespace), a seeded draw."""

    def __init__(self, texts: list[str], example: Any, eos: int) -> None:
        self._texts = texts
        self._left = json.dumps(example, separators=(",", ":"))
        self._eos = eos
        self._rng = random.Random(0)

    def next(self, allowed: list[int]) -> int | None:
        """An allowed token other than EOS (None: only EOS is left, the walk ends)."""
        choices = [token for token in allowed if token != self._eos]
        if not choices:
            return None
        spelled = [t for t in choices if self._texts[t] and self._left.startswith(self._texts[t])]
        token = (
            max(spelled, key=lambda t: len(self._texts[t]))
            if spelled
            else self._rng.choice(choices)
        )
        self._left = self._left[len(self._texts[token]) :] if spelled else ""
        return token


def _allowed_bits(bitmask: torch.Tensor, vocab: int) -> list[int]:
    """Token ids whose bit is set in an int32 bitmask row (both engines' layout)."""
    bits = bitmask.view(torch.uint8).reshape(-1)
    unpacked = (bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return unpacked.reshape(-1)[:vocab].nonzero().flatten().tolist()


def walk_llguidance(
    tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any], example: Any
) -> _Walk:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = _cached(("llg",), lambda: llguidance.hf.from_tokenizer(tokenizer))
    walk, stream = _Walk(), _stream(tokenizer, example)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    walk.compile_ms = _us(start) / 1e3
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    return _timed_steps(
        walk,
        stream,
        mask=lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
        allowed=lambda _: _allowed_bits(bitmask, lltok.vocab_size),
        forced=matcher.compute_ff_tokens,
        consume=matcher.consume_token,
        rollback=lambda: matcher.rollback(1),
    )


def walk_xgrammar(
    tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any], example: Any
) -> _Walk:
    import xgrammar

    info = _cached(("xgr",), lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer))
    compiler = _cached(("xgr-c",), lambda: xgrammar.GrammarCompiler(info))
    walk, stream = _Walk(), _stream(tokenizer, example)
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    walk.compile_ms = _us(start) / 1e3
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    return _timed_steps(
        walk,
        stream,
        mask=lambda: matcher.fill_next_token_bitmask(bitmask),
        allowed=lambda _: _allowed_bits(bitmask, info.vocab_size),
        forced=matcher.find_jump_forward_string,
        consume=matcher.accept_token,
        rollback=lambda: matcher.rollback(1),
    )


def walk_outlines(
    tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any], example: Any
) -> _Walk:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = _cached(("outlines",), lambda: _outlines_vocabulary(tokenizer))
    walk, stream = _Walk(), _stream(tokenizer, example)
    start = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
    guide = outlines_core.Guide(index)
    walk.compile_ms = _us(start) / 1e3
    return _timed_steps(
        walk,
        stream,
        mask=guide.get_tokens,
        allowed=list,
        consume=guide.advance,
        rollback=lambda: guide.rollback_state(1),
    )


def _timed_steps(
    walk: _Walk,
    stream: _Stream,
    *,
    mask: Callable[[], Any],
    allowed: Callable[[Any], list[int]],
    consume: Callable[[int], Any],
    rollback: Callable[[], Any],
    forced: Callable[[], Any] | None = None,
) -> _Walk:
    """Walk `stream` through one engine, timing each step's mask (what `mask` returns,
    untimed, `allowed` turns into token ids), forced-token query, advance and a one-token
    rollback (then the token is consumed again)."""
    for _ in range(MAX_STEPS):
        start = time.perf_counter()
        masked = mask()
        walk.mask_us.append(_us(start))
        if forced is not None:
            start = time.perf_counter()
            forced()
            walk.forced_us.append(_us(start))
        token = stream.next(allowed(masked))
        if token is None:
            break
        start = time.perf_counter()
        consume(token)
        walk.advance_us.append(_us(start))
        start = time.perf_counter()
        rollback()
        walk.rollback_us.append(_us(start))
        consume(token)
    return walk


def _outlines_vocabulary(tokenizer: PreTrainedTokenizerBase) -> Any:
    """outlines-core's vocabulary of a local tokenizer: each token's bytes, specials left out."""
    import outlines_core

    specials = set(tokenizer.all_special_ids)
    by_text: dict[bytes, list[int]] = {}
    for token_id in range(len(tokenizer)):
        if token_id in specials:
            continue
        text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
        by_text.setdefault(text.encode("utf-8", "surrogatepass"), []).append(token_id)
    return outlines_core.Vocabulary(tokenizer.eos_token_id, by_text)


def _stream(tokenizer: PreTrainedTokenizerBase, example: Any) -> _Stream:
    texts = _cached(
        ("texts",),
        lambda: [
            tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)])
            for token in range(len(tokenizer))
        ],
    )
    return _Stream(texts, example, tokenizer.eos_token_id)


_CACHE: dict[tuple[str, ...], Any] = {}


def _cached(key: tuple[str, ...], make: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


ENGINES: dict[str, Callable[[PreTrainedTokenizerBase, dict[str, Any], Any], _Walk]] = {
    "llguidance": walk_llguidance,
    "xgrammar": walk_xgrammar,
    "outlines-core": walk_outlines,
}


# Schemas past the workload's, for coverage: does the engine compile them, or refuse them
# naming what it cannot enforce? (An engine that compiles a keyword it then ignores gives
# output a validator refuses; that is checked apart, see NOTES.md.)
COVERAGE: dict[str, dict[str, Any]] = {
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": INT,
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "string_lengths": {"type": "string", "minLength": 3, "maxLength": 5},
    "one_of": {"oneOf": [INT, {"type": "string"}]},
    "all_of": {"allOf": [{"properties": {"a": INT}, "required": ["a"]}, {"required": ["b"]}]},
    "additional_schema": {"type": "object", "additionalProperties": INT},
    "pattern_properties": {"type": "object", "patternProperties": {"^x_": {"type": "string"}}},
    "unique_items": {"type": "array", "items": INT, "uniqueItems": True},
    "exclusive_bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "multiple_of": {"type": "integer", "multipleOf": 5},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string"}, INT], "items": False},
    "format_email": {"type": "string", "format": "email"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "if_then": {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "min_properties": {"type": "object", "minProperties": 1},
    "any_object": {"type": "object"},
}


def coverage(tokenizer: PreTrainedTokenizerBase, engine: str) -> dict[str, str]:
    """Per COVERAGE schema: "ok" or the engine's refusal."""
    walk_of = ENGINES[engine]
    result = {}
    for name, schema in COVERAGE.items():
        try:
            walk_of(tokenizer, schema, None)
            result[name] = "ok"
        except Exception as error:
            result[name] = f"refused: {str(error).splitlines()[0][:120]}"
    return result


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def _p90(values: list[float]) -> float | None:
    return round(statistics.quantiles(values, n=10)[-1], 1) if len(values) > 1 else None


def measure(tokenizer: PreTrainedTokenizerBase, engine: str) -> dict[str, Any]:
    walk_of = ENGINES[engine]
    walk_of(tokenizer, CASES[0].schema, CASES[0].example)  # tokenizer set-up, outside the timings
    per_schema, failed = [], {}
    for case in CASES:
        try:
            walk = walk_of(tokenizer, case.schema, case.example)
        except Exception as error:  # coverage: a schema the engine cannot compile
            failed[case.name] = f"{type(error).__name__}: {str(error)[:160]}"
            continue
        per_schema.append(
            {
                "schema": case.name,
                "compile_ms": round(walk.compile_ms, 1),
                "steps": len(walk.mask_us),
                "mask_us": _median(walk.mask_us),
                "mask_mean_us": round(statistics.fmean(walk.mask_us), 1),
                "mask_p90_us": _p90(walk.mask_us),
                "advance_us": _median(walk.advance_us),
                "rollback_us": _median(walk.rollback_us),
                "forced_us": _median(walk.forced_us),
            }
        )
    summary = {
        key: _median([row[key] for row in per_schema if row[key] is not None])
        for key in (
            "compile_ms",
            "mask_us",
            "mask_mean_us",
            "mask_p90_us",
            "advance_us",
            "rollback_us",
            "forced_us",
        )
    }
    return {
        "engine": engine,
        "compiled": len(per_schema),
        "schemas": len(CASES),
        "failed": failed,
        "median": summary,
        "per_schema": per_schema,
        "coverage": coverage(tokenizer, engine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = []
    for engine in args.engines:
        result = measure(tokenizer, engine)
        results.append(result)
        print(
            json.dumps({k: result[k] for k in ("engine", "compiled", "schemas", "median")}),
            flush=True,
        )
        for name, reason in result["failed"].items():
            print(f"  {engine} failed {name}: {reason}", flush=True)
        for name, outcome in result["coverage"].items():
            print(f"  {engine} coverage {name}: {outcome}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
