"""OpenAI-shaped response bodies: whole completions, stream chunks (one per verification round),
usage with kenspec's speculation statistics, and error bodies.

Every response carries a ``kenspec`` object beside OpenAI's fields: per chunk the round's
``index``, ``drafted``, ``accepted`` and ``mode`` (and ``draft_source`` with the server's
--report-draft-source); with the usage the request's ``drafted``, ``accepted``, ``rounds``,
``speculative_rounds``, the last round's ``mode`` and the ``seed`` (with n > 1 every choice's,
in ``seeds``). Usage counts every choice's tokens, the prompt once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kenspec.api.outputs import FinishReason, Mode, TokenLogprob
from kenspec.server.engine.detokenizer import TokenTexts
from kenspec.server.engine.generation import Round
from kenspec.server.tool_calls.parser import ChoiceParsers

FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TOOL_CALLS: "tool_calls",
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
    """One request's rendering: chat (``chat.completion``) or text (``text_completion``), with
    n choices (each round says which) and, when asked, each token's logprobs (chat: OpenAI's
    ``logprobs.content``; completions: the legacy ``tokens``/``token_logprobs``/...)."""

    chat: bool
    request_id: str
    model: str
    created: int = 0
    speculative_rounds: int = 0
    report_source: bool = False  # each chunk's draft_source (--report-draft-source)
    texts: TokenTexts | None = None  # token texts, for logprobs
    # When the request lets the model call tools: each choice's output split into content and
    # tool_calls (server.tool_calls.parser).
    tool_calls: ChoiceParsers | None = None
    last: dict[int, Round] = field(default_factory=dict)  # each choice's latest round
    _offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset per choice

    def __post_init__(self) -> None:
        self.created = int(time.time())

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def chunk(self, round_: Round) -> dict[str, Any]:
        """The stream event of one round (chat: a choice's first carries the assistant role)."""
        self.speculative_rounds += round_.mode == Mode.SPECULATIVE
        self.last[round_.choice] = round_
        finish = FINISH_REASONS.get(round_.finish_reason) if round_.finish_reason else None
        logprobs = self._logprobs(round_.choice, round_.logprobs)
        choice: dict[str, Any] = {"index": round_.choice}
        if self.chat:
            delta: dict[str, Any] = {"content": round_.text}
            if self.tool_calls is not None:
                parsed, ended = self.tool_calls.round(
                    round_.choice, round_.text, round_.token_ids, round_.finish_reason
                )
                finish = FINISH_REASONS[ended] if ended else None
                delta = {"content": parsed.content or (None if parsed.calls else "")}
                if parsed.calls:
                    delta["tool_calls"] = [call.as_openai() for call in parsed.calls]
            if round_.index == 0:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = round_.text
        choice.update(logprobs=logprobs, finish_reason=finish)
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

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last event, with no choices."""
        body = self._envelope(chunk=True, choices=[])
        body.update(self._usage([self.last[index] for index in sorted(self.last)]))
        return body

    def whole(self, rounds: Sequence[Round]) -> dict[str, Any]:
        """The non-streamed response: each choice's rounds joined, choices by index."""
        self.speculative_rounds = sum(r.mode == Mode.SPECULATIVE for r in rounds)
        by_choice: dict[int, list[Round]] = {}
        for round_ in rounds:
            by_choice.setdefault(round_.choice, []).append(round_)
        choices, lasts = [], []
        for index in sorted(by_choice):
            own = by_choice[index]
            lasts.append(own[-1])
            text = "".join(r.text for r in own)
            finish = own[-1].finish_reason
            reason = FINISH_REASONS.get(finish) if finish else None
            choice: dict[str, Any] = {"index": index}
            if self.chat and self.tool_calls is not None:
                ids = [token for r in own for token in r.token_ids]
                content, calls, ended = self.tool_calls.whole(index, text, ids, finish)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["content"] = content.strip() or None
                    message["tool_calls"] = calls
                choice["message"] = message
                reason = FINISH_REASONS[ended] if ended else None
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if own[0].logprobs is None:
                logprobs = None
            else:
                logprobs = self._logprobs(index, [lp for r in own for lp in r.logprobs or ()])
            choice.update(logprobs=logprobs, finish_reason=reason)
            choices.append(choice)
        body = self._envelope(chunk=False, choices=choices)
        body.update(self._usage(lasts))
        return body

    def _logprobs(
        self, choice: int, logprobs: Sequence[TokenLogprob] | None
    ) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        texts = self.texts
        assert texts is not None  # given whenever a request may ask for logprobs (routes)
        if self.chat:
            return {"content": [_chat_logprob(texts, logprob) for logprob in logprobs]}
        tokens = [texts.text_of(logprob.token_id) for logprob in logprobs]
        offset = self._offsets.get(choice, 0)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[choice] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [logprob.logprob for logprob in logprobs],
            "top_logprobs": [
                {texts.text_of(token_id): value for token_id, value in logprob.top}
                for logprob in logprobs
            ],
            "text_offset": offsets,
        }

    def _envelope(self, *, chunk: bool, choices: list) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _usage(self, lasts: Sequence[Round]) -> dict[str, Any]:
        """Every choice's totals (one prompt); None until each choice's last round."""
        usages = [last.usage for last in lasts]
        if not usages or any(usage is None for usage in usages):
            return {"usage": None}
        done = [usage for usage in usages if usage is not None]
        prompt = done[0].prompt_tokens
        completion = sum(usage.completion_tokens for usage in done)
        drafted = sum(usage.drafted_tokens for usage in done)
        accepted = sum(usage.accepted_tokens for usage in done)
        stats: dict[str, Any] = {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "rounds": sum(usage.rounds for usage in done),
            "speculative_rounds": self.speculative_rounds,
            "mode": lasts[-1].mode.value,
            "seed": done[0].seed,
        }
        if len(done) > 1:
            stats["seeds"] = [usage.seed for usage in done]  # choice i's
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
            "kenspec": stats,
        }


def _chat_logprob(texts: TokenTexts, logprob: TokenLogprob) -> dict[str, Any]:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        raw = texts.bytes_of(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": value, "bytes": list(raw)}

    return {
        **entry(logprob.token_id, logprob.logprob),
        "top_logprobs": [entry(token_id, value) for token_id, value in logprob.top],
    }


def sse(body: object) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
