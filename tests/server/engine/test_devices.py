"""The engine on each device (float32): greedy output equals transformers `generate`, streams in
a batch equal their solo output, seeded samples do not depend on drafts or batching, and sampled
output follows the target's distribution.

Each runs on cpu always and on cuda where a CUDA device exists (scripts/gpu_check.sh runs them
with `-m cuda`), and with both ways acceptance reads logits (engine.pass_logits): row by row
as they are read (CPU), or every row of a pass in one product with the pass's greedy tokens
copied to the host in one go (the default on accelerators), so a CPU-only run covers the code
the GPU takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kenspec.server.engine.batch import Batch
from kenspec.server.engine.context_draft import ContextDraft
from kenspec.server.engine.forward.plan import ExecutionOptions, HeadKind
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.params import SamplingParams
from kenspec.server.engine.pass_logits import computed_logits
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from tests import tiny
from tests.server.engine.drafts import (
    Branching,
    Collector,
    OracleDraft,
    generate,
    reference_greedy,
    start,
)
from tests.server.engine.test_batch import drive, mixed_generations
from tests.server.engine.test_sampling import (
    PROMPT,
    SAMPLES,
    chi_square_pvalue,
    exact_joint,
    likely_draft,
    speculative_samples,
)

MAX_NEW = 20


def on_device(directory: str | Path, device: str, pass_rows: bool) -> TargetModel:
    """The target on `device`, its rows read as an accelerator reads them (every row in one
    product) or, on a CPU, as they are read (pass_rows False)."""
    execution = ExecutionOptions(head=HeadKind.PASS if pass_rows else None)
    return TargetModel.load(directory, device=device, dtype="float32", execution=execution)


@pytest.fixture(scope="module", params=[False, True], ids=["row-reads", "pass-rows"])
def device_target(request, device: str, tiny_model_dir: Path) -> TargetModel:
    return on_device(tiny_model_dir, device, request.param)


@pytest.fixture(scope="module")
def device_streams(device_target: TargetModel) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers greedy continuation on the device) for 12 prompts."""
    streams = []
    for prompt in tiny.PROMPTS[:12]:
        ids = device_target.encode_prompt(prompt)
        streams.append((ids, reference_greedy(device_target, ids, MAX_NEW)))
    return streams


class CountingLogits:
    """Logits [rows, vocab] that count the argmaxes taken of them (each one a device copy)."""

    def __init__(self, argmaxes: list[int], vocab: int = 5) -> None:
        self.rows = torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()
        self.argmaxes = 0

    def argmax(self, dim: int) -> torch.Tensor:
        self.argmaxes += 1
        return self.rows.argmax(dim=dim)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def test_a_pass_copies_its_greedy_tokens_to_the_host_once() -> None:
    logits = CountingLogits([2, 0, 1, 4, 3])
    first, second = computed_logits(logits, [3, 2], one_copy=True)  # type: ignore[arg-type]
    assert (len(first), len(second), logits.argmaxes) == (3, 2, 0)  # nothing read yet
    assert [second.argmax(i) for i in range(2)] == [4, 3]
    assert [first.argmax(i) for i in range(3)] == [2, 0, 1]
    assert logits.argmaxes == 1
    assert int(second[1].argmax()) == 3
    assert [i for i, _ in first.computed(3)] == [0, 1, 2]
    with pytest.raises(IndexError):
        second[2]


def test_a_pass_gives_the_logits_its_path_reads(device_target: TargetModel, device: str) -> None:
    ids = device_target.encode_prompt(tiny.PROMPTS[0])
    passed = VerifyPass.sequences([0, 0], [ids, ids[:3]])
    rows = device_target.forward(device_target.new_cache(2), passed)
    computed = [len(row.computed(len(row))) for row in rows]
    if device_target.plan.head is HeadKind.PASS:  # every row in one product
        assert computed == [len(ids), 3]
    elif device == "cpu":  # lazily: only row 0 of each
        assert computed == [1, 1]
    assert [len(row) for row in rows] == [len(ids), 3]
    assert rows[0][0].device.type == device_target.device.type


def test_greedy_speculation_equals_generate(
    device_target: TargetModel, device_streams, partly_matching
) -> None:
    drafted = accepted = 0
    context = ContextDraft(partly_matching, min_match=1, max_match=4)
    for ids, expected in device_streams:
        for draft in (OracleDraft(expected), context, partly_matching):
            generation = generate(device_target, draft, ids, max_new_tokens=MAX_NEW, k=4)
            rounds = list(generation)
            assert generation.output_ids == expected, draft
            if isinstance(draft, OracleDraft):
                drafted += sum(r.drafted for r in rounds)
                accepted += sum(r.accepted for r in rounds)
    assert accepted == drafted > 0  # the oracle's drafts were all accepted: acceptance ran


def test_greedy_token_trees_equal_generate(device_target: TargetModel, device_streams) -> None:
    """Two chains per round, the reference's one second: tree masks and cache moves."""
    for ids, expected in device_streams[:4]:
        draft = Branching(expected, device_target.vocab_size)
        generation = generate(device_target, draft, ids, max_new_tokens=MAX_NEW, k=4, tree_budget=8)
        rounds = list(generation)
        assert generation.output_ids == expected
        assert sum(r.accepted for r in rounds) > 0


def test_streams_in_a_batch_equal_generate(
    device_target: TargetModel, device_streams, partly_matching, never_matching
) -> None:
    generations = mixed_generations(device_target, device_streams, partly_matching, never_matching)
    batch = Batch(device_target, BatchSettings(max_rows=5, prefill_chunk=3))
    collectors = [Collector() for _ in generations]
    pairs = [(g, c) for (_, g, _), c in zip(generations, collectors, strict=True)]
    drive(batch, {0: pairs[:4], **{3 * i: [p] for i, p in enumerate(pairs[4:], start=1)}})
    for (kind, _, expected), collector in zip(generations, collectors, strict=True):
        assert collector.error is None
        assert collector.tokens == expected, kind
    assert batch.stats.rows_verified > 2 * batch.stats.passes  # passes really were batched


def test_a_seeded_sample_is_the_same_alone_batched_and_without_drafts(
    device_target: TargetModel, device_streams, partly_matching
) -> None:
    ids, _ = device_streams[0]
    sampling = SamplingParams(temperature=1.0, seed=77)
    options = {"max_new_tokens": MAX_NEW, "sampling": sampling}
    alone = generate(device_target, partly_matching, ids, **options)
    list(alone)
    plain = generate(device_target, partly_matching, ids, enabled=False, **options)
    list(plain)
    batch = Batch(device_target, BatchSettings(max_rows=4))
    others = [Collector() for _ in range(3)]
    for seed, (other_ids, _) in enumerate(device_streams[1:4]):
        other_sampling = SamplingParams(temperature=1.0, seed=seed)
        _, other = start(
            device_target,
            partly_matching,
            other_ids,
            max_new_tokens=MAX_NEW,
            sampling=other_sampling,
        )
        batch.add(other, others[seed])
    _, batched = start(device_target, partly_matching, ids, k=2, **options)
    collector = Collector()
    batch.add(batched, collector)
    batch.run_until_idle()
    assert alone.output_ids == plain.output_ids == collector.tokens
    assert len({tuple(other.tokens) for other in others}) > 1  # they did sample


def test_speculative_sampling_follows_the_target_distribution(
    word_target: TargetModel, device: str
) -> None:
    target = on_device(word_target.name, device, pass_rows=True)  # cpu row reads: test_sampling
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    prompt_ids = target.encode_prompt(PROMPT)
    joint = exact_joint(target, prompt_ids, params)
    draft = likely_draft(target, prompt_ids, params)
    samples = speculative_samples(target, prompt_ids, params, draft)
    accepted_first = sum(1 for sample in samples if sample[0] == draft.tokens[0]) / SAMPLES
    assert 0.05 < accepted_first < 0.95, "the draft must be neither always nor never accepted"
    assert chi_square_pvalue(samples, joint) > 1e-3
