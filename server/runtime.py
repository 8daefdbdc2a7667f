"""Loading what the service serves: target, draft, calibrated breaker, and its ModelInfo."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
import torch

from kenspec.api import generator_pb2 as pb
from kenspec.server import __version__, calibration_cache
from kenspec.server.engine.calibration import Calibration, calibrate
from kenspec.server.engine.costs import Costs, one_row_steps
from kenspec.server.engine.draft_head import DraftHead, HeadFormatError
from kenspec.server.engine.events import NO_EVENTS, EngineEvents
from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.kenlm_draft import KenLMDraft, tokenizer_fingerprint
from kenspec.server.engine.live_costs import LiveCosts
from kenspec.server.engine.params import (
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
from kenspec.server.engine.suffix_index import SuffixIndex, add_text_corpus
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.tenant_index import SHARED_TENANT, TenantSuffixIndex
from kenspec.server.generate_params import Defaults, Limits, prompt_char_limit
from kenspec.server.memory import release_freed_memory, resident_mib
from kenspec.server.settings import Settings
from kenspec.server.tool_calls.formats import ToolFormat
from kenspec.server.tool_calls.formats import detect as detect_tool_format

log = structlog.get_logger("kenspec.runtime")


@dataclass(frozen=True, slots=True)
class Runtime:
    engine: SpeculativeEngine
    limits: Limits
    defaults: Defaults
    info: pb.ModelInfo
    tool_format: ToolFormat  # how the model writes tool calls (server.tool_calls.formats)
    save_costs: Callable[[], None] = field(default=lambda: None)  # at shutdown


def load_runtime(settings: Settings, events: EngineEvents = NO_EVENTS) -> Runtime:
    """Load, calibrate and warm up; blocking (run it off the event loop). The engine reports
    passes, reuse and breaker transitions to `events` (the server's metrics)."""
    started = time.perf_counter()
    if settings.kernels.threads > 0:
        torch.set_num_threads(settings.kernels.threads)
    target = TargetModel.load(
        settings.model.model,
        device=settings.kernels.device,
        dtype=settings.kernels.dtype,
        gguf_cache=settings.model.gguf_cache,
        weights=settings.kernels.weights,
        execution=execution_options(settings),
        chat_template=(
            Path(settings.model.chat_template).expanduser().read_text(encoding="utf-8")
            if settings.model.chat_template
            else None
        ),
    )
    draft = _load_draft(settings, target)
    head = _load_head(settings, target)
    log.info(
        "model_loaded",
        model=target.name,
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        weights=target.weights,
        draft=draft.name if draft else None,
        seconds=round(time.perf_counter() - started, 2),
    )
    tree_budget = settings.speculation.tree_budget
    invariance = target.plan.invariance
    if invariance is not None and invariance.value_block is None:
        tree_budget = 1  # trees would sum a node's keys in another order
    breaker_settings, costs, save_costs = _breaker_settings_and_costs(settings, target)
    context = ContextSettings(
        enabled=settings.speculation.draft_context,
        min_match=settings.speculation.context_min_match,
        max_match=settings.speculation.context_max_match,
        long_draft_tokens=settings.speculation.long_draft_tokens,
        tree_budget=tree_budget,
        learn_prompts=settings.speculation.suffix_learn_prompts,
    )
    batching = BatchSettings(
        max_rows=settings.limits.max_batch_size,
        prefill_chunk=settings.limits.prefill_chunk,
        prefill_chunk_alone=settings.limits.prefill_chunk_alone,
        pad_passes=settings.kernels.pad_verify,
        prefix_cache_bytes=_prefix_cache_bytes(settings.limits.prefix_cache_mb, target),
    )
    engine = SpeculativeEngine(
        target,
        draft,
        breaker_settings,
        context=context,
        batching=batching,
        costs=costs,
        events=events,
        suffix=_load_suffix_index(settings, target),
        isolate_tenants=settings.speculation.suffix_index_scope == "tenant",
        max_tenants=settings.speculation.suffix_index_tenants,
        recycled=(
            _recycled_predictions(target)
            if settings.speculation.recycled_predictions and settings.speculation.draft_context
            else None
        ),
        head=head,
    )
    _warm_up(engine)
    max_prompt_tokens = min(
        settings.limits.max_prompt_tokens or target.max_context, target.max_context
    )
    default_max_new_tokens, max_new_tokens = new_token_limits(settings, target.max_context)
    limits = Limits(
        default_max_new_tokens=default_max_new_tokens,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        max_prompt_chars=prompt_char_limit(
            settings.limits.max_prompt_chars, max_prompt_tokens, target.tokenizer.get_vocab()
        ),
        tokenize_concurrency=settings.limits.tokenize_concurrency,
        max_stop_sequences=settings.limits.max_stop_sequences,
        max_stop_length=settings.limits.max_stop_length,
    )
    defaults = Defaults(
        num_draft_tokens=settings.speculation.num_draft_tokens,
        adaptive=settings.speculation.adaptive,
        chain_tokens=settings.speculation.chain_tokens,
    )
    info = _model_info(
        settings, engine, limits, calibrated=settings.speculation.breaker_threshold < 0
    )
    released = release_freed_memory()  # what loading freed, no longer resident
    log.info(
        "loaded",
        seconds=round(time.perf_counter() - started, 2),
        resident_mib=_rounded(resident_mib()),
        released_mib=_rounded(released),
    )
    tool_format = detect_tool_format(target.tokenizer, settings.model.tool_call_format)
    log.info("tool_calls", format=tool_format.name, native=tool_format.native)
    return Runtime(
        engine=engine,
        limits=limits,
        defaults=defaults,
        info=info,
        tool_format=tool_format,
        save_costs=save_costs,
    )


def _rounded(mib: float | None) -> float | None:
    return None if mib is None else round(mib, 1)


def _recycled_predictions(target: TargetModel) -> RecycledPredictions:
    """The table of the target's recent predictions; on a CPU with kenspec's kernels, each
    row's top tokens in one read of it (csrc/layer.c, layer_avx2.c) instead of torch's top-k
    and logsumexp (~100 us a row: every row a pass computed is recorded)."""
    kernels = load_kernels() if target.device.type == "cpu" else None
    top_probs = kernels.top_probs if kernels is not None and kernels.layer_kernels else None
    return RecycledPredictions(target.vocab_size, top_probs=top_probs)


def _load_draft(settings: Settings, target: TargetModel) -> KenLMDraft | None:
    if not settings.model.has_draft:
        return None
    eos = target.tokenizer.eos_token_id
    return KenLMDraft.load(
        settings.model.draft,
        vocab_size=target.vocab_size,
        fingerprint=tokenizer_fingerprint(target.tokenizer.get_vocab()),
        min_draft_prob=settings.speculation.min_draft_prob,
        end_token_id=eos,
    )


def _load_head(settings: Settings, target: TargetModel) -> DraftHead | None:
    """The draft folder's learned head for this target (engine.draft_head), where it has one,
    --draft-head is on and context drafting too. One trained for another target is left out
    with a warning: the KenLM draft still serves (its tokenizer matched)."""
    spec = settings.speculation
    if not (spec.draft_head and spec.draft_context and settings.model.has_draft):
        return None
    folder = Path(settings.model.draft)
    if not folder.is_dir():
        return None
    if target.passes.head.wants_model_logits:  # its passes return logits, not hidden states
        log.warning(
            "draft_head_refused",
            reason="this target's passes give the model's logits, not its hidden states "
            f"(plan: {target.plan.describe()}); the head would never draft",
        )
        return None
    try:
        kernels = load_kernels() if target.device.type == "cpu" else None
        head = DraftHead.load(folder, target.model, kernels=kernels)
    except (HeadFormatError, OSError, ValueError, KeyError, RuntimeError) as error:
        log.warning("draft_head_refused", reason=f"{type(error).__name__}: {error}")
        return None
    if head is not None:
        log.info(
            "draft_head",
            folder=str(folder),
            vocabulary=head.vocabulary,
            inner=head.net.inner,
            kernels="c" if head.runs_in_c else "gemv_bf16" if head.uses_kernels else "torch",
            heldout=head.manifest.get("heldout_check"),
        )
    return head


def _load_suffix_index(settings: Settings, target: TargetModel) -> TenantSuffixIndex | None:
    """The index of past answers: the draft folder's corpus if it has one and the text of
    --suffix-corpus (shared by every tenant, never evicted), and each tenant's learned answers
    within what the bound leaves."""
    if not (settings.speculation.suffix_index and settings.speculation.draft_context):
        return None
    started = time.perf_counter()
    seeded, corpus = SuffixIndex.for_draft(
        Path(settings.model.draft) if settings.model.has_draft else None,
        target.vocab_size,
        max_tokens=settings.speculation.suffix_index_tokens,
        max_match=settings.speculation.suffix_max_match,
    )
    text_tokens = 0
    if settings.speculation.suffix_corpus:
        text_tokens = add_text_corpus(
            seeded, Path(settings.speculation.suffix_corpus).expanduser(), _batch_encoder(target)
        )
    shared = settings.speculation.suffix_index_scope == "shared"
    index = TenantSuffixIndex(
        seeded,
        max_tokens=settings.speculation.suffix_index_tokens,
        max_tenants=1 if shared else settings.speculation.suffix_index_tenants,
    )
    log.info(
        "suffix_index",
        corpus=str(corpus) if corpus else None,
        text_corpus=settings.speculation.suffix_corpus or None,
        text_corpus_tokens=text_tokens,
        tokens=index.tokens,
        max_tokens=index.max_tokens,
        learned_tokens=index.learned_budget,  # for every tenant together
        scope=settings.speculation.suffix_index_scope,
        max_tenants=index.max_tenants,
        seconds=round(time.perf_counter() - started, 2),
    )
    return index


def _batch_encoder(target: TargetModel) -> Callable[[list[str]], list[list[int]]]:
    """Token ids of many texts in one tokenizer call (no special tokens: passages of text)."""

    def encode(texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in target.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return encode


# --prefix-cache-mb -1: room for this many full contexts, within this share of free memory.
PREFIX_CACHE_CONTEXTS = 4
PREFIX_CACHE_MEMORY_SHARE = 0.1


def _prefix_cache_bytes(megabytes: int, target: TargetModel) -> int:
    """The prefix cache's budget: as set, or (-1) room for PREFIX_CACHE_CONTEXTS contexts of
    the model (a long document or system prompt must fit whole to be reused), at most a
    PREFIX_CACHE_MEMORY_SHARE of the memory available now."""
    if megabytes >= 0:
        return megabytes << 20
    wanted = PREFIX_CACHE_CONTEXTS * target.max_context * target.kv_bytes_per_position
    if target.device.type == "cuda":  # the cache lives where the model does
        available = torch.cuda.mem_get_info(target.device)[0]
    else:
        available = _available_memory_bytes()
    budget = min(wanted, int(PREFIX_CACHE_MEMORY_SHARE * available))
    log.info(
        "prefix_cache",
        mb=budget >> 20,
        positions=budget // target.kv_bytes_per_position,
        kb_per_position=round(target.kv_bytes_per_position / 1024, 1),
    )
    return budget


def _available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory's free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def execution_options(settings: Settings) -> ExecutionOptions:
    """What the server's flags ask of the target's passes (engine.forward decides within it)."""
    kernels = settings.kernels
    return ExecutionOptions(
        lean=LeanMode.AUTO if kernels.fast_step else LeanMode.OFF,
        skinny_gemm=kernels.skinny_gemm,
        attention=kernels.attention,
        batch_invariant=kernels.batch_invariant,
        amx=kernels.amx,
    )


def _breaker_settings_and_costs(
    settings: Settings, target: TargetModel
) -> tuple[BreakerSettings, Costs | None, Callable[[], None]]:
    """The breakers' settings, the pass costs batches choose widths by (measured, or read from the
    calibration cache; live unless --no-live-costs), and what saves them at shutdown."""
    breaker_settings = BreakerSettings(
        window_rounds=settings.speculation.breaker_window,
        threshold=max(0.0, settings.speculation.breaker_threshold),
        reset_timeout_s=settings.speculation.breaker_reset_timeout_s,
        fault_max=settings.speculation.draft_fault_max,
        fault_reset_timeout_s=settings.speculation.draft_fault_reset_timeout_s,
        draft_latency_budget_s=settings.speculation.draft_latency_budget_ms / 1000.0,
    )
    speculates = settings.model.has_draft or settings.speculation.draft_context
    if not speculates:
        return breaker_settings, None, _nothing
    k, rows = (
        settings.speculation.request_defaults.k,  # chains of k, within the cap
        settings.limits.max_batch_size,
    )
    long_draft_tokens = (
        min(
            max(settings.speculation.long_draft_tokens, settings.speculation.tree_budget),
            settings.speculation.num_draft_tokens,
        )
        if settings.speculation.draft_context
        else 0
    )
    key = calibration_cache.cache_key(
        settings.model.model,
        dtype=str(target.dtype),
        device=str(target.device),
        # the plan names every kernel choice and the C kernels' build: a calibration measured
        # with other kernels is not reused
        execution=target.plan.describe(),
        gpu=torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else None,
        k=k,
        rows=rows,
        long_draft_tokens=long_draft_tokens,
    )
    started = time.perf_counter()
    cached = calibration_cache.load(settings.kernels.calibration_cache, key)
    needed = {(1, w) for w in range(1, k + 2)} | {(rows, rows), (rows, rows * (k + 1))}
    if cached is not None and not needed <= cached.keys():
        log.warning("calibration_cache_ignored", error="it lacks passes calibration measures")
        cached = None
    if cached is not None:
        result = Calibration.from_pass_seconds(k, cached)
    else:
        result = calibrate(target, k, rows=rows, long_draft_tokens=long_draft_tokens)
        calibration_cache.store(
            settings.kernels.calibration_cache, key, result.pass_seconds, source="start-up"
        )
    _log_calibration(result, rows, cached=cached is not None, seconds=time.perf_counter() - started)
    fixed = (
        settings.speculation.breaker_threshold
        if settings.speculation.breaker_threshold >= 0
        else None
    )
    breaker_settings = replace(
        breaker_settings, threshold=result.threshold if fixed is None else fixed
    )
    if not settings.kernels.live_costs:
        return breaker_settings, result.pass_costs, _nothing
    live = LiveCosts(result.pass_seconds, k=k, fixed_threshold=fixed)

    def save() -> None:  # on the engine thread's last call, or after it stopped
        log.info("pass_costs", final=True, **live.summary())
        if live.passes >= SAVE_AFTER_PASSES:
            calibration_cache.store(
                settings.kernels.calibration_cache, key, dict(live.table.seconds), source="live"
            )

    return breaker_settings, live, save


# Live costs replace the cached start-up numbers once they have seen this many passes.
SAVE_AFTER_PASSES = 256


def _nothing() -> None:
    pass


def _log_calibration(result: Calibration, rows: int, *, cached: bool, seconds: float) -> None:
    k, steps = result.num_draft_tokens, one_row_steps(result.pass_seconds)
    log.info(
        "calibrated",
        k=k,
        step_ms=round(result.step_seconds * 1000, 2),
        verify_ms=round(result.verify_seconds * 1000, 2),
        cost_ratio=round(result.cost_ratio, 3),
        break_even_acceptance=round(result.threshold, 3),
        padded_widths=result.widths,
        # One row's passes of 1 .. k + 1 tokens, in steps (as the live pass_costs lines), and
        # those wider (long chains, token trees).
        steps={t: ratio for t, ratio in steps.items() if t <= k + 1},
        wide_steps={t: ratio for t, ratio in steps.items() if t > k + 1},
        batch_rows=rows,
        batch_step_ms=round(result.pass_seconds[rows, rows] * 1000, 2),
        batch_verify_ms=round(result.pass_seconds[rows, rows * (k + 1)] * 1000, 2),
        cached=cached,  # read from --calibration-cache instead of measured
        seconds=round(seconds, 2),
    )


def _warm_up(engine: SpeculativeEngine) -> None:
    """One short generation so lazy initialisation does not land on the first request; its
    answer is forgotten (it would hold a tenant's share of the suffix index)."""
    prompt = engine.target.encode_prompt("Hello")
    generation = engine.start(
        prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4),
        speculation=SpeculationParams(chain_tokens=2, adaptive=True),
        request_id="warm-up",
        tenant=WARM_UP_TENANT,
    )
    for _ in engine.batch.rounds(generation):
        pass
    engine.tenants.forget(WARM_UP_TENANT)  # its recycled table and acceptance statistics
    if engine.suffix is not None:
        engine.suffix.forget(WARM_UP_TENANT)
        engine.suffix.forget(SHARED_TENANT)  # the warm-up's, with --suffix-index-scope shared


WARM_UP_TENANT = "warm-up"  # no caller's: tenant_of names tenants "t" + hex, or "shared"


def new_token_limits(settings: Settings, max_context: int) -> tuple[int, int]:
    """(default, limit) of a request's new tokens: --max-new-tokens-limit, 0 the context; and
    --default-max-new-tokens within it, 0 the limit. Per request the default is then cut to
    the context its prompt leaves (generate_params.fit_stopping), as vLLM's is."""
    limit = settings.limits.max_new_tokens_limit or max_context
    return min(settings.limits.default_max_new_tokens or limit, limit), limit


def _model_info(
    settings: Settings, engine: SpeculativeEngine, limits: Limits, *, calibrated: bool
) -> pb.ModelInfo:
    target, breaker_settings = engine.target, engine.breaker_settings
    draft = engine.static_draft
    return pb.ModelInfo(
        model=target.name,
        draft=draft.name if draft else "",
        draft_order=draft.order if isinstance(draft, KenLMDraft) else 0,
        vocab_size=target.vocab_size,
        max_context_tokens=target.max_context,
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        weights=target.weights,
        execution_plan=target.plan.describe(),
        num_draft_tokens=settings.speculation.num_draft_tokens,
        adaptive_draft=settings.speculation.adaptive,
        min_draft_prob=settings.speculation.min_draft_prob,
        draft_context=settings.speculation.draft_context,
        breaker=pb.BreakerSettings(
            window_rounds=breaker_settings.window_rounds,
            threshold=breaker_settings.threshold,
            threshold_calibrated=calibrated and engine.draft is not None,
            reset_timeout_s=breaker_settings.reset_timeout_s,
            fault_max=breaker_settings.fault_max,
            draft_latency_budget_ms=breaker_settings.draft_latency_budget_s * 1000.0,
        ),
        max_new_tokens_limit=limits.max_new_tokens,
        default_max_new_tokens=limits.default_max_new_tokens,
        max_prompt_tokens=limits.max_prompt_tokens,
        version=__version__,
    )
