"""Routing by prefix through a real nginx with the repository's deploy/nginx.conf, in front of
two real replicas (conftest.py): a chat session's turns all reach one replica (its prefix cache
then serves the history), sessions land exactly where nginx's hash puts them, and calls without
a session go to the replica with fewer calls in flight. For both APIs.

The replica that served a call is the one its /metrics counted it on, or the one the test's
copy of the config names in the x-kenspec-upstream response header.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import zlib
from collections.abc import Callable, Iterator

import grpc
import httpx
import openai
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.client import Client
from tests.deploy.conftest import TIMEOUT, UPSTREAM_HEADER, running_nginx

SESSIONS = [f"session-{index}" for index in range(16)]


def nginx_hash_pick(key: str, servers: int) -> int:
    """The server (by its line in the upstream) that `hash $http_x_session_id;` picks for
    `key`, every server up and of weight 1: nginx's Cache::Memcached-compatible
    ((crc32(key) >> 16) & 0x7fff) modulo the total weight."""
    return ((zlib.crc32(key.encode()) >> 16) & 0x7FFF) % servers


def counted(scrape: Callable, replicas: list, name: str) -> list[float]:
    """Each replica's total of the counter `name`, over all its labels."""
    return [sum(v for (n, _), v in scrape(port).items() if n == name) for _, port in replicas]


def gained(before: list[float], after: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


def grpc_index(replicas: list, upstream: str) -> int:
    (index,) = [i for i, (p, _) in enumerate(replicas) if upstream == f"127.0.0.1:{p.port}"]
    return index


def http_index(replicas: list, upstream: str) -> int:
    (index,) = [i for i, (p, _) in enumerate(replicas) if upstream == f"127.0.0.1:{p.http_port}"]
    return index


@pytest.fixture(scope="module")
def stub(nginx) -> Iterator[pb_grpc.GeneratorStub]:
    with grpc.insecure_channel(f"127.0.0.1:{nginx[0]}") as channel:
        yield pb_grpc.GeneratorStub(channel)


@pytest.fixture(scope="module")
def http(nginx) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{nginx[1]}", timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_a_grpc_chat_session_stays_on_one_replica(replicas, nginx, scrape) -> None:
    """The bundled client with a session id (as `kenspec chat` sends one): five turns, each
    carrying the whole conversation, all on the replica the session hashes to, whose prefix
    cache serves the earlier turns."""
    session = "grpc-chat"
    home = nginx_hash_pick(session, len(replicas))
    before = counted(scrape, replicas, "kenspec_requests_total")
    reused = counted(scrape, replicas, "kenspec_prefix_cache_reused_tokens_total")
    conversation: list[tuple[str, str]] = [("system", "Answer briefly.")]
    with Client(f"127.0.0.1:{nginx[0]}", timeout=TIMEOUT, session_id=session) as client:
        for turn in range(5):
            conversation.append(("user", f"Question number {turn}?"))
            answer = client.generate_text(messages=conversation, max_new_tokens=8, ignore_eos=True)
            conversation.append(("assistant", answer.text))
    # Each call's status came after its replica had counted it: nothing to wait for.
    served = gained(before, counted(scrape, replicas, "kenspec_requests_total"))
    assert served == [5 if index == home else 0 for index in range(len(replicas))]
    reuse = gained(reused, counted(scrape, replicas, "kenspec_prefix_cache_reused_tokens_total"))
    assert reuse[home] > 0


def test_an_openai_chat_session_stays_on_one_replica(replicas, nginx, scrape, model) -> None:
    """The official client with the session in X-Session-Id (default_headers), as the docs
    tell OpenAI clients to send it."""
    session = "http-chat"
    home = nginx_hash_pick(session, len(replicas))
    reused = counted(scrape, replicas, "kenspec_prefix_cache_reused_tokens_total")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{nginx[1]}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers={"X-Session-Id": session},
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly."}]
    served = []
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question number {turn}?"})
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, extra_body={"ignore_eos": True}
        )
        served.append(http_index(replicas, raw.headers[UPSTREAM_HEADER]))
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
    client.close()
    assert served == [home] * 5
    reuse = gained(reused, counted(scrape, replicas, "kenspec_prefix_cache_reused_tokens_total"))
    assert reuse[home] > 0


def test_sessions_land_where_the_hash_puts_them(replicas, stub, http, model) -> None:
    """Sixteen sessions, one call each per API: each on the replica nginx's hash names, and
    these sixteen split over both replicas."""
    expected = [nginx_hash_pick(session, len(replicas)) for session in SESSIONS]
    assert set(expected) == set(range(len(replicas)))  # these keys do spread
    grpc_served, http_served = [], []
    for session in SESSIONS:
        call = stub.Generate(
            pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_new_tokens=2)),
            metadata=(("x-session-id", session),),
            timeout=TIMEOUT,
        )
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        grpc_served.append(grpc_index(replicas, dict(call.initial_metadata())[UPSTREAM_HEADER]))
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        response = http.post("/v1/completions", json=body, headers={"X-Session-Id": session})
        assert response.status_code == 200, response.text
        http_served.append(http_index(replicas, response.headers[UPSTREAM_HEADER]))
    assert grpc_served == expected
    assert http_served == expected


class SlowReplica:
    """A server line that accepts each call nginx sends it and answers nothing until closed:
    a replica busy with a long answer, as nginx sees it (a call in flight). Each call it
    receives is reported on `arrived`, so a test knows where every call went, with no wait."""

    def __init__(self, arrived: queue.Queue) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.http_port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        self._arrived = arrived
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                connection, _ = self._listener.accept()
                self._held.append(connection)
                if connection.recv(65536):  # the call's first bytes: nginx sent it here
                    self._arrived.put("slow")

    def close(self) -> None:
        self._listener.close()
        for connection in self._held:
            connection.close()


@pytest.fixture
def slow_nginx(replicas, tmp_path) -> Iterator[tuple[SlowReplica, queue.Queue, int, int]]:
    """nginx with the repository's config over one real replica and one SlowReplica."""
    arrived: queue.Queue = queue.Queue()
    slow = SlowReplica(arrived)
    with running_nginx([replicas[0][0], slow], tmp_path) as (port, http_port):
        try:
            yield slow, arrived, port, http_port
        finally:
            slow.close()  # before nginx stops: the held call fails at nginx, not in its thread


def grpc_call(port: int, model: str, arrived: queue.Queue) -> None:
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_new_tokens=2))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(request, timeout=TIMEOUT)
        try:
            responses = list(call)
        except grpc.RpcError as error:  # the slow one's, once it is closed
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            return
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        arrived.put("replica")


def http_call(port: int, model: str, arrived: queue.Queue) -> None:
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=TIMEOUT)
    if response.status_code != 502:  # 502: the slow one's, once it is closed
        assert response.status_code == 200, response.text
        arrived.put("replica")


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_calls_without_a_session_avoid_the_busy_replica(api, slow_nginx, model) -> None:
    """least_conn: once a call is in flight on one replica, every call without a session goes
    to the other, however many follow (round-robin would send every second one there)."""
    slow, arrived, grpc_port, http_port = slow_nginx
    call, port = (grpc_call, grpc_port) if api == "grpc" else (http_call, http_port)
    calls = []
    went = []
    for _ in range(6):  # one at a time: each reports where it went before the next starts
        calls.append(threading.Thread(target=call, args=(port, model, arrived), daemon=True))
        calls[-1].start()
        went.append(arrived.get(timeout=TIMEOUT))
    slow.close()  # the held call ends (nginx answers it 502: a completion is not retried)
    for thread in calls:
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    # Both idle, nginx picks either for the first; once the slow one holds a call, never it.
    assert went.count("slow") == 1, went
    assert went.index("slow") <= 1 and set(went[went.index("slow") + 1 :]) == {"replica"}, went
