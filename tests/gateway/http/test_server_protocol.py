"""``gateway.http.server_protocol``: uvicorn's httptools protocol holding a response's head until its first body
message, on a real socket: the head never goes out alone, and every answer's bytes are uvicorn's."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import pytest
import uvicorn

from gateway.http.server_protocol import WATCH_DISCONNECT, coalescing_protocol

release = threading.Event()
watched: list[str] = []  # what the /watch requests' disconnect callbacks saw


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if path.startswith("/watch"):  # watch for the client leaving; /watch/answer answers, /watch waits
        gone = asyncio.Event()
        unwatch = scope["extensions"][WATCH_DISCONNECT](gone.set)
        if path == "/watch/answer":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            await asyncio.sleep(0.2)  # the client hangs up after a complete answer: no callback
            watched.append("gone" if gone.is_set() else "answered")
            unwatch()
            return
        try:
            await asyncio.wait_for(gone.wait(), 5)
            watched.append("gone")
        except TimeoutError:
            watched.append("timed out")
        return
    if path == "/held":  # the head, then the body only once the test says so
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/stream":  # chunked: head with the first chunk, then more chunks, then the terminator
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"", b"bc"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path in _ODD:  # answers uvicorn checks or shapes: the same bytes, or the same refusal, from both
        status, headers, parts = _ODD[path]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for index, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": index < len(parts) - 1})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    else:
        body = b"hello"
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


_ODD: dict[str, tuple[int, list[tuple[bytes, bytes]], list[bytes]]] = {
    "/long": (200, [(b"content-length", b"2")], [b"abc"]),  # longer than declared: RuntimeError
    "/short": (200, [(b"content-length", b"5")], [b"ab"]),  # shorter than declared: RuntimeError
    "/bad-value": (200, [(b"x-bad", b"a\nb")], [b"x"]),  # a header value uvicorn refuses
    "/close": (200, [(b"Connection", b"Keep-Alive, Close"), (b"Content-Length", b"1")], [b"x"]),
    "/not-modified": (304, [], [b""]),
    "/chunked": (201, [(b"Transfer-Encoding", b"chunked")], [b"ab", b"", b"c", b""]),
    "/parts": (200, [(b"content-length", b"4"), (b"x-a", b"1"), (b"x-a", b"2")], [b"ab", b"cd"]),
    "/status": (599, [(b"content-length", b"0")], [b""]),  # no reason phrase
}


def serve(protocol) -> tuple[int, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, http=protocol, log_config=None, access_log=False, loop="asyncio")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return sock.getsockname()[1], server, thread


@pytest.fixture(scope="module")
def port():
    protocol = coalescing_protocol()
    assert protocol is not None  # uvicorn and httptools are dependencies: the protocol is always there
    number, server, thread = serve(protocol)
    yield number
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def uvicorn_port():
    """The same app on uvicorn's own httptools protocol: the reference for the bytes."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    number, server, thread = serve(HttpToolsProtocol)
    yield number
    server.should_exit = True
    thread.join(10)


def exchange(port: int, request: bytes, end: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        data = b""
        while not data.endswith(end):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_the_head_waits_for_the_first_body_message_and_goes_with_it(port):
    release.clear()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(0.3)
        with pytest.raises(TimeoutError):
            conn.recv(65536)  # uvicorn alone would have sent the head by now
        release.set()
        conn.settimeout(5)
        data = b""
        while not data.endswith(b"ok"):
            data += conn.recv(65536)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\nok")


def test_answers_are_whole_fixed_length_chunked_empty_and_head(port):
    plain = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"hello")
    assert plain.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 5\r\n" in plain
    chunked = exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", b"0\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in chunked
    assert chunked.endswith(b"\r\n\r\n1\r\na\r\n2\r\nbc\r\n0\r\n\r\n")
    empty = exchange(port, b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n\r\n")
    assert empty.startswith(b"HTTP/1.1 204 No Content\r\n")
    head = exchange(port, b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n\r\n")  # no body message writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 5\r\n" in head
    assert head.endswith(b"\r\n\r\n") and b"hello" not in head


def test_keep_alive_requests_and_connection_close(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        for _ in range(3):
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not data.endswith(b"hello"):
                data += conn.recv(65536)
            assert data.count(b"HTTP/1.1 200 OK") == 1
    closing = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"hello")
    assert b"connection: close\r\n" in closing and closing.endswith(b"hello")


def test_the_disconnect_watch_is_called_when_the_client_leaves_before_the_answer(port):
    watched.clear()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while not watched and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watched == ["gone"]
    assert exchange(port, b"GET /watch/answer HTTP/1.1\r\nHost: x\r\n\r\n", b"ok").endswith(b"ok")
    deadline = time.monotonic() + 5
    while len(watched) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watched == ["gone", "answered"]


def read_all(port: int, request: bytes) -> bytes:
    """Everything the server writes for ``request`` until it closes or stays silent for 0.5 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        conn.settimeout(0.5)
        data = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                return data
            if not chunk:
                return data
            data += chunk


def without_date(data: bytes) -> bytes:
    return re.sub(rb"date: [^\r]*\r\n", b"date: -\r\n", data)


@pytest.mark.parametrize("path", [*_ODD, "/", "/stream", "/empty"])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_bytes_on_the_wire_are_uvicorns(port, uvicorn_port, path, method):
    """Every answer, refused answer and connection handling is byte for byte what uvicorn's own protocol
    writes (the date header aside): two keep-alive requests, then one with ``Connection: close``."""
    request = f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    closing = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    for sent in (request * 2, closing, request + closing):
        ours = without_date(read_all(port, sent))
        theirs = without_date(read_all(uvicorn_port, sent))
        assert ours == theirs
