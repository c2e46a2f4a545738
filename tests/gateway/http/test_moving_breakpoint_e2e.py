"""A client that moves its ``cache_control`` breakpoint to the newest message every turn (Anthropic's documented
multi-turn pattern, Claude Code's), through the real gateway with the official SDK, in front of a stub
Anthropic upstream: what the provider receives keeps the conversation's earlier turns byte-identical (their
first time value included) while the system prompt's time changes every turn, and carries only the client's
marker, where the client put it (found by a fresh-user trial: the provider's cache read stayed at the system
prompt and the whole history was written again each turn)."""

from __future__ import annotations

import copy
from typing import Any

import anthropic
import pytest

from tests.gateway.server import RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, anthropic_stub

SYSTEM = "You are the release assistant of Acme. Answer in one sentence.\nCurrent time: 2026-12-06 10:{minute:02d}:00"
MARKER = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    state = StubState("ANT")
    stub = StubServer(anthropic_stub(state)).start()
    data = {
        "models": [
            {
                "name": "claude",
                "backend": "anthropic",
                "base_url": stub.base_url,
                "api_key": "k",
                "upstream_model": "claude-sonnet-4-5",
            }
        ]
    }
    server = RunningServer(write_config(tmp_path_factory.mktemp("mb") / "prefixgate.yaml", data)).start()
    server.state = state
    yield server
    server.stop()
    stub.stop()


def without_markers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for message in out:
        if isinstance(message["content"], list):
            for block in message["content"]:
                block.pop("cache_control", None)
    return out


def markers(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [
        (i, j)
        for i, message in enumerate(messages)
        if isinstance(message["content"], list)
        for j, block in enumerate(message["content"])
        if "cache_control" in block
    ]


def test_a_moving_breakpoint_keeps_the_history_the_provider_caches(gateway):
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What ships today?"}]}
    ]
    sent: list[list[dict[str, Any]]] = []
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="x", max_retries=0) as client:
        for turn in range(4):
            request = copy.deepcopy(history)
            request[-1]["content"][-1]["cache_control"] = MARKER
            before = len(gateway.state.requests)
            answer = client.messages.create(
                model="claude", max_tokens=16, system=SYSTEM.format(minute=turn), messages=request
            )
            body = gateway.state.requests[before]
            sent.append(body["messages"])
            assert markers(body["messages"]) == [
                (len(body["messages"]) - 1, len(body["messages"][-1]["content"]) - 1)
            ]
            history += [
                {"role": "assistant", "content": [{"type": "text", "text": answer.content[0].text}]},
                {"role": "user", "content": [{"type": "text", "text": f"And after step {turn}?"}]},
            ]
    for earlier, later in zip(sent, sent[1:], strict=False):
        assert without_markers(later)[: len(earlier)] == without_markers(earlier)
    assert "10:00:00" in str(sent[-1][0]) and "10:03:00" in str(sent[-1][-1])
