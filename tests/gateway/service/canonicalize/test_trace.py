"""Trace lines: OpenAI and Anthropic bodies and envelopes parsed into OpenAI-shaped requests."""

from __future__ import annotations

import json

import pytest

from gateway.service.canonicalize.trace import TraceLineError, parse_line


def test_anthropic_bodies_are_converted() -> None:
    body = {
        "model": "claude",
        "max_tokens": 5,
        "system": "Be terse and exact in every single reply you give.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    request = parse_line(json.dumps(body), 1)
    assert request.protocol == "anthropic"
    assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert request.tools[0]["function"]["name"] == "f"
    with pytest.raises(TraceLineError, match="anthropic"):
        parse_line(json.dumps({**body, "messages": [{"role": "robot", "content": "x"}]}), 2)
    with pytest.raises(TraceLineError, match="envelope 'protocol'"):
        parse_line(json.dumps({"protocol": "grpc", "body": body}), 3)
