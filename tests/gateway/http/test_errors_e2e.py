"""Bad input over HTTP gets OpenAI's error JSON and loses nothing (no block left allocated); disconnects free
their blocks. Against the real gateway over the tiny checkpoint."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MAX_BODY_BYTES, TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS

URL = "/v1/chat/completions"
GOOD = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def assert_openai_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def assert_nothing_lost(server):
    """No block in use, nothing running or waiting, and the next good request still works."""
    doc = server.wait_blocks_released(TINY_MODEL)
    model = doc["models"][TINY_MODEL]
    assert model["blocks"]["used"] == 0, model
    assert (model["engine"]["running"], model["engine"]["waiting"]) == (0, 0)
    response = httpx.post(server.base_url + URL, json=GOOD, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("content", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b"\xff\xfe", 400, "invalid_json", None),
        (json.dumps({"messages": GOOD["messages"]}).encode(), 400, "missing_required_parameter", "model"),
        (json.dumps({"model": TINY_MODEL}).encode(), 400, "missing_required_parameter", "messages"),
        (json.dumps({**GOOD, "max_tokens": "2"}).encode(), 400, "invalid_type", "max_tokens"),
        (
            json.dumps({**GOOD, "messages": [{"role": "user", "content": 3}]}).encode(),
            400,
            "invalid_type",
            "messages[0].content",
        ),
        (json.dumps({**GOOD, "n": 17}).encode(), 400, "integer_above_max_value", "n"),
        (json.dumps({**GOOD, "logprobs": 1}).encode(), 400, "invalid_type", "logprobs"),
        (
            json.dumps(
                {
                    **GOOD,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ],
                }
            ).encode(),
            400,
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        (json.dumps({**GOOD, "model": "gpt-nothing"}).encode(), 404, "model_not_found", "model"),
    ],
)
def test_bad_bodies_get_openai_errors(server, content, status, code, param):
    response = httpx.post(
        server.base_url + URL, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_error(response, status, code, param)
    assert_nothing_lost(server)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Before: 500 (the Responses answer echoes metadata and tools; json.dumps refused the NaN in them)
        ("/v1/responses", '{"model": "%s", "input": "hi", "max_output_tokens": 2, "metadata": {"a": NaN}}'),
        (
            "/v1/responses",
            '{"model": "%s", "input": "hi", "max_output_tokens": 2, "tool_choice": "none", "tools": [{"type":'
            ' "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"default": NaN}}}}]}',
        ),
        (URL, '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "max_tokens": 2, "top_p": 1e400}'),
        (
            "/v1/messages",
            '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -Infinity}',
        ),
    ],
)
def test_non_finite_numbers_are_invalid_json_on_every_face(server, path, body):
    response = httpx.post(
        server.base_url + path,
        content=(body % TINY_MODEL).encode(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    if path == "/v1/messages":
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "is not a JSON number" in response.json()["error"]["message"]
    else:
        error = assert_openai_error(response, 400, "invalid_json", None)
        assert "is not a JSON number" in error["message"]
    assert_nothing_lost(server)


def test_prompt_over_the_context_is_context_length_exceeded(server):
    long_text = "the quick brown fox jumps over the lazy dog " * 200  # far beyond the 512-token context
    for path, body, param in (
        (URL, {**GOOD, "messages": [{"role": "user", "content": long_text}]}, "messages"),
        (URL, {**GOOD, "messages": [{"role": "user", "content": long_text}], "stream": True}, "messages"),
        ("/v1/completions", {"model": TINY_MODEL, "prompt": long_text, "max_tokens": 2}, "prompt"),
        # a short prompt whose max_tokens cannot fit beside it in the 512-token context
        (URL, {**GOOD, "max_tokens": 600}, "messages"),
    ):
        response = httpx.post(server.base_url + path, json=body, timeout=30)
        assert_openai_error(response, 400, "context_length_exceeded", param)
    assert_nothing_lost(server)


def test_a_context_overflow_on_the_anthropic_face_is_worded_as_the_messages_api_words_it(server):
    """Before (a trial with Claude Code): OpenAI's wording, so Claude Code never retried with a smaller
    ``max_tokens`` (it parses ``input length and `max_tokens` exceed context limit: P + M > L``) nor compacted
    (``prompt is too long``)."""
    headers = {"anthropic-version": "2023-06-01"}
    messages = [{"role": "user", "content": "hi"}]
    response = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": TINY_MODEL, "max_tokens": 32000, "messages": messages},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    match = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ 32000 > 512, decrease input length or "
        r"`max_tokens` and try again",
        error["message"],
    )
    assert match, error["message"]
    fits = 512 - int(match.group(1))  # Claude Code's retry: the room left
    retried = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": TINY_MODEL, "max_tokens": fits, "messages": messages, "stop_sequences": ["e"]},
        headers=headers,
        timeout=60,
    )
    assert retried.status_code == 200, retried.text
    long_text = "the quick brown fox jumps over the lazy dog " * 200
    response = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": TINY_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": long_text}]},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 400
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 512 maximum", response.json()["error"]["message"])
    assert_nothing_lost(server)


def test_sdk_raises_typed_errors(client, server):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], n=17)
    assert bad.value.param == "n"
    assert_nothing_lost(server)


def test_body_over_the_limit_is_413_declared_or_not(server):
    big = json.dumps(
        {**GOOD, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}
    ).encode()
    declared = httpx.post(
        server.base_url + URL, content=big, headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_error(declared, 413, "request_too_large")

    def chunks():  # no Content-Length: chunked transfer encoding, counted while read
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    streamed = httpx.post(
        server.base_url + URL, content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert "content-length" not in streamed.request.headers
    assert_openai_error(streamed, 413, "request_too_large")
    assert_nothing_lost(server)


def test_admin_needs_the_token(server):
    for path in ("/admin/stats", "/metrics"):
        missing = httpx.get(server.base_url + path, timeout=10)
        assert_openai_error(missing, 401, "invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = httpx.get(server.base_url + path, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert_openai_error(wrong, 401, "invalid_api_key")
        assert httpx.get(server.base_url + path, headers=ADMIN_HEADERS, timeout=10).status_code == 200
    assert_nothing_lost(server)


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.base_url + "/v1/nothing", timeout=10), 404, "not_found")
    assert_openai_error(httpx.get(server.base_url + URL, timeout=10), 405, "method_not_allowed")
    assert_openai_error(
        httpx.get(server.base_url + "/v1/models/nope", timeout=10), 404, "model_not_found", "model"
    )


def test_bad_rules_header_is_400(server):
    response = httpx.post(
        server.base_url + URL, json=GOOD, headers={"x-prefixgate-rules": "sometimes"}, timeout=10
    )
    assert_openai_error(response, 400, "invalid_value", "x-prefixgate-rules")
    assert_nothing_lost(server)


def test_errors_are_counted(server):
    before = server.stats()["errors"].get("404", 0)
    httpx.post(server.base_url + URL, json={**GOOD, "model": "absent"}, timeout=10)
    assert server.stats()["errors"]["404"] == before + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages",
            {"model": TINY_MODEL, "max_tokens": -5, "messages": [{"role": "user", "content": "hi"}]},
        ),
        (URL, {**GOOD, "model": 7}),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
def test_a_request_refused_before_it_is_parsed_is_logged_with_its_stream_flag(
    server, caplog, path, body, stream
):
    """The request log's ``stream=`` is the body's own ``"stream"`` when validation refuses it before parsing."""
    with caplog.at_level("INFO", logger="prefixgate.request"):
        response = httpx.post(server.base_url + path, json={**body, "stream": stream}, timeout=10)
        assert response.status_code == 400, response.text
        for _ in range(100):  # the line is written as the answer goes out
            lines = [r.getMessage() for r in caplog.records if f"path={path} status=400" in r.getMessage()]
            if lines:
                break
            time.sleep(0.02)
    assert len(lines) == 1 and f"stream={str(stream).lower()}" in lines[0], lines
    assert_nothing_lost(server)


def long_generation_body(stream: bool) -> dict:
    return {
        "model": TINY_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 460,
        "temperature": 0,
        "stream": stream,
    }


def test_dropped_stream_cancels_the_engine_request(server):
    # Precondition (deterministic, greedy): this prompt generates all 460 tokens without hitting EOS.
    full = httpx.post(server.base_url + URL, json=long_generation_body(False), timeout=120).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 460
    before = server.stats()["models"][TINY_MODEL]
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.base_url + URL, json=long_generation_body(True)) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                break  # got the first token: hang up mid-generation
    doc = server.wait_blocks_released(TINY_MODEL)
    after = doc["models"][TINY_MODEL]
    assert after["blocks"]["used"] == 0 and after["engine"]["running"] == 0
    assert after["aborted"] == before["aborted"] + 1
    assert after["requests"] == before["requests"]  # the dropped stream never finished
    assert after["engine"]["decode_tokens"] - before["engine"]["decode_tokens"] < 460


def test_dropped_non_stream_request_is_cancelled_too(server):
    before = server.stats()["models"][TINY_MODEL]
    body = json.dumps(long_generation_body(False)).encode()
    head = (
        f"POST {URL} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(head.encode() + body)
        for _ in range(400):  # wait until the engine is decoding it, then hang up
            engine = server.stats()["models"][TINY_MODEL]["engine"]
            if engine["running"] == 1 and engine["decode_tokens"] > before["engine"]["decode_tokens"]:
                break
            time.sleep(0.005)
    doc = server.wait_blocks_released(TINY_MODEL)
    after = doc["models"][TINY_MODEL]
    assert after["blocks"]["used"] == 0
    assert after["aborted"] == before["aborted"] + 1 and after["requests"] == before["requests"]
    assert after["engine"]["decode_tokens"] - before["engine"]["decode_tokens"] < 460
