"""A GGUF file as --model: served exactly, refused with the reason, converted once and cached."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kenspec.server.engine import gguf_model
from kenspec.server.engine.target import TargetLoadError, TargetModel
from kenspec.server.settings import Settings
from tests import tiny
from tests.gguf_files import gguf_loaded_tied_llama, write_header_only_gguf, write_llama_gguf
from tests.server.engine.drafts import generate

MAX_NEW = 24


@pytest.fixture(scope="module")
def gguf_path(tiny_target: TargetModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return write_llama_gguf(folder / "tiny.gguf", tiny_target.model, tiny_target.tokenizer)


@pytest.fixture(scope="module")
def gguf_target(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    cache = tmp_path_factory.mktemp("gguf-cache")
    return TargetModel.load(gguf_path, device="cpu", dtype="float32", gguf_cache=cache)


def test_a_gguf_file_serves_what_generate_gives_on_the_same_weights(
    tiny_target, gguf_target, references, partly_matching
) -> None:
    """float32 greedy through the engine, speculating, equals transformers generate on the
    model the file was written from (its tokenizer and chat template came through the file)."""
    assert gguf_target.tokenizer.chat_template == tiny_target.tokenizer.chat_template
    assert gguf_target.eos_token_ids == tiny_target.eos_token_ids
    drafted = 0
    for prompt, (ids, expected) in references.items():
        assert gguf_target.encode_prompt(prompt) == ids
        generation = generate(gguf_target, partly_matching, ids, max_new_tokens=MAX_NEW, k=4)
        rounds = list(generation)
        assert generation.output_ids == expected
        drafted += rounds[-1].usage.drafted_tokens
    assert drafted > 0  # speculation really ran


def test_the_weights_come_through_bit_for_bit(tiny_target, gguf_target) -> None:
    reference = tiny_target.model.state_dict()
    for name, tensor in gguf_target.model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def test_the_second_load_reads_the_cache(gguf_path: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = TargetModel.load(gguf_path, device="cpu", dtype="float32", gguf_cache=cache)
    (folder,) = cache.iterdir()
    assert (folder / gguf_model.CACHE_MANIFEST).is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert first.name == str(gguf_path)

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_model, "load_gguf", no_conversion)
    second = TargetModel.load(gguf_path.parent, device="cpu", dtype="float32", gguf_cache=cache)
    assert list(cache.iterdir()) == [folder] and second.name == str(gguf_path.parent)
    with pytest.raises(AssertionError, match="converted again"):  # another dtype: another copy
        TargetModel.load(gguf_path, device="cpu", dtype="bfloat16", gguf_cache=cache)


def test_an_unsupported_architecture_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = write_header_only_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(TargetLoadError, match="GGUF architecture 'bert' is not one transformers"):
        TargetModel.load(path, gguf_cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before any conversion


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [
        ("falcon", "attention code of its own"),
        ("mamba", "layer types ['linear_attention']"),
        ("bloom", "ALiBi position biases"),
    ],
)
def test_an_architecture_kenspec_refuses_is_refused_before_converting(
    tmp_path: Path, architecture: str, reason: str
) -> None:
    """transformers loads these from GGUF; kenspec's engine cannot serve them exactly."""
    path = write_header_only_gguf(tmp_path / f"{architecture}.gguf", architecture)
    with pytest.raises(TargetLoadError, match=re.escape(f"{path}: model_type '{architecture}'")):
        TargetModel.load(path, gguf_cache=tmp_path / "cache")
    with pytest.raises(TargetLoadError, match=re.escape(reason)):
        TargetModel.load(path, gguf_cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_an_unsupported_quantization_type_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = write_header_only_gguf(tmp_path / "q.gguf", "llama", GGMLQuantizationType.Q8_1)
    with pytest.raises(TargetLoadError, match="tensor types Q8_1 cannot be dequantized"):
        TargetModel.load(path, gguf_cache=tmp_path / "cache")


def test_a_folder_of_several_gguf_files_and_a_foreign_file_are_refused(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        write_header_only_gguf(tmp_path / name, "llama")
    with pytest.raises(TargetLoadError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        TargetModel.load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(TargetLoadError, match=r"not a \.gguf file"):
        TargetModel.load(tmp_path / "weights.bin")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(TargetLoadError, match="not a readable GGUF file"):
        TargetModel.load(tmp_path / "junk.gguf")


def test_the_plain_copy_keeps_tied_embeddings_tied_and_drops_the_gguf_claim() -> None:
    source = gguf_loaded_tied_llama(tiny.build_byte_tokenizer())
    copy = gguf_model.plain_copy(source)
    assert "quantization_config" not in vars(copy.config)
    assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()
    assert copy.lm_head.weight.data_ptr() != source.lm_head.weight.data_ptr()
    for name, tensor in source.state_dict().items():
        assert torch.equal(copy.state_dict()[name], tensor), name


def test_the_server_default_cache_is_the_loader_default() -> None:
    assert Settings().model.gguf_cache == gguf_model.DEFAULT_GGUF_CACHE


def test_a_generation_ends_at_the_files_end_of_turn_token(tiny_target, tmp_path) -> None:
    """transformers' GGUF loader keeps only eos; the header's eot id ends a generation too."""
    eot = tiny_target.tokenizer.convert_tokens_to_ids("<|im_start|>")
    path = write_llama_gguf(tmp_path / "eot.gguf", tiny_target.model, tiny_target.tokenizer, eot)
    target = TargetModel.load(path, device="cpu", dtype="float32", gguf_cache=tmp_path / "cache")
    assert target.eos_token_ids == tiny_target.eos_token_ids | {eot}
    (folder,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((folder / gguf_model.CACHE_MANIFEST).read_text())
    assert manifest["end_token_ids"] == sorted(target.eos_token_ids)


@pytest.mark.parametrize(
    ("declared", "special", "starts", "ends"),
    [
        ([1], {"<bos>": 2, "<end_of_turn>": 106, "<start_of_turn>": 105}, [2], [1, 106]),  # Gemma 3
        ([2], {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, [0], [2]),  # SmolLM2
        ([128001], {"<|eot_id|>": 128009, "<|eom_id|>": 128008}, [], [128001, 128008, 128009]),
        ([7, 9], {}, [], [7, 9]),
    ],
)
def test_end_tokens_are_the_declared_ones_and_llama_cpps_by_text(
    declared, special, starts, ends
) -> None:
    assert gguf_model.end_token_ids(declared, special, starts) == ends


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_the_architecture_is_read_from_the_header_alone(gguf_path: Path, tmp_path: Path) -> None:
    """read_architecture (what --dtype auto asks before loading) gives inspect's answer on
    the files a writer makes; reaches the key past values of every kind; and says None for a
    file that is not GGUF, ends early, or names none."""
    assert gguf_model.read_architecture(gguf_path) == gguf_model.inspect(gguf_path).architecture
    bert = write_header_only_gguf(tmp_path / "bert.gguf", "bert")
    assert gguf_model.read_architecture(bert) == "bert"
    values = [
        (b"general.name", 8, _string("tiny")),
        (b"vocab", 9, struct.pack("<IQ", 8, 2) + _string("<s>") + _string("hello")),
        (b"scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0.5, 1.0, 2.0)),
        (b"nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 7, 2) + b"\x01\x00"),
        (b"count", 4, struct.pack("<I", 7)),
        (b"flag", 7, b"\x01"),
        (b"big", 11, struct.pack("<q", -3)),
        (b"general.architecture", 8, _string("qwen2")),
    ]
    entries = [struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + v for k, t, v in values]

    def gguf(name: str, kept: list[bytes]) -> Path:
        path = tmp_path / name
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kept)) + b"".join(kept))
        return path

    assert gguf_model.read_architecture(gguf("handmade.gguf", entries)) == "qwen2"
    cut = gguf("cut.gguf", entries)
    cut.write_bytes(cut.read_bytes()[:-3])
    assert gguf_model.read_architecture(cut) is None
    assert gguf_model.read_architecture(gguf("nameless.gguf", entries[:-1])) is None
    assert gguf_model.read_architecture(tmp_path / "missing.gguf") is None
    assert gguf_model.read_architecture(Path(__file__)) is None
