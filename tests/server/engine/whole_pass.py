"""The whole decoder pass in one C call against the Python loop over the same kernels: the
checks test_fused_layer.py, test_gemv_amx.py and test_gguf_weights.py share."""

from __future__ import annotations

import torch

from kenspec.server.engine.forward.passes import LeanForward
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass


def random_biases(target: TargetModel, *, every: bool = False, seed: int = 3) -> None:
    """Give the lean decoder's q/k/v and attention-output products random biases, as trained
    ones are (a new model's are zeros, which a pass that dropped them would still match): the
    products that have one, or `every` one."""
    assert isinstance(target.passes, LeanForward)
    generator = torch.Generator().manual_seed(seed)
    for layer in target.passes.decoder.weights.layers:
        for product in (layer.qkv, layer.out):
            if product.bias is None and not every:
                continue
            rows = product.grouped.shape[0] if product.grouped is not None else None
            shape = product.bias.shape if product.bias is not None else (rows,)
            dtype = product.bias.dtype if product.bias is not None else torch.bfloat16
            product.bias = (torch.randn(shape, generator=generator) * 0.5).to(dtype)


def whole_pass_calls(target: TargetModel, text: str) -> list[int]:
    """A prefill of `text` but its last 8 tokens, then passes of 1 and 7 tokens, once through
    the whole pass in one call and once through the Python loop: asserts the same rows of
    logits bit for bit and the same cache; returns the whole pass's calls (1 a pass that took
    it: the loop's take none)."""
    assert isinstance(target.passes, LeanForward)
    decoder = target.passes.decoder
    ids = target.encode_prompt(text)
    calls: list[int] = []
    whole = decoder._whole_pass
    results = []
    for one_call in (True, False):
        decoder._layers = decoder._describe_layers() if one_call and decoder._one_call() else None
        decoder._whole_pass = lambda *a: (calls.append(1), whole(*a))  # type: ignore[method-assign]
        cache = target.new_cache(1)
        target.prefill(cache, 0, 0, ids[:-8])
        rows = []
        for width in (1, 7):
            start = len(ids) - 8 + (0 if width == 1 else 1)
            verify = VerifyPass.sequences([start], [ids[start : start + width]])
            logits = target.forward(cache, verify)[0]
            rows.append(torch.stack([logits[i] for i in range(width)]))
        results.append((rows, cache.read(0, len(ids) - 1)))
    (whole_rows, whole_cache), (loop_rows, loop_cache) = results
    for a, b in zip(whole_rows, loop_rows, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        (*whole_cache[0], *whole_cache[1]), (*loop_cache[0], *loop_cache[1]), strict=True
    ):
        assert torch.equal(a, b)
    return calls
