"""How an upstream call fails, as the gateway reports it: ``FailureKind`` (an Enum), ``UpstreamCallError``
(before the first byte; an ``APIError`` with the status the gateway answers) and ``UpstreamStreamCut`` (after
it), built from an upstream's status and error body, an in-stream error event, or a transport exception.
Invariant: every message is redacted (``gateway.transport.redact``) before it is stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import httpx

from gateway.core import errors
from gateway.transport.redact import redact, redact_json, redact_url
from gateway.transport.retry import retry_after_from


class FailureKind(StrEnum):
    """Why an upstream call failed (``UpstreamCallError.kind``); a ``StrEnum``, so it equals its value."""

    TIMEOUT = "timeout"
    """No answer, or no next byte, within the timeout (504)."""
    CONNECTION = "connection"
    """The connection could not be made or broke (502)."""
    SERVER_ERROR = "server_error"
    """The upstream answered 5xx, or an empty body (502)."""
    PROTOCOL = "protocol"
    """A redirect, a request that could not be sent, or an answer that cannot be read (502)."""
    STREAM_CUT = "stream_cut"
    """The stream broke after the first byte (retried only for a non-streamed request, ``retryable_cut``)."""
    RATE_LIMIT = "rate_limit"
    """The upstream answered 429."""
    OVERLOADED = "overloaded"
    """The upstream answered 503 or 529."""
    CLIENT_ERROR = "client_error"
    """The upstream refused the request (4xx, passed through)."""
    UPSTREAM_AUTH = "upstream_auth"
    """The upstream refused the gateway's own key (401/403 -> 502)."""
    UPSTREAM_NOT_FOUND = "upstream_not_found"
    """The upstream answered 404 (-> 502): the path (``base_url``) or the model name the gateway sent is not
    the upstream's; the client's request named neither."""
    NO_REPLICA = "no_replica"
    """Every replica is cooling down (503)."""


RETRYABLE = frozenset(
    {
        FailureKind.TIMEOUT,
        FailureKind.CONNECTION,
        FailureKind.SERVER_ERROR,
        FailureKind.RATE_LIMIT,
        FailureKind.OVERLOADED,
    }
)
"""Kinds worth another attempt before the first byte."""

REPLICA_FAULTS = frozenset(
    {FailureKind.TIMEOUT, FailureKind.CONNECTION, FailureKind.SERVER_ERROR, FailureKind.OVERLOADED}
)
"""Kinds that count against the replica (its cool-down in the ring)."""


_KIND_TYPES: dict[FailureKind, tuple[str, str | None]] = {
    # kind -> (OpenAI error.type, error.code) when the upstream sent no error object of its own
    FailureKind.TIMEOUT: ("server_error", "upstream_timeout"),
    FailureKind.CONNECTION: ("server_error", "upstream_error"),
    FailureKind.SERVER_ERROR: ("server_error", "upstream_error"),
    FailureKind.PROTOCOL: ("server_error", "upstream_error"),
    FailureKind.STREAM_CUT: ("server_error", "upstream_error"),
    FailureKind.RATE_LIMIT: ("rate_limit_error", "rate_limit_exceeded"),
    FailureKind.OVERLOADED: ("server_error", "overloaded"),
    FailureKind.CLIENT_ERROR: ("invalid_request_error", None),
    FailureKind.UPSTREAM_AUTH: ("server_error", "upstream_auth_failed"),
    FailureKind.UPSTREAM_NOT_FOUND: ("server_error", "upstream_not_found"),
    FailureKind.NO_REPLICA: ("server_error", "service_unavailable"),
}


class UpstreamCallError(errors.UpstreamError):
    """An upstream call that failed. An ``APIError``: the app's one error handler (or a face) turns it into
    OpenAI or Anthropic error JSON with ``status_code``.

    Attributes:
        status_code: the HTTP status the gateway answers with: upstream 4xx statuses pass through (408 ->
            504), except 401/403, which refuse the gateway's own key, and 404, a path or upstream model
            name of the gateway's config (502); 502 for connection errors,
            redirects, unreadable answers and other 5xx; 504 for timeouts and upstream 504; 429; 503 and 529
            pass through (overloaded); 503 when no replica is left.
        kind: a ``FailureKind``.
        message: human-readable, already redacted.
        error_type / code / param: OpenAI error fields; taken from the upstream's OpenAI-shaped error object
            when it sent one, else from ``kind``.
        upstream_status: the upstream's HTTP status, when it answered.
        upstream_error: the ``error`` object of the upstream's JSON error body (redacted), when it had one:
            OpenAI ``{"message","type","param","code"}`` or Anthropic ``{"type","message"}``.
        retry_after_s: the upstream's ``Retry-After`` in seconds, when sent.
        attempts: upstream attempts made.
        upstream_request_id: the upstream's id for its error answer (``upstream_request_id``), when it sent one.
    """

    def __init__(
        self,
        status: int,
        kind: FailureKind,
        message: str,
        *,
        upstream_status: int | None = None,
        upstream_error: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        attempts: int = 1,
        upstream_request_id: str | None = None,
    ) -> None:
        error_type, code = _KIND_TYPES.get(kind, ("server_error", "upstream_error"))
        param = None
        if upstream_error and kind == FailureKind.CLIENT_ERROR:
            # pass an OpenAI-shaped error through; an Anthropic ``type`` is not an OpenAI type
            if isinstance(upstream_error.get("param"), str):
                param = upstream_error["param"]
            if isinstance(upstream_error.get("code"), str):
                code = upstream_error["code"]
            if isinstance(upstream_error.get("type"), str) and upstream_error["type"] in _OPENAI_TYPES:
                error_type = upstream_error["type"]
        super().__init__(message, param=param, code=code)
        self.status_code = status
        self.error_type = error_type
        self.kind = kind
        self.anthropic_message = (
            anthropic_overflow_message(message) if kind == FailureKind.CLIENT_ERROR else None
        )
        """An OpenAI-compatible upstream's context overflow in the Messages API's words (the Anthropic face's
        clients parse them to retry with less), or None."""
        self.upstream_status = upstream_status
        self.upstream_error = upstream_error
        self.retry_after_s = retry_after_s
        self.attempts = attempts
        self.upstream_request_id = upstream_request_id

    @property
    def retryable(self) -> bool:
        """Worth another attempt before the first byte: timeouts, connection errors, 5xx, 429."""
        return self.kind in RETRYABLE


_OPENAI_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "insufficient_quota",
    "tokens",
    "requests",
}


class UpstreamStreamCut(UpstreamCallError):
    """The upstream failed after the first byte (reset, timeout, truncated stream, an in-stream error event).
    A streamed request's is never retried (the face ends the client's stream with an SSE error event); a
    non-streamed one's may be (``retryable_cut``, ``UpstreamBackend.stream``)."""


def retryable_cut(cut: UpstreamStreamCut) -> bool:
    """Whether a non-streamed request may be asked again after ``cut``: the stream broke off (a reset, a read
    timeout, an end before the protocol's terminal event), which counts against the replica. Not an error
    the upstream reported itself (``upstream_error``: its own answer to this request) nor an answer that could
    not be read (``protocol``: the same upstream would send it again)."""
    return cut.kind == FailureKind.STREAM_CUT and cut.upstream_error is None


def status_for_error_event(error: dict[str, Any]) -> int:
    """HTTP status matching an Anthropic in-stream error event's ``type``."""
    return {
        "overloaded_error": 529,
        "rate_limit_error": 429,
        "api_error": 502,
        "timeout_error": 504,
        "invalid_request_error": 400,
    }.get(str(error.get("type")), 502)


REQUEST_ID_CHARS = 200
"""Most characters of an upstream's request id kept (it goes into a log line and a response header)."""


def upstream_request_id(headers: Mapping[str, str]) -> str | None:
    """The upstream's id for its answer in ``headers`` (``x-request-id`` or ``request-id``), cut to
    ``REQUEST_ID_CHARS`` characters; None when there is none."""
    value = headers.get("x-request-id") or headers.get("request-id")
    return value[:REQUEST_ID_CHARS] if value else None


def error_from_status(
    response: httpx.Response, body: bytes, replica: str, secrets: tuple[str, ...], attempts: int
) -> UpstreamCallError:
    status = response.status_code
    upstream_error: dict[str, Any] | None = None
    detail = body[:2000].decode("utf-8", errors="replace")
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict):
            upstream_error = redact_json(err, secrets)
            detail = str(err.get("message", detail))
        elif isinstance(err, str):  # some OpenAI-compatible servers send {"error": "..."}
            detail = err
        elif isinstance(parsed.get("message"), str):
            detail = parsed["message"]
        elif isinstance(parsed.get("detail"), str):  # FastAPI-style servers
            detail = parsed["detail"]
    retry_after = retry_after_from(response.headers)
    where = redact_url(replica)
    if status == 429:
        status_out, kind = 429, FailureKind.RATE_LIMIT
    elif status in (503, 529):
        status_out, kind = status, FailureKind.OVERLOADED
    elif status in (504, 408):
        status_out, kind = 504, FailureKind.TIMEOUT
    elif status >= 500:
        status_out, kind = 502, FailureKind.SERVER_ERROR
    elif status in (401, 403):  # the gateway's own key was refused: not the client's fault
        status_out, kind = 502, FailureKind.UPSTREAM_AUTH
    elif status == 404:  # the gateway's path or upstream model name: a 404 would read as the client's model
        status_out, kind = 502, FailureKind.UPSTREAM_NOT_FOUND
    else:
        status_out, kind = status, FailureKind.CLIENT_ERROR
    if kind == FailureKind.UPSTREAM_AUTH:
        detail = f"the upstream refused the gateway's credentials ({detail}); check api_key in the config"
        upstream_error = None  # its authentication_error type would tell the client its own key is wrong
    elif kind == FailureKind.UPSTREAM_NOT_FOUND:
        detail = (
            f"{detail}; check the model's base_url (an OpenAI-compatible server's usually ends in /v1, "
            "Anthropic's does not) and upstream_model in the config"
        )
        upstream_error = None  # its not_found / model_not_found names what the gateway sent, not the client
    rid = upstream_request_id(response.headers)
    said = f" (its request id {rid})" if rid else ""  # for the operator's ticket with the provider
    message = f"upstream {where} answered {status}{said}: {detail}" if kind != "client_error" else detail
    return UpstreamCallError(
        status_out,
        kind,
        redact(message, secrets),
        upstream_status=status,
        upstream_error=upstream_error,
        retry_after_s=retry_after,
        attempts=attempts,
        upstream_request_id=rid,
    )


def is_replica_fault(error: UpstreamCallError) -> bool:
    """Whether ``error`` counts against the replica that answered (``REPLICA_FAULTS``)."""
    return error.kind in REPLICA_FAULTS


def transport_failure(exc: httpx.RequestError | httpx.InvalidURL, where: str) -> tuple[int, FailureKind, str]:
    """(status, kind, message) of an attempt that failed before an answer could be read: 504 ``timeout``;
    502 ``protocol`` when the request could not be sent (bad URL, invalid headers) or the body could not be
    decoded; else 502 ``connection``. The text of a header error is left out: it quotes the header's value,
    which may be the API key."""
    if isinstance(exc, httpx.TimeoutException):
        return 504, FailureKind.TIMEOUT, f"upstream {where} timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.InvalidURL):
        return (
            502,
            FailureKind.PROTOCOL,
            f"cannot call upstream {where}: the request could not be sent ({type(exc).__name__})",
        )
    if isinstance(exc, httpx.DecodingError):
        return (
            502,
            FailureKind.PROTOCOL,
            f"upstream {where} sent a body that cannot be decoded ({type(exc).__name__})",
        )
    return 502, FailureKind.CONNECTION, f"upstream {where} connection failed ({type(exc).__name__}: {exc})"


_OVERFLOW_PROMPT = re.compile(
    r"maximum context length is (\d+) tokens\. However, your messages resulted in (\d+) tokens"
)
_OVERFLOW_REQUESTED = re.compile(
    r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens \((\d+) in the messages, "
    r"(\d+) in the completion\)"
)


def overflow_counts(message: str) -> tuple[int, int] | None:
    """(prompt tokens, tokens over the limit) of an OpenAI-compatible server's context-overflow message (the
    wordings ``anthropic_overflow_message`` reads), or None for any other message."""
    found = _OVERFLOW_PROMPT.search(message)
    if found:
        limit, prompt = int(found.group(1)), int(found.group(2))
        return prompt, prompt + 1 - limit
    found = _OVERFLOW_REQUESTED.search(message)
    if found:
        limit, prompt, completion = (int(g) for g in found.groups())
        return prompt, prompt + completion - limit
    return None


def anthropic_overflow_message(message: str) -> str | None:
    """An OpenAI-compatible server's context-overflow message (OpenAI's and vLLM's wordings, as prefixgate's
    own OpenAI face words it too) in the Messages API's words, as ``errors.anthropic_context_message`` words
    the gateway's own: ``prompt is too long: N tokens > L maximum``, or ``input length and `max_tokens` exceed
    context limit: P + M > L, ...``; None for any other message. Found by a trial: through a front gateway over
    prefixgate replicas, the Anthropic face passed the chat wording on."""
    found = _OVERFLOW_PROMPT.search(message)
    if found:
        return f"prompt is too long: {found.group(2)} tokens > {found.group(1)} maximum"
    found = _OVERFLOW_REQUESTED.search(message)
    if found:
        limit, prompt, completion = found.groups()
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {completion} > {limit}, decrease "
            "input length or `max_tokens` and try again"
        )
    return None
