"""One generation per call, timed the same way for every mode.

Modes: transformers `generate` (plain), transformers assisted generation with
`prompt_lookup_num_tokens` (the n-gram peer), kenspec autoregressive (speculation off), and
kenspec speculative with a fixed or adaptive k, breaker on. Each returns a RunResult whose
`chunk_times` are the moments tokens reached the caller (a streamer for transformers, each
round for kenspec).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers.generation.streamers import BaseStreamer

from kenspec.api.outputs import BreakerState
from kenspec.server.engine.linear_kernels import stock_linears
from kenspec.server.engine.params import (
    DRAFT_TOKENS,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.engine.speculative_engine import SpeculativeEngine


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    kind: str  # "hf", "hf_lookup", "kenspec"
    k: int = 0  # draft tokens (prompt lookup tokens for hf_lookup); 0 = no speculation
    adaptive: bool = False
    draft_context: bool | None = None  # None: the server default; True/False: force it
    static: bool = True  # False: the request's context alone, no KenLM


@dataclass(slots=True)
class RunResult:
    mode: str
    prompt_index: int
    tokens: list[int]
    seconds: float
    chunk_times: list[float]  # seconds since start at which each chunk of tokens arrived
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    breaker_opened: bool = False

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] if self.chunk_times else self.seconds

    @property
    def inter_round(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def rounds(self) -> int:
        return len(self.chunk_times)


class _TimingStreamer(BaseStreamer):
    """Records when generate() hands out tokens; the first put() is the prompt itself."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.started)

    def end(self) -> None:
        pass


def run_hf(
    engine: SpeculativeEngine,
    mode: Mode,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    index: int,
) -> RunResult:
    model = engine.target.model
    input_ids = torch.tensor([list(prompt_ids)], device=engine.target.device)
    kwargs: dict = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    if mode.kind == "hf_lookup":
        kwargs["prompt_lookup_num_tokens"] = mode.k
    started = time.perf_counter()
    streamer = _TimingStreamer(started)
    with torch.inference_mode(), stock_linears(model):  # transformers as shipped
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs
        )
    seconds = time.perf_counter() - started
    return RunResult(
        mode.name, index, output[0, len(prompt_ids) :].tolist(), seconds, streamer.times
    )


def run_kenspec(
    engine: SpeculativeEngine,
    mode: Mode,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    index: int,
) -> RunResult:
    if not mode.static:
        engine = context_only(engine)
    generation = engine.start(
        prompt_ids,
        sampling=SamplingParams(temperature=temperature, seed=seed),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        speculation=SpeculationParams(
            enabled=mode.k > 0,
            num_draft_tokens=max(mode.k, DRAFT_TOKENS),  # chains of k; trees, long matches
            chain_tokens=max(mode.k, 1),  # as the server's defaults
            adaptive=mode.adaptive,
            draft_context=mode.draft_context,
        ),
        request_id=f"bench-{index}",
    )
    started = time.perf_counter()
    result = RunResult(mode.name, index, [], 0.0, [])

    # Through the engine's batch, as the server runs it (a batch of one here): the same
    # cost-aware choice of how many drafts a pass verifies.
    for round_ in engine.batch.rounds(generation):
        result.chunk_times.append(time.perf_counter() - started)
        result.tokens.extend(round_.token_ids)
        result.drafted_per_round.append(round_.drafted)
        result.accepted_per_round.append(round_.accepted)
        result.breaker_opened |= round_.breaker_state != BreakerState.CLOSED
    result.seconds = time.perf_counter() - started
    return result


_CONTEXT_ONLY: dict[int, SpeculativeEngine] = {}


def context_only(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The same target and breaker settings, drafting from the request's context alone."""
    key = id(engine)
    if key not in _CONTEXT_ONLY:
        context = replace(engine.context, enabled=True)
        _CONTEXT_ONLY[key] = SpeculativeEngine(
            engine.target,
            None,
            engine.breaker_settings,
            context=context,
            batching=engine.batch.settings,
            costs=engine.batch.costs,
        )
    return _CONTEXT_ONLY[key]


def run(engine: SpeculativeEngine, mode: Mode, prompt_ids: Sequence[int], **kwargs) -> RunResult:
    runner = run_kenspec if mode.kind == "kenspec" else run_hf
    return runner(engine, mode, prompt_ids, **kwargs)
