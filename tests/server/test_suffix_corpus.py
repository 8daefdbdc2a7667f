"""--suffix-corpus: a plain-text file seeds the suffix index, so --draft none drafts from it at
once. A round's reported draft source names the index (`suffix:N`); chains (--tree-budget 1)
so that a round's source is one source. Without the corpus the same first round never does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.settings import Settings, parse_settings
from tests.server.conftest import TIMEOUT, Servers

PROMPT = "Speculative decoding"
CORPUS = (
    "Unrelated words first.\n\n"
    "Speculative decoding drafts tokens and verifies them in one pass.\n"
    "An n-gram model predicts the next word.\n"
)


@pytest.fixture
async def undrafted(base_settings: Settings, tmp_path: Path, servers: Servers) -> Callable:
    """undrafted(corpus: bool) -> a started, loaded server with --draft none (its own runtime)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")

    async def start(with_corpus: bool) -> KenspecServer:
        settings = base_settings.replace(
            draft="none",
            tree_budget=1,
            report_draft_source=True,
            recycled_predictions=False,
            suffix_corpus=str(corpus) if with_corpus else "",
        )
        return await servers.start(settings)

    return start


async def first_round_source(server: KenspecServer) -> str:
    request = pb.GenerateRequest(
        prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(request, timeout=TIMEOUT)
        responses = [response async for response in call]
    return responses[0].round.draft_source


async def test_a_request_is_drafted_from_the_corpus(undrafted) -> None:
    with_corpus = await undrafted(True)
    assert (await first_round_source(with_corpus)).startswith("suffix:")
    without = await undrafted(False)
    assert not (await first_round_source(without)).startswith("suffix")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--suffix-corpus", "/no/such/corpus.txt"],
            "--suffix-corpus /no/such/corpus.txt: no such",
        ),
        (["--no-suffix-index"], "needs --suffix-index and --draft-context"),
        (["--no-draft-context"], "needs --suffix-index and --draft-context"),
        (["--suffix-index-tokens", "0"], "--suffix-index-tokens is 0"),
    ],
)
def test_the_flag_is_checked(argv, message, tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    flags = argv if argv[0] == "--suffix-corpus" else ["--suffix-corpus", str(corpus), *argv]
    with pytest.raises(SystemExit):
        parse_settings(flags, env={})
    assert message in capsys.readouterr().err
    seeded = parse_settings(["--suffix-corpus", str(corpus)], env={}).speculation
    assert seeded.suffix_corpus == str(corpus)
    assert parse_settings([], env={}).speculation.suffix_corpus == ""
