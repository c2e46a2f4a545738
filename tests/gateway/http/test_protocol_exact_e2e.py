"""Exact protocol behaviour for inputs that used to answer 500 or be silently accepted (issue 16, item 5):
each is sent through the real server (the official SDK where it can send it, raw httpx otherwise) and gets
the protocol's error JSON, and no block is left in use."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from starlette.routing import Route

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import RunningServer, write_config

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 2}
ANTHROPIC = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 2}


def _boom(request):
    raise RuntimeError("a bug")


@pytest.fixture(scope="module")
def lenient(tiny_checkpoint, tmp_path_factory):
    """A gateway with ``server.unknown_fields: ignore``, a 1 MiB body limit and a route that fails."""
    data = tiny_config_data(tiny_checkpoint)
    data["server"] = {"max_body_bytes": 1 << 20, "unknown_fields": "ignore"}
    config = write_config(tmp_path_factory.mktemp("lenient") / "prefixgate.yaml", data)
    running = RunningServer(config, extra_routes=(Route("/boom", _boom, methods=["POST"]),)).start()
    yield running
    running.stop()


def assert_no_block_in_use(server) -> None:
    doc = server.wait_blocks_released(TINY_MODEL)
    model = doc["models"][TINY_MODEL]
    assert model["blocks"]["used"] == 0, model
    assert (model["engine"]["running"], model["engine"]["waiting"]) == (0, 0)


def post_raw(server, path: str, raw: bytes | str) -> httpx.Response:
    return httpx.post(
        server.base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )


def openai_error(response: httpx.Response, status: int, code=None, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def anthropic_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]


# ---- seed, integers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_a_400(server, client, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=2, seed=seed)
    assert info.value.status_code == 400 and info.value.body["param"] == "seed"
    assert_no_block_in_use(server)


def test_seed_at_the_64_bit_limit_is_served(server, client):
    answer = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=2, seed=2**63 - 1)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert_no_block_in_use(server)


# ---- lone surrogates -------------------------------------------------------------------------------------

SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"model": "ti\\ud800ny", "messages": [{"role": "user", "content": "a"}]}', "model"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a"}], "\\udfff": 1}', "\\udfff"),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\udc00x", "max_tokens": 2}', "prompt"),
    ("/v1/messages", '{"model": "tiny", "max_tokens": 2, "system": "\\ud800", "messages": [{"role": "user", "content": "a"}]}', "system"),
    ("/v1/messages/count_tokens", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', None),
]  # fmt: skip


@pytest.mark.parametrize("rules", ["on", "off"])
@pytest.mark.parametrize(("path", "raw", "param"), SURROGATE_BODIES)
def test_lone_surrogate_anywhere_is_a_400(server, path, raw, param, rules):
    response = httpx.post(
        server.base_url + path,
        content=raw,
        headers={"content-type": "application/json", "x-prefixgate-rules": rules},
        timeout=60,
    )
    if path.startswith("/v1/messages"):
        assert "surrogate" in anthropic_error(response, 400)["message"]
    else:
        error = openai_error(response, 400, code="invalid_unicode", param=param)
        assert "surrogate" in error["message"]
    assert_no_block_in_use(server)


def test_a_valid_surrogate_pair_is_served(server):
    raw = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert post_raw(server, "/v1/chat/completions", raw).status_code == 200
    assert_no_block_in_use(server)


# ---- depth -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("shape", ["[", '{"a":'])
def test_json_nested_100000_deep_is_a_400(lenient, path, shape):
    closing = "]" if shape == "[" else "}"
    raw = shape * 100_000 + "1" + closing * 100_000
    response = post_raw(lenient, path, raw)
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.text
    assert_no_block_in_use(lenient)


def test_brackets_inside_strings_do_not_count_as_depth(server, client):
    answer = client.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "[" * 200 + '\\"{'}], max_tokens=2
    )
    assert answer.choices[0].message.content is not None
    assert_no_block_in_use(server)


# ---- 500s close the connection ---------------------------------------------------------------------------


def test_a_500_says_connection_close_and_the_next_request_works(lenient):
    with httpx.Client(base_url=lenient.base_url, timeout=60) as http:
        failed = http.post("/boom", json={})
        assert failed.status_code == 500
        assert failed.headers["connection"] == "close"
        assert failed.json()["error"]["type"] == "server_error"
        after = http.post("/v1/chat/completions", json=CHAT)
        assert after.status_code == 200, after.text
    assert_no_block_in_use(lenient)


# ---- tool_choice -----------------------------------------------------------------------------------------


def test_tool_choice_of_the_wrong_type_is_a_type_error(server):
    response = post_raw(server, "/v1/chat/completions", json.dumps({**CHAT, "tool_choice": 5}))
    openai_error(response, 400, code="invalid_type", param="tool_choice")
    assert_no_block_in_use(server)


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_without_tools_is_a_400(server, client, choice):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=2, tool_choice=choice)
    assert info.value.body["param"] == "tool_choice"
    assert "only allowed when 'tools' are specified" in info.value.body["message"]
    assert_no_block_in_use(server)


def test_an_unknown_tool_choice_mode_is_a_400(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = post_raw(
        server, "/v1/chat/completions", json.dumps({**CHAT, "tools": tools, "tool_choice": "always"})
    )
    openai_error(response, 400, code="invalid_value", param="tool_choice")
    assert_no_block_in_use(server)


# ---- unknown fields, strict by default -------------------------------------------------------------------


def test_unknown_fields_are_refused_on_both_faces_by_default(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as sdk:
        with pytest.raises(anthropic.BadRequestError) as info:
            sdk.messages.create(
                model=TINY_MODEL, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": True}
            )
    assert info.value.body["error"]["message"] == "frobnicate: Extra inputs are not permitted"
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as error:
            sdk.chat.completions.create(
                model=TINY_MODEL, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": True}
            )
    assert error.value.body["code"] == "unknown_parameter"
    response = post_raw(server, "/v1/messages/count_tokens", json.dumps({**ANTHROPIC, "frobnicate": 1}))
    anthropic_error(response, 400)
    assert_no_block_in_use(server)


def test_unknown_fields_are_ignored_when_configured(lenient):
    with anthropic.Anthropic(base_url=lenient.base_url, api_key="unused", max_retries=0) as sdk:
        message = sdk.messages.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": True}
        )
    assert message.stop_reason in ("end_turn", "max_tokens")
    with openai.OpenAI(base_url=f"{lenient.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        answer = sdk.chat.completions.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": True}
        )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert_no_block_in_use(lenient)


# ---- Anthropic fields the embedded engine cannot honour --------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"output_config": {"effort": 3}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_thinking_and_output_config_are_refused_clearly(server, extra, field, stream):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as sdk:
        with pytest.raises(anthropic.BadRequestError) as info:
            sdk.messages.create(
                model=TINY_MODEL, messages=MESSAGES, max_tokens=2, stream=stream, extra_body=extra
            )
    assert info.value.body["error"]["message"].startswith(f"{field}:")
    assert_no_block_in_use(server)


def test_thinking_disabled_is_served(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as sdk:
        message = sdk.messages.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=2, thinking={"type": "disabled"}
        )
    assert message.type == "message"
    assert_no_block_in_use(server)


CLAUDE_CODE_DEFAULTS = {
    "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}
"""What Claude Code sends on every request: each asks nothing a model without thinking or effort levels cannot
give (adaptive thinking leaves it to the model; effort is a hint; clearing thinking blocks clears none here)."""


@pytest.mark.parametrize("stream", [False, True])
def test_claude_codes_default_thinking_effort_and_context_management_are_served(server, stream):
    """Before (a trial with Claude Code): each was a 400, so no default Claude Code request got an answer, and
    count_tokens refused them too."""
    body = {**ANTHROPIC, **CLAUDE_CODE_DEFAULTS, "max_tokens": 2, "stream": stream}
    response = post_raw(server, "/v1/messages", json.dumps(body))
    assert response.status_code == 200, response.text
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    counted = post_raw(server, "/v1/messages/count_tokens", json.dumps(count))
    assert counted.status_code == 200, counted.text
    assert_no_block_in_use(server)


@pytest.mark.parametrize(
    "block",
    [
        {"type": "fancy_new_block", "payload": 1},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
    ],
)
def test_an_unsupported_content_block_is_named_by_its_own_type(server, block):
    body = {**ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}
    error = anthropic_error(post_raw(server, "/v1/messages", json.dumps(body)), 400)
    assert f"'{block['type']}'" in error["message"]
    assert "x-anthropic" not in error["message"]
    assert_no_block_in_use(server)


@pytest.mark.parametrize("content", ["Be brief.", [{"type": "text", "text": "Be brief."}]])
def test_a_mid_conversation_system_message_is_served_and_counted(server, content):
    """Before (a trial with Claude Code, which sends its agent list in one on every request, beta
    ``mid-conversation-system-2026-04-07``): 400 "role must be 'user' or 'assistant'"."""
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": content}]
    body = {**ANTHROPIC, "messages": messages}
    response = post_raw(server, "/v1/messages", json.dumps(body))
    assert response.status_code == 200, response.text
    count = {k: v for k, v in body.items() if k != "max_tokens"}
    with_system = post_raw(server, "/v1/messages/count_tokens", json.dumps(count)).json()["input_tokens"]
    count["messages"] = messages[:1]
    without = post_raw(server, "/v1/messages/count_tokens", json.dumps(count)).json()["input_tokens"]
    assert with_system > without  # the model reads it
    bad = {
        **ANTHROPIC,
        "messages": [messages[0], {"role": "system", "content": [{"type": "image", "source": {}}]}],
    }
    error = anthropic_error(post_raw(server, "/v1/messages", json.dumps(bad)), 400)
    assert (
        "system messages hold text blocks only" in error["message"]
        or "messages[1].content[0]" in error["message"]
    )
    assert_no_block_in_use(server)
