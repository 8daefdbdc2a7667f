"""OpenAI-shaped response bodies: whole completions, stream chunks (one per verification round),
usage with kenspec's speculation statistics, and error bodies.

Every response carries a ``kenspec`` object beside OpenAI's fields: per chunk the round's
``index``, ``drafted``, ``accepted`` and ``mode`` (and ``draft_source`` with the server's
--report-draft-source); with the usage the request's ``drafted``, ``accepted``, ``rounds``,
``speculative_rounds`` and the last round's ``mode``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kenspec_api.outputs import FinishReason, Mode
from server.engine.generation import Round

FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
}

# The error "type" OpenAI's clients read, by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    """{"error": {...}} as OpenAI's API sends it; its clients raise on it with the message."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(slots=True)
class Completion:
    """One request's rendering: chat (``chat.completion``) or text (``text_completion``)."""

    chat: bool
    request_id: str
    model: str
    created: int = 0
    speculative_rounds: int = 0
    report_source: bool = False  # each chunk's draft_source (--report-draft-source)

    def __post_init__(self) -> None:
        self.created = int(time.time())

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def chunk(self, round_: Round) -> dict[str, Any]:
        """The stream event of one round (chat: the first carries the assistant role)."""
        self.speculative_rounds += round_.mode == Mode.SPECULATIVE
        finish = FINISH_REASONS.get(round_.finish_reason) if round_.finish_reason else None
        if self.chat:
            delta = {"content": round_.text}
            if round_.index == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": round_.text, "logprobs": None, "finish_reason": finish}
        body = self._envelope(chunk=True, choices=[choice])
        body["kenspec"] = {
            "round": round_.index,
            "drafted": round_.drafted,
            "accepted": round_.accepted,
            "mode": round_.mode.value,
        }
        if self.report_source:
            body["kenspec"]["draft_source"] = round_.source
        return body

    def usage_chunk(self, last: Round) -> dict[str, Any]:
        """stream_options.include_usage: the last event, with no choices."""
        body = self._envelope(chunk=True, choices=[])
        body.update(self._usage(last))
        return body

    def whole(self, rounds: Sequence[Round]) -> dict[str, Any]:
        """The non-streamed response: every round's text joined."""
        self.speculative_rounds = sum(r.mode == Mode.SPECULATIVE for r in rounds)
        last = rounds[-1]
        text = "".join(r.text for r in rounds)
        finish = FINISH_REASONS.get(last.finish_reason) if last.finish_reason else None
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = self._envelope(chunk=False, choices=[choice])
        body.update(self._usage(last))
        return body

    def _envelope(self, *, chunk: bool, choices: list) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self, last: Round) -> dict[str, Any]:
        usage = last.usage
        if usage is None:  # only a finished round carries it
            return {"usage": None}
        return {
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
            "kenspec": {
                "drafted": usage.drafted_tokens,
                "accepted": usage.accepted_tokens,
                "acceptance": usage.acceptance,
                "rounds": usage.rounds,
                "speculative_rounds": self.speculative_rounds,
                "mode": last.mode.value,
                "seed": usage.seed,
            },
        }


def sse(body: object) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
