"""Real processes on loopback for the deploy tests: kenspec replicas (`kenspec serve`) and
Debian's nginx with the repository's `deploy/nginx.conf`, rewritten only for the addresses.

Nothing here polls: nginx is ready when it logs that it starts its workers (after binding its
port).
"""

from __future__ import annotations

import queue
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches
UPSTREAM_HEADER = "x-kenspec-upstream"  # the replica nginx chose, added to the test's config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LogLines:
    """A process's output, read on a thread of its own (a full pipe would block the process),
    waited on line by line."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> str:
        """The next line that contains `text`."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout} s: {self.lines}") from None
            if line is None:
                raise AssertionError(f"the process exited before {text!r}: {self.lines}")
            self.lines.append(line)
            if text in line:
                return line


def require(binary: str) -> str:
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    assert path, f"{binary} is not installed; .ci/run installs it (apt-get install {binary})"
    return path


def substitute(pattern: str, replacement: str, text: str, count: int = 1) -> str:
    """re.sub that insists on exactly `count` matches: the repo's config must still say it."""
    result, found = re.subn(pattern, replacement, text)
    assert found == count, f"{pattern!r} matched {found} times in the config, not {count}"
    return result


@pytest.fixture(scope="module")
def replicas(tiny_server):
    """Two replicas: (process, metrics port) each."""
    metrics = [free_port(), free_port()]
    processes = [tiny_server("--metrics-port", str(port), "--port", "0") for port in metrics]
    yield list(zip(processes, metrics, strict=True))
    for process in processes:
        process.stop()


def loopback_config(servers, directory: Path, port: int, http_port: int) -> str:
    """deploy/nginx.conf with the servers' loopback addresses on its server lines (each pool
    lists them all), listening on `port` (gRPC) and `http_port`, logging notices, and naming
    the replica that served each call in an UPSTREAM_HEADER response header."""
    upstreams = "".join(f"server 127.0.0.1:{s.port};\n        " for s in servers)
    http_upstreams = "".join(f"server 127.0.0.1:{s.http_port};\n        " for s in servers)
    config = (REPO / "deploy" / "nginx.conf").read_text()
    config = substitute(r"server kenspec:50051;\n\s*", upstreams, config, count=2)
    config = substitute(r"server kenspec:8000;\n\s*", http_upstreams, config, count=2)
    config = substitute(r"listen \d+ http2;", f"listen 127.0.0.1:{port} http2;", config)
    config = substitute(r"listen 8000;", f"listen 127.0.0.1:{http_port};", config)
    config = config.replace("/tmp/kenspec-nginx", str(directory / "nginx"))
    # Notices (nginx logs when it starts its workers, after binding), and which replica served.
    config = substitute(r"error_log \S+ \w+;", "error_log stderr notice;", config)
    header = f"add_header {UPSTREAM_HEADER} $upstream_addr;"
    config = substitute(r"(grpc_pass [^;]+;)", rf"\1\n            {header}", config)
    return substitute(r"(proxy_pass [^;]+;)", rf"\1\n            {header}", config)


@contextmanager
def running_nginx(servers, directory: Path) -> Iterator[tuple[int, int]]:
    """A real nginx with loopback_config in front of `servers` (anything with .port and
    .http_port, in the order of their server lines): (gRPC port, HTTP port) once it listens."""
    port = free_port()
    http_port = free_port()
    (directory / "nginx.conf").write_text(loopback_config(servers, directory, port, http_port))
    process = subprocess.Popen(
        [
            require("nginx"),
            "-c",
            str(directory / "nginx.conf"),
            "-p",
            str(directory),
            "-g",
            "daemon off;",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        LogLines(process.stderr).wait_for("start worker process")
        yield port, http_port
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def nginx(replicas, tmp_path_factory) -> Iterator[tuple[int, int]]:
    """A real nginx in front of `replicas`: (gRPC port, HTTP port)."""
    with running_nginx([p for p, _ in replicas], tmp_path_factory.mktemp("nginx")) as ports:
        yield ports
