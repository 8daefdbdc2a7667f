"""bench.perplexity on the tiny model: every mode scores the same tokens, and the figures
are what the served passes give."""

from __future__ import annotations

import json
import math

import pytest

from bench import perplexity
from kenspec.server.engine.target import TargetModel
from tests import tiny


def test_modes_score_the_same_tokens_and_agree_with_themselves(tiny_model_dir, tmp_path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("\n".join(tiny.PROMPTS) + "\n\n")
    out = tmp_path / "perplexity.json"
    argv = ["--model", str(tiny_model_dir), "--text", str(text), "--modes", "fp32,int8-fp32"]
    assert perplexity.main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    fp32, int8 = results["modes"]["fp32"], results["modes"]["int8-fp32"]
    assert fp32["tokens"] == int8["tokens"] > 0
    assert int8["plan"].startswith("lean; int8;") and fp32["plan"].startswith("eager;")
    assert 0.0 <= results["top1_agreement"]["int8-fp32 vs fp32"] <= 1.0
    target = TargetModel.load(tiny_model_dir, device="cpu", dtype="float32")
    prompts = [ids for p in tiny.PROMPTS if len(ids := target.encode_prompt(p)) > 1]
    nll = [n for ids in prompts for n in perplexity.score(target, ids)[0]]
    assert fp32["perplexity"] == round(math.exp(sum(nll) / len(nll)), 3)


def test_unknown_modes_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        perplexity.main(["--modes", "fp32,int2"])
    assert exit_.value.code == 2
    assert "unknown ['int2']" in capsys.readouterr().err
