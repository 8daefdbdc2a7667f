"""`python -m draft_tools build`, end to end on the tiny model with the real lmplz/build_binary:
one command makes a draft the server loads; a rerun skips what is done; a changed input redoes
its stage; bad inputs end in one line, not a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from harness.server_process import ServerProcess
from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.draft_tools import build, distill, kenlm_tools, stages
from kenspec.draft_tools import train as train_draft
from kenspec.draft_tools.stages import split_prompts
from kenspec.server.engine.kenlm_draft import KenLMDraft, tokenizer_fingerprint
from kenspec.server.settings import SpeculationSettings
from tests import tiny
from tests.gguf_files import write_header_only_gguf, write_llama_gguf
from tests.server.engine.drafts import reference_greedy

FLAGS = ["--max-new-tokens", "16", "--batch-size", "4", "--threads", "1", "--memory", "32M"]
FLAGS += ["--order", "3", "--heldout", "0.2"]
DRAFT_FILES = ("model.bin", "successors.npz", "draft.json", "corpus.ids.gz")
STREAM_TIMEOUT = 60  # seconds; bounds a stream that a passing run finishes long before


def run_build(argv: list[str]) -> tuple[int, str, str]:
    """build.main in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = build.main(argv)
    return code, out.getvalue(), err.getvalue()


def build_argv(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--prompts", str(prompts), "--out", str(out), *FLAGS, *extra]


def skipped(stderr: str) -> list[str]:
    """The stages a run skipped as done, in order."""
    stage = ""
    names = []
    for line in stderr.splitlines():
        if match := re.match(r"\[\d+/\d+\] (\w+):", line):
            stage = match.group(1)
        elif "done before with the same inputs: skipping" in line:
            names.append(stage)
    return names


def answered_prompts(ids: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in ids.with_suffix(".jsonl").open()]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(tiny.PROMPTS) + "\n\n")
    return path


@pytest.fixture(scope="module")
def built(tiny_model_dir, prompts_file, tmp_path_factory) -> tuple[list[str], Path, str, str]:
    """One build into a fresh folder: (argv, out, stdout, stderr). Tests that change it copy it."""
    out = tmp_path_factory.mktemp("built") / "draft"
    argv = build_argv(tiny_model_dir, prompts_file, out)
    code, stdout, stderr = run_build(argv)
    assert code == 0, stderr
    return argv, out, stdout, stderr


def test_one_command_writes_a_loadable_draft_checked_on_held_out_prompts(
    built, tiny_model_dir, tiny_target
) -> None:
    _, out, stdout, stderr = built
    assert skipped(stderr) == []
    assert all((out / name).stat().st_size > 0 for name in DRAFT_FILES)
    draft = KenLMDraft.load(
        out,
        vocab_size=tiny_target.vocab_size,
        fingerprint=tokenizer_fingerprint(tiny_target.tokenizer.get_vocab()),
    )
    assert draft.order == 3
    # The held-out prompts are the split's, answered apart from the training ones.
    training, held = split_prompts(tiny.PROMPTS, 0.2)
    assert sorted(answered_prompts(out / "work" / "train.ids")) == sorted(training)
    assert sorted(answered_prompts(out / "work" / "heldout.ids")) == sorted(held)
    assert set(training).isdisjoint(held) and len(held) == round(0.2 * len(tiny.PROMPTS))
    # The check reported is the replay of those answers through this draft.
    manifest = json.loads((out / "draft.json").read_text())
    check = manifest["heldout_check"]
    served = SpeculationSettings()
    k = served.request_defaults.k
    assert (check["k"], check["min_draft_prob"]) == (k, served.min_draft_prob)
    replayed = train_draft.evaluate(
        tiny_model_dir,
        out,
        out / "work" / "heldout.ids",
        k=k,
        adaptive=served.adaptive,
        min_draft_prob=served.min_draft_prob,
    )
    assert (check["answers"], check["tokens"]) == (len(held), replayed.tokens)
    assert check["tokens_per_round"] == pytest.approx(replayed.tokens_per_round, abs=1e-4)
    assert manifest["corpus_lines"] == len(training)
    form = "chat template" if tiny_target.tokenizer.chat_template else "raw prompts"
    assert f"prompts of prompts.txt ({form}, max " in manifest["corpus"]
    assert f"{check['tokens_per_round']:.2f} tokens/round" in stdout
    assert f"  kenspec serve --model {tiny_model_dir} --draft {out}" in stdout.splitlines()


def test_the_server_serves_the_built_draft(built, tiny_target) -> None:
    """The summary's command, as printed, starts a server that drafts with the new draft."""
    _, out, stdout, _ = built
    command = next(line for line in stdout.splitlines() if "kenspec serve" in line)
    args = shlex.split(command)[2:]  # after `kenspec serve`
    flags = ["--device", "cpu", "--dtype", "float32", "--breaker-threshold", "0", "--no-live-costs"]
    flags += ["--threads", "1", "--no-draft-context"]  # only the n-gram drafts
    server = ServerProcess([*args, *flags], timeout=120)
    try:
        assert server.logged("model_loaded")["draft"] == str(out)
        prompt = split_prompts(tiny.PROMPTS, 0.2)[0][0]  # a training prompt: its answer is known
        request = pb.GenerateRequest(
            messages=pb.Messages(messages=[pb.ChatMessage(role="user", content=prompt)]),
            stopping=pb.StoppingCriteria(max_new_tokens=16),
        )
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            responses = list(stub.Generate(request, timeout=STREAM_TIMEOUT))
        ids = tiny_target.encode_chat([{"role": "user", "content": prompt}])
        assert [t for r in responses for t in r.token_ids] == reference_greedy(tiny_target, ids, 16)
        assert responses[-1].usage.accepted_tokens > 0
    finally:
        server.stop()


def test_a_second_run_skips_every_stage(built, monkeypatch) -> None:
    argv, out, first_stdout, _ = built
    before = {name: (out / name).stat().st_mtime_ns for name in DRAFT_FILES if name != "draft.json"}

    def no_target(*args, **kwargs):
        raise AssertionError("a finished build loaded the target again")

    monkeypatch.setattr(distill, "load_target", no_target)
    code, stdout, stderr = run_build(argv)
    assert code == 0, stderr
    assert skipped(stderr) == ["distill", "heldout", "fit", "check"]
    assert before == {name: (out / name).stat().st_mtime_ns for name in before}
    timed = "time by stage"  # the one line that differs: the times
    assert [line for line in stdout.splitlines() if not line.startswith(timed)] == [
        line for line in first_stdout.splitlines() if not line.startswith(timed)
    ]


def test_a_changed_order_refits_and_rechecks_only(built, tmp_path) -> None:
    argv, out, _, _ = built
    copy = shutil.copytree(out, tmp_path / "draft")
    argv = [*argv[: argv.index("--out") + 1], str(copy), *FLAGS, "--order", "2"]
    code, _, stderr = run_build(argv)
    assert code == 0, stderr
    assert skipped(stderr) == ["distill", "heldout"]
    assert "redoing: order changed since the last run" in stderr
    manifest = json.loads((copy / "draft.json").read_text())
    assert manifest["order"] == 2 and KenLMDraft.load(copy).order == 2
    before = json.loads((out / "draft.json").read_text())
    assert manifest["heldout_check"] != before["heldout_check"]


def test_added_prompts_cost_only_the_answers_not_given_before(
    built, tiny_model_dir, prompts_file, tmp_path
) -> None:
    """A prompt appended moves at most one prompt across the split; every other answer is kept."""
    _, out, _, _ = built
    copy = shutil.copytree(out, tmp_path / "draft")
    grown = tmp_path / "prompts.txt"
    new_prompts = [*tiny.PROMPTS, "the brown dog sleeps over the fox"]
    grown.write_text("\n".join(new_prompts) + "\n")
    code, _, stderr = run_build(build_argv(tiny_model_dir, grown, copy))
    assert code == 0, stderr
    old_sides = split_prompts(tiny.PROMPTS, 0.2)
    new_sides = split_prompts(new_prompts, 0.2)
    moved = sum(len(set(new) - set(old)) for new, old in zip(new_sides, old_sides, strict=True))
    to_go = [int(n) for n in re.findall(r"(\d+) to go,", stderr)]
    assert sum(to_go) == moved and 1 <= moved <= 2
    assert sorted(answered_prompts(copy / "work" / "train.ids")) == sorted(new_sides[0])
    assert sorted(answered_prompts(copy / "work" / "heldout.ids")) == sorted(new_sides[1])
    old_answers = dict(
        zip(
            answered_prompts(out / "work" / "train.ids"),
            (out / "work" / "train.ids").read_text().splitlines(),
            strict=True,
        )
    )
    new_answers = dict(
        zip(
            answered_prompts(copy / "work" / "train.ids"),
            (copy / "work" / "train.ids").read_text().splitlines(),
            strict=True,
        )
    )
    assert all(new_answers[p] == old_answers[p] for p in old_answers.keys() & new_answers.keys())


def test_an_interrupted_distillation_resumes_where_it_stopped(
    built, tiny_model_dir, prompts_file, tmp_path, monkeypatch
) -> None:
    _, full, _, _ = built
    out = tmp_path / "draft"
    write, calls = distill.CorpusWriter.write, []

    def interrupted(writer, answer):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt
        return write(writer, answer)

    monkeypatch.setattr(distill.CorpusWriter, "write", interrupted)
    code, _, stderr = run_build(build_argv(tiny_model_dir, prompts_file, out))
    assert code == 130 and "run the same command again to resume" in stderr
    assert len((out / "work" / "train.ids").read_text().splitlines()) == 8  # each one kept
    times = json.loads((out / "work" / "times.json").read_text())  # the stages before
    assert [t["stage"] for t in times] == ["tools", "split"]

    monkeypatch.setattr(distill.CorpusWriter, "write", write)
    code, _, stderr = run_build(build_argv(tiny_model_dir, prompts_file, out))
    assert code == 0, stderr
    training = len(split_prompts(tiny.PROMPTS, 0.2)[0])
    assert f"8 prompts done before, {training - 8} to go" in stderr
    for name in ("train.ids", "heldout.ids"):
        assert (out / "work" / name).read_text() == (full / "work" / name).read_text()


def test_text_alone_checked_on_held_out_prompts(tiny_model_dir, tmp_path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(tiny.CORPUS * 3).replace("\n    ", " ") + "\n")
    dev = tmp_path / "dev.txt"
    dev.write_text("The quick brown fox\nAn n-gram model\n")
    out = tmp_path / "draft"
    argv = ["--model", str(tiny_model_dir), "--text", str(text), "--heldout-prompts", str(dev)]
    code, stdout, stderr = run_build([*argv, "--out", str(out), *FLAGS])
    assert code == 0, stderr
    assert re.findall(r"\] (\w+):", stderr) == ["tools", "split", "heldout", "text", "fit", "check"]
    manifest = json.loads((out / "draft.json").read_text())
    lines = [line for line in text.read_text().splitlines() if line.strip()]
    assert manifest["corpus_lines"] == len(lines) and manifest["heldout_check"]["answers"] == 2
    assert "held-out check: 2 answers" in stdout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--model": "missing"}, "no such file or folder"),
        ({"--model": "."}, "is not a model folder (it has no config.json) and holds no GGUF"),
        ({"--model": "one.txt"}, "is a file but not a .gguf file"),
        ({"--chat-template": "missing.jinja"}, "--chat-template"),
        ({"--prompts": "empty.txt"}, "holds no prompts"),
        ({"--prompts": "missing.txt"}, "no such file"),
        ({"--prompts": "one.txt"}, "needs 2 distinct prompts or more"),
        ({"--prompts": "binary.txt"}, "is not UTF-8 text"),
        ({"--out": "one.txt"}, "is a file; give a folder"),
    ],
)
def test_bad_inputs_end_in_one_line(tiny_model_dir, prompts_file, tmp_path, change, message):
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "one.txt").write_text("hello\nhello\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00prompt\n")
    values = {"--model": tiny_model_dir, "--prompts": prompts_file, "--out": tmp_path / "draft"}
    values.update({flag: str(tmp_path / name) for flag, name in change.items()})
    argv = [str(item) for pair in values.items() for item in pair]
    code, stdout, stderr = run_build([*argv, *FLAGS])
    assert code == 1 and stdout == ""
    assert stderr.startswith("error: ") and message in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_a_model_folder_transformers_cannot_read_ends_in_one_line(prompts_file, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # no weights, no tokenizer
    code, stdout, stderr = run_build(build_argv(model, prompts_file, tmp_path / "draft"))
    assert code == 1 and stdout == "" and "Traceback" not in stderr
    assert stderr.splitlines()[-2].startswith("[3/6] distill:")  # found once it was needed
    assert stderr.splitlines()[-1].startswith(f"error: cannot load the model from {model}: ")


def test_missing_tools_that_cannot_be_built_say_how_to_install(
    tiny_model_dir, prompts_file, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(kenlm_tools, "find_tools", lambda tools_dir: None)
    monkeypatch.setattr(kenlm_tools, "missing_build_deps", lambda: ["cmake", "Boost headers"])
    code, _, stderr = run_build(build_argv(tiny_model_dir, prompts_file, tmp_path / "draft"))
    assert code == 1 and len(stderr.strip().splitlines()) == 2  # the stage line, the error
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: KenLM's lmplz and build_binary are missing")
    assert "no cmake, Boost headers" in error and "sudo apt-get install cmake" in error
    assert "brew install cmake boost" in error and "--tools DIR" in error


def _fake_build_script(path: Path, body: str) -> Path:
    path.write_text(f"#!/usr/bin/env bash\nset -e\n{body}\n")
    return path


def test_missing_tools_are_built_by_the_script(tmp_path, monkeypatch) -> None:
    real = kenlm_tools.find_tools(None)
    assert real is not None, "build them first: bash scripts/build_kenlm_tools.sh"
    monkeypatch.setattr(train_draft, "REPO_ROOT", tmp_path / "repo")  # not where they are
    bin_dir = tmp_path / "bin"  # what the fake script runs, and no KenLM tool
    bin_dir.mkdir()
    for command in ("bash", "mkdir", "cp"):
        (bin_dir / command).symlink_to(shutil.which(command))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("KENSPEC_TOOLS_DIR", str(tmp_path / "tools"))
    monkeypatch.setattr(kenlm_tools, "missing_build_deps", lambda: [])
    script = _fake_build_script(
        tmp_path / "build.sh",
        f'[[ $KENSPEC_SKIP_APT == 1 ]]\nmkdir -p "$KENSPEC_TOOLS_DIR/kenlm/bin"\n'
        f'cp {real[0]} {real[1]} "$KENSPEC_TOOLS_DIR/kenlm/bin/"\necho built',
    )
    monkeypatch.setattr(kenlm_tools, "BUILD_SCRIPT", script)
    said: list[str] = []
    lmplz, build_binary = kenlm_tools.ensure_tools(None, tmp_path / "log", said.append)
    assert lmplz == tmp_path / "tools" / "kenlm" / "bin" / "lmplz"
    assert build_binary.parent == lmplz.parent
    assert "building them" in said[0] and (tmp_path / "log").read_text() == "built\n"

    monkeypatch.setenv("KENSPEC_TOOLS_DIR", str(tmp_path / "elsewhere"))
    script.write_text("echo compiling\necho '[build_kenlm_tools] ERROR: bad sha256' >&2\nexit 1")
    with pytest.raises(kenlm_tools.ToolsError, match=r"failed: .*ERROR: bad sha256 \(full log"):
        kenlm_tools.ensure_tools(None, tmp_path / "log", said.append)
    with pytest.raises(kenlm_tools.ToolsError, match="no lmplz and build_binary in --tools"):
        kenlm_tools.ensure_tools(str(tmp_path), tmp_path / "log", said.append)


@pytest.mark.parametrize(
    ("commands", "header", "missing"),
    [
        ({"cmake", "make", "g++"}, True, []),
        ({"cmake", "make", "clang++"}, True, []),
        ({"make", "c++"}, True, ["cmake"]),
        ({"cmake", "make"}, True, ["a C++ compiler"]),
        ({"cmake", "make", "c++"}, False, ["Boost headers (boost/program_options.hpp)"]),
    ],
)
def test_missing_build_deps(tmp_path, commands, header, missing) -> None:
    if header:
        (tmp_path / "boost").mkdir()
        (tmp_path / "boost" / "program_options.hpp").write_text("")
    which = {name: f"/usr/bin/{name}" for name in commands}.get
    assert kenlm_tools.missing_build_deps(which, include_dirs=[tmp_path]) == missing


def test_split_holds_out_a_share_of_distinct_prompts_stably() -> None:
    prompts = [f"prompt {i}" for i in range(40)] + ["prompt 3", "prompt 3"]
    training, held = split_prompts(prompts, 0.25)
    assert len(set(held)) == 10
    assert set(training).isdisjoint(held)  # the copies of "prompt 3" are on one side
    assert sorted(training + held) == sorted(prompts)
    assert [p for p in prompts if p in set(held)] == held  # file order kept
    _, grown_held = split_prompts([*prompts, "prompt 40"], 0.25)
    assert len(set(held) ^ set(grown_held)) <= 2  # at most one moves, besides the new one
    assert len(split_prompts(["a", "b"], 0.01)[1]) == 1  # at least one held out ...
    assert len(split_prompts(["a", "b"], 0.99)[0]) == 1  # ... and one to train on
    assert split_prompts(prompts, 0.0) == (prompts, [])


def test_stage_names_follow_the_inputs() -> None:
    def names(*argv: str) -> list[str]:
        return stages.stage_names(build.parse_args(["--model", "m", "--out", "o", *argv]))

    assert names("--prompts", "p") == ["tools", "split", "distill", "heldout", "fit", "check"]
    assert names("--prompts", "p", "--heldout", "0") == ["tools", "split", "distill", "fit"]
    assert names("--text", "t") == ["tools", "text", "fit"]
    both = ["tools", "split", "distill", "heldout", "text", "fit", "check"]
    assert names("--prompts", "p", "--text", "t") == both


def test_the_build_script_names_missing_compilers_and_how_to_install_them(tmp_path) -> None:
    """Run by hand without cmake or a compiler, scripts/build_kenlm_tools.sh stops before any
    download and says what to install."""
    bin_dir = tmp_path / "bin"  # bash and what the script runs before building: no compilers
    bin_dir.mkdir()
    for command in ("bash", "dirname", "mkdir"):
        (bin_dir / command).symlink_to(shutil.which(command))
    env = {"PATH": str(bin_dir), "KENSPEC_TOOLS_DIR": str(tmp_path), "KENSPEC_SKIP_APT": "1"}
    result = subprocess.run(
        [str(bin_dir / "bash"), str(kenlm_tools.BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert "ERROR: missing cmake, make, a C++ compiler; install them" in result.stderr
    assert "sudo apt-get install cmake make g++ libboost-program-options-dev" in result.stderr
    assert not (tmp_path / "kenlm" / "kenlm-0.3.0.tar.gz").exists()


def test_each_stage_is_timed_in_the_summary(built) -> None:
    _, out, stdout, _ = built
    names = ["tools", "split", "distill", "heldout", "fit", "check"]
    times = json.loads((out / "work" / "times.json").read_text())  # the last run's
    assert [t["stage"] for t in times] == names and all(t["seconds"] >= 0 for t in times)
    (line,) = [line for line in stdout.splitlines() if line.startswith("time by stage")]
    stages = line.split(": ", 1)[1].split(", ")
    assert [re.fullmatch(r"(\w+) [\d.]+ s", stage).group(1) for stage in stages] == names


def test_a_gguf_model_builds_the_draft_the_folder_builds(
    built, tiny_target, prompts_file, tmp_path
) -> None:
    """A GGUF file as --model is converted once into --gguf-cache, as the server converts it,
    and gives the answers (so the draft) that its Hugging Face folder gives; the summary's
    command serves the file from that cache."""
    _, folder_out, _, _ = built
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", tiny_target.model, tiny_target.tokenizer)
    cache, out = tmp_path / "cache", tmp_path / "draft"
    argv = build_argv(gguf, prompts_file, out, "--gguf-cache", str(cache))
    code, stdout, stderr = run_build(argv)
    assert code == 0, stderr
    assert stderr.splitlines()[0] == (
        f"[1/7] model: tiny.gguf dequantized to float32 under {cache}"
    )
    (converted,) = cache.iterdir()
    assert "converted" in stderr and json.loads((out / "draft.json").read_text())["target"] == (
        str(converted)
    )
    for part in ("train.ids", "heldout.ids"):
        assert (out / "work" / part).read_text() == (folder_out / "work" / part).read_text()
    assert (out / "model.bin").read_bytes() == (folder_out / "model.bin").read_bytes()
    command = f"  kenspec serve --model {gguf} --gguf-cache {cache} --draft {out}"
    assert command in stdout.splitlines()

    code, _, stderr = run_build(argv)  # the cached folder is found, nothing redone
    assert code == 0 and "cached before" in stderr
    assert skipped(stderr) == ["distill", "heldout", "fit", "check"]
    assert json.loads((out / "work" / "times.json").read_text())[0] == {
        "stage": "model",
        "seconds": pytest.approx(0, abs=30),
        "skipped": True,
    }


def test_a_chat_template_file_renders_the_prompts(tiny_target, prompts_file, tmp_path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    out = tmp_path / "draft"
    argv = build_argv(tiny_target.name, prompts_file, out, "--chat-template", str(template))
    code, stdout, stderr = run_build([*argv, "--heldout", "0"])
    assert code == 0, stderr
    records = [json.loads(line) for line in (out / "work" / "train.jsonl").open()]
    for record in records:
        assert record["prompt_ids"] == tiny_target.encode_chat_text(f"<<{record['prompt']}>>")
    assert f"--chat-template {template} --draft {out}" in stdout


def test_a_gguf_file_the_server_refuses_ends_the_build_in_one_line(prompts_file, tmp_path):
    model = write_header_only_gguf(tmp_path / "bert.gguf", "bert")
    argv = build_argv(model, prompts_file, tmp_path / "draft", "--gguf-cache", str(tmp_path / "c"))
    code, stdout, stderr = run_build(argv)
    assert code == 1 and stdout == "" and "Traceback" not in stderr
    assert stderr.splitlines()[0].startswith("[1/7] model: bert.gguf")
    last = stderr.splitlines()[-1]
    assert last.startswith(f"error: cannot load the model from {model}: ")
    assert "GGUF architecture 'bert' is not one transformers" in last


def test_a_prompt_too_long_for_the_context_ends_the_build_in_one_line(tiny_target, tmp_path):
    words = ["fox"]
    while len(tiny_target.encode_chat([{"role": "user", "content": " ".join(words)}])) < (
        tiny_target.max_context
    ):
        words *= 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n" + " ".join(words) + "\n")
    argv = build_argv(tiny_target.name, prompts, tmp_path / "draft", "--heldout", "0")
    code, stdout, stderr = run_build(argv)
    assert code == 1 and stdout == "" and "Traceback" not in stderr
    last = stderr.splitlines()[-1]
    assert last.startswith("error: the prompt 'fox fox") and "exceeds the model's context" in last
    assert not (tmp_path / "draft" / "work" / "train.ids").read_text()  # none answered


def test_a_model_without_a_chat_template_is_distilled_on_raw_prompts(
    tiny_model_dir, prompts_file, tmp_path
) -> None:
    """A base model (no chat template) gets the prompts raw, and the draft's manifest says so
    rather than naming a template it never had."""
    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config_path = base / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    out = tmp_path / "draft"
    code, _, stderr = run_build(build_argv(base, prompts_file, out))
    assert code == 0, stderr
    corpus = json.loads((out / "draft.json").read_text())["corpus"]
    assert "(raw prompts, max 16 new tokens)" in corpus
