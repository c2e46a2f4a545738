"""An OpenAI-compatible upstream's refusal, relayed in the client's own terms (found by a trial of a front gateway
over prefixgate replicas): on ``/v1/responses`` its chat field paths become the Responses body's (``messages`` ->
``input``, ``reasoning_effort`` -> ``reasoning.effort``, ``tools[1].function.name`` -> ``tools[1].name``), and on
``/v1/messages`` a context overflow is worded as the Messages API words it (``prompt is too long: N tokens > L
maximum``), as the gateway words its own."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.config.loader import load_config
from gateway.transport.failures import anthropic_overflow_message
from tests.gateway.server import RunningServer
from tests.gateway.stub_upstreams import StubServer

OVERFLOW = (
    "This model's maximum context length is 8192 tokens. However, your messages resulted in 9032 tokens "
    "(including room for at least one completion token)."
)
REFUSALS = {  # the chat body's first user text -> the upstream's OpenAI error object
    "long": {
        "message": OVERFLOW,
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    },
    "effort": {
        "message": "Invalid 'reasoning_effort': 'extreme'.",
        "type": "invalid_request_error",
        "param": "reasoning_effort",
        "code": None,
    },
    "tool": {
        "message": "tools[1].function.name: duplicate tool name 'f'",
        "type": "invalid_request_error",
        "param": "tools[1].function.name",
        "code": None,
    },
}


async def chat(request: Request) -> JSONResponse:
    body = await request.json()
    text = next(m["content"] for m in body["messages"] if m["role"] == "user")
    text = text if isinstance(text, str) else text[0]["text"]
    return JSONResponse({"error": REFUSALS[text]}, status_code=400)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    stub = StubServer(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])).start()
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(
        f"models:\n  - {{name: up, backend: openai, base_url: '{stub.base_url}/v1', retries: 0}}\nrules: []\n"
    )
    server = RunningServer(load_config(path)).start()
    yield server
    server.stop()
    stub.stop()


def test_the_overflow_wordings_of_openai_compatible_servers_in_the_messages_apis_words():
    assert anthropic_overflow_message(OVERFLOW) == "prompt is too long: 9032 tokens > 8192 maximum"
    vllm = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the "
        "messages, 100 in the completion). Please reduce the length of the messages or completion."
    )
    assert anthropic_overflow_message(vllm) == (
        "input length and `max_tokens` exceed context limit: 2000 + 100 > 2048, decrease input length or "
        "`max_tokens` and try again"
    )
    assert anthropic_overflow_message("Invalid 'temperature'.") is None


@pytest.mark.parametrize(
    ("text", "extra", "param"),
    [
        ("long", {}, "input"),
        ("effort", {"reasoning": {"effort": "high"}}, "reasoning.effort"),
        (
            "tool",
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}] * 2},
            "tools[1].name",
        ),
    ],
)
def test_responses_errors_name_the_responses_fields(front, text, extra, param):
    answer = httpx.post(
        f"{front.base_url}/v1/responses",
        json={"model": "up", "input": text, "max_output_tokens": 8, **extra},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert "messages[" not in error["message"] and "reasoning_effort" not in error["message"]


def test_a_messages_overflow_is_worded_as_the_messages_api_words_it(front):
    answer = httpx.post(
        f"{front.base_url}/v1/messages",
        json={"model": "up", "max_tokens": 8, "messages": [{"role": "user", "content": "long"}]},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "prompt is too long: 9032 tokens > 8192 maximum"
