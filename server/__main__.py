"""`kenspec serve`: serve until SIGTERM/SIGINT, then drain in-flight streams and exit 0."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from kenspec.server import default_model
from kenspec.server.engine.arpa import DraftFormatError
from kenspec.server.engine.target import TargetLoadError
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.logs import configure_logging
from kenspec.server.settings import DEFAULT_MODEL, Settings, parse_settings

log = structlog.get_logger("kenspec")


async def serve(settings: Settings) -> int:
    server = KenspecServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await server.start()
    except BaseException:
        # Whatever did start (gRPC, HTTP) stops while the loop runs: left to the garbage
        # collector, gRPC's server schedules its shutdown on a closed loop (a traceback).
        await server.stop(0)
        raise
    loading = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        await server.stop(0)
        error = loading.exception()
        log.error("load_failed", error=str(error))
        return 1
    await stopping
    if not loading.done():
        loading.cancel()
    await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    configure_logging(settings.server.log_format, settings.server.log_level)
    # The engine thread runs Python between torch kernels and waits for the GIL whenever the
    # event loop holds it; with Python's default 5 ms switch interval that wait stalls a whole
    # batch (see docs/design.md, "Threads").
    sys.setswitchinterval(0.0005)
    try:
        if settings.model.model == str(DEFAULT_MODEL):
            # The first `kenspec serve` after `pip install`: fetch the default target once.
            if not DEFAULT_MODEL.exists():
                log.info("fetching_default_model", dest=str(DEFAULT_MODEL))
            default_model.ensure(DEFAULT_MODEL)
        return asyncio.run(serve(settings))
    except (TargetLoadError, DraftFormatError, ValueError, OSError) as error:
        log.error("startup_failed", error=str(error))
        return 1


if __name__ == "__main__":
    sys.exit(main())
