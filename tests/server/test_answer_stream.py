"""The shared answer stream (--share-answers) between replicas, over a real redis-server on
loopback: in-process replicas, each with its own runtime (its own engine and index), and a
`kenspec serve` process where a tenant id has to mean the same in two processes.

Every test waits (bounded) for something the stream does, never for time to pass. A replica's
first round of a prompt drafts from the suffix index only when the index holds an answer after
that prompt's end (chains, --tree-budget 1, so a round's source names the index), which is the
observable of "learned from another replica": without sharing it never happens (checked too).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from structlog.testing import capture_logs

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.answer_records import AnswerRecord, encode, model_fingerprint
from kenspec.server.answer_stream import AnswerStream, StreamSettings
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.tenant_index import SHARED_TENANT, TenantSuffixIndex
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.metrics import Metrics
from kenspec.server.settings import Settings
from tests import tiny
from tests.server.conftest import TIMEOUT, Servers, until


class RedisServer:
    """redis-server on 127.0.0.1, no persistence: stop() kills it, start() brings it back
    (empty) on the same port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.directory)),
                *("--enable-debug-command", "local"),  # DEBUG SLEEP: a Redis that stalls
            ],
            stdout=subprocess.DEVNULL,
        )
        client = self.client()
        for _ in range(int(TIMEOUT / 0.05)):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert self.process.poll() is None, "redis-server exited"
                time.sleep(0.05)
        raise AssertionError("redis-server never answered")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(TIMEOUT)

    def client_answers(self) -> bool:
        """Whether Redis answers a PING within a tenth of a second."""
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.1) as client:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=TIMEOUT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def replica(base_settings: Settings, redis_server, servers: Servers) -> Callable:
    """replica(share=True, **settings) -> a started, loaded KenspecServer with its own runtime,
    sharing answers through redis_server (or not)."""

    async def start(share: bool = True, **overrides: object) -> KenspecServer:
        settings = base_settings.replace(
            tree_budget=1,
            report_draft_source=True,
            share_answers=redis_server.url if share else "",
            **overrides,
        )
        return await servers.start(settings)  # load_runtime: a runtime of its own

    return start


async def rounds(server: KenspecServer, prompt: str, token: str = "") -> list[pb.GenerateResponse]:
    """Every round of a greedy 24-token answer (as the caller holding `token` sees it)."""
    request = pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)
    )
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(request, metadata=metadata, timeout=TIMEOUT)
        return [response async for response in call]


def from_index(responses: list[pb.GenerateResponse]) -> bool:
    """Whether the answer's first round was drafted from the suffix index."""
    return responses[0].round.draft_source.startswith("suffix")


def sources(responses: list[pb.GenerateResponse]) -> list[str]:
    return [response.round.draft_source for response in responses]


def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


def index_drafts(server: KenspecServer, prompt: str, tenant: str = SHARED_TENANT) -> list[int]:
    """What the server's suffix index drafts for the tenant right after `prompt` (the same
    lookup as the answer's first round; which chain a round then verifies depends on the
    acceptance the replica has learned per source, so tests that served before check this)."""
    engine = server.serving.runtime.engine
    found, _length = engine.suffix.view(tenant).propose(engine.target.encode_prompt(prompt), 8)
    return found


def count(server: KenspecServer, name: str, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(f"kenspec_shared_answers_{name}", labels)
    return value or 0.0


@pytest.mark.parametrize("share", [True, False])
async def test_an_answer_served_by_one_replica_is_drafted_by_another(replica, share) -> None:
    """A answers a prompt; B, which never saw it, drafts A's answer from its first round (and
    answers the same): only with --share-answers."""
    a, b = await replica(share), await replica(share)
    answer = tokens(await rounds(a, "Replica A answers this first"))
    if share:
        await until(lambda: count(b, "received_total") == 1, "B received A's answer")
        assert count(a, "published_total") == 1 and count(b, "published_total") == 0
        held = b.serving.runtime.engine.suffix.learned(SHARED_TENANT)
        assert held is not None and held.tokens > len(answer)
        await until(lambda: a.answers.last_id == b.answers.last_id, "A read its own answer")
        assert count(a, "received_total") == 0  # and skipped it: learned when it answered
    assert index_drafts(b, "Replica A answers this first") == (answer[:8] if share else [])
    again = await rounds(b, "Replica A answers this first")
    assert from_index(again) is share, sources(again)
    assert tokens(again) == answer


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """The tiny model's architecture and tokenizer with other weights (another seed)."""
    directory = tmp_path_factory.mktemp("tiny-other-model")
    return tiny.save_tiny_model(directory, tiny.build_byte_tokenizer(), seed=7)


async def test_replicas_of_different_models_never_share(
    replica, redis_server, other_model_dir
) -> None:
    """A and B serve models of one architecture and tokenizer but other weights: different
    fingerprints, so different streams. A record of A's model written into B's stream anyway
    is dropped as foreign, a broken one as malformed; B learns only what carries its own
    fingerprint."""
    a, b = await replica(), await replica(model=str(other_model_dir))
    assert a.answers is not None and b.answers is not None
    assert a.answers.key != b.answers.key
    await rounds(a, "Only replica A knows this")
    await until(lambda: count(a, "published_total") == 1, "A published its answer")
    client = redis_server.client()
    forged = AnswerRecord(SHARED_TENANT, tuple(range(40, 80)), tuple(range(10, 26)))
    client.xadd(b.answers.key, encode(forged, "elsewhere", a.answers.settings.fingerprint))
    broken = encode(forged, "elsewhere", b.answers.settings.fingerprint) | {b"a": b"\xff" * 7}
    client.xadd(b.answers.key, broken)  # not whole ids
    marker = AnswerRecord(SHARED_TENANT, tuple(range(90, 130)), tuple(range(30, 46)))
    client.xadd(b.answers.key, encode(marker, "elsewhere", b.answers.settings.fingerprint))
    await until(lambda: count(b, "received_total") == 1, "B read its stream past both")
    assert count(b, "dropped_total", reason="foreign_model") == 1
    assert count(b, "dropped_total", reason="malformed") == 1
    assert client.xlen(a.answers.key) == 1 and client.xlen(b.answers.key) == 3
    again = await rounds(b, "Only replica A knows this")
    assert not from_index(again), sources(again)


async def test_a_replica_started_late_catches_up_from_the_stream(replica) -> None:
    """A answers three prompts before B starts; B reads the stream from its start, so it
    holds all three answers and drafts the first from its first round."""
    a = await replica()
    prompts = [f"Answered before B started, number {n}" for n in range(3)]
    answers = [tokens(await rounds(a, prompt)) for prompt in prompts]
    await until(lambda: count(a, "published_total") == 3, "A published its answers")
    b = await replica()
    await until(lambda: count(b, "received_total") == 3, "B caught up")
    assert [index_drafts(b, prompt) for prompt in prompts] == [a[:8] for a in answers]
    assert from_index(await rounds(b, prompts[0]))


async def test_redis_killed_mid_run_fails_no_request_and_sharing_resumes(
    replica, redis_server
) -> None:
    """Redis is killed while both replicas serve: every request still succeeds, nothing is
    logged at error, each link warns once, the lost answers are counted; once Redis is back
    on its port, both reconnect and later answers are shared again."""
    a, b = await replica(), await replica()
    with capture_logs() as logs:
        await rounds(a, "Shared before the outage")
        await until(lambda: count(b, "received_total") == 1, "B received the first answer")
        redis_server.stop()
        answered = [
            await rounds(server, f"During the outage, {n}") for n in range(3) for server in (a, b)
        ]
        assert all(r and r[-1].finish_reason == pb.FINISH_REASON_LENGTH for r in answered)
        await until(lambda: count(a, "dropped_total", reason="redis_down") == 3, "A's 3 lost")
        await until(lambda: count(b, "dropped_total", reason="redis_down") == 3, "B's 3 lost")
        for server in (a, b):
            await until(lambda s=server: count(s, "connected", link="read") == 0, "reader down")
        assert count(a, "connected", link="publish") == 0
        redis_server.start()
        # An entry older than any B read (Redis came back empty, with an earlier clock): B
        # reads the new stream from its start, not from its last id.
        early = AnswerRecord(SHARED_TENANT, tuple(range(90, 130)), tuple(range(30, 46)))
        fields = encode(early, "elsewhere", b.answers.settings.fingerprint)
        redis_server.client().xadd(b.answers.key, fields, id="1-1")
        for server, link in [(a, "publish"), (b, "read"), (a, "read"), (b, "publish")]:
            await until(lambda s=server, n=link: count(s, "connected", link=n) == 1, "back")
        served = tokens(await rounds(a, "Shared after the outage"))
        await until(lambda: count(b, "received_total") == 3, "B received the later answers")
        assert index_drafts(b, "Shared after the outage") == served[:8]
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    warned = sorted(
        (e["event"], e.get("link"))
        for e in logs
        if e["log_level"] == "warning" and e["event"].startswith("shared_answers")
    )
    # Once per replica and link for the whole outage, however many answers were lost.
    assert (
        warned
        == [("shared_answers_unreachable", "publish")] * 2
        + [("shared_answers_unreachable", "read")] * 2
    )


async def test_an_answer_reaches_only_its_own_tenant_on_another_replica(
    replica, redis_server, tiny_server, tmp_path
) -> None:
    """Replica A is a `kenspec serve` process, B in-process, with one tokens file: tenant
    x's answer on A lands in x's index on B (the same tenant id in both processes), and only
    there: x drafts it from B's index, y does not."""
    x, y = secrets.token_hex(16), secrets.token_hex(16)
    path = tmp_path / "tokens"
    path.write_text(f"{x}\n{y}\n")
    b = await replica(auth_tokens_file=str(path))
    a = tiny_server(
        *["--share-answers", redis_server.url, "--auth-tokens-file", str(path)],
        *["--tree-budget", "1", "--report-draft-source", "--min-draft-prob", "0"],
    )
    try:
        await asyncio.to_thread(a.wait_for, "shared_answers_connected", TIMEOUT)
        request = pb.GenerateRequest(
            prompt="Tenant x asked replica A",
            stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(a.address) as channel:
            call = pb_grpc.GeneratorStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {x}"),), timeout=TIMEOUT
            )
            answer = tokens([response async for response in call])
    finally:
        a.stop()
    await until(lambda: count(b, "received_total") == 1, "B received x's answer")
    index = b.serving.runtime.engine.suffix
    tenant_x, tenant_y = b.serving.tenant(f"Bearer {x}"), b.serving.tenant(f"Bearer {y}")
    assert index.learned(tenant_x) is not None and index.learned(tenant_y) is None
    assert index.tenants == [tenant_x]
    assert index_drafts(b, "Tenant x asked replica A", tenant_x) == answer[:8]
    assert index_drafts(b, "Tenant x asked replica A", tenant_y) == []
    assert from_index(await rounds(b, "Tenant x asked replica A", token=x))
    assert not from_index(await rounds(b, "Tenant x asked replica A", token=y))


async def test_a_stalled_redis_delays_no_request(replica, redis_server) -> None:
    """Redis stops answering (DEBUG SLEEP) while A serves: A's requests finish while Redis
    still sleeps (publishing waits on no request), the answers that could not go out are
    counted, and publishing resumes once Redis answers again."""
    a = await replica()
    stall = asyncio.create_task(
        asyncio.to_thread(redis_server.client().execute_command, "DEBUG", "SLEEP", "8")
    )
    await until(lambda: not redis_server.client_answers(), "Redis stalled")
    answered = [await rounds(a, f"While Redis sleeps, {n}") for n in range(2)]
    assert all(r[-1].finish_reason == pb.FINISH_REASON_LENGTH for r in answered)
    assert not stall.done()  # Redis is still asleep: no request waited for it
    await stall
    await until(lambda: count(a, "dropped_total", reason="redis_down") == 2, "both counted")
    await until(lambda: count(a, "connected", link="publish") == 1, "publishing again")
    await rounds(a, "After Redis woke up")
    await until(lambda: count(a, "published_total") == 1, "published again")


def test_a_full_buffer_drops_at_once_and_counts() -> None:
    """The engine thread's hand-off never waits: beyond --share-answers-buffer, dropped."""
    metrics = Metrics()
    settings = StreamSettings("redis://127.0.0.1:1/0", "0" * 16, vocab_size=320, buffer=2)
    stream = AnswerStream(settings, TenantSuffixIndex(), metrics)  # not started: nothing sent
    for n in range(5):
        stream.offer(SHARED_TENANT, [1, 2, 3], [n, n + 1, n + 2])
    stream.offer(SHARED_TENANT, [1, 2, 3], [9])  # too short to learn: not shared either
    dropped = metrics.registry.get_sample_value(
        "kenspec_shared_answers_dropped_total", {"reason": "buffer_full"}
    )
    assert dropped == 3 and [r.answer for r in stream._take(10)] == [(0, 1, 2), (1, 2, 3)]


async def test_answers_offered_before_a_first_failed_ping_are_dropped_and_counted() -> None:
    """Answers buffered while the link is not yet known to be down (the first PING still
    under way) are dropped and counted when that PING fails, as when an XADD fails; the
    offers after it are dropped at once."""
    metrics = Metrics()
    settings = StreamSettings("redis://127.0.0.1:1/0", "0" * 16, vocab_size=320)
    stream = AnswerStream(settings, TenantSuffixIndex(), metrics)
    for n in range(2):
        stream.offer(SHARED_TENANT, [1, 2, 3], [n, n + 1, n + 2])

    def dropped() -> float:
        value = metrics.registry.get_sample_value(
            "kenspec_shared_answers_dropped_total", {"reason": "redis_down"}
        )
        return value or 0.0

    assert dropped() == 0
    await stream.start()  # nothing listens on port 1: the first PING fails
    try:
        await until(lambda: dropped() == 2, "the buffered answers counted")
        stream.offer(SHARED_TENANT, [1, 2, 3], [7, 8, 9])
        assert dropped() == 3 and stream._take(10) == []
    finally:
        await stream.stop(0.1)


def test_the_model_fingerprint_names_weights_and_tokenizer_not_path_or_dtype(
    tiny_model_dir, other_model_dir, tmp_path
) -> None:
    copy = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")
    fingerprints = [
        model_fingerprint(TargetModel.load(path, device="cpu", dtype=dtype))
        for path, dtype in [
            (tiny_model_dir, "float32"),
            (copy, "float32"),
            (tiny_model_dir, "bfloat16"),
            (other_model_dir, "float32"),
        ]
    ]
    assert fingerprints[0] == fingerprints[1] == fingerprints[2] != fingerprints[3]
    assert len(fingerprints[0]) == 16


async def test_a_replica_with_a_shared_index_learns_no_tenants_answers(replica, tmp_path) -> None:
    """A keeps tenants apart, B (--suffix-index-scope shared) drafts everyone's answers for
    everyone: B learns A's tenant's answer not at all, rather than for every caller."""
    x = secrets.token_hex(16)
    path = tmp_path / "tokens"
    path.write_text(f"{x}\n")
    a = await replica(auth_tokens_file=str(path))
    b = await replica(suffix_index_scope="shared")
    await rounds(a, "Tenant x asked replica A", token=x)
    await until(lambda: count(b, "dropped_total", reason="tenant_scope") == 1, "B dropped it")
    assert count(b, "received_total") == 0
    assert index_drafts(b, "Tenant x asked replica A") == []
