"""A GGUF file as a target: checked, dequantized by transformers, cached as a safetensors folder.

transformers reads GGUF files (`from_pretrained(folder, gguf_file=name)`) and dequantizes every
tensor on load, which takes many seconds for even a small model; so the first load saves the
dequantized model, its tokenizer and chat template as a plain Hugging Face folder under a cache
directory, and later loads read that folder. The folder's name holds the file's checksum, the
dtype, the kenspec and transformers versions and the conversion's own format number, so a
changed file, an upgrade or a changed conversion converts again.

A generation ends where llama.cpp ends it on the same file: at the tokens the file names
(eos, and eot/eom when present) and at the special tokens llama.cpp ends a turn at by their text
(`<end_of_turn>`, `<|eot_id|>`, ...); transformers' GGUF loader keeps only eos. Gemma 3's file
names `<eos>` alone, yet its turns end with `<end_of_turn>`, as its own generation config says.

    >>> find_gguf(Path("models/smollm2-135m-instruct"))  # a Hugging Face folder: None
    >>> find_gguf(Path("gemma-3-270m-q4_k_m.gguf"))
    PosixPath('gemma-3-270m-q4_k_m.gguf')
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, dequantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from kenspec.server import __version__
from kenspec.server.engine.architecture import UnsupportedArchitecture, refuse_unsupported

GGUF_SUFFIX = ".gguf"
DEFAULT_GGUF_CACHE = "~/.cache/kenspec/gguf"
CACHE_MANIFEST = "kenspec-gguf.json"
# The manifest of a folder kenspec converted from a GGUF file and keeps it in (the default
# model: server/default_model.py); its "weights_file" names the file.
FOLDER_MANIFEST = "kenspec-model.json"
# Architectures transformers' GGUF loader knows that are not causal LMs (or no GGUF type at all).
_NOT_CAUSAL = frozenset({"general", "tokenizer", "t5", "umt5", "t5encoder"})
_CACHE_FORMAT = 2  # 2: the end tokens below are written into the generation config
# The header keys naming a generation's end tokens, and the texts of special tokens llama.cpp
# also ends a generation at (its llama-vocab.cpp: end of turn, end of message, end of text).
_END_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
END_TEXTS = (
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
)


class GgufRefused(ValueError):
    """The GGUF file cannot be served; the message says why and what would work."""


@dataclass(frozen=True, slots=True)
class GgufFile:
    """What a GGUF file's header says, read without reading its tensors."""

    path: Path
    architecture: str
    tensor_types: frozenset[str]  # GGML quantization type names, e.g. {"Q4_K", "F32"}
    end_token_ids: frozenset[int] = frozenset()  # the header's eos, eot and eom ids


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only .gguf in a folder that has no
    config.json. None: `path` is something else (a Hugging Face folder, or missing)."""
    if path.is_file():
        if path.suffix != GGUF_SUFFIX:
            raise GgufRefused(
                f"{path} is a file but not a {GGUF_SUFFIX} file; --model takes a "
                "GGUF file or a Hugging Face model folder"
            )
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(file.name for file in files)
        raise GgufRefused(f"{path} holds {len(files)} GGUF files ({names}); name one as --model")
    return files[0] if files else None


def kept_source(folder: Path) -> Path | None:
    """The GGUF file a Hugging Face folder was converted from, where the folder keeps it: its
    kenspec-model.json names the file as "weights_file" and the file lies in the folder (the
    default model). None for any other path. Served as the file keeps its weights
    (--weights auto), each tensor is checked against the folder's own on load
    (gguf_weights), so a file that is not the folder's source is refused there."""
    try:
        manifest = json.loads((folder / FOLDER_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = manifest.get("weights_file") if isinstance(manifest, dict) else None
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(GGUF_SUFFIX):
        return None
    path = folder / name
    return path if path.is_file() else None


def inspect(path: Path) -> GgufFile:
    """Read the header and refuse a file transformers cannot load as a causal LM."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GgufRefused(f"{path} is not a readable GGUF file: {error}") from None
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if not isinstance(architecture, str):
        raise GgufRefused(f"{path} has no general.architecture; it is not a model GGUF file")
    types = frozenset(GGMLQuantizationType(tensor.tensor_type).name for tensor in reader.tensors)
    ends = (reader.get_field(key) for key in _END_KEYS)
    declared = frozenset(int(end.contents()) for end in ends if end is not None)
    info = GgufFile(
        path=path, architecture=architecture, tensor_types=types, end_token_ids=declared
    )
    _refuse_architecture(info)
    _refuse_tensor_types(info)
    return info


# GGUF metadata scalars' sizes in bytes, by value type, as the gguf package reads them
_SCALAR_BYTES = {int(t): np.dtype(s).itemsize for t, s in GGUFReader.gguf_scalar_to_np.items()}
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


def read_architecture(path: Path) -> str | None:
    """The file's general.architecture, read from its header only as far as that key (writers
    put it first), where `inspect` parses the whole header: seconds for a large vocabulary.
    None where the file is not GGUF or its header does not say."""
    try:
        with path.open("rb") as file:
            return _read_header(file, stop_at_architecture=True).architecture
    except (OSError, ValueError, struct.error):
        return None


@dataclass(frozen=True, slots=True)
class FileTensor:
    """One tensor of a GGUF file: its name, GGML type and bytes as the file keeps them."""

    name: str
    tensor_type: int
    data: np.ndarray  # uint8, a read-only map of the file


def read_tensors(path: Path) -> tuple[str, dict[str, FileTensor]]:
    """The file's architecture and its tensors by name, each a map of its bytes: the header's
    keys skipped, not parsed (the gguf package's reader turns every vocabulary entry into
    numpy views: ~10 s for SmolLM2's 49,152). ValueError where the file is not one it can
    read."""
    try:
        with path.open("rb") as file:
            header = _read_header(file, stop_at_architecture=False)
            infos = []
            for _ in range(header.tensors):
                name = _read(file, struct.unpack("<Q", _read(file, 8))[0]).decode("utf-8")
                (dims,) = struct.unpack("<I", _read(file, 4))
                shape = struct.unpack(f"<{dims}Q", _read(file, 8 * dims))
                kind, offset = struct.unpack("<IQ", _read(file, 12))
                infos.append((name, shape, kind, offset))
            if header.alignment <= 0:
                raise ValueError(f"general.alignment is {header.alignment}")
            start = -(-file.tell() // header.alignment) * header.alignment
    except (OSError, ValueError, struct.error) as error:  # UnicodeDecodeError among them
        raise ValueError(f"{path}: not a GGUF file kenspec can read ({error})") from None
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, shape, kind, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has an unknown type {kind}") from None
        count = int(np.prod(shape, dtype=np.int64))
        begin, end = start + offset, start + offset + count // block * size
        if count % block or end > len(whole):
            raise ValueError(f"{path}: tensor {name} does not fit the file")
        tensors[name] = FileTensor(name, kind, whole[begin:end])
    return header.architecture or "", tensors


@dataclass(slots=True)
class _Header:
    """What a GGUF header says that kenspec reads: its tensor count, architecture, alignment."""

    tensors: int
    architecture: str | None = None
    alignment: int = 32  # GGUF's default where general.alignment is absent


def _read(file: BinaryIO, size: int) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise ValueError("the header ends early")
    return data


def _skip(file: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        file.seek(struct.unpack("<Q", _read(file, 8))[0], os.SEEK_CUR)
    elif kind == _ARRAY:
        inner, count = struct.unpack("<IQ", _read(file, 12))
        if inner in _SCALAR_BYTES:
            file.seek(count * _SCALAR_BYTES[inner], os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip(file, inner)
    elif kind in _SCALAR_BYTES:
        file.seek(_SCALAR_BYTES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"value type {kind}")


def _read_header(file: BinaryIO, stop_at_architecture: bool) -> _Header:
    """From the start of the file: the header's tensor count, general.architecture and
    general.alignment, every other key skipped; the file left at the tensor table (or just
    past the architecture, where told to stop there). ValueError where it is not GGUF."""
    magic, _version, tensors, keys = struct.unpack("<4sIQQ", _read(file, 24))
    if magic != b"GGUF":
        raise ValueError("not a GGUF file")
    found = _Header(tensors)
    for _ in range(keys):
        key = _read(file, struct.unpack("<Q", _read(file, 8))[0])
        (kind,) = struct.unpack("<I", _read(file, 4))
        if key == b"general.architecture" and kind == _STRING:
            text = _read(file, struct.unpack("<Q", _read(file, 8))[0])
            found.architecture = text.decode("utf-8", errors="replace")
            if stop_at_architecture:
                return found
        elif key == b"general.alignment" and kind == int(GGUFValueType.UINT32):
            (found.alignment,) = struct.unpack("<I", _read(file, 4))
        else:
            _skip(file, kind)
    return found


def _refuse_architecture(info: GgufFile) -> None:
    known = set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_CAUSAL
    if info.architecture not in known:
        raise GgufRefused(
            f"{info.path}: GGUF architecture {info.architecture!r} is not one transformers "
            f"{transformers.__version__} loads from GGUF as a causal LM (it loads "
            f"{', '.join(sorted(known))}); convert the original checkpoint to a Hugging Face "
            "folder instead"
        )


def _refuse_tensor_types(info: GgufFile) -> None:
    unknown = sorted(name for name in info.tensor_types if not _dequantizable(name))
    if unknown:
        raise GgufRefused(
            f"{info.path}: tensor types {', '.join(unknown)} cannot be dequantized by the gguf "
            "package installed here; use a file quantized otherwise (F32, F16, BF16, Q8_0, "
            "Q4_K, ... all work) or upgrade gguf"
        )


def _dequantizable(type_name: str) -> bool:
    """Whether gguf's dequantize handles this type: tried on one block of zeros."""
    qtype = GGMLQuantizationType[type_name]
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def sha256_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def cache_key(path: Path, dtype: torch.dtype, digest: str) -> str:
    """The cached folder's name: the file, its checksum, the dtype, the versions that wrote it."""
    dtype_name = str(dtype).removeprefix("torch.")
    return (
        f"{path.stem}-{digest[:16]}-{dtype_name}"
        f"-kenspec{__version__}-transformers{transformers.__version__}-v{_CACHE_FORMAT}"
    )


def cached_folder(path: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """The Hugging Face folder of the dequantized model, converted now unless cached already."""
    digest = sha256_file(path)  # a quarter of a second for 250 MB: every load
    folder = cache_dir.expanduser() / cache_key(path, dtype, digest)
    if (folder / CACHE_MANIFEST).is_file():
        return folder
    info = inspect(path)  # seconds for a large vocabulary (its header is parsed in Python)
    _refuse_for_kenspec(path)
    # Written under another name and renamed when complete: a crash leaves no half folder.
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model, tokenizer = load_gguf(path, dtype)
    special = {str(t): i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    starts = (tokenizer.bos_token_id, tokenizer.pad_token_id)
    ends = end_token_ids(info.end_token_ids, special, [i for i in starts if i is not None])
    model.generation_config.eos_token_id = ends[0] if len(ends) == 1 else ends
    save_plain(model, tokenizer, partial)
    manifest = {
        "source": str(path.resolve()),
        "sha256": digest,
        "architecture": info.architecture,
        "tensor_types": sorted(info.tensor_types),
        "dtype": str(dtype),
        "end_token_ids": ends,
    }
    (partial / CACHE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def end_token_ids(
    declared: Iterable[int], special: Mapping[str, int], starts: Iterable[int] = ()
) -> list[int]:
    """The ids a generation ends at, sorted: those the header declares, and the special tokens
    (text -> id) whose text llama.cpp ends a generation at, but for those the file begins or
    pads with (`starts`: SmolLM2's `<|endoftext|>` is its bos, not an end).

    >>> end_token_ids([1], {"<bos>": 2, "<end_of_turn>": 106, "<start_of_turn>": 105})
    [1, 106]
    >>> end_token_ids([2], {"<|endoftext|>": 0, "<|im_end|>": 2}, starts=[0])
    [2]
    """
    by_text = {special[text] for text in END_TEXTS if text in special} - set(starts)
    return sorted(set(declared) | by_text)


def _refuse_for_kenspec(path: Path) -> None:
    """Refuse what kenspec's engine cannot serve (ALiBi, attention of its own, non-attention
    layers: architecture.refuse_unsupported) from the file's config alone, on a model without
    weights, before minutes of dequantizing and a cached copy that would never be served."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    try:
        refuse_unsupported(skeleton)
    except UnsupportedArchitecture as error:
        raise GgufRefused(f"{path}: {error}") from None


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Tokenizer]:
    """The model dequantized to `dtype` and its tokenizer (with the file's chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype
    )
    model.eval()
    return model, tokenizer


def plain_copy(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a freshly built model: `save_pretrained` refuses a GGUF-loaded one,
    and the copy's config no longer claims to be GGUF-quantized. Tied embeddings stay tied."""
    config = copy.deepcopy(gguf_model.config)
    vars(config).pop("quantization_config", None)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.eval()
    return model


def save_plain(model: PreTrainedModel, tokenizer: Tokenizer, folder: Path) -> None:
    """Save as a Hugging Face folder: safetensors, configs, tokenizer and chat template."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    plain_copy(model).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for file in folder.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; containers may read as another user
