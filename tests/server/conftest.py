"""An in-process kenspec server on an ephemeral port, over the tiny model and a test ARPA draft,
and what the service tests share: requests, reading a stream, a gate on the target's passes and
a wait for every stream slot to come free.

No verdict here waits for time to pass: where a test needs a stream that cannot finish (a
deadline, a full queue, a cancellation mid-stream), its passes wait at the gate until the test
lets them through, so the machine's speed cannot change the outcome. TIMEOUT only bounds a wait
that a passing run never reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine.target import TargetModel
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.runtime import Runtime, load_runtime
from kenspec.server.settings import Settings

TIMEOUT = 60.0  # seconds; a bound on waits that a passing run never reaches


def serve_loaded(runtime: Runtime | None, gate: threading.Event | None = None) -> Callable:
    """A KenspecServer loader that hands over `runtime`, already loaded (once `gate` is set,
    when given). It takes the loader's arguments, (settings) or (settings, events), and
    ignores them: the runtime reports to whatever it was loaded with."""

    def loader(settings: Settings, events: object = None) -> Runtime | None:
        if gate is not None:
            gate.wait()
        return runtime

    return loader


@pytest.fixture(scope="session", name="serve_loaded")
def serve_loaded_fixture() -> Callable:
    """serve_loaded(runtime, gate=None) -> a loader for KenspecServer (see serve_loaded)."""
    return serve_loaded


@pytest.fixture(scope="session")
def base_settings(tiny_model_dir: Path, tiny_draft_path: Path) -> Settings:
    return Settings.of(
        model=str(tiny_model_dir),
        draft=str(tiny_draft_path),
        device="cpu",
        dtype="float32",
        grpc_port=0,
        metrics_port=-1,
        port=-1,
        breaker_threshold=0.0,
        live_costs=False,  # drafts priced by the start-up table alone: verified here
        min_draft_prob=0.0,
        max_new_tokens_limit=400,
        default_max_new_tokens=32,
        grace_period_s=5.0,
        calibration_cache="none",
    )


@pytest.fixture(scope="session")
def runtime(base_settings: Settings) -> Runtime:
    return load_runtime(base_settings)


class Servers:
    """KenspecServers a test starts, each started and loaded, all stopped when it ends."""

    def __init__(self) -> None:
        self._started: list[KenspecServer] = []

    async def start(self, settings: Settings, loader: Callable | None = None) -> KenspecServer:
        """A started, loaded server (`loader`: e.g. serve_loaded(runtime); None: its own)."""
        server = KenspecServer(settings) if loader is None else KenspecServer(settings, loader)
        self._started.append(server)
        await server.start()
        await server.load()
        return server

    async def stop_all(self) -> None:
        for server in self._started:
            await server.stop(0)


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    """Servers.start(settings, loader=None) -> a started, loaded server, stopped afterwards."""
    started = Servers()
    yield started
    await started.stop_all()


@pytest.fixture
async def start_server(base_settings, runtime) -> AsyncIterator[Callable]:
    """start_server(**setting_overrides) -> (server, stub); every server is stopped afterwards."""
    servers: list[KenspecServer] = []
    channels: list[grpc.aio.Channel] = []

    async def start(load: bool = True, **overrides) -> tuple[KenspecServer, pb_grpc.GeneratorStub]:
        server = KenspecServer(base_settings.replace(**overrides), loader=serve_loaded(runtime))
        servers.append(server)
        await server.start()
        if load:
            await server.load()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        return server, pb_grpc.GeneratorStub(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (at most TIMEOUT) for `condition`, checked every 10 ms; else fail naming `what`."""
    for _ in range(int(TIMEOUT / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def _collect(call, timeout: float = TIMEOUT) -> list[pb.GenerateResponse]:
    async def read():
        return [response async for response in call]

    return await asyncio.wait_for(read(), timeout)


@pytest.fixture(scope="session")
def collect() -> Callable:
    """await collect(call) -> every response of a streaming call (its error raised)."""
    return _collect


def _prompt_request(prompt: str = "The quick brown fox", **stopping) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(**stopping))


@pytest.fixture(scope="session")
def prompt_request() -> Callable[..., pb.GenerateRequest]:
    """prompt_request(prompt="The quick brown fox", **stopping) -> a GenerateRequest."""
    return _prompt_request


async def _wait_until_idle(server: KenspecServer, timeout: float = TIMEOUT) -> None:
    """Return once no stream holds a slot of `server`: take every slot (queueing for it as a
    request would, so this waits on the scheduler itself), then give them all back."""
    scheduler = server.scheduler
    async with contextlib.AsyncExitStack() as held:
        for _ in range(scheduler.max_active):
            slot = await asyncio.wait_for(scheduler.acquire(), timeout)
            await held.enter_async_context(slot)


@pytest.fixture(scope="session")
def wait_until_idle() -> Callable:
    """await wait_until_idle(server): every stream slot of the server is free again."""
    return _wait_until_idle


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward pass the batch asked of the target: a row of tokens per stream in it."""

    rows: list[list[int]]
    prompt_tails: list[int]  # per row, the prompt tokens prefilled in the pass before its own


class PassGate:
    """Holds TargetModel.forward (on the engine thread) until the test lets each pass through,
    and records every pass that reaches it, in order."""

    def __init__(self, forward: Callable) -> None:
        self._forward = forward
        self._condition = threading.Condition()
        self._allowed = 0  # passes that may go through, from the first
        self.arrived: list[Pass] = []

    def through(self, target: TargetModel, cache, verify):  # type: ignore[no-untyped-def]
        tails = [len(row.prompt_tail) for row in verify.rows]
        with self._condition:
            index = len(self.arrived)
            self.arrived.append(Pass([row.tokens for row in verify.rows], tails))
            self._condition.notify_all()
            if not self._condition.wait_for(lambda: index < self._allowed, 5 * TIMEOUT):
                raise RuntimeError("a pass was held at the gate and never let through")
        return self._forward(target, cache, verify)

    def allow(self, passes: int = 1) -> None:
        """Let `passes` more passes through."""
        with self._condition:
            self._allowed += passes
            self._condition.notify_all()

    def open(self) -> None:
        """Let every pass through from now on."""
        self.allow(1 << 40)

    async def arrival(self, count: int) -> Pass:
        """The count-th pass (from 1), once it has reached the gate."""

        def wait() -> Pass:
            with self._condition:
                reached = self._condition.wait_for(lambda: len(self.arrived) >= count, TIMEOUT)
                assert reached, f"pass {count} never reached the gate ({len(self.arrived)} did)"
                return self.arrived[count - 1]

        return await asyncio.to_thread(wait)


@pytest.fixture
def held_passes(start_server, monkeypatch) -> Iterator[PassGate]:
    """Every forward pass of the target waits at a gate until the test lets it through. The gate
    opens at teardown, before the servers stop (so it asks for start_server)."""
    gate = PassGate(TargetModel.forward)

    def forward(target, *args, **options):  # type: ignore[no-untyped-def]
        return gate.through(target, *args, **options)

    monkeypatch.setattr(TargetModel, "forward", forward)
    yield gate
    gate.open()


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(subject, issuer, key, signer, *, ca: bool, dns: str | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


def _write(directory: Path, name: str, certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 'localhost', a client certificate, and a stranger's."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("kenspec test CA", "kenspec test CA", ca_key, ca_key, ca=True)
    ca_path, _ = _write(directory, "ca", ca, ca_key)
    files = {"ca": ca_path}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(name, "kenspec test CA", key, ca_key, ca=False, dns="localhost")
        files[f"{name}_cert"], files[f"{name}_key"] = _write(directory, name, cert, key)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _certificate("stranger", "stranger", other_key, other_key, ca=False)
    files["stranger_cert"], files["stranger_key"] = _write(directory, "stranger", other, other_key)
    return files
