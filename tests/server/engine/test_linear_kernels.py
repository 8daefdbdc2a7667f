"""Linear layers computed as W @ x^T for small row counts (server.engine.linear_kernels)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kenspec.server.engine.linear_kernels import (
    SkinnyLinear,
    decoder_linears,
    measure_skinny_rows,
    stock_linears,
    use_skinny,
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (3, 1), (2, 3), (5,), (4, 2)])
def test_skinny_linear_computes_what_linear_does(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape, 48)
    expected = layer(x)
    layer.__class__ = SkinnyLinear
    layer.skinny_rows = frozenset(range(1, 9))
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layer.skinny_rows = frozenset()  # every row count through F.linear: bit for bit
    assert torch.equal(layer(x), expected)


def test_use_skinny_switches_the_decoder_not_the_output_layer(tiny_target) -> None:
    model = tiny_target.model
    layers = decoder_linears(model)
    assert layers and model.lm_head not in layers
    try:
        use_skinny(model, [2, 3])
        assert all(type(layer) is SkinnyLinear for layer in layers)
        assert all(layer.skinny_rows == {2, 3} for layer in layers)
        assert type(model.lm_head) is nn.Linear
        with stock_linears(model):
            assert all(type(layer) is nn.Linear for layer in layers)
        assert all(layer.skinny_rows == {2, 3} for layer in layers)  # restored after the block
    finally:
        use_skinny(model, ())
    assert all(type(layer) is nn.Linear for layer in layers)


def test_measure_picks_the_rows_where_w_x_t_was_faster(tiny_target) -> None:
    rows, timings = measure_skinny_rows(tiny_target.model, [2, 4], repeats=2, margin=0.05)
    assert set(timings) == {2, 4}
    assert all(plain > 0 and skinny > 0 for plain, skinny in timings.values())
    assert rows == {r for r, (plain, skinny) in timings.items() if skinny < plain * 0.95}
