"""The one logits type: rows computed on access (CPU) or all at once with one greedy copy."""

from __future__ import annotations

import pytest
import torch

from kenspec.server.engine.forward.plan import Kernel, RowPlan
from kenspec.server.engine.forward.products import rows_at_one_rows_cost
from kenspec.server.engine.pass_logits import Logits, OutputLayer, lazy_logits

GEMV, PACKED = Kernel.GEMV, Kernel.PACKED


def _lazy(tiny_target, hidden: torch.Tensor) -> Logits:
    head = tiny_target.passes.head.layer  # float32 llama on a CPU: rows as read
    (logits,) = lazy_logits(hidden, [(0, hidden.shape[0])], head)
    return logits


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6], [6, 1, 3, 0, 5, 2, 4], [2, 1, 0]])
def test_lazy_rows_equal_the_full_output_layer_in_any_order(tiny_target, order) -> None:
    """Rows come one at a time or in blocks; every one equals the head applied to all rows."""
    hidden = torch.randn(7, tiny_target.model.config.hidden_size)
    weight = tiny_target.model.lm_head.weight
    with torch.inference_mode():
        full = hidden @ weight.t()
    lazy = _lazy(tiny_target, hidden)
    for index in order:
        torch.testing.assert_close(lazy[index], full[index], rtol=1e-5, atol=1e-5)
        assert lazy.argmax(index) == int(full[index].argmax())
    with pytest.raises(IndexError):
        lazy[7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_rows_greedy_token_is_torchs_argmax_with_ties_and_nan(dtype: torch.dtype) -> None:
    """The first of tied largest logits, the first NaN where there is one (torch's rule; the
    row's argmax is taken by numpy where it can hold the dtype)."""
    rows = torch.tensor(
        [[0.0, 3.0, 1.0, 3.0], [1.0, float("nan"), 5.0, float("nan")], [-1.0, -1.0, -2.0, -9.0]]
    ).to(dtype)
    logits = Logits.of(rows)
    assert [logits.argmax(i) for i in range(3)] == [1, 1, 0]
    assert [logits.argmax(i) for i in range(3)] == [int(row.argmax()) for row in rows]


def test_lazy_rows_past_the_first_are_read_in_blocks(tiny_target) -> None:
    lazy = _lazy(tiny_target, torch.randn(7, tiny_target.model.config.hidden_size))
    assert [i for i, _ in lazy.computed(7)] == [0]  # row 0: every sequence reads one
    lazy[1]
    assert [i for i, _ in lazy.computed(7)] == [0, 1, 2, 3, 4]  # with the next BLOCK - 1 rows
    lazy[6]
    assert [i for i, _ in lazy.computed(7)] == [0, 1, 2, 3, 4, 6]  # the last: a GEMV of its own
    lazy[5]
    assert len(lazy.computed(7)) == 7
    assert [i for i, _ in lazy.computed(3)] == [0, 1, 2]  # only those asked for


def test_computed_rows_are_all_there() -> None:
    rows = torch.nn.functional.one_hot(torch.tensor([2, 0, 1]), 5).float()
    logits = Logits.of(rows)
    assert len(logits) == 3 and logits.argmax(0) == 2
    assert [i for i, _ in logits.computed(2)] == [0, 1]
    torch.testing.assert_close(logits[1], rows[1])
    with pytest.raises(IndexError):
        logits[3]


def test_a_pass_within_together_rows_has_them_all_computed_at_once(tiny_target) -> None:
    """Where the output layer's product costs about one row's for a few rows (the fast step's
    GEMV), a pass of at most `together` rows gets every row in one product; past it, lazily."""
    weight = tiny_target.model.lm_head.weight
    calls: list[int] = []

    def product(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return hidden @ weight.t()

    hidden = torch.randn(7, tiny_target.model.config.hidden_size)
    spans = [(0, 3), (3, 4), (4, 7)]
    with torch.inference_mode():
        full = hidden @ weight.t()
    together = lazy_logits(hidden, spans, OutputLayer(None, None, product=product, together=7))
    assert calls == [7]
    for logits, (begin, end) in zip(together, spans, strict=True):
        # Every row computed ahead is there to recycle, read or not
        assert [i for i, _ in logits.computed(end - begin)] == list(range(end - begin))
        assert [i for i, _ in logits.computed(1)] == [0]  # only those asked for
        torch.testing.assert_close(torch.stack([logits[i] for i in range(end - begin)]),
                                   full[begin:end])  # fmt: skip
        torch.testing.assert_close(torch.stack([row for _, row in logits.computed(9)]),
                                   full[begin:end])  # fmt: skip
    calls.clear()
    lazy = lazy_logits(hidden, spans, OutputLayer(None, None, product=product, together=6))
    assert calls == [3] and [len(x.computed(9)) for x in lazy] == [1, 1, 1]  # row 0s only


def test_together_is_the_most_rows_at_about_one_rows_cost() -> None:
    plan = RowPlan(((1, GEMV), (24, PACKED)))
    timings = {
        1: {GEMV: 1.6, PACKED: 1.7},
        4: {GEMV: 1.8, PACKED: 1.9},
        8: {GEMV: 1.4, PACKED: 2.4},
        12: {GEMV: 2.3, PACKED: 2.9},  # 44% over one row's: still together
        17: {GEMV: 2.6, PACKED: 3.5},  # 63% over: lazily
        24: {GEMV: 1.0, PACKED: 3.6},  # (the plan's kernel here is oneDNN's)
    }
    assert rows_at_one_rows_cost(timings, plan) == 12
    assert rows_at_one_rows_cost({4: {GEMV: 1.0}}, plan) == 1


def test_one_noisy_count_does_not_cut_together_short() -> None:
    """A slow timing at 4 rows (a neighbour's burst) must not leave a dozen rows to be read
    a block at a time: the largest count within the bound is taken (the old rule, stopping at
    the first count over, gave 2 here)."""
    plan = RowPlan(((1, PACKED), (6, GEMV)))
    timings = {  # a start-up's output-layer timings on the EPYC, ms
        1: {GEMV: 1.99, PACKED: 1.82},
        2: {GEMV: 2.15, PACKED: 2.11},
        4: {GEMV: 2.41, PACKED: 2.95},  # over 1.5 x 1.82
        8: {GEMV: 2.63, PACKED: 2.84},
        12: {GEMV: 2.06, PACKED: 3.5},
        17: {GEMV: 3.88, PACKED: 4.75},
    }
    assert rows_at_one_rows_cost(timings, plan) == 12
