"""``prompt_size.prompt_chars``: the characters a request's prompt holds, counted exactly."""

from __future__ import annotations

from engine.api import SamplingParams
from gateway.core.prompt_size import prompt_chars
from gateway.core.request import ChatRequest


def test_prompt_chars_counts_strings_and_text_parts_by_length():
    image = {"type": "image_url", "image_url": {"url": "u"}}
    messages = [
        {"role": "system", "content": "abcd"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "xyz", "cache_control": {"type": "ephemeral"}}, image],
        },
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    request = ChatRequest(model="m", messages=messages, params=SamplingParams(), tools=[{"type": "function"}])
    assert prompt_chars(request) == 4 + 3 + len(str(image)) + len(str([{"type": "function"}]))
