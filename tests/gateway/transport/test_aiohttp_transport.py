"""``AiohttpTransport`` against scripted HTTP/1.1 servers on real loopback sockets: the bytes on the wire are
httpx's, connections are kept or cut as httpcore's are, and every failure is the httpx error httpcore gives.

Every test runs twice: with the lean path for bytes POSTs (``AiohttpTransport.lean``, the default) and with every
request through ``ClientSession.request``; the tests at the end compare the two paths directly."""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import pytest

from gateway.transport import aiohttp_transport
from gateway.transport.aiohttp_transport import AiohttpTransport, DirectResponse
from gateway.transport.upstream_http import make_client


@pytest.fixture(autouse=True, params=[True, False], ids=["lean", "session"])
def lean(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(AiohttpTransport, "lean", request.param)
    return request.param


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 5\r\n\r\nhello"


class Server:
    """A loopback server running ``handler`` per connection; records request heads and counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request (head and Content-Length body); False at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        self.bodies.append(await reader.readexactly(length))
        return True


def _answer(*responses: bytes) -> Callable[[Server], Handler]:
    """A handler answering each request on a connection with the next of ``responses``."""

    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for response in responses:
                if not await server.read_request(reader):
                    return
                writer.write(response)
                await writer.drain()
            await reader.read()  # hold the connection open until the client closes it

        return handler

    return make


async def _serving(make: Callable[[Server], Handler]) -> Server:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = make(server)
    return await server.__aenter__()


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(), timeout=httpx.Timeout(5.0))


def _post(client: httpx.AsyncClient, url: str) -> httpx.Request:
    return client.build_request(
        "POST",
        url,
        headers={"content-type": "application/json", "authorization": "Bearer sk-test"},
        content=b'{"model": "m"}',
    )


def _header_lines(head: bytes) -> list[tuple[bytes, bytes]]:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    return sorted((n.strip().lower(), v.strip()) for n, _, v in (line.partition(b":") for line in lines[1:]))


async def test_the_request_on_the_wire_is_the_one_httpcore_sends():
    server = await _serving(_answer(OK))
    try:
        async with httpx.AsyncClient() as plain, _client() as ours:
            for client in (plain, ours):
                response = await client.send(_post(client, server.url))
                assert (response.status_code, response.content) == (200, b"hello")
        default, sent = server.heads
        assert sent.split(b"\r\n")[0] == default.split(b"\r\n")[0] == b"POST /v1/chat/completions HTTP/1.1"
        assert _header_lines(sent) == _header_lines(default)
        assert server.bodies == [b'{"model": "m"}', b'{"model": "m"}']
    finally:
        await server.__aexit__()


async def test_a_body_read_to_its_end_keeps_the_connection_and_one_closed_early_cuts_it():
    long = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234"  # 5 of 10 bytes now, the rest never
    server = await _serving(_answer(OK, OK, long, OK))
    try:
        async with _client() as client:
            for _ in range(2):
                response = await client.send(_post(client, server.url), stream=True)
                assert [chunk async for chunk in response.aiter_bytes()] == [b"hello"]
                await response.aclose()
            assert server.connections == 1
            response = await client.send(_post(client, server.url), stream=True)
            async for chunk in response.aiter_raw():
                assert chunk == b"01234"
                break
            await response.aclose()  # closed before its end: the connection is cut
            response = await client.send(_post(client, server.url))
            assert response.content == b"hello" and server.connections == 2
    finally:
        await server.__aexit__()


async def test_an_encoded_body_reaches_httpx_undecoded_and_httpx_decodes_it():
    text = b'{"answer": "forty-two"}' * 20
    packed = gzip.compress(text)
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(packed)
    server = await _serving(_answer(head + packed, head + packed))
    try:
        async with _client() as client:
            response = await client.send(_post(client, server.url))
            assert response.content == text
            response = await client.send(_post(client, server.url), stream=True)
            assert b"".join([chunk async for chunk in response.aiter_raw()]) == packed
            await response.aclose()
    finally:
        await server.__aexit__()


async def test_a_refused_connection_is_a_connect_error():
    server = await _serving(_answer(OK))
    url = server.url
    await server.__aexit__()
    server.server.close()
    await server.server.wait_closed()
    async with _client() as client:
        with pytest.raises(httpx.ConnectError) as caught:
            await client.send(_post(client, url))
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    # named by host and port and the OS's reason; no "ssl:default" for an http:// URL
    assert str(caught.value).startswith(f"Cannot connect to host {host_port}: ")
    assert "ssl" not in str(caught.value)


@pytest.mark.parametrize(
    "answer",
    [b"", b"HTTP/1.1 200 OK\r\ncontent-le", b"garbage that is not http\r\n\r\n"],
    ids=["closed-before-answering", "closed-inside-the-head", "garbled-status-line"],
)
async def test_a_server_that_closes_or_garbles_the_head_is_a_remote_protocol_error(answer):
    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(answer)
            await writer.drain()

        return handler

    server = await _serving(make)
    try:
        async with _client() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.send(_post(client, server.url))
    finally:
        await server.__aexit__()


async def test_a_body_cut_short_is_a_remote_protocol_error():
    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
            await writer.drain()

        return handler

    server = await _serving(make)
    try:
        async with _client() as client:
            response = await client.send(_post(client, server.url), stream=True)
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                async for _ in response.aiter_bytes():
                    pass
            await response.aclose()
        # a trial read aiohttp's "<ContentLengthError: 400, message=...>" as a 400 from the upstream
        message = str(caught.value)
        assert message.startswith("the response body ended before its end (") and "400" not in message, (
            message
        )
    finally:
        await server.__aexit__()


async def test_silence_longer_than_the_read_timeout_is_a_read_timeout():
    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
            await writer.drain()
            await reader.read()

        return handler

    server = await _serving(make)
    try:
        async with httpx.AsyncClient(transport=AiohttpTransport(), timeout=httpx.Timeout(0.2)) as client:
            response = await client.send(_post(client, server.url), stream=True)
            with pytest.raises(httpx.ReadTimeout):
                async for _ in response.aiter_bytes():
                    pass
            await response.aclose()
            with pytest.raises(httpx.ReadTimeout):  # no answer at all: the first byte is waited for as long
                await client.send(_post(client, server.url))
    finally:
        await server.__aexit__()


async def test_a_header_value_that_cannot_be_sent_is_a_local_protocol_error_that_does_not_quote_it():
    server = await _serving(_answer(OK))
    try:
        async with _client() as client:
            request = client.build_request(
                "POST", server.url, headers={"authorization": "Bearer hunter2\r\nx-evil: 1"}, content=b"{}"
            )
            with pytest.raises(httpx.LocalProtocolError) as info:
                await client.send(request)
            assert "hunter2" not in str(info.value)
            assert server.heads == []
    finally:
        await server.__aexit__()


async def test_the_shared_client_uses_it_with_the_configured_limits():
    client = make_client(max_connections=7)
    try:
        transport = client._transport
        assert isinstance(transport, AiohttpTransport) and transport._limit == 7
    finally:
        await client.aclose()


async def test_the_shared_upstream_client_keeps_no_cookie_between_requests():
    """The upstream client serves every key and tenant: a cookie set on one answer rides on no later request,
    neither through httpx's jar nor through aiohttp's."""
    with_cookie = (
        b"HTTP/1.1 200 OK\r\nset-cookie: session=tenant-a-secret; Path=/\r\n"
        b"set-cookie: other=1; Domain=127.0.0.1; Path=/\r\ncontent-length: 5\r\n\r\nhello"
    )
    server = await _serving(_answer(with_cookie, OK, OK))
    try:
        async with make_client() as client:
            for _ in range(3):
                response = await client.send(_post(client, server.url))
                assert (response.status_code, response.content[:5]) == (200, b"hello")
            assert len(client.cookies.jar) == 0
        assert len(server.heads) == 3 and server.connections == 1  # one kept connection, three requests
        assert all(b"cookie" not in dict(_header_lines(head)) for head in server.heads)
        # the server did set it: a plain httpx client would have sent it back
        plain_server = await _serving(_answer(with_cookie, OK))
        try:
            async with httpx.AsyncClient() as plain:
                for _ in range(2):
                    await plain.send(_post(plain, plain_server.url))
            assert b"session=tenant-a-secret" in dict(_header_lines(plain_server.heads[1])).get(
                b"cookie", b""
            )
        finally:
            await plain_server.__aexit__()
    finally:
        await server.__aexit__()


async def test_a_streamed_send_on_the_upstream_client_goes_straight_to_the_transport(monkeypatch):
    """``UpstreamClient.send`` with ``stream=True`` skips httpx's auth / redirect / cookie layers and answers as
    ``AsyncClient.send`` does; any other send still takes those layers."""
    with_cookie = (
        b"HTTP/1.1 200 OK\r\nset-cookie: session=tenant-a-secret; Path=/\r\ncontent-length: 5\r\n\r\nhello"
    )
    server = await _serving(_answer(with_cookie, OK, OK, OK))
    layered: list[httpx.Request] = []
    original = httpx.AsyncClient._send_handling_auth

    async def spy(self, request, *args, **kwargs):
        layered.append(request)
        return await original(self, request, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "_send_handling_auth", spy)
    try:
        async with make_client() as client:
            for _ in range(2):
                request = _post(client, server.url)
                response = await client.send(request, stream=True)
                assert response.request is request and response.status_code == 200
                assert response.headers["content-length"] == "5"
                assert await response.aread() == b"hello"
                await response.aclose()
            assert layered == []  # straight to the transport
            assert len(client.cookies.jar) == 0
            request = _post(client, server.url)
            response = await client.send(request)  # not streamed: httpx's own path
            assert (response.status_code, response.content, layered) == (200, b"hello", [request])
            hooked: list[httpx.Request] = []

            async def hook(request: httpx.Request) -> None:
                hooked.append(request)

            client.event_hooks = {"request": [hook], "response": []}
            request = _post(client, server.url)
            response = await client.send(request, stream=True)  # a hook: httpx's own path
            await response.aread()
            assert layered[-1] is request and hooked == [request]
        assert server.connections == 1 and len(server.heads) == 4
        assert all(b"cookie" not in dict(_header_lines(head)) for head in server.heads)
    finally:
        await server.__aexit__()


async def test_a_streamed_send_on_the_upstream_client_raises_httpx_errors_with_their_request():
    server = await _serving(_answer(OK))
    url = server.url
    await server.__aexit__()
    await asyncio.sleep(0)
    async with make_client() as client:
        request = _post(client, url)
        with pytest.raises(httpx.ConnectError) as caught:
            await client.send(request, stream=True)
        assert caught.value.request is request
    with pytest.raises(RuntimeError, match="closed"):
        await client.send(_post(client, url), stream=True)


HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-test"}
TIMEOUT = httpx.Timeout(5.0).as_dict()


async def test_a_direct_send_puts_on_the_wire_what_the_httpx_path_sends():
    """``UpstreamClient.send_direct`` sends the head httpx builds, byte for byte (header order included), with
    each body's length; its 2xx answer is a ``DirectResponse`` whose body read to its end keeps the
    connection."""
    server = await _serving(_answer(OK, OK, OK))
    try:
        async with make_client() as client:
            response = await client.send(_post(client, server.url), stream=True)
            assert await response.aread() == b"hello"
            await response.aclose()
            for content in (b'{"model": "m"}', b'{"model": "a longer one"}'):
                direct = await client.send_direct(httpx.URL(server.url), HEADERS, content, TIMEOUT)
                assert isinstance(direct, DirectResponse) and direct.status_code == 200
                assert direct.headers.get("Content-Type") == "text/event-stream"
                assert b"".join([chunk async for chunk in direct.aiter_bytes()]) == b"hello"
                assert direct.is_closed  # read to its end: released
        via_httpx, first, second = server.heads
        assert first == via_httpx
        assert second == via_httpx.replace(b"Content-Length: 14", b"Content-Length: 25")
        assert server.bodies[1:] == [b'{"model": "m"}', b'{"model": "a longer one"}']
        assert server.connections == 1
    finally:
        await server.__aexit__()


async def test_a_direct_send_hands_errors_and_encoded_bodies_to_httpx():
    zipped = gzip.compress(b"hello")
    encoded = (
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(zipped) + zipped
    )
    failed = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 2\r\ncontent-length: 4\r\n\r\nbusy"
    server = await _serving(_answer(encoded, failed))
    try:
        async with make_client() as client:
            response = await client.send_direct(httpx.URL(server.url), HEADERS, b"{}", TIMEOUT)
            assert isinstance(response, httpx.Response)
            assert await response.aread() == b"hello"  # decoded by httpx
            response = await client.send_direct(httpx.URL(server.url), HEADERS, b"{}", TIMEOUT)
            assert isinstance(response, httpx.Response) and response.status_code == 503
            assert response.headers["retry-after"] == "2" and await response.aread() == b"busy"
    finally:
        await server.__aexit__()


async def test_a_direct_send_closed_early_cuts_the_connection_and_maps_failures():
    long = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234"  # 5 of 10 bytes now, the rest never
    server = await _serving(_answer(long, OK))
    try:
        async with make_client() as client:
            direct = await client.send_direct(httpx.URL(server.url), HEADERS, b"{}", TIMEOUT)
            assert isinstance(direct, DirectResponse)
            async for chunk in direct.aiter_bytes():
                assert chunk == b"01234"
                break
            await direct.aclose()
            direct = await client.send_direct(httpx.URL(server.url), HEADERS, b"{}", TIMEOUT)
            assert isinstance(direct, DirectResponse)  # on a new connection: it answers `long` again
            await direct.aclose()
        assert server.connections == 2  # the cut one was not reused
        url = server.url
    finally:
        await server.__aexit__()
    await asyncio.sleep(0)
    async with make_client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.send_direct(httpx.URL(url), HEADERS, b"{}", TIMEOUT)


async def test_a_direct_send_declines_what_httpx_must_handle():
    async with make_client() as client:
        url = httpx.URL("http://127.0.0.1:9/v1/chat/completions")
        assert (
            await client.send_direct(httpx.URL("http://u:p@127.0.0.1:9/x"), HEADERS, b"{}", TIMEOUT) is None
        )

        async def hook(request: httpx.Request) -> None:
            pass

        client.event_hooks = {"request": [hook], "response": []}
        assert await client.send_direct(url, HEADERS, b"{}", TIMEOUT) is None
    async with make_client() as client:
        client._mounts = {
            httpx._utils.URLPattern("all://"): httpx.AsyncHTTPTransport()
        }  # a proxy's transport
        assert await client.send_direct(url, HEADERS, b"{}", TIMEOUT) is None


async def test_a_body_cut_short_is_the_same_error_through_httpx_and_direct():
    """Both readers of an aiohttp body (httpx's stream and ``DirectResponse``) share one reader: a body cut
    short is a ``RemoteProtocolError`` after the bytes that came, and the direct response is not closed as if
    read to its end."""
    cut = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100\r\n\r\nonly this"

    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(cut)
            await writer.drain()

        return handler

    server = await _serving(make)
    try:
        async with make_client() as client:
            response = await client.send(_post(client, server.url), stream=True)
            got = []
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in response.aiter_raw():
                    got.append(chunk)
            assert b"".join(got) == b"only this"
            await response.aclose()
            direct = await client.send_direct(httpx.URL(server.url), HEADERS, b"{}", TIMEOUT)
            assert isinstance(direct, DirectResponse)
            got = []
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in direct.aiter_bytes():
                    got.append(chunk)
            assert b"".join(got) == b"only this" and not direct.is_closed
            await direct.aclose()
            assert direct.is_closed
        assert server.connections == 2  # the cut connection was not reused
    finally:
        await server.__aexit__()


LEAN_HEADER_SETS: list[list[tuple[str, str]]] = [
    [
        ("Host", "HOSTPORT"),
        ("Accept", "*/*"),
        ("Connection", "keep-alive"),
        ("Content-Type", "application/json"),
    ],
    [("host", "example.test"), ("X-Dup", "1"), ("x-dup", "2"), ("X-Dup", "3"), ("Authorization", "Bearer k")],
    [("X-Latin", "caf\u00e9 \u00ff"), ("User-Agent", "ua/1"), ("Accept-Encoding", "gzip"), ("X-Tab", "a\tb")],
    [("Content-Length", "LENGTH"), ("X-After", "z")],
]
"""Header lists for the lean-path comparison: an explicit Host (any case, which replaces aiohttp's in place),
duplicates in different cases (``ClientSession._prepare_headers`` folds them), non-ASCII and tab values, the
automatic headers present, Content-Length first."""


async def _open_both(url: str, headers: list[tuple[str, str]], body: bytes) -> list[object]:
    """Send one request through each path (lean, then the session's) and return what each gave: the body
    read to its end, or the (type, text) of the httpx error raised."""
    outcomes: list[object] = []
    for lean in (True, False):
        transport = AiohttpTransport()
        transport.lean = lean
        try:
            response = await transport.open("POST", url, headers, body, httpx.Timeout(0.5).as_dict())
            data = b"".join([chunk async for chunk in DirectResponse(response).aiter_bytes()])
            outcomes.append((response.status, response.reason, tuple(response.raw_headers), data))
        except httpx.TransportError as exc:
            outcomes.append((type(exc), str(exc)))
        finally:
            await transport.aclose()
    return outcomes


@pytest.mark.parametrize("headers", LEAN_HEADER_SETS)
async def test_the_lean_path_puts_on_the_wire_byte_for_byte_what_the_session_path_does(headers):
    server = await _serving(_answer(OK))
    try:
        port = server.url.split("//", 1)[1].split("/", 1)[0]
        body = b'{"model": "m", "q": "\xc3\xa9"}'
        sent = [
            (name, value.replace("HOSTPORT", port).replace("LENGTH", str(len(body))))
            for name, value in headers
        ]
        if not any(name.lower() == "content-length" for name, _ in sent):
            sent.append(("Content-Length", str(len(body))))
        lean, session = await _open_both(server.url + "?a=1&b=%20", sent, body)
        assert lean == session == (200, "OK", tuple(lean[2]), b"hello")  # type: ignore[index]
        assert len(server.heads) == 2 and server.heads[0] == server.heads[1]
        assert server.bodies == [body, body]
    finally:
        await server.__aexit__()


@pytest.mark.parametrize(
    "answer",
    [
        b"",
        b"HTTP/1.1 200 OK\r\ncontent-le",
        b"garbage that is not http\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this",
        b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        None,  # no answer: the read timeout
    ],
    ids=[
        "closed",
        "inside-head",
        "garbled",
        "cut-body",
        "bad-length",
        "continue",
        "chunked",
        "until-eof",
        "silent",
    ],
)
async def test_the_lean_path_answers_and_fails_as_the_session_path_does(answer):
    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            if answer is None:
                await reader.read()
                return
            writer.write(answer)
            await writer.drain()

        return handler

    server = await _serving(make)
    try:
        headers = [("Host", "h"), ("Content-Length", "2")]
        lean, session = await _open_both(server.url, headers, b"{}")
        assert lean == session
    finally:
        await server.__aexit__()


async def test_the_lean_path_refuses_what_the_session_path_refuses():
    server = await _serving(_answer(OK))
    url = server.url
    try:
        evil = [("Authorization", "Bearer hunter2\r\nx-evil: 1"), ("Content-Length", "2")]
        lean, session = await _open_both(url, evil, b"{}")
        assert (
            lean
            == session
            == (httpx.LocalProtocolError, "a request header could not be sent (illegal value)")
        )
        assert server.heads == []
    finally:
        await server.__aexit__()
    await asyncio.sleep(0)
    lean, session = await _open_both(url, [("Content-Length", "2")], b"{}")  # refused
    assert lean == session and lean[0] is httpx.ConnectError  # type: ignore[index]


@pytest.mark.parametrize(
    ("method", "headers", "body"),
    [
        ("POST", [("Content-Length", "2")], b"{}"),
        ("POST", [], b"{}"),  # no Content-Length: ClientRequest adds it
        ("POST", [("Content-Length", "3")], b"{}"),  # not the body's
        ("POST", [("Content-Length", "2"), ("Expect", "100-continue")], b"{}"),
        ("POST", [("Transfer-Encoding", "chunked")], b"{}"),
        ("POST", [("Content-Length", "2"), ("Content-Encoding", "gzip")], b"{}"),
        ("POST", [("Content-Length", "2")], bytearray(b"{}")),
        ("PUT", [("Content-Length", "2")], b"{}"),
    ],
    ids=["lean", "no-length", "wrong-length", "expect", "chunked", "encoded", "bytearray", "put"],
)
async def test_only_a_plain_bytes_post_takes_the_lean_path(monkeypatch, method, headers, body):
    """The lean path is taken exactly for a POST of a bytes body whose headers ClientRequest sends as they are;
    anything else goes through ``ClientSession.request``."""
    taken: list[str] = []

    class Taken(Exception):
        pass

    async def session_request(self, *args, **kwargs):
        taken.append("session")
        raise Taken

    async def exchange(self, *args, **kwargs):
        taken.append("lean")
        raise Taken

    monkeypatch.setattr(aiohttp.ClientSession, "request", session_request)
    monkeypatch.setattr(AiohttpTransport, "_exchange", exchange)
    transport = AiohttpTransport()
    try:
        with pytest.raises(Taken):
            await transport.open(
                method, "http://127.0.0.1:9/v1/x", headers, body, httpx.Timeout(1.0).as_dict()
            )
        lean_taken = method == "POST" and headers == [("Content-Length", "2")] and type(body) is bytes
        assert taken == ["lean" if lean_taken and AiohttpTransport.lean else "session"]
    finally:
        await transport.aclose()


async def test_a_lean_request_cancelled_while_waiting_closes_its_connection():
    """A caller that leaves while the upstream works (the client went away) closes the connection, which is
    what tells the upstream to stop; the pool does not reuse it."""
    server = await _serving(_answer(OK, OK))
    transport = AiohttpTransport()
    try:
        headers = [("Content-Length", "2")]
        opened: list[AiohttpTransport] = []

        def make(server: Server) -> Handler:
            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await server.read_request(reader)
                opened.append(transport)
                await reader.read()  # never answers; sees the close

            return handler

        slow = await _serving(make)
        task = asyncio.create_task(
            transport.open("POST", slow.url, headers, b"{}", httpx.Timeout(5.0).as_dict())
        )
        while not opened:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        connector = transport._open().connector
        assert connector is not None and sum(len(v) for v in connector._conns.values()) == 0
        await slow.__aexit__()
        for _ in range(2):  # the pool still serves: one connection, two requests
            response = await transport.open("POST", server.url, headers, b"{}", httpx.Timeout(5.0).as_dict())
            assert b"".join([c async for c in DirectResponse(response).aiter_bytes()]) == b"hello"
        assert server.connections == 1 and len(server.heads) == 2
    finally:
        await transport.aclose()
        await server.__aexit__()


async def test_the_lean_path_reads_with_the_sessions_parameters(monkeypatch):
    """The answer is parsed with what ``ClientSession._request`` would set on the connection's protocol
    (buffer size, limits, read timeout, no decompression): recorded on both paths and compared."""
    from aiohttp.client_proto import ResponseHandler

    seen: list[dict] = []
    original = ResponseHandler.set_response_params

    def spy(self, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k != "timer"} | {"timer": type(kwargs["timer"])})
        return original(self, **kwargs)

    monkeypatch.setattr(ResponseHandler, "set_response_params", spy)
    server = await _serving(_answer(OK, OK))
    try:
        await _open_both(server.url, [("Host", "h"), ("Content-Length", "2")], b"{}")
        lean, session = seen
        assert lean == session and lean["read_bufsize"] == 2**18 and lean["read_timeout"] == 0.5
    finally:
        await server.__aexit__()


def _keepalive_then(after: bytes | None, *, reset: bool = False) -> Callable[[Server], Handler]:
    """A handler answering the first request on each connection with ``OK`` and keeping the connection; once
    the next request's first bytes arrive it writes ``after`` (None: nothing) and closes (``reset``: with an
    RST instead of a FIN), as a server closing an idle keep-alive connection when the request crosses it."""

    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not await server.read_request(reader):
                return
            writer.write(OK)
            await writer.drain()
            if not await reader.read(1):
                return
            if after:
                writer.write(after)
                await writer.drain()
            if reset:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort() if reset else writer.close()

        return handler

    return make


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_request_crossing_the_servers_close_of_an_idle_connection_is_sent_again(reset):
    server = await _serving(_keepalive_then(None, reset=reset))
    try:
        async with _client() as client:
            first = await client.send(_post(client, server.url))
            assert first.content == b"hello" and server.connections == 1
            second = await client.send(_post(client, server.url))  # the pooled connection is closed under it
            assert second.status_code == 200 and second.content == b"hello"
            assert server.connections == 2
            assert server.bodies == [b'{"model": "m"}', b'{"model": "m"}']  # the crossed one was never read
    finally:
        await server.__aexit__()


async def test_a_new_connection_closed_before_the_answer_is_not_sent_again():
    def make(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)

        return handler

    server = await _serving(make)
    try:
        async with _client() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.send(_post(client, server.url))
            assert server.connections == 1
    finally:
        await server.__aexit__()


@pytest.mark.parametrize(
    "after",
    [b"HTTP/1.1 200 OK\r\ncontent-le", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234"],
    ids=["inside-the-head", "inside-the-body"],
)
async def test_a_reused_connection_closed_after_the_answer_began_is_not_sent_again(after):
    server = await _serving(_keepalive_then(after))
    try:
        async with _client() as client:
            await client.send(_post(client, server.url))
            with pytest.raises(httpx.RemoteProtocolError):
                response = await client.send(_post(client, server.url))
                await response.aread()
            assert server.connections == 1
    finally:
        await server.__aexit__()


async def test_a_streamed_body_is_not_sent_again_after_a_crossed_close():
    server = await _serving(_keepalive_then(None))

    async def chunks():
        yield b'{"model": '
        yield b'"m"}'

    try:
        async with _client() as client:
            await client.send(_post(client, server.url))
            request = client.build_request("POST", server.url, content=chunks())
            with pytest.raises(httpx.TransportError):
                await client.send(request)
            assert server.connections == 1
    finally:
        await server.__aexit__()


@pytest.mark.parametrize("bound", [3, 2])
async def test_resends_take_each_stale_pooled_connection_then_a_new_one_within_the_bound(monkeypatch, bound):
    """Three pooled connections the server closes at once: each resend takes the next one (and closes it), the
    fourth attempt a new connection; with two resends allowed the third stale one's failure is raised."""
    monkeypatch.setattr(aiohttp_transport, "STALE_RESENDS", bound)
    three = asyncio.Event()

    def make(server: Server) -> Handler:
        inner = _keepalive_then(None)(server)

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if server.connections >= 3:
                three.set()
            if server.connections <= 3:
                await three.wait()  # the first three requests are in flight at once: three connections
            await inner(reader, writer)

        return handler

    server = await _serving(make)
    try:
        async with _client() as client:
            answers = await asyncio.gather(*(client.send(_post(client, server.url)) for _ in range(3)))
            assert [a.content for a in answers] == [b"hello"] * 3 and server.connections == 3
            if bound >= 3:
                response = await client.send(_post(client, server.url))
                assert response.content == b"hello" and server.connections == 4
            else:
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.send(_post(client, server.url))
                assert server.connections == 3
    finally:
        await server.__aexit__()
