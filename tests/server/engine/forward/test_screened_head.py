"""The greedy token through an int8 screen of the output layer (engine.forward.screened_head): the
argmax of the bf16 GEMV's logits exactly, ties to the earlier token, whatever the hidden
state; whole rows exact; greedy serving through it is plain decoding through the bf16 head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.plan import ExecutionOptions, Kernel, LeanMode, RowPlan
from kenspec.server.engine.forward.screened_head import (
    SCREEN_ROWS,
    WIDE_SCREEN_ROWS,
    ScreenedHead,
    ScreenedLogits,
)
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import PassRow, VerifyPass
from tests import tiny
from tests.server.engine.drafts import Branching, OracleDraft, generate, plain_decoding
from tests.tiny_architectures import save_architecture

KERNELS = load_kernels()
BF16 = KERNELS is not None and KERNELS.bf16
VNNI = KERNELS is not None and KERNELS.vnni
needs_vnni = pytest.mark.skipif(not VNNI, reason="the CPU has no avx512_vnni")
pytestmark = pytest.mark.skipif(not BF16, reason="the CPU has no avx512_bf16 (or no compiler)")
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3 4 5 6", "Hello world"]


def _exact_argmax(weight: torch.Tensor, x: torch.Tensor) -> int:
    assert KERNELS is not None
    return int(KERNELS.gemv(x[None].contiguous(), weight)[0].float().argmax())


@pytest.mark.parametrize("kernels", [True, False], ids=["kenspec_screen", "torch"])
def test_the_screened_argmax_is_the_exact_rows_argmax(kernels: bool) -> None:
    """Random layers and hidden states of every scale, rows that tie exactly (a duplicated
    weight row: the earlier wins) and rows a hair apart (one weight nudged by one bf16 step):
    the screen's token is the argmax of the exact logits every time."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(0)
    vocab, hidden = 3000, 96
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.05).bfloat16()
    weight[2500] = weight[700]  # an exact tie: 700 first
    weight[1200] = weight[40]
    nudged = weight[1200].clone()
    nudged[3] = torch.nextafter(nudged[3].float(), torch.tensor(1.0)).bfloat16()
    weight[1200] = nudged  # 40 and 1200 a bf16 step apart in one weight
    head = ScreenedHead(weight, KERNELS, in_c=kernels, wide=False)
    for trial in range(200):
        scale = [0.01, 1.0, 30.0][trial % 3]
        x = (torch.randn(hidden, generator=generator) * scale).bfloat16()
        if trial % 4 == 0:  # aim at the tie: x along the duplicated row
            x = (weight[700].float() * 40 + torch.randn(hidden, generator=generator)).bfloat16()
        if trial % 4 == 1:
            x = (weight[40].float() * 40).bfloat16()
        approximate = head.approximate(x[None])[0][0]
        assert head.argmax(x, approximate) == _exact_argmax(weight, x), trial
    x = (weight[700].float() * 40).bfloat16()
    assert head.argmax(x, head.approximate(x[None])[0][0]) == 700  # not 2500


@needs_vnni
@pytest.mark.parametrize("kernels", [True, False], ids=["kenspec_screen", "torch"])
def test_a_verify_pass_screened_with_quantized_rows_gives_each_rows_exact_argmax(
    kernels: bool,
) -> None:
    """Passes of 2-16 rows take the int8 x int8 approximation (the rows quantized too, with
    each row's residue in the bound): every row's token is the exact row's argmax, ties to
    the earlier token, for hidden states of every scale, some aimed at a tie and at rows a
    bf16 step apart, one all zeros."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(5)
    vocab, hidden = 3000, 96
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.05).bfloat16()
    weight[2500] = weight[700]
    nudged = weight[40].clone()
    nudged[3] = torch.nextafter(nudged[3].float(), torch.tensor(1.0)).bfloat16()
    weight[1200] = nudged
    head = ScreenedHead(weight, KERNELS, in_c=kernels)
    assert head.rows == WIDE_SCREEN_ROWS
    for trial in range(40):
        rows = 2 + trial % (WIDE_SCREEN_ROWS - 1)
        scale = [0.01, 1.0, 30.0][trial % 3]
        x = torch.randn(rows, hidden, generator=generator) * scale
        x[0] = weight[700].float() * 40 + torch.randn(hidden, generator=generator)
        x[1] = weight[40].float() * 40
        if trial == 0:
            x[-1] = 0.0
        x = x.bfloat16()
        (logits,) = head.logits(x, [(0, rows)])
        assert isinstance(logits, ScreenedLogits)
        exact = KERNELS.gemv(x.contiguous(), weight).float().argmax(-1).tolist()
        assert [logits.argmax(i) for i in range(rows)] == exact, trial
        # each row read so: its recycled approximation's best token is the exact one
        assert [int(row.argmax()) for _, row in logits.computed(rows)] == exact, trial
    x = (weight[700].float() * 40).bfloat16().expand(3, hidden)
    (logits,) = head.logits(x, [(0, 3)])
    assert logits.argmax(2) == 700  # not 2500


@needs_vnni
def test_the_quantized_rows_product_is_its_integer_sums_scaled() -> None:
    """csrc/gemv_u8s8.c against its definition in torch: each row quantized to p = round(x /
    t) with t = max|x| / 127, the sums exact in integers, then y = float(sum) * s_j * t in
    float32 (bit for bit); the residue it reports bounds |x - t p|_2 from above."""
    assert KERNELS is not None and VNNI
    generator = torch.Generator().manual_seed(6)
    cases = ((37, 64, 1), (130, 96, 5), (66, 128, 2), (99, 64, 3), (257, 200, 7), (257, 200, 16))
    for out, k, rows in cases:  # (k: whole and partial 64-byte loads; every row block)
        weight = (torch.randn(out, k, generator=generator) * 0.05).bfloat16()
        head = ScreenedHead(weight, KERNELS)
        x = torch.randn(rows, k, generator=generator) * 3
        x[-1] = 0.0 if rows == 3 else x[-1]  # an all-zero row: t = 0
        x = x.bfloat16()
        approximate, residue = KERNELS.u8s8(x, head.values, head.u8s8_scale, head.u8s8_offset)
        exact = x.float()
        t = exact.abs().amax(dim=1) / 127
        p = torch.round(exact / t[:, None]).clamp(-127, 127).nan_to_num(0.0)
        sums = p.long() @ head.values.long().T
        expected = sums.float() * head.scales.float() * t[:, None]
        assert torch.equal(approximate, expected)
        d = (exact.double() - t.double()[:, None] * p.double()).norm(dim=1)
        assert bool((residue >= d).all()) and bool((residue <= d * 1.001 + 1e-12).all())


@pytest.mark.parametrize("kernels", [True, False], ids=["kenspec_screen", "torch"])
def test_the_screen_misses_nothing_when_its_approximation_is_far_off(kernels: bool) -> None:
    """The bound, not luck: with the approximation pushed by the most the bound allows
    against the true winner, the winner is still among the candidates."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(500, 64, generator=generator) * 0.1).bfloat16()
    head = ScreenedHead(weight, KERNELS, in_c=kernels, wide=False)
    missed = 0
    for _ in range(50):
        x = torch.randn(64, generator=generator).bfloat16()
        exact = KERNELS.gemv(x[None], weight)[0].float()
        winner = int(exact.argmax())
        norm = float(x.double().norm())
        worst = exact.clone()  # every other token raised, the winner lowered, by ~the bound
        bound = head.error * norm + exact.abs() * 2.0**-8
        worst += bound * 0.99
        worst[winner] -= 2 * bound[winner] * 0.99
        assert head.argmax(x, worst) == winner
        assert int(worst.argmax()) == winner  # the candidates' exact logits written back
        if VNNI:  # with a quantized row's residue, its own term in the bound
            residue = 0.05 * norm
            wider = exact + (bound + head.weight * residue) * 0.99
            wider[winner] = exact[winner] - (bound + head.weight * residue)[winner] * 0.99
            assert head.argmax(x, wider.clone(), residue) == winner
            # without the residue term the same approximation may miss the winner
            missed += head.argmax(x, wider.clone()) != winner
    assert not VNNI or missed > 0  # (the residue term is needed, so the check can fail)


@pytest.mark.parametrize("kernels", [True, False], ids=["kenspec_screen", "torch"])
def test_a_row_the_screen_cannot_narrow_is_computed_whole_and_recycled_exact(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too many candidates (here: any), or a NaN in the approximation (even at the winner,
    whose bound a NaN would otherwise drop from the candidates): the whole row is computed,
    its argmax taken, and the row written into the approximation recycling reads."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(300, 64, generator=generator) * 0.1).bfloat16()
    head = ScreenedHead(weight, KERNELS, in_c=kernels)
    hidden = torch.randn(4, 64, generator=generator).bfloat16()
    exact = KERNELS.gemv(hidden, weight).float()
    winners = exact.argmax(-1).tolist()
    (logits,) = head.logits(hidden, [(0, 4)])
    logits._approximate[1, winners[1]] = float("nan")
    assert logits.argmax(1) == winners[1]
    assert torch.equal(logits.computed(4)[1][1], exact[1])
    monkeypatch.setattr("kenspec.server.engine.forward.screened_head.CANDIDATES", 0)
    (logits,) = head.logits(hidden, [(0, 4)])
    assert [logits.argmax(i) for i in range(4)] == winners
    assert torch.equal(torch.stack([row for _, row in logits.computed(4)]), exact)
    with pytest.raises(ValueError, match="bfloat16"):
        head.logits(hidden.float(), [(0, 4)])


def test_screened_logits_give_exact_rows_and_recycle_the_approximations() -> None:
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(2)
    weight = (torch.randn(400, 64, generator=generator) * 0.1).bfloat16()
    head = ScreenedHead(weight, KERNELS, wide=False)
    hidden = torch.randn(7, 64, generator=generator).bfloat16()
    first, second = head.logits(hidden, [(0, 3), (3, 7)])
    assert isinstance(first, ScreenedLogits) and (len(first), len(second)) == (3, 4)
    exact = KERNELS.gemv(hidden, weight).float()
    assert torch.equal(second[1], exact[4])  # a whole row: the GEMV's bits
    assert [second.argmax(i) for i in range(4)] == exact[3:].argmax(-1).tolist()
    recycled = first.computed(9)
    assert [i for i, _ in recycled] == [0, 1, 2]
    torch.testing.assert_close(
        torch.stack([row for _, row in recycled]), exact[:3], atol=0.1, rtol=0.05
    )
    with pytest.raises(IndexError):
        first.argmax(3)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return tiny.build_byte_tokenizer()


def _served(directory: Path, screen: bool) -> TargetModel:
    gemv = RowPlan.every(Kernel.GEMV)
    options = ExecutionOptions(lean=LeanMode.AUTO, decoder=gemv, head_kernels=gemv, screen=screen)
    return TargetModel.load(directory, device="cpu", dtype="bfloat16", execution=options)


def test_greedy_serving_through_the_screen_is_plain_decoding_through_the_bf16_head(
    tokenizer, tmp_path: Path
) -> None:
    """The tiny bf16 Llama with the fast step: plain decoding with the screen equals plain
    decoding without it, and speculation through it (drafts always right, trees partly
    right) gives that output token for token."""
    directory = save_architecture(tmp_path / "llama", tokenizer, "llama", **WIDE_HEADS)
    screened, unscreened = _served(directory, True), _served(directory, False)
    assert screened.plan.screen and not unscreened.plan.screen
    plain = plain_decoding(unscreened, PROMPTS, max_new_tokens=24)
    assert plain_decoding(screened, PROMPTS, max_new_tokens=24) == plain
    for ids, expected in plain.values():
        for draft, options in (
            (OracleDraft(expected), {"k": 4}),
            (Branching(expected, screened.vocab_size), {"k": 4, "tree_budget": 12}),
        ):
            solo = generate(screened, draft, ids, max_new_tokens=24, **options)
            for _ in solo:
                pass
            assert solo.output_ids == expected, draft.name


def test_only_greedy_steps_the_screen_takes(tokenizer, tmp_path: Path) -> None:
    """A pass whose rows read whole rows (sampling, logprobs, processors) is not screened,
    nor one of more rows of logits than the screen takes (SCREEN_ROWS, or WIDE_SCREEN_ROWS
    where the CPU has VNNI); a screened pass's rows are ScreenedLogits, with the unscreened
    pass's tokens and rows."""
    directory = save_architecture(tmp_path / "llama", tokenizer, "llama", **WIDE_HEADS)
    target = _served(directory, True)
    ids = target.encode_prompt("The quick brown fox jumps")
    cache = target.new_cache(1)
    target.prefill(cache, 0, 0, ids[:-1])
    step = PassRow(len(ids) - 1, ids[-1])
    greedy = target.forward(cache, VerifyPass((step,), argmax_only=True))[0]
    whole = target.forward(cache, VerifyPass((step,)))[0]
    assert isinstance(greedy, ScreenedLogits) and not isinstance(whole, ScreenedLogits)
    assert greedy.argmax(0) == int(whole[0].argmax())
    assert torch.equal(greedy[0], whole[0])
    widest = WIDE_SCREEN_ROWS if VNNI else SCREEN_ROWS
    wide = PassRow(len(ids) - 1, ids[-1], tuple(range(5, 5 + widest)))
    verify = target.forward(cache, VerifyPass((wide,), argmax_only=True))[0]
    assert not isinstance(verify, ScreenedLogits)
    if VNNI:  # the widest it takes: screened, with the whole pass's tokens
        drafts = PassRow(len(ids) - 1, ids[-1], tuple(range(5, 5 + widest - 1)))
        screened = target.forward(cache, VerifyPass((drafts,), argmax_only=True))[0]
        exact = target.forward(cache, VerifyPass((drafts,)))[0]
        assert isinstance(screened, ScreenedLogits)
        assert [screened.argmax(i) for i in range(widest)] == [
            int(exact[i].argmax()) for i in range(widest)
        ]
