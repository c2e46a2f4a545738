"""HTTP plumbing shared by the remote backends: one ``httpx.AsyncClient``, retries before the first byte,
replica choice through ``AffinityRing``, and redaction of API keys in every error text (SSE parsing is
``gateway.transport.sse``'s).

Retry rule: a request is retried (on the replica the ring picks next, after exponential backoff with full
jitter) only while nothing of the upstream's response body has arrived: connection errors and resets, timeouts,
5xx, and 429 (waiting ``Retry-After`` when given). Once the first body byte is read, the response belongs to the
client: a later failure is an ``UpstreamStreamCut``, never a silent retry that could duplicate output.

Backoff ("full jitter", AWS Architecture Blog, "Exponential Backoff And Jitter", 2015)::

    delay(attempt) = uniform(0, min(backoff_max_s, backoff_base_s * 2 ** attempt))

raised to ``Retry-After`` (RFC 9110 section 10.2.3; seconds or an HTTP-date) when the upstream sent one, capped at
``max_retry_after_s``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.core import errors
from gateway.transport.affinity import AffinityRing, Lease, NoReplicaAvailable
from gateway.transport.sse import SSEEvent, iter_sse

REDACTED = "[REDACTED]"
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error body we read
_KEY_PATTERN = re.compile(
    r"sk-ant-[A-Za-z0-9_\-]{6,}"  # Anthropic keys
    r"|sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{12,}"  # OpenAI keys
    r"|(?i:bearer)\s+[A-Za-z0-9._\-~+/]{8,}=*"  # Authorization: Bearer <token>
    r"|(?i:(?:x-api-key|api[_-]?key|access[_-]?token)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;}&]{6,}"  # key=..., "api_key": "..."
)
_KEY_PREFIX = re.compile(r"(?i:(?:x-api-key|api[_-]?key|access[_-]?token)[\"']?\s*[:=]\s*[\"']?)")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and anything shaped like an API key replaced by ``[REDACTED]``.

    Known secrets (resolved ``api_key`` values) are removed verbatim; then OpenAI (``sk-...``), Anthropic
    (``sk-ant-...``) keys, ``Bearer`` tokens and ``api_key=...`` / ``"x-api-key": "..."`` values are masked.
    """
    for secret in secrets:
        if secret and len(secret) >= 4:
            # verbatim, stripped, and as repr() shows it inside an exception text (``\\n`` for a newline)
            for form in {secret, secret.strip(), repr(secret)[1:-1]}:
                if len(form) >= 4:
                    text = text.replace(form, REDACTED)

    def mask(match: re.Match[str]) -> str:
        prefix = _KEY_PREFIX.match(match.group(0))
        if prefix:
            return prefix.group(0) + REDACTED
        if match.group(0).lower().startswith("bearer"):
            return "Bearer " + REDACTED
        return REDACTED

    return _KEY_PATTERN.sub(mask, text)


def redact_url(url: str) -> str:
    """A URL without user-info or query string (names of replicas in stats and logs)."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(username=None, password=None, query=None, fragment=None))


# ---- errors -------------------------------------------------------------------------------------------


_KIND_TYPES = {
    # kind -> (OpenAI error.type, error.code) when the upstream sent no error object of its own
    "timeout": ("server_error", "upstream_timeout"),
    "connection": ("server_error", "upstream_error"),
    "server_error": ("server_error", "upstream_error"),
    "protocol": ("server_error", "upstream_error"),
    "stream_cut": ("server_error", "upstream_error"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "client_error": ("invalid_request_error", None),
    "upstream_auth": ("server_error", "upstream_auth_failed"),
    "no_replica": ("server_error", "service_unavailable"),
}


class UpstreamCallError(errors.UpstreamError):
    """An upstream call that failed. An ``APIError``: the app's one error handler (or a face) turns it into
    OpenAI or Anthropic error JSON with ``status_code``.

    Attributes:
        status_code: the HTTP status the gateway answers with: upstream 4xx statuses pass through (408 -> 504),
            except 401/403, which refuse the gateway's own key (502); 502 for connection errors, redirects,
            unreadable answers and other 5xx; 504 for timeouts and upstream 504; 429; 503 and 529 pass through
            (overloaded); 503 when no replica is left.
        kind: ``"timeout"``, ``"connection"``, ``"server_error"``, ``"rate_limit"``, ``"overloaded"``,
            ``"client_error"``, ``"upstream_auth"``, ``"stream_cut"``, ``"protocol"`` (a redirect, a request that
            could not be sent or an unreadable upstream answer) or ``"no_replica"``.
        message: human-readable, already redacted.
        error_type / code / param: OpenAI error fields; taken from the upstream's OpenAI-shaped error object when
            it sent one, else from ``kind``.
        upstream_status: the upstream's HTTP status, when it answered.
        upstream_error: the ``error`` object of the upstream's JSON error body (redacted), when it had one:
            OpenAI ``{"message","type","param","code"}`` or Anthropic ``{"type","message"}``.
        retry_after_s: the upstream's ``Retry-After`` in seconds, when sent.
        attempts: upstream attempts made.
    """

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        upstream_status: int | None = None,
        upstream_error: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        attempts: int = 1,
    ) -> None:
        error_type, code = _KIND_TYPES.get(kind, ("server_error", "upstream_error"))
        param = None
        if upstream_error and kind == "client_error":
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
        self.upstream_status = upstream_status
        self.upstream_error = upstream_error
        self.retry_after_s = retry_after_s
        self.attempts = attempts

    @property
    def retryable(self) -> bool:
        """Worth another attempt before the first byte: timeouts, connection errors, 5xx, 429."""
        return self.kind in {"timeout", "connection", "server_error", "rate_limit", "overloaded"}


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
    Never retried; the face ends the client's stream with an SSE error event."""


# ---- retry policy ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Retries before the first byte.

    Attributes:
        retries: extra attempts after the first (0 = no retry).
        backoff_base_s: first backoff ceiling, seconds.
        backoff_max_s: largest backoff ceiling, seconds.
        max_retry_after_s: longest ``Retry-After`` honoured; a longer one fails at once with the upstream's 429.
    """

    retries: int = 2
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 30.0

    def delay(
        self, attempt: int, retry_after_s: float | None = None, rng: Callable[[], float] = random.random
    ) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 0): full jitter, at least
        ``retry_after_s``."""
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        wait = rng() * ceiling
        if retry_after_s is not None:
            wait = max(wait, retry_after_s)
        return wait


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds (RFC 9110 10.2.3: delay-seconds or an HTTP-date); None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # "inf", "nan" or "1e400" is not a delay anyone can wait for
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


# ---- the shared client and one upstream call ----------------------------------------------------------------


def make_client(max_connections: int = 256, max_keepalive: int = 64) -> httpx.AsyncClient:
    """A client for upstream calls (connection pooling; timeouts are set per request)."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive),
        follow_redirects=False,
    )


class SharedClient:
    """The one ``httpx.AsyncClient`` all remote backends of a process share, reference-counted: the first
    ``acquire`` creates it, the last ``release`` closes it (backends call them from ``start`` / ``close``)."""

    _client: httpx.AsyncClient | None = None
    _users: int = 0

    @classmethod
    def acquire(cls) -> httpx.AsyncClient:
        """The shared client (created on first use)."""
        if cls._client is None or cls._client.is_closed:
            cls._client = make_client()
            cls._users = 0
        cls._users += 1
        return cls._client

    @classmethod
    async def release(cls) -> None:
        """Drop one user; close the client when none is left."""
        cls._users = max(cls._users - 1, 0)
        if cls._users == 0 and cls._client is not None:
            client, cls._client = cls._client, None
            await client.aclose()


@dataclass
class Upstream:
    """One remote model endpoint: its replicas (the ring), credentials, timeouts and retry policy.

    Attributes:
        ring: replica choice; replica names are base URLs without a trailing slash.
        timeout: httpx timeout per attempt (``read`` = most seconds between two bytes, first byte included).
        policy: retries before the first byte.
        secrets: strings that must never leave the process (the resolved API key); redacted from every error.
    """

    ring: AffinityRing
    timeout: httpx.Timeout
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    secrets: tuple[str, ...] = ()


class OpenedResponse:
    """An upstream response whose status was OK and whose first body byte has arrived.

    Iterate ``lines()`` (or call ``read()``) once, then ``aclose()`` (always; it releases the replica lease).
    Failures while reading raise ``UpstreamStreamCut`` and mark the replica failed.
    """

    def __init__(
        self,
        response: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
        lease: Lease,
        upstream: Upstream,
    ) -> None:
        self.response = response
        self.lease = lease
        self.upstream = upstream
        self._chunks = chunks
        self._first: bytes | None = first
        self._closed = False

    @property
    def replica(self) -> str:
        """The replica (base URL) that is answering."""
        return self.lease.replica

    @property
    def content_type(self) -> str:
        """The media type of the response, lower case, without parameters."""
        return self.response.headers.get("content-type", "").split(";")[0].strip().lower()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes, the first chunk included. Raises ``UpstreamStreamCut`` on a read failure."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for chunk in self._chunks:
                if chunk:
                    yield chunk
        except httpx.RequestError as exc:  # transport or decoding
            self.upstream.ring.report_failure(self.lease.replica)
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
            raise UpstreamStreamCut(
                502,
                "stream_cut",
                redact(
                    f"upstream stream from {redact_url(self.replica)} broke off ({kind}: {exc!r})",
                    self.upstream.secrets,
                ),
                upstream_status=self.response.status_code,
            ) from None

    def events(self) -> AsyncIterator[SSEEvent]:
        """The body's server-sent events (``gateway.sse.iter_sse``). Raises ``UpstreamStreamCut`` on a read
        failure."""
        return iter_sse(self.chunks())

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.chunks()])

    def json_object(self, text: str | bytes, what: str) -> dict[str, Any]:
        """``text`` (an event's data, a body) parsed as a JSON object.

        Raises:
            UpstreamStreamCut: kind ``protocol``, "the upstream sent {what} that is not JSON" (or not an object).
        """
        try:
            value = json.loads(text)
        except ValueError:
            raise self.cut(f"the upstream sent {what} that is not JSON", kind="protocol") from None
        if not isinstance(value, dict):
            raise self.cut(f"the upstream sent {what} that is not a JSON object", kind="protocol")
        return value

    def cut(
        self, message: str, kind: str = "stream_cut", upstream_error: dict[str, Any] | None = None
    ) -> UpstreamStreamCut:
        """An ``UpstreamStreamCut`` for a protocol-level failure seen by the caller (e.g. EOF before the terminal
        event); marks the replica failed unless the upstream itself reported an error event."""
        if upstream_error is None:
            self.upstream.ring.report_failure(self.lease.replica)
        return UpstreamStreamCut(
            502 if upstream_error is None else _status_for_error_event(upstream_error),
            kind,
            redact(message, self.upstream.secrets),
            upstream_status=self.response.status_code,
            upstream_error=_redact_json(upstream_error, self.upstream.secrets) if upstream_error else None,
        )

    async def aclose(self) -> None:
        """Close the upstream response (cancels the upstream's work) and release the lease. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            self.lease.release()


def _status_for_error_event(error: dict[str, Any]) -> int:
    """HTTP status matching an Anthropic in-stream error event's ``type``."""
    return {
        "overloaded_error": 529,
        "rate_limit_error": 429,
        "api_error": 502,
        "timeout_error": 504,
        "invalid_request_error": 400,
    }.get(str(error.get("type")), 502)


def _redact_json(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: _redact_json(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v, secrets) for v in value]
    return value


def _error_from_status(
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
            upstream_error = _redact_json(err, secrets)
            detail = str(err.get("message", detail))
        elif isinstance(err, str):  # some OpenAI-compatible servers send {"error": "..."}
            detail = err
        elif isinstance(parsed.get("message"), str):
            detail = parsed["message"]
        elif isinstance(parsed.get("detail"), str):  # FastAPI-style servers
            detail = parsed["detail"]
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    where = redact_url(replica)
    if status == 429:
        status_out, kind = 429, "rate_limit"
    elif status in (503, 529):
        status_out, kind = status, "overloaded"
    elif status in (504, 408):
        status_out, kind = 504, "timeout"
    elif status >= 500:
        status_out, kind = 502, "server_error"
    elif status in (401, 403):  # the gateway's own key was refused: not the client's fault
        status_out, kind = 502, "upstream_auth"
    else:
        status_out, kind = status, "client_error"
    if kind == "upstream_auth":
        detail = f"the upstream refused the gateway's credentials ({detail}); check api_key in the config"
        upstream_error = None  # its authentication_error type would tell the client its own key is wrong
    message = f"upstream {where} answered {status}: {detail}" if kind != "client_error" else detail
    return UpstreamCallError(
        status_out,
        kind,
        redact(message, secrets),
        upstream_status=status,
        upstream_error=upstream_error,
        retry_after_s=retry_after,
        attempts=attempts,
    )


def _is_replica_fault(error: UpstreamCallError) -> bool:
    return error.kind in {"timeout", "connection", "server_error", "overloaded"}


async def open_response(
    client: httpx.AsyncClient,
    upstream: Upstream,
    key: str,
    build_request: Callable[[str], httpx.Request],
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> OpenedResponse:
    """Send a request to the replica the ring picks for ``key`` and wait for the first body byte, retrying
    (per ``upstream.policy``) on timeouts, connection errors, 5xx and 429.

    Args:
        client: the shared client.
        upstream: replicas, timeouts, policy, secrets.
        key: the prefix key (affinity).
        build_request: makes the ``httpx.Request`` for a replica's base URL (called once per attempt).
        sleep: the backoff sleep (injectable for tests).

    Returns:
        an ``OpenedResponse`` holding the replica lease (close it).

    Raises:
        UpstreamCallError: a non-retryable answer (4xx other than 408/429), or the last failure once retries are
            exhausted; its message is redacted.
    """
    attempt = 0
    while True:
        try:
            lease = upstream.ring.acquire(key)
        except NoReplicaAvailable as exc:
            raise UpstreamCallError(503, "no_replica", str(exc), attempts=attempt) from None
        error = await _attempt(client, upstream, lease, build_request, attempt + 1)
        if isinstance(error, OpenedResponse):
            return error
        if _is_replica_fault(error):
            upstream.ring.report_failure(lease.replica)
        lease.release()
        too_long = error.retry_after_s is not None and error.retry_after_s > upstream.policy.max_retry_after_s
        if not error.retryable or attempt >= upstream.policy.retries or too_long:
            raise error
        await sleep(upstream.policy.delay(attempt, error.retry_after_s))
        attempt += 1


async def _attempt(
    client: httpx.AsyncClient,
    upstream: Upstream,
    lease: Lease,
    build_request: Callable[[str], httpx.Request],
    attempts: int,
) -> OpenedResponse | UpstreamCallError:
    """One attempt: an ``OpenedResponse`` on success, else the error (the lease is still held by the caller)."""
    secrets = upstream.secrets
    where = "(a replica whose URL cannot be parsed)"  # never the raw URL: it may hold user:password@
    response: httpx.Response | None = None
    try:
        where = redact_url(lease.replica)
        request = build_request(lease.replica)
        request.extensions["timeout"] = upstream.timeout.as_dict()
        response = await client.send(request, stream=True)
        if 300 <= response.status_code < 400:  # redirects are not followed: a misconfigured base_url
            location = response.headers.get("location", "")
            await response.aclose()
            upstream.ring.report_success(lease.replica)  # the replica answered; the URL is what is wrong
            return UpstreamCallError(
                502,
                "protocol",
                redact(
                    f"upstream {where} answered {response.status_code} (Location: {location}); check base_url",
                    secrets,
                ),
                attempts=attempts,
                upstream_status=response.status_code,
            )
        if response.status_code >= 400:
            body = await _read_limited(response)
            await response.aclose()
            if response.status_code < 500 and response.status_code != 408:
                upstream.ring.report_success(lease.replica)  # the replica works; the request was refused
            return _error_from_status(response, body, lease.replica, secrets, attempts)
        chunks = response.aiter_bytes()
        first = b""
        async for chunk in chunks:
            if chunk:
                first = chunk
                break
        if not first:
            await response.aclose()
            return UpstreamCallError(
                502,
                "server_error",
                f"upstream {where} sent an empty body",
                attempts=attempts,
                upstream_status=response.status_code,
            )
        upstream.ring.report_success(lease.replica)
        return OpenedResponse(response, chunks, first, lease, upstream)
    except (httpx.RequestError, httpx.InvalidURL) as exc:  # transport, decoding, bad URL
        await _close_quietly(response)
        status, kind, message = _transport_failure(exc, where)
        return UpstreamCallError(status, kind, redact(message, secrets), attempts=attempts)
    except BaseException:
        await _close_quietly(response)
        lease.release()
        raise


def _transport_failure(exc: httpx.RequestError | httpx.InvalidURL, where: str) -> tuple[int, str, str]:
    """(status, kind, message) of an attempt that failed before an answer could be read: 504 ``timeout``;
    502 ``protocol`` when the request could not be sent (bad URL, invalid headers) or the body could not be
    decoded; else 502 ``connection``. The text of a header error is left out: it quotes the header's value,
    which may be the API key."""
    if isinstance(exc, httpx.TimeoutException):
        return 504, "timeout", f"upstream {where} timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.InvalidURL):
        return (
            502,
            "protocol",
            f"cannot call upstream {where}: the request could not be sent ({type(exc).__name__})",
        )
    if isinstance(exc, httpx.DecodingError):
        return 502, "protocol", f"upstream {where} sent a body that cannot be decoded ({type(exc).__name__})"
    return 502, "connection", f"upstream {where} connection failed ({type(exc).__name__}: {exc})"


async def _read_limited(response: httpx.Response) -> bytes:
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) >= _ERROR_BODY_LIMIT:
                break
    except httpx.RequestError:  # transport or decoding: report what arrived
        pass
    return body[:_ERROR_BODY_LIMIT]


async def _close_quietly(response: httpx.Response | None) -> None:
    if response is not None:
        try:
            await response.aclose()
        except Exception:  # noqa: BLE001 - closing a broken response must not mask the original error
            pass
