"""A target's execution plan: decided once at load, a frozen value, its own Forward's; two
targets with different plans run side by side, each as it runs alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.passes import EagerForward, LeanForward
from kenspec.server.engine.forward.plan import (
    ExecutionOptions,
    ExecutionPlan,
    ForwardKind,
    HeadKind,
    Kernel,
    LeanMode,
    RowPlan,
)
from kenspec.server.engine.params import AttentionMode, Weights
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from tests import tiny
from tests.tiny_architectures import save_architecture

EVERY_GEMV = RowPlan.every(Kernel.GEMV)
KERNELS = load_kernels()
GEMV = KERNELS is not None and KERNELS.gemv_bf16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny.build_byte_tokenizer()
    wide = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    return save_architecture(tmp_path_factory.mktemp("plan"), tokenizer, "llama", **wide)


def _passes(target: TargetModel, ids: list[int], widths: tuple[int, ...]) -> list[torch.Tensor]:
    """The logits of a prefill then passes of `widths` tokens, one after another."""
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, ids[:4])
    rows, at = [], 4
    for width in widths:
        (logits,) = target.forward(cache, VerifyPass.sequences([at], [ids[at : at + width]]))
        rows.append(torch.stack([logits[i] for i in range(width)]))
        at += width
    return rows


def test_two_targets_with_different_plans_run_side_by_side(llama_dir: Path) -> None:
    """A lean bf16 target (kenspec's kernels, or torch's where the CPU has none) and an eager
    one of the same model in one process: each keeps its own plan and Forward, and their
    passes, interleaved, give what each gives alone."""
    kernel = Kernel.GEMV if GEMV else Kernel.STOCK
    lean_options = ExecutionOptions(
        lean=LeanMode.AUTO, decoder=RowPlan.every(kernel), head_kernels=RowPlan.every(kernel)
    )
    eager_options = ExecutionOptions(attention=AttentionMode.SDPA)

    def load(options: ExecutionOptions) -> TargetModel:
        return TargetModel.load(llama_dir, device="cpu", dtype="bfloat16", execution=options)

    lean, eager = load(lean_options), load(eager_options)
    assert isinstance(lean.passes, LeanForward) and isinstance(eager.passes, EagerForward)
    assert lean.plan.forward is ForwardKind.LEAN and lean.plan.head is HeadKind.LAZY
    assert eager.plan.forward is ForwardKind.EAGER and eager.plan.head is HeadKind.MODEL
    assert lean.plan.attention.grouped != eager.plan.attention.grouped == ()
    assert lean.plan.describe() != eager.plan.describe()
    ids = lean.encode_prompt("The quick brown fox jumps over the lazy dog")
    widths = (1, 5, 1, 3)
    interleaved = [_passes(target, ids, widths) for target in (lean, eager)]
    alone = [_passes(load(options), ids, widths) for options in (lean_options, eager_options)]
    for side_by_side, by_itself in zip(interleaved, alone, strict=True):
        for a, b in zip(side_by_side, by_itself, strict=True):
            assert torch.equal(a, b)


def test_nothing_is_assigned_to_a_target_or_its_plan_after_load(tiny_target) -> None:
    """The target and its plan are frozen: a new choice is a new target, not a switch."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_target.passes = tiny_target.passes  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_target.plan.head = HeadKind.MODEL  # type: ignore[misc]
    assert tiny_target.passes.plan is tiny_target.plan


def test_the_stock_options_measure_nothing_and_say_so(tiny_target) -> None:
    """TargetModel.load's default: transformers' forward, its head read as rows (float32
    llama), grouped attention up to 16 queries, nothing measured, every choice named."""
    plan = tiny_target.plan
    assert plan.forward is ForwardKind.EAGER and plan.head is HeadKind.LAZY
    assert plan.attention.grouped == ((16, 0),) and plan.invariance is None
    assert plan.skinny_rows == frozenset() and plan.row_invariant_below == 0
    described = plan.describe()
    assert described.startswith("eager; head lazy;") and "attention 16:0" in described
    assert f"threads {torch.get_num_threads()}" in described


def test_a_fixed_head_the_model_cannot_take_is_refused(tmp_path: Path) -> None:
    """Rows from hidden states need a plain output layer: a model whose logits are not one
    (Phi: a biased output layer) is refused a LAZY head it is asked for."""
    tokenizer = tiny.build_byte_tokenizer()
    directory = save_architecture(tmp_path / "phi", tokenizer, "phi")
    assert TargetModel.load(directory, device="cpu", dtype="float32").plan.head is HeadKind.MODEL
    with pytest.raises(ValueError, match="plain output layer"):
        TargetModel.load(
            directory,
            device="cpu",
            dtype="float32",
            execution=ExecutionOptions(head=HeadKind.LAZY),
        )


def test_row_invariance_is_a_property_of_the_plan() -> None:
    """Lean passes narrower than the first count the invariant kernel leaves compute each row
    as a one-row pass does (int4: torch's kernel is the invariant one); eager plans promise
    nothing."""

    def lean(decoder: RowPlan, head: RowPlan, weights: Weights = Weights.BF16) -> ExecutionPlan:
        return ExecutionPlan(
            forward=ForwardKind.LEAN,
            head=HeadKind.LAZY,
            weights=weights,
            threads=1,
            decoder=decoder,
            head_kernels=head,
        )

    split = RowPlan(((1, Kernel.GEMV), (8, Kernel.PACKED)))
    assert lean(EVERY_GEMV, split).row_invariant_below == 8
    assert lean(EVERY_GEMV, EVERY_GEMV).row_invariant_below > 1 << 40
    stock = RowPlan.every(Kernel.STOCK)
    assert lean(stock, EVERY_GEMV).row_invariant_below == 0
    assert lean(stock, EVERY_GEMV, Weights.INT4).row_invariant_below > 1 << 40
    assert lean(stock, stock, Weights.INT4).row_invariant_below == 0  # (its head is int8)
    eager = dataclasses.replace(lean(EVERY_GEMV, EVERY_GEMV), forward=ForwardKind.EAGER)
    assert eager.row_invariant_below == 0
