"""The runtime plans the target's linear layers as W @ x^T where measured faster."""

from __future__ import annotations

from torch import nn

from kenspec.server.engine.forward import choose
from kenspec.server.engine.linear_kernels import SkinnyLinear, decoder_linears
from kenspec.server.runtime import load_runtime


def test_runtime_uses_the_row_counts_measured_faster(base_settings, monkeypatch) -> None:
    timings = {2: (2.0, 1.0), 3: (1.0, 1.0), 4: (2.0, 1.0)}
    monkeypatch.setattr(choose, "measure_skinny_rows", lambda model: (frozenset({2, 4}), timings))
    runtime = load_runtime(base_settings.replace(draft="none", draft_context=False))
    layers = decoder_linears(runtime.engine.target.model)
    assert layers and all(type(layer) is SkinnyLinear for layer in layers)
    assert all(layer.skinny_rows == {2, 4} for layer in layers)


def test_no_skinny_gemm_keeps_plain_linear_layers(base_settings, monkeypatch) -> None:
    def never(model):
        raise AssertionError("measured although --no-skinny-gemm")

    monkeypatch.setattr(choose, "measure_skinny_rows", never)
    settings = base_settings.replace(draft="none", draft_context=False, skinny_gemm=False)
    runtime = load_runtime(settings)
    assert all(type(layer) is nn.Linear for layer in decoder_linears(runtime.engine.target.model))
