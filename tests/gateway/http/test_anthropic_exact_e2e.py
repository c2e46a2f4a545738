"""Anthropic face, exact behaviour over the embedded engine (issue 16): ``stop_sequences`` report
``stop_reason: stop_sequence`` and the matched string, streamed and not; a final assistant turn (prefill) is
continued; a streamed ``message_start`` carries the real input counts. Through the official SDK; no block is
left in use after any of them."""

from __future__ import annotations

import anthropic
import pytest

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.http.test_protocol_exact_e2e import assert_no_block_in_use

GREEDY = {"temperature": 0}  # the SDK's create() has no temperature argument any more: sent as an extra
QUESTION = [{"role": "user", "content": "Tell me a story about a cat"}]


@pytest.fixture
def sdk(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def _greedy_text(sdk, **extra) -> str:
    message = sdk.messages.create(
        model=TINY_MODEL, messages=QUESTION, max_tokens=12, extra_body=GREEDY, **extra
    )
    return "".join(block.text for block in message.content if block.type == "text")


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string taken from the greedy answer, and the text before its first occurrence."""
    stop = text[3:5]
    assert stop.strip(), text  # a greedy answer of the tiny model is long enough to cut
    return stop, text[: text.index(stop)]


def test_stop_sequences_report_the_matched_string(server, sdk):
    stop, before = _stop_inside(_greedy_text(sdk))
    message = sdk.messages.create(
        model=TINY_MODEL,
        messages=QUESTION,
        max_tokens=12,
        extra_body=GREEDY,
        stop_sequences=["\u2603never\u2603", stop],
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert "".join(b.text for b in message.content if b.type == "text") == before
    assert_no_block_in_use(server)


def test_stop_sequences_report_the_matched_string_when_streamed(server, sdk):
    stop, before = _stop_inside(_greedy_text(sdk))
    with sdk.messages.stream(
        model=TINY_MODEL, messages=QUESTION, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "message_delta"]
    assert deltas[-1].delta.stop_reason == "stop_sequence" and deltas[-1].delta.stop_sequence == stop
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert "".join(b.text for b in final.content if b.type == "text") == before
    assert_no_block_in_use(server)


def test_end_turn_and_max_tokens_report_no_stop_sequence(server, sdk):
    message = sdk.messages.create(
        model=TINY_MODEL, messages=QUESTION, max_tokens=3, stop_sequences=["\u2603"]
    )
    assert (message.stop_reason, message.stop_sequence) in (("max_tokens", None), ("end_turn", None))
    assert_no_block_in_use(server)


def test_streamed_message_start_carries_the_input_counts(server, sdk):
    messages = [{"role": "user", "content": "cache me " * 20}]
    for _ in range(2):  # the second time the prompt's full blocks come from the prefix cache
        with sdk.messages.stream(model=TINY_MODEL, messages=messages, max_tokens=4) as stream:
            events = list(stream)
            final = stream.get_final_message()
        start = next(e for e in events if e.type == "message_start").message.usage
        assert start.input_tokens > 0
        assert start.input_tokens == final.usage.input_tokens
        assert start.cache_read_input_tokens == final.usage.cache_read_input_tokens
        assert start.output_tokens == 0
    assert final.usage.cache_read_input_tokens > 0
    assert_no_block_in_use(server)


def test_a_final_assistant_turn_is_continued(server, sdk, client):
    prefill = [*QUESTION, {"role": "assistant", "content": "Once upon"}]
    continued = sdk.messages.create(model=TINY_MODEL, messages=prefill, max_tokens=2, extra_body=GREEDY)
    counted = sdk.messages.count_tokens(model=TINY_MODEL, messages=prefill)
    assert (
        continued.usage.input_tokens + (continued.usage.cache_read_input_tokens or 0) == counted.input_tokens
    )
    # The OpenAI face closes the assistant turn and opens a new one: more prompt tokens for the same messages.
    closed = client.chat.completions.create(
        model=TINY_MODEL, messages=prefill, max_tokens=2, extra_body=GREEDY
    )
    assert closed.usage.prompt_tokens > counted.input_tokens
    with sdk.messages.stream(model=TINY_MODEL, messages=prefill, max_tokens=2, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in continued.content]
    assert_no_block_in_use(server)


def test_a_final_assistant_tool_use_is_not_a_prefill(server, sdk):
    messages = [
        *QUESTION,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    ]
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    counted = sdk.messages.count_tokens(model=TINY_MODEL, messages=messages, tools=tools)
    assert counted.input_tokens > 0
    assert_no_block_in_use(server)


def test_cache_control_markers_the_messages_api_refuses_are_refused_here_too(server, sdk):
    # more than 4 breakpoints: the real API answers 400, so a client tested against it must see the same here
    text = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, extra_body=GREEDY
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in caught.value.message
    ordered = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": ordered}], max_tokens=2, extra_body=GREEDY
        )
    four = text[:4]
    message = sdk.messages.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": four}], max_tokens=2, extra_body=GREEDY
    )
    assert message.usage.output_tokens >= 1
    assert_no_block_in_use(server)


def test_top_p_zero_is_greedy_as_on_the_openai_face(server, sdk):
    """Before: ``top_p: 0`` passed the face's check ("a number in [0.0, 1.0]") and the engine then refused it
    with "top_p must be in (0, 1]", two messages that contradicted each other. Both faces now run it as the
    nucleus of mass -> 0: the single most likely token, greedy."""
    greedy = _greedy_text(sdk)
    message = sdk.messages.create(
        model=TINY_MODEL, messages=QUESTION, max_tokens=12, extra_body={"top_p": 0, "temperature": 1}
    )
    assert "".join(b.text for b in message.content if b.type == "text") == greedy
    with pytest.raises(anthropic.BadRequestError) as err:
        sdk.messages.create(model=TINY_MODEL, messages=QUESTION, max_tokens=12, extra_body={"top_p": 1.5})
    assert "[0.0, 1.0]" in err.value.body["error"]["message"]
    assert_no_block_in_use(server)
