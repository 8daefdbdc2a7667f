"""Which request tracing the server runs: off (the default), or OpenTelemetry with `--otel`.

`build_tracing` loads `server.otel` (which needs the `otel` extra) only when tracing is on;
what both kinds offer the APIs is `server.request_spans`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kenspec.server.request_spans import NO_TRACING, Tracing, TracingUnavailable


def build_tracing(
    enabled: bool, service_name: str, model: str, environ: Mapping[str, str] | None = None
) -> Tracing:
    """NO_TRACING unless `enabled`; else spans exported as the standard OTEL_* variables say
    (OTLP to OTEL_EXPORTER_OTLP_ENDPOINT by default). TracingUnavailable (a ValueError, so a
    clear start-up error) when the packages are missing."""
    if not enabled:
        return NO_TRACING
    try:
        from kenspec.server import otel
    except ImportError as error:
        if not (error.name or "").startswith("opentelemetry"):
            raise
        raise TracingUnavailable(error.name or "opentelemetry") from None
    environ = os.environ if environ is None else environ
    name = service_name or environ.get("OTEL_SERVICE_NAME") or "kenspec"
    return otel.OtelTracing(otel.tracer_provider(name, environ), model)
