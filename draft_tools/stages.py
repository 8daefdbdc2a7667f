"""The stages of a draft build (see draft_tools/build.py), each skipped when a rerun finds it
done with the same inputs, as recorded in OUT/work/stages.json (draft_tools/stamps.py)."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kenspec.draft_tools import distill, train
from kenspec.draft_tools.build_report import CheckResult, StageTime, check_draft, summary
from kenspec.draft_tools.kenlm_tools import ensure_tools
from kenspec.draft_tools.stamps import Stamps, file_digest, folder_digest
from kenspec.server.engine.gguf_model import (
    DEFAULT_GGUF_CACHE,
    GgufRefused,
    cached_folder,
    find_gguf,
)
from kenspec.server.engine.kenlm_draft import DRAFT_MANIFEST
from kenspec.server.engine.suffix_index import SUFFIX_CORPUS
from kenspec.server.settings import SpeculationSettings


class BuildError(Exception):
    """A problem the user can fix; main prints it as one line, without a traceback."""


def split_prompts(prompts: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """(training, held out), each in file order. The distinct prompts whose sha256 ranks lowest
    are held out, round(fraction * distinct) of them (at least one, and one fewer than all):
    a prompt's side depends on its text, so adding prompts moves at most one across, and copies
    of a prompt never land on both sides.

    >>> split_prompts(["a", "b", "c", "a"], 0.25)
    (['a', 'b', 'a'], ['c'])
    """
    distinct = sorted(set(prompts), key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    count = round(fraction * len(distinct))
    if fraction > 0:
        count = min(max(count, 1), len(distinct) - 1)
    held = set(distinct[:count])
    return [p for p in prompts if p not in held], [p for p in prompts if p in held]


def gguf_model(model: Path) -> Path | None:
    """The GGUF file --model names (the file, or the only one in a folder without a
    config.json), None for a Hugging Face folder; what the server refuses ends the build."""
    try:
        return find_gguf(model)
    except GgufRefused as error:
        raise BuildError(str(error)) from None


class Build:
    """The stages over one output folder; each says on stderr what it does or why it skips,
    and is timed (`times`, in the summary)."""

    def __init__(self, args: argparse.Namespace, stage_names: Sequence[str]) -> None:
        self.args = args
        self.out: Path = args.out
        self.work = args.out / "work"
        self.stamps = Stamps(self.work / "stages.json")
        self.model_dir: Path = args.model  # a GGUF --model: its converted folder (`convert`)
        self._model_id = ""
        self._names = list(stage_names)
        self._stage = ""
        self._started = 0.0
        self._skipped = False
        self.times: list[StageTime] = []
        self._target: distill.Target | None = None
        self.tools: tuple[Path, Path] | None = None
        self.check: CheckResult | None = None

    @property
    def model_id(self) -> str:
        if not self._model_id:
            self._model_id = folder_digest(self.model_dir)
        return self._model_id

    def begin(self, name: str, what: str) -> None:
        self.end()
        self._stage, self._started, self._skipped = name, time.perf_counter(), False
        number = self._names.index(name) + 1
        print(f"[{number}/{len(self._names)}] {name}: {what}", file=sys.stderr)

    def end(self) -> None:
        """Close the running stage's clock (begin does, for the one before it) and keep the
        times so far in OUT/work/times.json: an interrupted build still tells them."""
        if self._stage and all(t.stage != self._stage for t in self.times):
            seconds = time.perf_counter() - self._started
            self.times.append(StageTime(self._stage, round(seconds, 2), self._skipped))
            self.work.mkdir(parents=True, exist_ok=True)
            (self.work / "times.json").write_text(
                json.dumps([t.to_json() for t in self.times], indent=2) + "\n"
            )

    def say(self, message: str) -> None:
        print(f"    {message}", file=sys.stderr)

    def skip_if_done(self, inputs: dict[str, Any], outputs: Sequence[Path]) -> bool:
        """True (and says so) when this stage is done with these inputs; else forgets its
        stamp, saying which inputs changed, so that an interrupted redo is never taken as done."""
        if self.stamps.done(self._stage, inputs, outputs):
            self.say("done before with the same inputs: skipping")
            self._skipped = True
            return True
        previous = self.stamps.get(self._stage)
        if previous is not None:
            changed = sorted(
                k for k in inputs.keys() | previous.keys() if inputs.get(k) != previous.get(k)
            )
            why = f"{', '.join(changed)} changed since the last run" if changed else "output gone"
            self.say(f"redoing: {why}")
        self.stamps.forget(self._stage)
        return False

    # --- stages ----------------------------------------------------------------------------

    def convert(self, gguf: Path) -> None:
        """The GGUF file as the server loads it at --dtype float32: the same cached folder."""
        self.begin("model", f"{gguf.name} dequantized to float32 under {self.args.gguf_cache}")
        before = set(_listing(self.args.gguf_cache))
        with self._model_errors():
            self.model_dir = cached_folder(gguf, torch.float32, self.args.gguf_cache)
        self._skipped = self.model_dir.name in before
        self.say(f"{self.model_dir} ({'cached before' if self._skipped else 'converted'})")

    def find_tools(self) -> None:
        self.begin("tools", "KenLM's lmplz and build_binary")
        self.tools = ensure_tools(self.args.tools, self.work / "kenlm-build.log", self.say)
        self.say(f"using {self.tools[0]} and {self.tools[1]}")

    def split(self) -> None:
        self.begin("split", "training and held-out prompts")
        prompts = read_prompt_lines(self.args.prompts, "--prompts") if self.args.prompts else []
        if self.args.heldout_prompts:
            held = read_prompt_lines(self.args.heldout_prompts, "--heldout-prompts")
            training = prompts
        else:
            training, held = split_prompts(prompts, self.args.heldout)
        self.work.mkdir(parents=True, exist_ok=True)
        _write_lines(self.work / "train-prompts.txt", training)
        _write_lines(self.work / "heldout-prompts.txt", held)
        source = (
            "--heldout-prompts" if self.args.heldout_prompts else f"--heldout {self.args.heldout:g}"
        )
        self.say(f"{len(training)} prompts to train on, {len(held)} held out ({source})")

    def distill(self, name: str, prompts_file: Path, ids: Path) -> None:
        self.begin(name, f"the target's greedy answers to {prompts_file.name} -> {ids}")
        settings = {
            "model": self.model_id,
            "prompts_sha256": file_digest(prompts_file),
            "max_new_tokens": self.args.max_new_tokens,
            "dtype": self.args.dtype,
            "decoding": "greedy",
        }
        if self.args.chat_template:  # only then: drafts built before keep their stamps
            settings["chat_template"] = file_digest(self.args.chat_template)
        if self.skip_if_done(settings, [ids, ids.with_suffix(".jsonl")]):
            return
        prompts = distill.read_prompts(prompts_file)
        self._reuse_answers(ids, settings, prompts)
        target = self.target()
        writer = distill.CorpusWriter(ids).open()
        distill.check_run_settings(ids.with_suffix(".meta.json"), settings)
        try:
            distill.distill(
                target,
                prompts,
                writer,
                max_new_tokens=self.args.max_new_tokens,
                progress=not self.args.quiet,
            )
        except distill.PromptRefused as error:
            prompt = dict(prompts)[error.index]
            raise BuildError(
                f"the prompt {prompt[:40]!r}... is refused: {error}; shorten it or lower "
                "--max-new-tokens"
            ) from None
        finally:
            writer.close()
        self.stamps.record(name, settings)

    def _reuse_answers(
        self, ids: Path, settings: dict[str, Any], prompts: Sequence[tuple[int, str]]
    ) -> None:
        """Keep what an earlier run answered: all of it when it had these settings (an
        interrupted run resumes), the answers to prompts still asked when only the prompts
        changed; nothing when the model or the decoding changed."""
        meta = ids.with_suffix(".meta.json")
        previous = json.loads(meta.read_text(encoding="utf-8")) if meta.exists() else None
        if previous == settings:
            return
        meta.unlink(missing_ok=True)  # first: a crash below leaves a corpus no run resumes
        if previous is not None and _same_but_prompts(previous, settings):
            kept = distill.keep_answers(ids, prompts)
            self.say(f"kept {kept} answers from the last run to prompts still asked")
            return
        for suffix in (".ids", ".jsonl", ".txt"):
            ids.with_suffix(suffix).unlink(missing_ok=True)

    def tokenize_text(self, ids: Path) -> None:
        self.begin("text", f"{self.args.text} tokenized -> {ids}")
        inputs = {"model": self.model_id, "text": file_digest(self.args.text)}
        if self.skip_if_done(inputs, [ids]):
            return
        self.work.mkdir(parents=True, exist_ok=True)
        with self._model_errors():
            count = train.tokenize_text(
                self.model_dir, self.args.text, ids, progress=not self.args.quiet
            )
        if count == 0:
            raise BuildError(f"--text {self.args.text} holds no text (blank lines are skipped)")
        self.say(f"{count:,} tokens")
        self.stamps.record("text", inputs)

    def fit(self, parts: Sequence[Path]) -> None:
        order, prune = self.args.order, list(self.args.prune)
        self.begin("fit", f"a {order}-gram -> {self.out}")
        inputs = {
            "model": self.model_id,
            "corpus": [file_digest(p) for p in parts],
            "order": order,
            "prune": prune,
        }
        files = ("model.bin", "successors.npz", DRAFT_MANIFEST, SUFFIX_CORPUS)
        if self.skip_if_done(inputs, [self.out / name for name in files]):
            return
        self.stamps.forget("check")  # a refitted draft is checked again
        corpus = self.work / "corpus.ids"
        lines, tokens = _concatenate(parts, corpus)
        if tokens == 0:
            raise BuildError(
                "the corpus is empty: every answer was empty; give more prompts or --text"
            )
        self.say(f"corpus: {lines:,} lines, {tokens:,} tokens")
        assert self.tools is not None
        log = self.work / "kenlm.log"
        log.unlink(missing_ok=True)
        try:
            train.train(
                self.model_dir,
                corpus,
                self.out,
                order=order,
                prune=prune,
                memory=self.args.memory,
                tools_dir=str(self.tools[0].parent),
                log=log,
            )
        except subprocess.CalledProcessError as error:
            tool = Path(str(error.cmd[0])).name
            raise BuildError(
                f"{tool} failed (exit code {error.returncode}): {_last_line(log)} (log: {log})"
            ) from error
        with (
            corpus.open("rb") as source,
            gzip.GzipFile(self.out / SUFFIX_CORPUS, "wb", mtime=0) as sink,
        ):
            shutil.copyfileobj(source, sink)
        self._describe_corpus(parts)
        self.stamps.record("fit", inputs)

    def _describe_corpus(self, parts: Sequence[Path]) -> None:
        described = []
        if self.work / "train.ids" in parts:
            answers = _count_lines(self.work / "train.ids")
            described.append(
                f"the target's greedy answers to {answers} prompts of {self.args.prompts.name} "
                f"({self._prompt_form()}, max {self.args.max_new_tokens} new tokens)"
            )
        if self.work / "text.ids" in parts:
            described.append(
                f"{_count_lines(self.work / 'text.ids')} lines of {self.args.text.name}"
            )
        _update_manifest(self.out, corpus=f"{SUFFIX_CORPUS}: " + " + ".join(described))

    def _prompt_form(self) -> str:
        """How the prompts reached the target: through a chat template, or raw (a model whose
        tokenizer has none, as a base model's GGUF file)."""
        if self.args.chat_template:
            return f"chat template {self.args.chat_template.name}"
        if (self.model_dir / "chat_template.jinja").is_file():
            return "chat template"
        config = self.model_dir / "tokenizer_config.json"
        if config.is_file() and json.loads(config.read_text()).get("chat_template"):
            return "chat template"
        return "raw prompts"

    def check_heldout(self, answers: Path) -> None:
        self.begin("check", f"replay the held-out answers ({answers.name}) through the draft")
        served = SpeculationSettings()  # what the server drafts by default
        inputs = {
            "draft": self.stamps.get("fit"),
            "answers": file_digest(answers),
            "k": served.request_defaults.k,
            "min_draft_prob": served.min_draft_prob,
        }
        result_path = self.work / "check.json"
        if not self.skip_if_done(inputs, [result_path]):
            result = check_draft(self.model_dir, self.out, answers, served)
            result_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
            _update_manifest(self.out, heldout_check=result.to_json())
            self.stamps.record("check", inputs)
        self.check = CheckResult.from_json(json.loads(result_path.read_text()))

    def target(self) -> distill.Target:
        """The server's engine over the target, loaded on first use: a rerun with nothing to
        distil never loads it."""
        if self._target is None:
            with self._model_errors():
                self._target = distill.load_target(
                    self.model_dir,
                    self.args.device,
                    self.args.dtype,
                    rows=self.args.batch_size,
                    chat_template=self.args.chat_template,
                    threads=self.args.threads,
                )
            device = self._target.engine.target.device
            self.say(f"loaded the target's engine on {device} ({self.args.dtype})")
        return self._target

    @contextlib.contextmanager
    def _model_errors(self) -> Iterator[None]:
        """A model folder transformers cannot read ends the build in one line."""
        try:
            yield
        except (OSError, ValueError) as error:
            raise BuildError(
                f"cannot load the model from {self.args.model}: {_one_line(error)}"
            ) from error


def stage_names(args: argparse.Namespace) -> list[str]:
    """The stages this run's inputs call for, in order."""
    heldout = bool(args.heldout_prompts) or (bool(args.prompts) and args.heldout > 0)
    names = ["model"] * (gguf_model(args.model) is not None) + ["tools"]
    names += ["split"] * bool(args.prompts or args.heldout_prompts)
    names += ["distill"] * bool(args.prompts) + ["heldout"] * heldout
    names += ["text"] * bool(args.text) + ["fit"] + ["check"] * heldout
    return names


def run(args: argparse.Namespace) -> str:
    """Every stage the inputs call for; returns the summary."""
    names = stage_names(args)
    build = Build(args, names)
    gguf = gguf_model(args.model)
    if gguf is not None:
        build.convert(gguf)
    build.find_tools()
    if "split" in names:
        build.split()
    parts = []
    if "distill" in names:
        parts.append(build.work / "train.ids")
        build.distill("distill", build.work / "train-prompts.txt", parts[-1])
    if "heldout" in names:
        build.distill("heldout", build.work / "heldout-prompts.txt", build.work / "heldout.ids")
    if "text" in names:
        parts.append(build.work / "text.ids")
        build.tokenize_text(parts[-1])
    build.fit(parts)
    if "check" in names:
        build.check_heldout(build.work / "heldout.ids")
    build.end()
    return summary(_serve_flags(args), args.out, build.check, build.times)


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The server's flags for this target, as given to the build."""
    flags = ["--model", str(args.model)]
    if gguf_model(args.model) is not None and args.gguf_cache != Path(DEFAULT_GGUF_CACHE):
        flags += ["--gguf-cache", str(args.gguf_cache)]
    if args.chat_template:
        flags += ["--chat-template", str(args.chat_template)]
    return flags


# --- inputs and files -----------------------------------------------------------------------


def _same_but_prompts(previous: dict[str, Any], settings: dict[str, Any]) -> bool:
    other = {key: value for key, value in settings.items() if key != "prompts_sha256"}
    return {key: value for key, value in previous.items() if key != "prompts_sha256"} == other


def read_prompt_lines(path: Path, flag: str) -> list[str]:
    prompts = [prompt for _, prompt in distill.read_prompts(path)]
    if not prompts:
        raise BuildError(f"{flag} {path} holds no prompts (one a line; blank lines are skipped)")
    return prompts


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _concatenate(parts: Sequence[Path], out: Path) -> tuple[int, int]:
    """Write the parts one after the other; returns (lines, tokens)."""
    lines = tokens = 0
    with out.open("w", encoding="utf-8") as sink:
        for part in parts:
            for line in part.open(encoding="utf-8"):
                sink.write(line)
                lines += 1
                tokens += len(line.split())
    return lines, tokens


def _listing(folder: Path) -> list[str]:
    folder = folder.expanduser()
    return [path.name for path in folder.iterdir()] if folder.is_dir() else []


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _update_manifest(draft: Path, **fields: Any) -> None:
    path = draft / DRAFT_MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, **fields}, indent=2) + "\n")


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    return ([line for line in lines if line] or ["no messages"])[-1]


def _one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (transformers' span several), cut at `limit`."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
