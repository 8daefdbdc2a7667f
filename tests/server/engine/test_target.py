"""Loading targets: clear errors for bad folders; dtype and device resolution; cache rollback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kenspec.server.engine import target as target_module
from kenspec.server.engine.forward.cpu_kernels import load_kernels
from kenspec.server.engine.forward.plan import ExecutionOptions, HeadKind, LeanMode
from kenspec.server.engine.packed_pass import pack
from kenspec.server.engine.target import TargetLoadError, TargetModel, resolve_dtype
from kenspec.server.engine.verify_pass import VerifyPass


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TargetLoadError, match="does not exist"):
        TargetModel.load(tmp_path / "missing")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(TargetLoadError, match=r"no config\.json"):
        TargetModel.load(tmp_path)


def test_non_causal_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert"})
    )
    with pytest.raises(TargetLoadError, match="not a causal language model"):
        TargetModel.load(tmp_path)


def test_cuda_requested_without_cuda(tiny_model_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.xfail("this machine has CUDA")  # the check is for CPU-only machines like CI
    with pytest.raises(TargetLoadError, match="CUDA is not available"):
        TargetModel.load(tiny_model_dir, device="cuda")


def test_dtype_resolution(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cuda) is torch.bfloat16
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) is torch.float32
    assert resolve_dtype("auto", cpu, avx2_step=True) is torch.bfloat16
    assert resolve_dtype("float32", cpu, avx2_step=True) is torch.float32
    assert resolve_dtype("float32", cuda) is torch.float32
    with pytest.raises(TargetLoadError, match="dtype 'int8'"):
        resolve_dtype("int8", cpu)


def test_a_cpu_with_native_bf16_reads_no_model_for_the_avx2_rule(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir
) -> None:
    """--dtype auto is bf16 there anyway: the AVX2 rule reads neither the config nor a GGUF
    header (parsing a large one whole takes seconds)."""

    def unread(*args: object) -> None:
        raise AssertionError("the model was read")

    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(target_module, "_model_type", unread)
    lean = ExecutionOptions(lean=LeanMode.AUTO)
    assert not target_module._avx2_step(tiny_model_dir, None, torch.device("cpu"), lean)
    monkeypatch.setattr(target_module, "cpu_has_native_bf16", lambda: False)
    if (kernels := load_kernels()) is not None and kernels.layer_kernels:
        with pytest.raises(AssertionError, match="the model was read"):
            target_module._avx2_step(tiny_model_dir, None, torch.device("cpu"), lean)


def test_rollback_restores_the_cache_exactly(tiny_target: TargetModel) -> None:
    """Scoring after rejected tokens equals scoring on a cache that never saw them."""
    prompt = tiny_target.encode_prompt("The quick brown fox")
    rolled = tiny_target.new_cache()
    tiny_target.prefill(rolled, 0, 0, prompt)
    tiny_target.forward(
        rolled, VerifyPass.sequences([len(prompt)], [[5, 6, 7]])
    )  # then rolled back: length stays
    fresh = tiny_target.new_cache()
    tiny_target.prefill(fresh, 0, 0, prompt)
    after_rollback = tiny_target.forward(rolled, VerifyPass.sequences([len(prompt)], [[9, 10]]))[0]
    never_seen = tiny_target.forward(fresh, VerifyPass.sequences([len(prompt)], [[9, 10]]))[0]
    for row in range(2):
        torch.testing.assert_close(after_rollback[row], never_seen[row])


def test_pack_lays_rows_end_to_end_and_attention_out_as_rows() -> None:
    packed = pack([5, 9], [[1], [2, 3]], torch.float32, torch.device("cpu"))
    assert packed.input_ids.tolist() == [[1, 2, 3]]
    assert packed.positions.tolist() == [[5, 9, 10]]
    assert packed.token_rows.tolist() == [0, 1, 1] and packed.starts == [0, 1]
    assert packed.packing.slots.tolist() == [[0, 0], [1, 2]]  # row 0 padded with its token
    assert packed.packing.tokens.tolist() == [0, 2, 3]  # row 0's padding slot is not read back
    assert packed.kv_length == 11 and packed.packing.mask.shape == (2, 1, 2, 11)
    padded = pack([5], [[1, 2]], torch.float32, torch.device("cpu"), pad_to=4)
    assert padded.input_ids.tolist() == [[1, 2, 2, 2]]
    assert padded.positions.tolist() == [[5, 6, 7, 8]]


def test_rows_of_a_batch_score_as_they_would_alone(tiny_target: TargetModel) -> None:
    """Rows of different lengths and widths, packed into one pass (padded to 9 tokens), match
    solo passes."""
    prompts = [tiny_target.encode_prompt(text) for text in ("Hi", "The quick brown fox", "a b")]
    feeds = [[5, 6, 7], [9], [11, 12]]
    batch = tiny_target.new_cache(rows=len(prompts))
    for row, prompt in enumerate(prompts):
        tiny_target.prefill(batch, row, 0, prompt)
    together = tiny_target.forward(
        batch, VerifyPass.sequences([len(p) for p in prompts], feeds, width=9)
    )
    for prompt, feed, rows in zip(prompts, feeds, together, strict=True):
        alone = tiny_target.new_cache()
        tiny_target.prefill(alone, 0, 0, prompt)
        solo = tiny_target.forward(alone, VerifyPass.sequences([len(prompt)], [feed]))[0]
        assert len(rows) == len(feed)
        for position in range(len(feed)):
            torch.testing.assert_close(rows[position], solo[position], rtol=1e-5, atol=1e-5)


def test_moved_rows_keep_their_keys_and_values(tiny_target: TargetModel) -> None:
    prompt = tiny_target.encode_prompt("The quick brown fox")
    cache = tiny_target.new_cache(rows=3)
    tiny_target.prefill(cache, 2, 0, prompt)
    cache.move(2, 0, len(prompt))
    moved = tiny_target.forward(cache, VerifyPass.sequences([len(prompt)], [[9]]))[0][0]
    alone = tiny_target.new_cache()
    tiny_target.prefill(alone, 0, 0, prompt)
    torch.testing.assert_close(
        moved, tiny_target.forward(alone, VerifyPass.sequences([len(prompt)], [[9]]))[0][0]
    )


def test_cache_grows_and_refuses_passes_past_its_length(tiny_target: TargetModel) -> None:
    cache = tiny_target.new_cache(rows=2)
    tiny_target.prefill(cache, 1, 0, list(range(3, 303)))  # past the first capacity (256)
    assert cache.capacity >= 300
    with pytest.raises(ValueError, match="the cache holds"):
        tiny_target.prefill(cache, 0, cache.max_length, [5])


def test_lazy_transposed_head_only_in_float32(
    tiny_model_dir: Path, tiny_target: TargetModel
) -> None:
    # llama, float32: rows through the transposed head
    assert tiny_target.plan.head is HeadKind.LAZY
    bf16 = TargetModel.load(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert bf16.plan.head is HeadKind.MODEL  # transformers' own head, as `generate` uses it
    ids = bf16.encode_prompt("Hello")
    logits = bf16.forward(bf16.new_cache(), VerifyPass.sequences([0], [ids]))[0]
    assert len(logits.computed(len(ids))) == len(ids)  # every row computed, by the model
    assert logits[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [0, 1, 37])
def test_a_one_token_pass_is_packed_as_every_pass_is(dtype: torch.dtype, length: int) -> None:
    """A decoding step's pass, built directly (packed_pass._one_token), holds what the general
    packing gives it: every tensor, value for value, dtype and shape."""
    from kenspec.server.engine import packed_pass
    from kenspec.server.engine.kernels import Kernels

    cpu, kernels = torch.device("cpu"), Kernels()
    direct = pack([length], [[7]], dtype, cpu, kernels=kernels)
    general = packed_pass._rows([length], [[7]], dtype, cpu, 0, None, kernels)
    assert direct.starts == general.starts and direct.kv_length == general.kv_length
    assert direct.cache_positions is None and general.cache_positions is None
    pairs = [
        (direct.input_ids, general.input_ids), (direct.positions, general.positions),
        (direct.token_rows, general.token_rows),
        (direct.packing.slots, general.packing.slots),
        (direct.packing.tokens, general.packing.tokens),
        (direct.packing.mask, general.packing.mask),
        (direct.packing.grid, general.packing.grid),
    ]  # fmt: skip
    for mine, theirs in pairs:
        assert mine is not None and theirs is not None
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert mine.is_contiguous() == theirs.is_contiguous()
        assert torch.equal(mine, theirs)
    assert direct.packing.trees == general.packing.trees == ()
    assert direct.packing.reordered == general.packing.reordered == ()
