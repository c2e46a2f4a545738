"""An ``httpx`` transport that sends requests over an ``aiohttp`` connection pool: the upstream calls keep the
``httpx.AsyncClient`` API (requests, responses, cookies, proxies from the environment, the typed
``httpx`` errors that ``gateway.transport.failures`` classifies, respx in the tests), while the HTTP/1.1
work per request is aiohttp's (C parser, asyncio-native streams) instead of httpcore's pure-Python h11 over
anyio.

Why: profiled under ``bench.overhead``, the upstream call was the largest part of the gateway's CPU per
request, and most of it was httpcore's pool and anyio's stream layers (a ``select`` poll and an anyio
attribute dictionary per idle pooled connection on every request, a cancel scope per read and write). The
same streamed POST costs about a third of the CPU through this transport (docs/overhead.md has the numbers).

What the upstream sees is what httpx builds: the request's headers are sent as they are (aiohttp adds none),
its body as bytes (or chunked from an async stream). The answer's body is handed to httpx undecoded (httpx
decodes ``Content-Encoding`` itself), chunk by chunk as it arrives.

The shared upstream client also sends without httpx's request and response objects
(``gateway.transport.upstream_http.UpstreamClient.send_direct``): ``AiohttpTransport.open`` takes the header
list httpx would build and returns aiohttp's response, and a 2xx answer without ``Content-Encoding`` is read
through ``DirectResponse`` (the rest becomes the ``httpx.Response`` of ``as_httpx_response``, as here).

A POST whose body is bytes (every upstream call of the chat path) takes a leaner route through aiohttp
(``AiohttpTransport._exchange``): the session's connector and the connection's ``ResponseHandler`` directly,
without ``ClientSession._request``, ``ClientRequest`` and ``ClientResponse``, which cost about as much again
per call (docs/overhead.md, session 10). It keeps aiohttp's pool, TLS, timeouts, parser and errors, writes the
head aiohttp's serializer makes from the multidict ``ClientRequest`` would build, and reads with the
session's response parameters; anything ``ClientRequest`` would treat specially takes the session's path.

Invariants:
- the lean route and ``ClientSession.request`` put the same bytes on the wire, give the same answer and raise
  the same errors (the tests run every case through both);
- every aiohttp failure comes out as the ``httpx`` error httpcore gives for the same event (``ERRORS``):
  connect failures ``ConnectError``, connect timeouts ``ConnectTimeout``, a silence longer than the read
  timeout ``ReadTimeout``, a server that closes or garbles the answer ``RemoteProtocolError``, a reset
  ``ReadError``, an unusable URL ``UnsupportedProtocol``, a header value that cannot be sent
  ``LocalProtocolError`` (whose text never quotes the value: it may be the API key);
- a response read to its end gives its connection back to the pool; one closed before its end closes the
  connection (which is what stops the upstream's work);
- a request whose body can be sent again (bytes, or none) and that fails on a reused keep-alive connection
  before any byte of the answer (the server closed or reset it: ``ServerDisconnectedError``,
  ``ClientOSError``, a transport already closing) is sent again on another connection, up to
  ``STALE_RESENDS`` times, whatever its method; a failure on a new connection, a timeout or a malformed
  answer is never sent again here (that is the caller's retry policy, which also marks the replica down).
  An idle connection the server is closing is the keep-alive race of RFC 9112 section 9.3.1 (both sides'
  idle limits are often 5 s: uvicorn's ``timeout_keep_alive``, httpx's ``keepalive_expiry``): the request
  never reached the server's application, so sending it again is what the RFC's "some means to detect that
  the original request was never applied" allows, and it is not the replica's failure;
- timeouts come from the request's ``timeout`` extension (httpx's ``Timeout``): ``connect`` bounds the TCP
  and TLS set-up, ``read`` the wait for each chunk (the first byte included), ``pool`` + ``connect`` the
  wait for a free connection and its set-up together (aiohttp has one bound for both); there is no write
  timeout (aiohttp has none; a body is written to the socket buffer).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
from aiohttp import hdrs
from aiohttp.client_reqrep import ClientRequest, RequestInfo
from aiohttp.helpers import TimerNoop
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

try:  # aiohttp's own head serializer (C when built): the lean path's head is byte for byte the session's
    from aiohttp.http_writer import _serialize_headers
except ImportError:  # pragma: no cover - another aiohttp version: every request takes ClientSession's path
    _serialize_headers = None

__all__ = ["ERRORS", "STALE_RESENDS", "AiohttpTransport"]

ERRORS: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ClientConnectorError, httpx.ConnectError),  # refused, DNS, TLS handshake and certificate
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),  # a body cut short or badly chunked
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),  # a status line or header aiohttp cannot parse
    (aiohttp.InvalidURL, httpx.UnsupportedProtocol),
    (aiohttp.ClientOSError, httpx.ReadError),  # reset, broken pipe
    (aiohttp.ClientConnectionError, httpx.ConnectError),
    (aiohttp.ClientError, httpx.RemoteProtocolError),
    (OSError, httpx.ReadError),
)
"""aiohttp (and OS) error class -> the httpx error raised for it; the first entry that matches wins."""

_MAX_HEADER_BYTES = 100 * 1024  # httpcore's limit on a response's status line and headers (h11 event size)
_MAX_HEADERS = 1000
_MAX_URLS = 256  # parsed URLs (and timeouts) kept; a handful in practice
_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""The headers aiohttp would add when a request has none of them: httpx already set what it sends."""
STALE_RESENDS = 4
"""Most times one request is sent again after a reused keep-alive connection failed before its answer began.
Each resend takes another pooled connection (the failed one is closed) or a new one, and a new connection's
failure is final, so the bound only matters when the pool holds several connections the server closed at
once."""
_STALE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""What a keep-alive connection the server closed or reset gives when a request is written to it (checked with
``_stale``: a connect failure is a ``ClientOSError`` too, and never a stale connection)."""


class _ClosingConnectionError(aiohttp.ClientConnectionError):
    """The lean path's "transport already closing" failure (``ClientRequest``'s text and class for the
    caller), told apart so that a reused connection in that state is replaced."""


def _stale(exc: BaseException) -> bool:
    """Whether ``exc``, raised before any byte of the answer, is what a closed or reset keep-alive connection
    gives (``_STALE_ERRORS``, the lean path's closing transport, or an OS reset or broken pipe before
    aiohttp wrapped it), not a connect failure or a timeout."""
    if isinstance(exc, aiohttp.ClientConnectorError | asyncio.TimeoutError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # else the part of an answer's head that came before the close
    return isinstance(exc, (*_STALE_ERRORS, _ClosingConnectionError, ConnectionResetError, BrokenPipeError))


async def _note_reuse(session: Any, context: Any, params: Any) -> None:
    """aiohttp trace hook (``on_connection_reuseconn``): mark the request's context as sent on a pooled
    connection (the session path's way to know what the lean path reads off ``_carried``)."""
    marks = context.trace_request_ctx
    if isinstance(marks, dict):
        marks["reused"] = True


_REUSE_TRACE = aiohttp.TraceConfig()
_REUSE_TRACE.on_connection_reuseconn.append(_note_reuse)
_REUSE_TRACE.freeze()


_LEAN_DECLINES = (hdrs.TRANSFER_ENCODING, hdrs.EXPECT, hdrs.CONTENT_ENCODING)
"""Request headers that make ``ClientRequest`` do more than send the head and body as they are (chunking,
100-continue, compression): a request holding one takes ``ClientSession``'s path."""


def httpx_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx error for an aiohttp (or OS) error ``exc``, or None when it is neither (``ERRORS``)."""
    for source, target in ERRORS:
        if isinstance(exc, source):
            return target(_message(exc))
    return None


def _message(exc: BaseException) -> str:
    """``exc``'s text; a plain connect failure as ``Cannot connect to host H:P: <reason>``, without the
    ``ssl:default`` aiohttp appends even to an ``http://`` URL (TLS errors keep theirs); a body cut short as
    ``the response body ended before its end (<aiohttp's reason>)``, without the parser's internal code (a
    trial read ``<TransferEncodingError: 400, ...>`` as a 400 from the replica)."""
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(exc, aiohttp.ClientSSLError):
        reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
        return f"Cannot connect to host {exc.host}:{exc.port}: {reason}"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientPayloadError) and "not completed" in text:
        reason = _PARSER_REASON.search(text)
        return (
            f"the response body ended before its end ({reason.group(1) if reason else 'connection closed'})"
        )
    return text


_PARSER_REASON = re.compile(r"message='([^']*)'")
"""The reason inside aiohttp's ``<TransferEncodingError: 400, message='...'>`` (``ClientPayloadError``'s text)."""


async def _body_chunks(
    response: aiohttp.ClientResponse | LeanResponse, at_end: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[bytes]:
    """``response``'s body chunks as they arrive, read failures raised as ``ERRORS`` maps them (any other
    exception as it is); ``at_end`` awaited once the body was read to its end. The one reader of both
    ``_ResponseStream`` and ``DirectResponse``, returned by them as it is (no generator layer in between).

    Raises:
        httpx.TransportError: a read failure, as ``ERRORS`` maps it.
    """
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    except Exception as exc:  # noqa: BLE001 - mapped to httpx's errors, the rest re-raised as it is
        mapped = httpx_error(exc)
        if mapped is None:
            raise
        raise mapped from exc
    if at_end is not None:
        await at_end()


class _ResponseStream(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx reads it: chunks as they arrive; closing releases the connection
    to the pool when the body was read to its end, else closes it."""

    def __init__(self, response: aiohttp.ClientResponse | LeanResponse) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _body_chunks(self._response)

    async def aclose(self) -> None:
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()


def as_httpx_response(response: aiohttp.ClientResponse | LeanResponse) -> httpx.Response:
    """aiohttp's ``response`` (status and headers arrived) as the ``httpx.Response`` httpcore would give: its
    body streams undecoded (httpx decodes ``Content-Encoding``); closing it releases or closes the connection
    (``_ResponseStream``)."""
    return httpx.Response(
        response.status,
        headers=[(name, value) for name, value in response.raw_headers],
        stream=_ResponseStream(response),
        extensions={
            "http_version": b"HTTP/%d.%d" % (response.version.major, response.version.minor)
            if response.version
            else b"HTTP/1.1",
            "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
        },
    )


class LeanResponse:
    """The parts of ``aiohttp.ClientResponse`` this module reads (``status``, ``reason``, ``version``,
    ``headers``, ``raw_headers``, ``content``, ``release``, ``close``), for a request sent by
    ``AiohttpTransport``'s lean path: made from the message and payload aiohttp's ``ResponseHandler`` parsed,
    as ``ClientResponse.start`` does. The connection goes back to the pool when the body has been read to its
    end (``ClientResponse``'s end-of-payload callback does the same); ``close`` before that closes it.

    Args:
        connection: the aiohttp connection the request went out on (released or closed here, once).
        message: the parsed status line and headers (``RawResponseMessage``).
        payload: the body's ``StreamReader``.
    """

    __slots__ = ("_connection", "content", "headers", "raw_headers", "reason", "status", "version")

    def __init__(self, connection: Any, message: Any, payload: aiohttp.StreamReader) -> None:
        self._connection = connection
        self.status: int = message.code
        self.reason: str | None = message.reason
        self.version = message.version
        self.headers: CIMultiDictProxy[str] = message.headers
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = message.raw_headers
        self.content = payload
        payload.on_eof(self.release)

    def release(self) -> None:
        """Give the connection back (aiohttp closes it instead when the body was not read to its end or the
        server asked to close). Idempotent."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.release()

    def close(self) -> None:
        """Close the connection (the upstream sees the request abandoned). Idempotent."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class DirectResponse:
    """An upstream response read straight from aiohttp, with the parts of ``httpx.Response`` the upstream
    call reads (``status_code``, ``headers.get``, ``is_closed``, ``aiter_bytes``, ``aclose``): what
    ``UpstreamClient.send_direct`` returns for a 2xx answer without a ``Content-Encoding`` (any other answer is
    given to httpx, ``as_httpx_response``). The body comes as aiohttp hands it; read failures are raised as
    ``ERRORS`` maps them; a body read to its end releases its connection to the pool, and ``aclose`` before the
    end closes it (as ``_ResponseStream`` does).

    Args:
        response: aiohttp's response (or the lean path's), status and headers arrived.
    """

    def __init__(self, response: aiohttp.ClientResponse | LeanResponse) -> None:
        self._response = response
        self.status_code: int = response.status
        self.is_closed = False

    @property
    def headers(self) -> Any:
        """The response headers (aiohttp's case-insensitive multidict: ``.get(name, default)``)."""
        return self._response.headers

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; closes the response at the end of the body (as httpx's ``aiter_raw``
        does).

        Raises:
            httpx.TransportError: a read failure, as ``ERRORS`` maps it.
        """
        return _body_chunks(self._response, at_end=self.aclose)

    def at_eof(self) -> bool:
        """Whether the whole body has arrived and been read (nothing is left to drain)."""
        return self._response.content.at_eof()

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end, else close it. Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()


def _lean_head(
    method: str, url: URL, headers: list[tuple[str, str]], length: int
) -> tuple[bytes, CIMultiDict[str]] | None:
    """The request head ``ClientRequest`` would write for ``method url`` with ``headers`` and a body of
    ``length`` bytes (``ClientSession._prepare_headers`` then ``ClientRequest.update_headers``, step for step:
    Host first, then the headers in order, a Host among them replacing it in place; nothing added, every
    automatic header being present or skipped), with the multidict it was serialized from; None when the
    lean path would differ from ``ClientRequest``'s: a URL without a host or with credentials, no
    ``Content-Length`` of ``length``, or a header in ``_LEAN_DECLINES``.

    Raises:
        ValueError: a header or the request line holds a control character (aiohttp's serializer refuses it).
    """
    host = url.host_port_subcomponent
    if not url.raw_host or host is None or url.raw_user or url.raw_password:
        return None
    prepared: CIMultiDict[str] = CIMultiDict()  # ClientSession._prepare_headers (no default headers)
    added: set[str] = set()
    for name, value in CIMultiDict(headers).items():
        if name in added:
            prepared.add(name, value)
        else:
            prepared[name] = value
            added.add(name)
    multi: CIMultiDict[str] = CIMultiDict()  # ClientRequest.update_headers
    multi[hdrs.HOST] = host
    for name, value in prepared.items():
        if name in hdrs.HOST_ALL:
            multi[name] = value
        else:
            multi.add(name, value)
    if multi.get(hdrs.CONTENT_LENGTH) != str(length) or any(name in multi for name in _LEAN_DECLINES):
        return None
    assert _serialize_headers is not None
    return _serialize_headers(f"{method} {url.raw_path_qs} HTTP/1.1", multi), multi


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (made on the first request, inside the
    running event loop).

    Args:
        limits: most connections open at once (``max_connections``; None = aiohttp's unbounded) and how
            long an idle one is kept (``keepalive_expiry``, seconds). aiohttp keeps every idle connection
            under the total limit: there is no separate bound on idle ones (``max_keepalive_connections``).
        verify: an ``ssl.SSLContext``, or True for httpx's default one (certifi's roots), or False (no
            verification).
    """

    def __init__(self, limits: httpx.Limits | None = None, verify: ssl.SSLContext | bool = True) -> None:
        limits = limits or httpx.Limits()
        self._limit = limits.max_connections or 0
        self._keepalive_s = limits.keepalive_expiry
        if isinstance(verify, ssl.SSLContext):
            self._ssl: ssl.SSLContext | bool = verify
        else:
            self._ssl = httpx.create_ssl_context(verify=verify) if verify else False
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        self._connect_requests: dict[URL, ClientRequest] = {}
        self._timeouts: dict[tuple[float | None, ...], aiohttp.ClientTimeout] = {}
        self._carried: weakref.WeakSet[Any] = weakref.WeakSet()
        """The lean path's connections (their protocols) that have carried an answer: one of them taken from
        the pool again is a reused keep-alive connection."""

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._limit, keepalive_timeout=self._keepalive_s, ssl=self._ssl
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx keeps the cookies
                auto_decompress=False,  # httpx decodes Content-Encoding
                timeout=aiohttp.ClientTimeout(total=None),
                max_line_size=_MAX_HEADER_BYTES,
                max_field_size=_MAX_HEADER_BYTES,
                max_headers=_MAX_HEADERS,
                requote_redirect_url=False,
                trace_configs=[_REUSE_TRACE],
            )
        return self._session

    lean: bool = True
    """Whether a POST with a bytes body goes over the lean path (``_exchange``); False sends every request
    through ``ClientSession.request`` (the tests run both and compare them)."""

    async def open(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Any, timeout: dict[str, Any]
    ) -> aiohttp.ClientResponse | LeanResponse:
        """Send a request as it is (``headers`` in order, none added) and return aiohttp's response once its
        status and headers arrived (the body streams; release or close it).

        A POST whose body is bytes (every upstream call of the chat path) skips ``ClientSession._request``,
        ``ClientRequest`` and ``ClientResponse`` (``_exchange``): the connection still comes from the session's
        connector (pool, TLS, connect timeouts), the head is what ``ClientRequest`` would write (aiohttp's own
        serializer over the same multidict), and the answer is parsed by the connection's ``ResponseHandler``
        with the session's settings (read timeout, limits), so the bytes, the pooling and the errors are the
        same; about half of aiohttp's CPU per call goes (docs/overhead.md, session 10).

        On both paths, a request with a bytes body (or none) that fails on a reused keep-alive connection
        before its answer began is sent again on another connection (``STALE_RESENDS``; the module's
        invariants say why that is safe).

        Args:
            method: the HTTP method.
            url: the absolute URL, already encoded (as ``str(httpx.URL)`` gives it).
            headers: (name, value) pairs, sent in this order.
            body: bytes, or an async iterable of bytes (sent chunked).
            timeout: httpx's ``Timeout.as_dict()`` (``connect``, ``read``, ``pool`` seconds or None).

        Raises:
            httpx.TransportError: the failure, as ``ERRORS`` maps it.
        """
        connect, read, pool = timeout.get("connect"), timeout.get("read"), timeout.get("pool")
        try:
            if self.lean and method == "POST" and type(body) is bytes and _serialize_headers is not None:
                yurl = self._yarl(url)
                session = self._open()
                head = _lean_head(method, yurl, headers, len(body))
                if head is not None and session.connector is not None:
                    return await self._exchange(session, yurl, head, body, self._timeout(connect, read, pool))
            resendable = body is None or isinstance(body, bytes | bytearray)
            for resend in range(STALE_RESENDS + 1):
                marks: dict[str, bool] = {}
                try:
                    return await self._open().request(
                        method,
                        self._yarl(url),
                        headers=headers,
                        skip_auto_headers=_SKIP_AUTO_HEADERS,
                        data=body,
                        allow_redirects=False,
                        compress=None,
                        chunked=None,
                        timeout=self._timeout(connect, read, pool),
                        trace_request_ctx=marks,
                    )
                except _STALE_ERRORS as exc:
                    if not (resendable and marks.get("reused") and resend < STALE_RESENDS and _stale(exc)):
                        raise
            raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover
        except ValueError as exc:
            if isinstance(exc, aiohttp.ClientError):
                raise httpx_error(exc) or httpx.RemoteProtocolError(str(exc)) from exc
            # aiohttp refuses a header value holding CR or LF before sending anything; never quote it
            raise httpx.LocalProtocolError("a request header could not be sent (illegal value)") from None
        except Exception as exc:  # noqa: BLE001 - mapped to httpx's errors, the rest re-raised as it is
            mapped = httpx_error(exc)
            if mapped is None:
                raise
            raise mapped from exc

    async def _exchange(
        self,
        session: aiohttp.ClientSession,
        url: URL,
        head: tuple[bytes, CIMultiDict[str]],
        body: bytes,
        timeout: aiohttp.ClientTimeout,
    ) -> LeanResponse:
        """``ClientSession._request``'s steps for one POST, without its request and response objects: a
        connection from the connector (``ClientRequest`` made once per URL, for its connection key), the
        response parameters the session sets, head and body in one write, the read timeout started, then
        the answer's head (1xx skipped as ``ClientResponse.start`` does). Errors are wrapped as those steps
        wrap them (``ConnectionTimeoutError``, ``ClientResponseError``, ``ClientOSError``); the connection is
        closed on any failure after it was taken. A connection that carried an answer before (``_carried``)
        and fails before this one's head (``_stale``) is replaced, up to ``STALE_RESENDS`` times.

        Raises:
            aiohttp.ClientError: as ``ClientSession.request`` raises it for the same event.
            OSError: as ``ClientSession.request`` lets it through.
        """
        connector = session.connector
        assert connector is not None
        template = self._connect_requests.get(url)
        if template is None:
            template = ClientRequest("POST", url, loop=asyncio.get_running_loop(), ssl=True)
            if len(self._connect_requests) >= _MAX_URLS:
                self._connect_requests.clear()
            self._connect_requests[url] = template
        data, headers = head
        for resend in range(STALE_RESENDS + 1):
            try:
                connection = await connector.connect(template, traces=[], timeout=timeout)
            except TimeoutError as exc:
                raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host {template.url}") from exc
            protocol = connection.protocol
            reused = protocol in self._carried
            try:
                transport = connection.transport
                assert protocol is not None
                protocol.set_response_params(
                    timer=TimerNoop(),
                    skip_payload=False,
                    read_until_eof=True,
                    auto_decompress=False,
                    read_timeout=timeout.sock_read,
                    read_bufsize=session._read_bufsize,  # the session's (its default, 256 KiB)
                    timeout_ceil_threshold=connector._timeout_ceil_threshold,
                    max_line_size=_MAX_HEADER_BYTES,
                    max_field_size=_MAX_HEADER_BYTES,
                    max_headers=_MAX_HEADERS,
                )
                if transport is None or transport.is_closing():
                    raise _ClosingConnectionError(
                        f"Failed to send bytes into the underlying connection {connection!s}: "
                        f"{aiohttp.ClientConnectionResetError('Cannot write to closing transport')!r}"
                    )
                transport.writelines((data, body))
                protocol.start_timeout()
                while True:
                    try:
                        message, payload = await protocol.read()
                    except HttpProcessingError as exc:
                        info = RequestInfo(url, "POST", CIMultiDictProxy(headers), url)
                        raise aiohttp.ClientResponseError(
                            info, (), status=exc.code, message=exc.message, headers=exc.headers
                        ) from exc
                    if message.code < 100 or message.code > 199 or message.code == 101:
                        self._carried.add(protocol)
                        return LeanResponse(connection, message, payload)
            except BaseException as exc:
                connection.close()
                if reused and resend < STALE_RESENDS and _stale(exc):
                    continue  # the keep-alive race: nothing of the answer came; another connection
                if isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError):
                    if exc.errno is None and isinstance(exc, asyncio.TimeoutError):
                        raise
                    raise aiohttp.ClientOSError(*exc.args) from exc
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _yarl(self, url: str) -> URL:
        """``url`` as an encoded ``yarl.URL``, parsed once per URL (a few replicas and paths; bounded)."""
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = URL(url, encoded=True)
            if len(self._urls) >= _MAX_URLS:
                self._urls.clear()
            self._urls[url] = parsed
        return parsed

    def _timeout(
        self, connect: float | None, read: float | None, pool: float | None
    ) -> aiohttp.ClientTimeout:
        """aiohttp's timeout for httpx's ``connect`` / ``read`` / ``pool`` (made once per triple)."""
        key = (connect, read, pool)
        found = self._timeouts.get(key)
        if found is None:
            found = aiohttp.ClientTimeout(
                total=None,
                connect=None if pool is None or connect is None else pool + connect,
                sock_connect=connect,
                sock_read=read,
            )
            if len(self._timeouts) >= _MAX_URLS:
                self._timeouts.clear()
            self._timeouts[key] = found
        return found

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and return its response once the status and headers arrived (the body streams).

        Raises:
            httpx.TransportError: the failure, as ``ERRORS`` maps it.
        """
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers.raw]
        body: Any = request.content if isinstance(request.stream, httpx.ByteStream) else request.stream
        response = await self.open(
            request.method, str(request.url), headers, body, request.extensions.get("timeout", {})
        )
        return as_httpx_response(response)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
