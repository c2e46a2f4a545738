"""Bad input on the two hot endpoints (``POST /v1/chat/completions``, ``POST /v1/messages``) over a real socket,
served as ``prefixgate serve`` serves them (uvicorn with ``gateway.http.server_protocol``'s protocol, the app's
short path for these routes), against a stub OpenAI upstream: every malformed, mistyped, oversized or
abandoned body gets its protocol's own error JSON (or, for a client that left, a 499 log line), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import urllib.error
import urllib.request

import httpx
import pytest

from gateway.config.loader import parse_config
from gateway.http.body import drain
from tests.gateway.server import RunningServer
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
MAX_BODY = 4096
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    state = StubState("OAI")
    stub = StubServer(openai_stub(state)).start()
    config = parse_config(
        {
            "server": {"max_body_bytes": MAX_BODY},
            "models": [{"name": "m", "backend": "openai", "base_url": f"{stub.base_url}/v1", "api_key": "k"}],
        }
    )
    running = RunningServer(config).start()
    yield running
    running.stop()
    stub.stop()


def assert_protocol_error(response: httpx.Response, path: str, status: int, code: str | None = None) -> None:
    """``response`` is ``status`` with the error JSON of ``path``'s protocol (OpenAI's or Anthropic's)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    if path == MESSAGES:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        if code is not None:
            assert body["error"]["code"] == code


def raw_exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` + ``body`` on a new connection and read the answer until the server closes or it is
    complete (its Content-Length read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head + body)
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                return data
            data += chunk
            top, sep, rest = data.partition(b"\r\n\r\n")
            for line in top.split(b"\r\n"):
                if sep and line.lower().startswith(b"content-length:") and len(rest) >= int(line[15:]):
                    return data


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[1, 2]", b"\xff\xfe", b'{"model": "m", "messages": ', b"null", b'"text"'],
)
def test_malformed_bodies_get_the_protocols_error(server, path, content):
    response = httpx.post(
        server.base_url + path, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert_protocol_error(response, path, 400, "invalid_json")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_body_that_parses_but_is_wrong_gets_the_protocols_error(server, path):
    response = httpx.post(server.base_url + path, json={"model": "m"}, timeout=30)
    assert_protocol_error(response, path, 400, "missing_required_parameter")
    response = httpx.post(server.base_url + path, json={**GOOD, "model": "nothing"}, timeout=30)
    assert_protocol_error(response, path, 404, "model_not_found")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_the_content_type_is_not_what_decides(server, path, content_type):
    """The body is read as JSON whatever the Content-Type says (as before this path): JSON answers, anything
    else is the protocol's invalid_json."""
    headers = {} if content_type is None else {"content-type": content_type}
    good = httpx.post(server.base_url + path, content=json.dumps(GOOD).encode(), headers=headers, timeout=30)
    assert good.status_code == 200, good.text
    assert "OAI" in good.text
    form = httpx.post(server.base_url + path, content=b"model=m&messages=hi", headers=headers, timeout=30)
    assert_protocol_error(form, path, 400, "invalid_json")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_huge_bodies_are_413_declared_or_streamed(server, path):
    big = b'{"model": "m", "pad": "' + b"x" * (MAX_BODY * 4) + b'"}'
    declared = httpx.post(server.base_url + path, content=big, timeout=30)
    assert_protocol_error(declared, path, 413, "request_too_large")

    def chunks():
        for start in range(0, len(big), 1024):
            yield big[start : start + 1024]

    streamed = httpx.post(server.base_url + path, content=chunks(), timeout=30)
    assert "content-length" not in streamed.request.headers
    assert_protocol_error(streamed, path, 413, "request_too_large")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_client_that_sends_its_whole_huge_body_before_reading_still_reads_the_413(server, path):
    """Before: the 413 went out with the body unread and the server's close reset the connection while ``urllib``
    was still sending (``ConnectionResetError``); the rest of the body is now drained first (``drain``)."""
    big = b'{"model": "m", "pad": "' + b"x" * (4 << 20) + b'"}'
    request = urllib.request.Request(
        server.base_url + path, data=big, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 413
    error = json.loads(caught.value.read())["error"]
    assert error["message"].startswith("Request body too large")
    # the same body sent chunked (no Content-Length: over the limit while streaming), all of it before reading
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(big[i : i + 65536]), big[i : i + 65536]) for i in range(0, len(big), 65536)
    )
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    answer = raw_exchange(server.port, head, chunked + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_client_waiting_for_100_continue_gets_the_413_at_once(server, path):
    """``Expect: 100-continue`` with an oversized ``Content-Length``: no 100 Continue (reading the body to drain
    it would send one and wait for the body), the 413 at once (curl sends this header for large bodies)."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {MAX_BODY * 1000}\r\nexpect: 100-continue\r\n\r\n"
    ).encode()
    answer = raw_exchange(server.port, head)  # reading the body would have sent "HTTP/1.1 100 Continue" first
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def _stream_of(parts: list[bytes], stall: bool = False):
    for part in parts:
        yield part
    if stall:
        await asyncio.sleep(3600)


@pytest.mark.parametrize(
    ("stall", "limit", "expected"), [(False, 1 << 20, 3000), (False, 1500, 2000), (True, 1 << 20, 3000)]
)
def test_drain_throws_the_rest_away_within_its_byte_and_time_bounds(stall, limit, expected):
    class Stub:
        def stream(self):
            return _stream_of([b"x" * 1000] * 3, stall)

    got = asyncio.run(drain(Stub(), max_bytes=limit, timeout_s=0.2))
    assert got == expected


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_content_length_that_is_no_number_is_refused_without_a_500(server, path):
    answer = raw_exchange(
        server.port, f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 12abc\r\n\r\n".encode(), b"{}"
    )
    assert answer.startswith(b"HTTP/1.1 400 "), answer  # httptools refuses the head itself


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_client_that_leaves_mid_body_is_a_499_not_an_error(server, path, caplog):
    before = server.stats()["errors"]
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            conn.sendall(head.encode() + b'{"model": "m", "messages": [')
            time.sleep(0.2)  # the handler is reading the body when the client goes
        deadline = time.monotonic() + 10
        lines: list[str] = []
        while not lines and time.monotonic() < deadline:
            lines = [
                r.getMessage()
                for r in caplog.records
                if r.name == "prefixgate.request" and path in r.getMessage()
            ]
            time.sleep(0.02)
    assert len(lines) == 1 and "status=499" in lines[0], lines
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert problems == [], [r.getMessage() for r in problems]  # no "unhandled", no ASGI traceback
    assert server.stats()["errors"] == before
    good = httpx.post(server.base_url + path, json=GOOD, timeout=30)  # the gateway goes on serving
    assert good.status_code == 200, good.text


def test_a_json_answer_has_the_gateways_headers_and_a_matching_length(server):
    """A JSON answer on the hot path, as bytes on the wire: the status line, uvicorn's date and server, the
    gateway's request id and content headers, and a body of the declared length."""
    body = json.dumps(GOOD).encode()
    head = f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    answer = raw_exchange(server.port, head.encode(), body)
    top, _, payload = answer.partition(b"\r\n\r\n")
    lines = top.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    names = [line.split(b":", 1)[0] for line in lines[1:]]
    for name in (b"date", b"server", b"x-request-id", b"content-length", b"content-type"):
        assert name in names, names
    length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.startswith(b"content-length:"))
    assert len(payload) == length and json.loads(payload)["object"] == "chat.completion"
