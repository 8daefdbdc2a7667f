"""The architecture matrix: tiny random models of each supported architecture, served over gRPC
with speculation on and several streams in one batch, give exactly transformers' greedy output;
architectures the engine cannot serve exactly are refused at load with the feature named.

References come from a second copy of each model, loaded by transformers as shipped (its own
attention, its own output layer), never from the served one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine import attention
from kenspec.server.engine.architecture import served_context
from kenspec.server.engine.batch import Batch
from kenspec.server.engine.forward import choose
from kenspec.server.engine.forward.plan import HeadKind
from kenspec.server.engine.linear_kernels import (
    SkinnyConv1D,
    SkinnyLinear,
    decoder_linears,
    use_skinny,
)
from kenspec.server.engine.packed_pass import pack
from kenspec.server.engine.prefix_cache import PrefixCache
from kenspec.server.engine.target import TargetLoadError, TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.runtime import Runtime, load_runtime
from kenspec.server.settings import Settings
from tests import tiny
from tests.server.conftest import TIMEOUT, PassGate
from tests.tiny_architectures import ARCHITECTURES, MODEL_LOGITS, WINDOW, save_architecture

MAX_NEW = 24  # with a prompt, past the sliding windows (WINDOW positions)
STREAMS = ["The quick brown fox", "Speculative decoding", "def add(a, b):", "Hello world"]


@dataclass(frozen=True, slots=True)
class Served:
    name: str  # a key of ARCHITECTURES
    directory: Path
    runtime: Runtime
    references: dict[str, list[int]]  # prompt -> transformers' greedy continuation
    settings: Settings


def shipped_greedy(model: transformers.PreTrainedModel, ids: list[int], new: int) -> list[int]:
    input_ids = torch.tensor([ids])
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=new
    )
    return output[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return tiny.build_byte_tokenizer()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def served(request, tokenizer, tmp_path_factory) -> Iterator[Served]:
    """A tiny model of one architecture, its references, and a runtime serving it with a
    partly matching ARPA draft (trained on the references' first tokens), W @ x^T in every
    linear layer at 2-5 rows, and grouped attention for passes up to 16 queries a row."""
    model_type = request.param
    directory = save_architecture(tmp_path_factory.mktemp(model_type), tokenizer, model_type)
    shipped = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    references = {
        prompt: shipped_greedy(shipped, tokenizer(prompt)["input_ids"], MAX_NEW)
        for prompt in STREAMS
    }
    draft = tmp_path_factory.mktemp(f"{model_type}-draft") / "draft.arpa"
    firsts = [continuation[:10] for continuation in references.values()]
    tiny.train_arpa(draft, firsts, range(len(tokenizer)), order=3)
    settings = Settings.of(
        model=str(directory),
        draft=str(draft),
        device="cpu",
        dtype="float32",
        threads=1,
        grpc_port=0,
        metrics_port=-1,
        breaker_threshold=0.0,
        live_costs=False,  # drafts priced by the start-up table alone: verified here
        min_draft_prob=0.0,
        attention="grouped",
        calibration_cache="none",
        pad_verify=False,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(choose, "measure_skinny_rows", lambda model: (frozenset(range(2, 6)), {}))
        yield Served(model_type, directory, load_runtime(settings), references, settings)


async def serve(
    served: Served, monkeypatch, prompts: list[str], **speculation: int
) -> tuple[list[list[pb.GenerateResponse]], PassGate]:
    """`prompts` at once through an in-process server (`speculation`: SpeculationParameters
    fields); no pass runs before every stream is in the batch, so they are verified
    together. The responses per prompt, and the gate that saw every pass."""
    gate = PassGate(TargetModel.forward)
    monkeypatch.setattr(TargetModel, "forward", lambda *args, **kw: gate.through(*args, **kw))
    all_added, added = asyncio.Event(), []
    original_add = Batch.add

    def counting_add(batch, generation, deliver, follows=None):  # type: ignore[no-untyped-def]
        queued = original_add(batch, generation, deliver, follows)
        added.append(generation)
        if len(added) == len(prompts):
            all_added.set()
        return queued

    monkeypatch.setattr(Batch, "add", counting_add)
    settings = Settings.of(
        model=str(served.directory), grpc_port=0, metrics_port=-1, grace_period_s=5.0
    )
    server = KenspecServer(settings, loader=lambda *_: served.runtime)
    await server.start()
    await server.load()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.GeneratorStub(channel)

    async def run(prompt: str) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            prompt=prompt,
            stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW),
            speculation=pb.SpeculationParameters(**speculation),
        )
        return [response async for response in stub.Generate(request)]

    try:
        streams = asyncio.gather(*(run(prompt) for prompt in prompts))
        await asyncio.wait_for(all_added.wait(), TIMEOUT)
        gate.open()
        return await asyncio.wait_for(streams, TIMEOUT), gate
    finally:
        gate.open()
        await channel.close()
        await server.stop(0)


def assert_greedy_and_speculative(
    served: Served, prompts: list[str], results: list[list[pb.GenerateResponse]]
) -> tuple[int, int]:
    """Each stream's tokens are the reference's, and drafts were accepted; (drafted,
    accepted) in all."""
    for prompt, responses in zip(prompts, results, strict=True):
        assert [t for r in responses for t in r.token_ids] == served.references[prompt], prompt
    drafted = sum(responses[-1].usage.drafted_tokens for responses in results)
    accepted = sum(responses[-1].usage.accepted_tokens for responses in results)
    assert accepted > 0
    return drafted, accepted


async def test_batched_streams_equal_transformers_greedy(served: Served, monkeypatch) -> None:
    """Four streams verified together (grouped attention: up to 16 queries a row)."""
    results, gate = await serve(served, monkeypatch, STREAMS)
    drafted, accepted = assert_greedy_and_speculative(served, STREAMS, results)
    assert accepted < drafted  # some drafts rejected too: rolled back in the cache
    assert max(len(p.rows) for p in gate.arrived) == len(STREAMS)  # a row per stream


async def test_a_solo_stream_equals_transformers_greedy(served: Served, monkeypatch) -> None:
    """One stream, chains of at most three drafts from the n-gram draft alone: passes of 2-5
    tokens, which take W @ x^T in every linear layer; attention by SDPA (soft-capped scores
    by grouped attention: SDPA has no capping). Twice: the second copies the first's keys
    and values from the prefix cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(choose, "measure_skinny_rows", lambda model: (frozenset(range(2, 6)), {}))
        runtime = load_runtime(served.settings.replace(attention="sdpa"))
    assert runtime.engine.target.plan.attention.grouped == ()
    served = dataclasses.replace(served, runtime=runtime)
    copies: list[int] = []
    copy_into = PrefixCache.copy_into

    def counting_copy(prefixes, cache, row, prefix, length):  # type: ignore[no-untyped-def]
        copies.append(length)
        return copy_into(prefixes, cache, row, prefix, length)

    monkeypatch.setattr(PrefixCache, "copy_into", counting_copy)
    prompt = STREAMS[1]
    for _ in range(2):
        results, gate = await serve(
            served, monkeypatch, [prompt], num_draft_tokens=3, draft_context=pb.DRAFT_CONTEXT_OFF
        )
        assert_greedy_and_speculative(served, [prompt], results)
        assert any(2 <= sum(map(len, p.rows)) <= 5 for p in gate.arrived)
    assert copies and max(copies) >= PrefixCache(0).min_match


def test_output_rows_equal_the_shipped_logits(served: Served) -> None:
    """Most architectures of the matrix read their output layer row by row (soft-capped
    where the model caps it), the others take the model's logits: either way, the rows
    equal the shipped model's logits."""
    target = served.runtime.engine.target
    assert (target.plan.head is HeadKind.MODEL) == (served.name in MODEL_LOGITS)
    shipped = AutoModelForCausalLM.from_pretrained(served.directory, dtype=torch.float32).eval()
    ids = target.encode_prompt("The quick brown fox jumps over the lazy dog.")
    assert len(ids) > WINDOW  # the windowed layers' mask is used
    with torch.inference_mode():
        expected = shipped(torch.tensor([ids])).logits[0]
        cache = target.new_cache()
        (rows,) = target.forward(cache, VerifyPass.sequences([0], [ids]))
        got = torch.stack([rows[i] for i in range(len(ids))])
    assert torch.allclose(got, expected, atol=1e-4 * float(expected.abs().max()))
    # What the prefix cache budget and the attention timing assume, the cache holds.
    assert cache.bytes_per_position == target.kv_bytes_per_position


def test_the_whole_context_is_served_with_every_linear_layer_switched(served: Served) -> None:
    """Sliding windows included: the context is not capped at the window. Conv1D (GPT-2)
    included: every decoder linear layer takes W @ x^T at the rows chosen."""
    model = served.runtime.engine.target.model
    assert served.runtime.engine.target.max_context == model.config.max_position_embeddings
    layers = decoder_linears(model)
    assert layers and all(type(layer) in (SkinnyLinear, SkinnyConv1D) for layer in layers)


# model_type -> (config class, model class, config fields, the feature the refusal names)
REFUSED = {
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
        "attention code of its own",
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            intermediate_size_mlp=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=1,
            attention_chunk_size=16,
        ),
        "layer types ['chunked_attention']",
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(hidden_size=64, n_layer=2, n_head=4),
        "ALiBi position biases",
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, state_size=4),
        "layer types ['linear_attention']",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["full_attention", "full_attention"],
        ),
        "s_aux",
    ),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_unsupported_architectures_are_refused_at_load_naming_the_feature(
    model_type: str, tokenizer, tmp_path: Path
) -> None:
    config_name, model_name, fields, feature = REFUSED[model_type]
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **fields)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(TargetLoadError) as refused:
        TargetModel.load(tmp_path, device="cpu", dtype="float32")
    message = str(refused.value)
    assert f"model_type {model_type!r} uses" in message
    assert feature in message
    assert "kenspec's engine does not support" in message


def test_windowed_mask_counts_positions_not_slots_in_a_token_tree() -> None:
    """Window 4. Row 0 holds 20 tokens and a tree (a; b and c both after a: positions 20, 21,
    21 in slots 20, 21, 22); row 1 holds 3 tokens and one new token."""
    packed = pack(
        [20, 3], [[1, 2, 3], [4]], torch.float32, torch.device("cpu"), parents=[[-1, 0, 0], None]
    )
    visible = (packed.packing.windowed_mask(4) == 0)[:, 0]  # [rows, width, kv_length]
    seen = [[torch.nonzero(query).flatten().tolist() for query in row] for row in visible]
    assert seen[0] == [[17, 18, 19, 20], [18, 19, 20, 21], [18, 19, 20, 22]]
    assert seen[1][0] == [0, 1, 2, 3]  # its padding queries are never read
    assert packed.packing.windows == {4}


@pytest.mark.parametrize("shape", [(1, 7), (3, 1), (2, 3), (5,)])
def test_skinny_conv1d_computes_what_conv1d_does(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = Conv1D(80, 48)  # GPT-2's linear layer: weight [in, out]
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(*shape, 48)
    expected = layer(x)
    use_skinny(torch.nn.Sequential(layer), range(1, 9))
    assert type(layer) is SkinnyConv1D
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    use_skinny(torch.nn.Sequential(layer), ())
    assert type(layer) is Conv1D and torch.equal(layer(x), expected)


def test_a_packed_pass_unlike_the_model_is_refused_at_load(
    tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """The load's check against the model's own forward: attention that dropped Gemma 2's
    score capping (a feature nothing else names) is caught, not served."""
    save_architecture(tmp_path, tokenizer, "gemma2")
    uncapped = attention.grouped_attention

    def grouped_without_capping(*args, softcap=None, **options):  # type: ignore[no-untyped-def]
        return uncapped(*args, **options)

    monkeypatch.setattr(attention, "grouped_attention", grouped_without_capping)
    with pytest.raises(TargetLoadError, match="a packed pass's logits differ from the model's"):
        TargetModel.load(tmp_path, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("fields", "windows", "context"),
    [
        (dict(), frozenset(), 512),  # no window
        (dict(sliding_window=16), frozenset({16}), 512),  # Mistral: windowed by packed attention
        (dict(sliding_window=16), frozenset(), 16),  # declared, never passed: capped, exact
        (dict(sliding_window=16, use_sliding_window=False), frozenset(), 512),  # Qwen2: off
        (dict(sliding_window=16, layer_types=["full_attention"]), frozenset(), 512),
        (dict(sliding_window=16, layer_types=["sliding_attention"]), frozenset(), 16),
    ],
)
def test_served_context_is_capped_only_at_a_window_packed_attention_did_not_see(
    fields: dict, windows: frozenset[int], context: int
) -> None:
    config = transformers.PretrainedConfig(max_position_embeddings=512, **fields)
    assert served_context(config, windows) == context
