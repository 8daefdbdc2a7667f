"""Hostile input, load with cancellations, and faults: the server keeps serving, nothing is lost.

The server runs in a thread of its own (its own event loop), so synchronous clients, threads and
hypothesis can drive it the way real clients would.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.lifecycle import KenspecServer
from tests.server.engine.drafts import fail_passes_fed, reference_greedy

VALIDATABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches


class ServerThread:
    def __init__(self, settings, loader) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            # grpc.aio binds a server to the loop it is made in: make it in the server's loop.
            self.server = KenspecServer(settings, loader=loader)
            await self.server.start()
            await self.server.load()
            self._stopped = asyncio.Event()
            ready.set()
            await self._stopped.wait()  # the loop runs until stop() has finished draining

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),))
        self.thread.start()
        assert ready.wait(60)
        self.address = f"127.0.0.1:{self.server.port}"

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        """Run a coroutine in the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT)

    def stop(self) -> None:
        async def drain() -> None:
            await self.server.stop(5)
            self._stopped.set()

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(30)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def served(base_settings, runtime, serve_loaded):
    settings = base_settings.replace(
        max_new_tokens_limit=16,
        default_max_new_tokens=8,
        max_concurrent_streams=8,
        max_queue=200,
    )
    server = ServerThread(settings, serve_loaded(runtime))
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.GeneratorStub(channel), channel
    channel.close()
    server.stop()


def call(stub, request: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        for _ in stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def still_serves(stub) -> None:
    request = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_new_tokens=3))
    responses = list(stub.Generate(request, timeout=60))
    assert responses[-1].usage.completion_tokens == 3


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=40),
    prompt=st.one_of(st.none(), st.text(max_size=200)),
    sampling=st.builds(
        pb.SamplingParameters,
        temperature=floats,
        top_k=st.integers(0, 2**32 - 1),
        top_p=floats,
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    ),
    stopping=st.builds(
        pb.StoppingCriteria,
        max_new_tokens=st.integers(0, 2**32 - 1),
        stop=st.lists(st.text(max_size=140), max_size=10),
        ignore_eos=st.booleans(),
    ),
    speculation=st.builds(
        pb.SpeculationParameters,
        mode=st.integers(0, 5),
        num_draft_tokens=st.integers(0, 2**32 - 1),
        adaptive=st.one_of(st.none(), st.booleans()),
        draft_context=st.integers(0, 4),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests)
def test_fuzzed_requests_never_get_internal(served, request) -> None:
    _, stub, _ = served
    assert call(stub, request) in VALIDATABLE


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(max_size=300))
def test_fuzzed_raw_bytes_never_get_internal(served, payload) -> None:
    _, _, channel = served
    raw = channel.unary_stream(
        "/kenspec.v1.Generator/Generate",
        request_serializer=lambda data: data,
        response_deserializer=lambda data: data,
    )
    try:
        for _ in raw(payload, timeout=60):
            pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    assert code in VALIDATABLE


def test_server_serves_after_fuzzing(served) -> None:
    still_serves(served[1])


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_load_with_cancellations_loses_nothing(served, tiny_target, wait_until_idle) -> None:
    server, stub, _ = served
    prompts = [f"prompt number {i} about foxes" for i in range(32)]
    solo = {p: reference_greedy(tiny_target, tiny_target.encode_prompt(p), 16) for p in prompts}
    gc.collect()
    before = resident_kib()

    def complete(prompt: str) -> list[int]:
        request = pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=16))
        return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

    def cancel_midway(index: int) -> int:
        request = pb.GenerateRequest(
            prompt=f"cancelled {index}",
            stopping=pb.StoppingCriteria(max_new_tokens=16),
            speculation=pb.SpeculationParameters(mode=pb.SPECULATION_MODE_OFF),
        )
        stream = stub.Generate(request, timeout=120)
        next(stream)
        stream.cancel()
        return 1

    with ThreadPoolExecutor(max_workers=48) as pool:
        completed = [pool.submit(complete, p) for p in prompts]
        cancelled = [pool.submit(cancel_midway, i) for i in range(100)]
        outputs = [future.result(timeout=300) for future in completed]
        assert sum(future.result(timeout=300) for future in cancelled) == 100
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == solo[prompt], prompt  # greedy: identical to its solo run
    server.run(wait_until_idle(server.server))  # cancelled streams' slots come free
    assert server.server.scheduler.active == 0 and server.server.scheduler.waiting == 0
    gc.collect()
    after = resident_kib()
    grown = after - before
    print(f"load: 32 streams + 100 cancellations; RSS {before} KiB before, {after} KiB after")
    assert grown < 64 * 1024, f"resident memory grew by {grown} KiB"
    still_serves(stub)


def test_target_failure_fails_only_that_request(served, monkeypatch) -> None:
    """A forward pass that raises (a kernel failure) fails its own request with a clear status;
    the slot and cache are freed and other requests go on."""
    server, stub, _ = served
    target = server.server.serving.runtime.engine.target
    poison = target.encode_prompt("zq#")[-1]  # every forward of a request starts with its
    assert poison != target.encode_prompt("Hello")[-1]  # pending token: the prompt's last one
    fail_passes_fed(monkeypatch, poison)
    request = pb.GenerateRequest(prompt="zq#", stopping=pb.StoppingCriteria(max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "request_id=" in error.value.details() and "simulated" not in error.value.details()
    assert server.server.scheduler.active == 0
    still_serves(stub)


def test_oom_is_resource_exhausted(served, monkeypatch) -> None:
    import torch

    from kenspec.server.engine.generation import Generation

    _, stub, _ = served

    def out_of_memory(self, proposal, row, emitted, path, logprobs=()):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(Generation, "accept", out_of_memory)
    request = pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=4))
    assert call(stub, request) == grpc.StatusCode.RESOURCE_EXHAUSTED
    monkeypatch.undo()
    still_serves(stub)
