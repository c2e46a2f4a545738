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

Invariants:
- every aiohttp failure comes out as the ``httpx`` error httpcore gives for the same event (``ERRORS``):
  connect failures ``ConnectError``, connect timeouts ``ConnectTimeout``, a silence longer than the read
  timeout ``ReadTimeout``, a server that closes or garbles the answer ``RemoteProtocolError``, a reset
  ``ReadError``, an unusable URL ``UnsupportedProtocol``, a header value that cannot be sent
  ``LocalProtocolError`` (whose text never quotes the value: it may be the API key);
- a response read to its end gives its connection back to the pool; one closed before its end closes the
  connection (which is what stops the upstream's work);
- timeouts come from the request's ``timeout`` extension (httpx's ``Timeout``): ``connect`` bounds the TCP
  and TLS set-up, ``read`` the wait for each chunk (the first byte included), ``pool`` + ``connect`` the
  wait for a free connection and its set-up together (aiohttp has one bound for both); there is no write
  timeout (aiohttp has none; a body is written to the socket buffer).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
from yarl import URL

__all__ = ["ERRORS", "AiohttpTransport"]

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


def httpx_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx error for an aiohttp (or OS) error ``exc``, or None when it is neither (``ERRORS``)."""
    for source, target in ERRORS:
        if isinstance(exc, source):
            return target(_message(exc))
    return None


def _message(exc: BaseException) -> str:
    """``exc``'s text; a plain connect failure as ``Cannot connect to host H:P: <reason>``, without the
    ``ssl:default`` aiohttp appends even to an ``http://`` URL (TLS errors keep theirs)."""
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(exc, aiohttp.ClientSSLError):
        reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
        return f"Cannot connect to host {exc.host}:{exc.port}: {reason}"
    return str(exc) or type(exc).__name__


async def _body_chunks(
    response: aiohttp.ClientResponse, at_end: Callable[[], Awaitable[None]] | None = None
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

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _body_chunks(self._response)

    async def aclose(self) -> None:
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()


def as_httpx_response(response: aiohttp.ClientResponse) -> httpx.Response:
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


class DirectResponse:
    """An upstream response read straight from aiohttp, with the parts of ``httpx.Response`` the upstream
    call reads (``status_code``, ``headers.get``, ``is_closed``, ``aiter_bytes``, ``aclose``): what
    ``UpstreamClient.send_direct`` returns for a 2xx answer without a ``Content-Encoding`` (any other answer is
    given to httpx, ``as_httpx_response``). The body comes as aiohttp hands it; read failures are raised as
    ``ERRORS`` maps them; a body read to its end releases its connection to the pool, and ``aclose`` before the
    end closes it (as ``_ResponseStream`` does).

    Args:
        response: aiohttp's response, status and headers arrived.
    """

    def __init__(self, response: aiohttp.ClientResponse) -> None:
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
        self._timeouts: dict[tuple[float | None, ...], aiohttp.ClientTimeout] = {}

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
            )
        return self._session

    async def open(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Any, timeout: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        """Send a request as it is (``headers`` in order, none added) and return aiohttp's response once its
        status and headers arrived (the body streams; release or close it).

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
            )
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
