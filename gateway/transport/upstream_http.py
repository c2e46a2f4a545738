"""One upstream call: the shared ``httpx.AsyncClient``, replica choice through ``AffinityRing``, retries
before the first byte (``gateway.transport.retry``), failures typed (``gateway.transport.failures``) and
redacted (``gateway.transport.redact``). Protocol-blind: the backends build bodies and read answers; SSE
parsing is ``gateway.transport.sse``'s.

Retry rule: a request is retried (on the replica the ring picks next, after exponential backoff with full
jitter) only while nothing of the upstream's response body has arrived: connection errors and resets,
timeouts, 5xx, and 429 (waiting ``Retry-After`` when given). Once the first body byte is read, the response
belongs to the
client: a later failure is an ``UpstreamStreamCut``, never a silent retry here that could duplicate output (a
backend asks again for a non-streamed request, whose client has seen nothing: ``UpstreamBackend.stream``).
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from gateway.core import json_decode
from gateway.transport.affinity import AffinityRing, Lease, NoReplicaAvailable
from gateway.transport.aiohttp_transport import AiohttpTransport, DirectResponse, as_httpx_response
from gateway.transport.failures import (
    FailureKind,
    UpstreamCallError,
    UpstreamStreamCut,
    error_from_status,
    is_replica_fault,
    status_for_error_event,
    transport_failure,
    upstream_request_id,
)
from gateway.transport.redact import redact, redact_json, redact_url
from gateway.transport.retry import RetryPolicy
from gateway.transport.routing_policy import RouteRequest, RoutingPolicy
from gateway.transport.sse import SSEEvent, iter_sse

_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error body we read
_DRAIN_LIMIT = 64 * 1024  # bytes read after a stream's terminal event to keep its connection
_DRAIN_TIMEOUT_S = 1.0  # seconds waited for the end of such a body

# ---- the shared client and one upstream call ---------------------------------------------------------------


def make_client(max_connections: int = 256, max_keepalive: int = 64) -> httpx.AsyncClient:
    """A client for upstream calls (connection pooling; timeouts are set per request), sending over aiohttp's
    pool (``gateway.transport.aiohttp_transport``: a third of httpcore's CPU per call, docs/overhead.md).
    Proxies from the environment still go through httpx's own proxy transports. ``max_keepalive`` bounds the
    idle connections kept where the transport has such a bound (aiohttp keeps any under ``max_connections``)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive)
    return UpstreamClient(limits=limits, transport=AiohttpTransport(limits))


_httpx_logger = logging.getLogger("httpx")


class UpstreamClient(httpx.AsyncClient):
    """The upstream ``httpx.AsyncClient``: redirects not followed, a cookie jar that keeps nothing
    (``NoCookies``), and a short ``send`` for what the backends send through it.

    ``httpx.AsyncClient.send`` runs every request through its auth flow and redirect loop (two async
    generators), event hooks, a response-stream wrapper that times the response, and cookie extraction
    (``http.cookiejar`` walks every response's headers). With no auth, no credentials in the URL, no event
    hooks, redirects off and a jar that keeps nothing, none of that changes a streamed request or its
    response, and it cost about as much CPU per call as the aiohttp transport under it (docs/overhead.md,
    session 6). So a streamed ``send`` on such a client hands the request to the URL's transport directly
    (``AsyncClient._transport_for_url``: a proxy from the environment still gets its own transport), as
    ``_send_single_request`` does: the timeout extension, the transport errors (with ``exc.request`` set),
    ``response.request`` and the httpx logger's INFO line are the same. What differs: ``response.elapsed``
    is not set (nothing reads it). Any other request (non-streamed, with auth, redirects, hooks, or after
    the client was closed) takes ``httpx.AsyncClient.send``.

    ``send_direct`` goes one step further for the backends' POSTs (``open_response``'s ``send_direct``): the
    header list httpx would build is made once per URL and headers, and a 2xx answer is read from aiohttp
    without an ``httpx.Response`` (``DirectResponse``), which left httpx's request building, its response
    model and its three nested body iterators off every upstream call (docs/overhead.md, session 7).

    Args:
        limits: the transport's and httpx's connection limits.
        transport: the transport for direct (non-proxied) requests.
    """

    def __init__(self, *, limits: httpx.Limits, transport: httpx.AsyncBaseTransport) -> None:
        super().__init__(
            limits=limits,
            follow_redirects=False,
            transport=transport,
            cookies=http.cookiejar.CookieJar(policy=NoCookies()),
        )
        self._direct_heads: dict[
            tuple[str, tuple[tuple[str, str], ...]], tuple[list[tuple[str, str]], int]
        ] = {}

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        """``httpx.AsyncClient.send``; a streamed request the client adds nothing to goes straight to its
        transport (class docstring).

        Raises:
            httpx.RequestError: the transport's (``exc.request`` set), as from ``AsyncClient.send``.
            RuntimeError: the client was closed.
        """
        if (
            not stream
            or auth is not httpx.USE_CLIENT_DEFAULT
            or follow_redirects not in (httpx.USE_CLIENT_DEFAULT, False)
            or not self._adds_nothing(request.url)
        ):
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        request.extensions.setdefault("timeout", self.timeout.as_dict())
        transport = self._transport_for_url(request.url)
        try:
            response = await transport.handle_async_request(request)
        except httpx.RequestError as exc:
            exc.request = request
            raise
        response.request = request
        response.default_encoding = self._default_encoding
        if _httpx_logger.isEnabledFor(logging.INFO):
            _httpx_logger.info(
                'HTTP Request: %s %s "%s %d %s"',
                request.method,
                request.url,
                response.http_version,
                response.status_code,
                response.reason_phrase,
            )
        return response

    def _adds_nothing(self, url: httpx.URL) -> bool:
        """Whether httpx's send layers would leave a request to ``url`` and its response as they are (open
        client, no auth, no credentials in the URL, no hooks, redirects off, the ``NoCookies`` jar)."""
        return not (
            self.is_closed
            or self.follow_redirects
            or self.auth is not None
            or url.userinfo
            or any(self.event_hooks.values())
            or not isinstance(self.cookies.jar._policy, NoCookies)  # noqa: SLF001 - set by __init__
        )

    async def send_direct(
        self, url: httpx.URL, headers: Mapping[str, str], content: bytes, timeout: dict[str, Any]
    ) -> DirectResponse | httpx.Response | None:
        """POST ``content`` to ``url`` straight over the aiohttp transport, without building httpx's request
        and response objects (docs/overhead.md, session 7); None, having sent nothing, when the request needs
        httpx's path: a client that adds something (``send``'s conditions) or a URL whose transport is not an
        ``AiohttpTransport`` (a proxy from the environment).

        The bytes on the wire are what ``build_request("POST", url, headers=headers, content=content)`` then
        ``send`` would send: the header list is that request's (made once per URL and headers, with its
        ``Content-Length`` set to this body's). A 2xx answer without ``Content-Encoding`` comes back as a
        ``DirectResponse``; any other as the ``httpx.Response`` the transport gives (httpx decodes bodies and
        reads errors as before), without ``request`` set.

        Raises:
            httpx.TransportError: the transport's (``exc.request`` not set).
        """
        if not self._adds_nothing(url):
            return None
        transport = self._transport_for_url(url)
        if not isinstance(transport, AiohttpTransport):
            return None
        key = (str(url), tuple(headers.items()))
        template = self._direct_heads.get(key)
        if template is None:
            # the request httpx would build (a one-byte body: Content-Length sits where a non-empty body's does)
            raw = self.build_request("POST", url, headers=dict(headers), content=b"-").headers.raw
            pairs = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw]
            length_at = next(i for i, (name, _) in enumerate(pairs) if name.lower() == "content-length")
            template = (pairs, length_at)
            if len(self._direct_heads) >= _DIRECT_HEADS:
                self._direct_heads.clear()
            self._direct_heads[key] = template
        pairs, length_at = template
        sent = pairs.copy()
        sent[length_at] = (sent[length_at][0], str(len(content)))
        response = await transport.open("POST", key[0], sent, content, timeout)
        if _httpx_logger.isEnabledFor(logging.INFO):
            _httpx_logger.info(
                'HTTP Request: %s %s "HTTP/%d.%d %d %s"',
                "POST",
                url,
                *(response.version or (1, 1)),
                response.status,
                response.reason or "",
            )
        if 200 <= response.status < 300 and "content-encoding" not in response.headers:
            return DirectResponse(response)
        return as_httpx_response(response)


DirectSend = Callable[[str, dict[str, Any]], Awaitable[DirectResponse | httpx.Response | None]]
"""``(replica base URL, timeout dict) -> response, or None`` (``open_response``'s ``send_direct``)."""

_DIRECT_HEADS = 1024  # header templates kept by ``UpstreamClient.send_direct`` (replicas x paths x keys)


class NoCookies(http.cookiejar.CookiePolicy):
    """A cookie policy that stores and sends nothing: the upstream client is shared by every client key and
    tenant, so a ``Set-Cookie`` an upstream answered one tenant with must never ride on another's request
    (httpx's default jar would keep it and send it on every later request to that host)."""

    netscape = True  # read by CookieJar.make_cookies / add_cookie_header
    rfc2965 = False
    hide_cookie2 = False

    def set_ok(self, cookie: http.cookiejar.Cookie, request: object) -> bool:
        """Never store a cookie."""
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: object) -> bool:
        """Never send a stored cookie."""
        return False

    def domain_return_ok(self, domain: str, request: object) -> bool:
        """No domain has cookies to send."""
        return False

    def path_return_ok(self, path: str, request: object) -> bool:
        """No path has cookies to send."""
        return False


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


def join_url(base_url: str, path: str) -> str:
    """``path`` appended to the path of ``base_url``, before its query string
    (``http://h/v1?api-version=1`` + ``/chat/completions`` -> ``http://h/v1/chat/completions?api-version=1``;
    concatenated, the path landed inside the query). ``urllib.parse.urlsplit``'s reading of the URL."""
    if "?" not in base_url and "#" not in base_url:
        return base_url + path  # the common case, unparsed
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


@dataclass
class Upstream:
    """One remote model endpoint: its replicas (the ring), credentials, timeouts and retry policy.

    Attributes:
        ring: replica choice; replica names are base URLs without a trailing slash.
        timeout: httpx timeout per attempt (``read`` = most seconds between two bytes, first byte included).
        policy: retries before the first byte.
        secrets: strings that must never leave the process (the resolved API key); redacted from every error.
        routing: the replica choice over ``ring`` (``gateway.transport.routing_policy``); None = the ring's own
            bounded-load walk from the prefix key. Its ``ring`` must be ``ring``.
    """

    ring: AffinityRing
    timeout: httpx.Timeout
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    secrets: tuple[str, ...] = ()
    routing: RoutingPolicy | None = None

    def __post_init__(self) -> None:
        if self.routing is not None and self.routing.ring is not self.ring:
            raise ValueError("the routing policy must wrap this upstream's ring")

    def acquire(self, key: str, blocks: tuple[int, ...] = ()) -> Lease:
        """A lease on the replica chosen for ``key`` (and the prompt's block hashes, for cache-aware routing).

        Raises:
            NoReplicaAvailable: no replica can be tried.
        """
        if self.routing is None:
            return self.ring.acquire(key)
        return self.routing.acquire(RouteRequest(key=key, blocks=blocks))  # type: ignore[return-value]


class OpenedResponse:
    """An upstream response whose status was OK and whose first body byte has arrived.

    Iterate ``lines()`` (or call ``read()``) once, then ``aclose()`` (always; it releases the replica lease).
    Failures while reading raise ``UpstreamStreamCut`` and mark the replica failed. A caller that saw the
    protocol's terminal event calls ``completed()`` first, so ``aclose`` reads the (empty) rest of the body and
    the connection goes back to the pool instead of being closed (a new TCP, and TLS, handshake per request).
    """

    def __init__(
        self,
        response: httpx.Response | DirectResponse,
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
        self._completed = False

    @property
    def replica(self) -> str:
        """The replica (base URL) that is answering."""
        return self.lease.replica

    @property
    def request_id(self) -> str | None:
        """The id the upstream gave this answer (``x-request-id``, OpenAI's and vLLM's; ``request-id``,
        Anthropic's), at most ``REQUEST_ID_CHARS`` characters, or None when it sent none."""
        return upstream_request_id(self.response.headers)

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
            replica_failed(self.upstream, self.lease)
            kind = FailureKind.TIMEOUT if isinstance(exc, httpx.TimeoutException) else FailureKind.CONNECTION
            raise UpstreamStreamCut(
                502,
                FailureKind.STREAM_CUT,
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
            UpstreamStreamCut: kind ``protocol``, "the upstream sent {what} that is not JSON" (or not an
                object).
        """
        try:
            value = json_decode.loads(text)
        except ValueError:
            raise self.cut(f"the upstream sent {what} that is not JSON", kind=FailureKind.PROTOCOL) from None
        if not isinstance(value, dict):
            raise self.cut(f"the upstream sent {what} that is not a JSON object", kind=FailureKind.PROTOCOL)
        return value

    def cut(
        self,
        message: str,
        kind: FailureKind = FailureKind.STREAM_CUT,
        upstream_error: dict[str, Any] | None = None,
    ) -> UpstreamStreamCut:
        """An ``UpstreamStreamCut`` for a protocol-level failure seen by the caller (e.g. EOF before the
        terminal event); marks the replica failed unless the upstream itself reported an error event."""
        if upstream_error is None:
            replica_failed(self.upstream, self.lease)
        return UpstreamStreamCut(
            502 if upstream_error is None else status_for_error_event(upstream_error),
            kind,
            redact(message, self.upstream.secrets),
            upstream_status=self.response.status_code,
            upstream_error=redact_json(upstream_error, self.upstream.secrets) if upstream_error else None,
            upstream_request_id=self.request_id,  # the answer's id: the error event came in it
        )

    def completed(self) -> None:
        """Note that the protocol's terminal event arrived (``[DONE]``, ``message_stop``): what follows is the end
        of the body, which ``aclose`` then reads to keep the connection."""
        self._completed = True

    async def aclose(self) -> None:
        """Close the upstream response (cancels the upstream's work) and release the lease. Idempotent.

        After ``completed()``, first reads the rest of the body (at most 64 KiB, 1 s), so the connection is
        kept alive; a stream closed early (a client that left) is cut, which stops the upstream's work."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._completed and not self.response.is_closed:
                if isinstance(self.response, DirectResponse) and self.response.at_eof():
                    await self._chunks.aclose()  # nothing left to read: no timer, no read
                else:
                    await self._drain()
            await self.response.aclose()
        finally:
            self.lease.release()

    async def _drain(self) -> None:
        read = 0
        try:
            async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                async for chunk in self._chunks:
                    read += len(chunk)
                    if read > _DRAIN_LIMIT:
                        return
        except (httpx.RequestError, TimeoutError):  # the connection is closed by aclose then
            pass


async def open_response(
    client: httpx.AsyncClient,
    upstream: Upstream,
    key: str,
    build_request: Callable[[str], httpx.Request],
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    blocks: tuple[int, ...] = (),
    send_direct: DirectSend | None = None,
) -> OpenedResponse:
    """Send a request to the replica the ring picks for ``key`` and wait for the first body byte, retrying
    (per ``upstream.policy``) on timeouts, connection errors, 5xx and 429.

    Args:
        client: the shared client.
        upstream: replicas, timeouts, policy, secrets.
        key: the prefix key (affinity).
        build_request: makes the ``httpx.Request`` for a replica's base URL (called once per attempt).
        sleep: the backoff sleep (injectable for tests).
        blocks: chained block hashes of the prompt (``routing_policy.text_block_hashes``), for cache-aware
            routing; empty otherwise.
        send_direct: sends the request for a replica's base URL without httpx's request and response objects
            (``UpstreamClient.send_direct`` with the body and headers ``build_request`` would use); it returns
            None, having sent nothing, when the request must take ``build_request`` and ``client.send``.

    Returns:
        an ``OpenedResponse`` holding the replica lease (close it).

    Raises:
        UpstreamCallError: a non-retryable answer (4xx other than 408/429), or the last failure once retries
            are exhausted; its message is redacted.
    """
    attempt = 0
    waited = 0.0  # seconds spent on Retry-After so far (the policy's max_retry_after_s bounds it)
    while True:
        try:
            lease = upstream.acquire(key, blocks)
        except NoReplicaAvailable as exc:
            raise UpstreamCallError(503, FailureKind.NO_REPLICA, str(exc), attempts=attempt) from None
        error = await _attempt(client, upstream, lease, build_request, attempt + 1, send_direct)
        if isinstance(error, OpenedResponse):
            if (prefill_done := getattr(lease, "prefill_done", None)) is not None:
                prefill_done()  # cache-aware: the prefill is no longer pending
            return error
        if is_replica_fault(error):
            replica_failed(upstream, lease)
        lease.release()
        asked = error.retry_after_s
        too_long = asked is not None and waited + asked > upstream.policy.max_retry_after_s
        if not error.retryable or attempt >= upstream.policy.retries or too_long:
            raise error
        delay = upstream.policy.delay(attempt, asked)
        if asked is not None:
            waited += delay
        await sleep(delay)
        attempt += 1


def replica_failed(upstream: Upstream, lease: Lease) -> None:
    """``lease``'s replica failed its request (before or after the first byte): a failure on the ring, and a
    cache-aware route's blocks taken back (``PendingLease.not_served``: a dead replica has none of them)."""
    upstream.ring.report_failure(lease.replica)
    not_served = getattr(lease, "not_served", None)
    if not_served is not None:
        not_served()


async def _attempt(
    client: httpx.AsyncClient,
    upstream: Upstream,
    lease: Lease,
    build_request: Callable[[str], httpx.Request],
    attempts: int,
    send_direct: DirectSend | None = None,
) -> OpenedResponse | UpstreamCallError:
    """One attempt: an ``OpenedResponse`` on success, else the error (the lease is still held by the
    caller)."""
    secrets = upstream.secrets
    where = "(a replica whose URL cannot be parsed)"  # never the raw URL: it may hold user:password@
    response: httpx.Response | DirectResponse | None = None
    try:
        where = redact_url(lease.replica)
        timeout = upstream.timeout.as_dict()
        if send_direct is not None:
            response = await send_direct(lease.replica, timeout)
        if response is None:
            request = build_request(lease.replica)
            request.extensions["timeout"] = timeout
            response = await client.send(request, stream=True)
        if 300 <= response.status_code < 400:  # redirects are not followed: a misconfigured base_url
            location = response.headers.get("location", "")
            await response.aclose()
            upstream.ring.report_success(lease.replica)  # the replica answered; the URL is what is wrong
            return UpstreamCallError(
                502,
                FailureKind.PROTOCOL,
                redact(
                    f"upstream {where} answered {response.status_code} (Location: {location}); check "
                    "base_url",
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
            return error_from_status(response, body, lease.replica, secrets, attempts)
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
                FailureKind.SERVER_ERROR,
                f"upstream {where} sent an empty body",
                attempts=attempts,
                upstream_status=response.status_code,
            )
        upstream.ring.report_success(lease.replica)
        return OpenedResponse(response, chunks, first, lease, upstream)
    except (httpx.RequestError, httpx.InvalidURL) as exc:  # transport, decoding, bad URL
        await _close_quietly(response)
        status, kind, message = transport_failure(exc, where)
        return UpstreamCallError(status, kind, redact(message, secrets), attempts=attempts)
    except BaseException:
        await _close_quietly(response)
        lease.release()
        raise


async def _read_limited(response: httpx.Response | DirectResponse) -> bytes:
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) >= _ERROR_BODY_LIMIT:
                break
    except httpx.RequestError:  # transport or decoding: report what arrived
        pass
    return body[:_ERROR_BODY_LIMIT]


async def _close_quietly(response: httpx.Response | DirectResponse | None) -> None:
    if response is not None:
        try:
            await response.aclose()
        except Exception:  # noqa: BLE001 - closing a broken response must not mask the original error
            pass
