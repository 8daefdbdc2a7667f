"""A fleet on loopback for `bench.replicas`: `kenspec serve` replicas, a `redis-server` for
their shared answer stream, and nginx with the repository's `deploy/nginx.conf` in front.

Everything binds 127.0.0.1 on free ports and is ready when it says so in its log (nothing
polls): a replica when it logs `ready`, redis-server when it logs that it accepts connections,
nginx when it logs that it starts its workers (after binding its ports).
"""

from __future__ import annotations

import queue
import re
import shutil
import socket
import subprocess
import threading
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

from harness.server_process import REPO, ServerProcess

UPSTREAM_HEADER = "x-kenspec-upstream"  # the replica nginx chose, added to the bench's config
TIMEOUT = 60.0  # seconds; bounds the waits for redis-server and nginx to start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require(binary: str) -> str:
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin")
    if path is None:
        raise RuntimeError(f"{binary} is not installed (apt-get install {binary})")
    return path


class _Lines:
    """A process's output, read on a thread of its own (a full pipe would block the process)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> None:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no {text!r} within {timeout} s: {self.lines[-5:]}") from None
            if line is None:
                raise RuntimeError(f"the process exited before {text!r}: {self.lines[-5:]}")
            self.lines.append(line.rstrip())
            if text in line:
                return


class _Daemon:
    """A process started in the foreground, stdout and stderr read together."""

    def __init__(self, command: Sequence[str], ready: str) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            _Lines(self.process).wait_for(ready)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Redis(_Daemon):
    """A throwaway redis-server: loopback only, nothing saved to disk."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.port = free_port() if port is None else port  # a port: a restart in its place
        directory.mkdir(parents=True, exist_ok=True)
        command = [require("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
        super().__init__(command, "Ready to accept connections")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL, as an outage does it: no shutdown, no goodbye to the clients."""
        self.process.kill()
        self.process.wait()


def start_replicas(count: int, args: Sequence[str], timeout: float = 600) -> list[ServerProcess]:
    """`count` replicas, one after another: each measures its pass costs at start-up
    (`calibrated`), which replicas starting side by side would disturb for each other."""
    replicas: list[ServerProcess] = []
    try:
        for _ in range(count):
            replicas.append(ServerProcess(args, timeout))
    except BaseException:
        stop_all(replicas)
        raise
    return replicas


def start_together(arguments: Sequence[Sequence[str]], timeout: float = 600) -> list[ServerProcess]:
    """One replica per entry of `arguments`, all side by side (quicker; their start-up
    calibrations disturb each other)."""
    with ThreadPoolExecutor(max(len(arguments), 1)) as pool:
        starts = [pool.submit(ServerProcess, args, timeout) for args in arguments]
    failures = [error for start in starts if (error := start.exception()) is not None]
    if failures:
        stop_all([start.result() for start in starts if start.exception() is None])
        raise failures[0]
    return [start.result() for start in starts]


def stop_all(replicas: Sequence[ServerProcess]) -> None:
    """Stop them side by side: each drains and exits in its own time."""
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.terminate()
    for replica in replicas:
        replica.stop()


def replica_log(replica: ServerProcess) -> dict:
    """What a replica's log says about its run: its `calibrated` event, how many events of each
    name it logged, and its warnings and errors (the first 20)."""
    events = list(replica.events)
    troubles = [e for e in events if e.get("level") in ("warning", "error", "critical")]
    return {
        "address": replica.address,
        "calibrated": replica.logged("calibrated"),
        "event_counts": dict(Counter(str(e.get("event")) for e in events)),
        "warnings_and_errors": len(troubles),
        "first_warnings_and_errors": troubles[:20],
    }


def metrics(replica: ServerProcess, prefix: str = "kenspec_") -> dict[str, float]:
    """The replica's /metrics samples named `prefix`..., as `name{label="v",...}` -> value
    (the replica must have been started with --metrics-port 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    event = replica.logged("metrics")
    if event is None:
        raise ValueError("the replica serves no /metrics: start it with --metrics-port 0")
    port = event["address"].rsplit(":", 1)[1].split("/")[0]  # its host may be a wildcard
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _replace_all(pattern: str, replacement: str, text: str) -> str:
    """re.sub that insists on a match: the repository's config must still say it."""
    result, count = re.subn(pattern, replacement, text)
    if count == 0:
        raise ValueError(f"deploy/nginx.conf no longer matches {pattern!r}")
    return result


def nginx_config(
    template: str, grpc: Sequence[int], http: Sequence[int], ports: tuple[int, int], root: Path
) -> str:
    """deploy/nginx.conf for local replicas: every upstream's `kenspec:PORT` replaced by the
    replicas' ports, the public ports (8080 gRPC, 8000 HTTP) by `ports` on loopback, temp files
    under `root`, notices to stderr, and each gRPC answer naming the replica that served it."""
    grpc_servers = "".join(f"server 127.0.0.1:{port};\n        " for port in grpc)
    http_servers = "".join(f"server 127.0.0.1:{port};\n        " for port in http)
    config = _replace_all(r"server kenspec:50051;\n\s*", grpc_servers, template)
    config = _replace_all(r"server kenspec:8000;\n\s*", http_servers, config)
    config = _replace_all(r"listen 8080\b", f"listen 127.0.0.1:{ports[0]}", config)
    config = _replace_all(r"listen 8000\b", f"listen 127.0.0.1:{ports[1]}", config)
    config = config.replace("/tmp/kenspec-nginx", str(root / "nginx"))
    config = _replace_all(r"error_log \S+ \w+;", "error_log stderr notice;", config)
    header = f"add_header {UPSTREAM_HEADER} $upstream_addr;"
    return _replace_all(r"(grpc_pass [^;]+;)", rf"\1\n            {header}", config)


class Nginx(_Daemon):
    """nginx in the foreground with deploy/nginx.conf rewritten for `replicas` (each started
    with an HTTP port too, as the config balances both APIs)."""

    def __init__(self, replicas: Sequence[ServerProcess], root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port, self.http_port = free_port(), free_port()
        http = [replica.http_port for replica in replicas]
        if None in http:
            raise ValueError("nginx balances HTTP too: start the replicas with --port 0")
        template = (REPO / "deploy" / "nginx.conf").read_text()
        config = nginx_config(
            template,
            [replica.port for replica in replicas],
            [port for port in http if port is not None],
            (self.port, self.http_port),
            root,
        )
        (root / "nginx.conf").write_text(config)
        command = [require("nginx"), "-c", str(root / "nginx.conf"), "-p", str(root)]
        super().__init__([*command, "-g", "daemon off;"], "start worker process")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
