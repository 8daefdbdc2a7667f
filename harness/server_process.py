"""A `kenspec serve` process for benchmarks and end-to-end tests, read through its JSON log."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def server_command(args: Sequence[str]) -> list[str]:
    """`kenspec serve` on a free port, JSON logs, no metrics port and no HTTP API (unless
    `args` set them), pass costs measured at start-up (not read from a cache an earlier run
    left), then `args`."""
    return [
        sys.executable,
        "-m",
        "kenspec.server",
        "--grpc-port",
        "0",
        "--log-format",
        "json",
        "--metrics-port",
        "-1",
        "--port",
        "-1",
        "--calibration-cache",
        "none",
        *args,
    ]


class ServerProcess:
    """`kenspec serve` on a free port, read through its JSON log events; ready on return."""

    def __init__(self, args: Sequence[str], timeout: float = 600) -> None:
        self.process = subprocess.Popen(
            server_command(args), cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        self.events: list[dict] = []
        self._seen = 0  # events before this index were already looked at by wait_for
        self._arrived = threading.Condition()  # notified on each event and when the log ends
        self._other: deque[str] = deque(maxlen=5)  # the last lines that were not JSON events
        self._ended = False
        # The log is read all the time, not only while waiting: a full stderr pipe would block
        # the server mid-round (it logs from the engine thread) and a sweep would measure that.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.port = int(self.wait_for("listening", timeout)["address"].rsplit(":", 1)[1])
        self.wait_for("ready", timeout)
        http = [e for e in self.events if e.get("event") == "http_listening"]
        # the OpenAI-compatible API's port, when --port turned it on
        self.http_port = int(http[0]["address"].rsplit(":", 1)[1]) if http else None

    def _drain(self) -> None:
        """Collect JSON log events; other output (KenLM's progress bars) is skipped."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self._other.append(line.rstrip())  # e.g. an argparse error before logging
                continue
            if isinstance(record, dict):
                with self._arrived:
                    self.events.append(record)
                    self._arrived.notify_all()
        with self._arrived:
            self._ended = True
            self._arrived.notify_all()

    def wait_for(self, event: str, timeout: float = 120) -> dict:
        """The next log event named `event` (after those earlier calls returned)."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                while self._seen < len(self.events):
                    record = self.events[self._seen]
                    self._seen += 1
                    if record.get("event") == event:
                        return record
                if self._ended:
                    last = self.events[-5:] or list(self._other)
                    raise RuntimeError(f"server exited before {event!r}: {last}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {event!r} from the server within {timeout} s")
                self._arrived.wait(left)

    def logged(self, event: str) -> dict | None:
        """The first log event named `event` received so far (e.g. "calibrated"), or None."""
        with self._arrived:
            return next((e for e in self.events if e.get("event") == event), None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
