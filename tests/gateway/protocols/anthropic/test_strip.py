"""``plain_messages`` (gateway.protocols.anthropic.strip): a failed tool's result (``is_error: true``) reaches a
backend that is not Anthropic with ``Error: `` first, since that backend has no field for the flag."""

from __future__ import annotations

import copy

import pytest

from gateway.protocols.anthropic.strip import TOOL_ERROR_PREFIX, plain_messages

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def tool(content, is_error=True) -> dict:
    return {"role": "tool", "tool_call_id": "toolu_1", "content": content, "is_error": is_error}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("city not found", "Error: city not found"),
        ([{"type": "text", "text": "city "}, {"type": "text", "text": "not found"}], "Error: city not found"),
        (
            [{"type": "text", "text": "see"}, IMAGE],
            [{"type": "text", "text": "Error:"}, {"type": "text", "text": "see"}, IMAGE],
        ),
        ("", "Error:"),
        ([], "Error:"),  # no parts: the empty text
    ],
)
def test_a_failed_tools_result_starts_with_the_error_prefix(content, expected):
    """Before: ``is_error`` was dropped with the other Anthropic-only keys, so the model read a failure as a
    result (``count_tokens`` counted the same tokens with and without it)."""
    message = tool(content)
    before = copy.deepcopy(message)
    (out,) = plain_messages([message])
    assert out == {"role": "tool", "tool_call_id": "toolu_1", "content": expected}
    assert message == before and TOOL_ERROR_PREFIX == "Error: "


def test_a_result_that_did_not_fail_and_other_messages_stay_as_they_were():
    ok = tool("18C, cloudy", is_error=False)
    user = {"role": "user", "content": "Error budget?", "is_error": True}  # only a tool message's flag counts
    assert plain_messages([ok, user]) == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C, cloudy"},
        {"role": "user", "content": "Error budget?"},
    ]
