"""Anthropic: the client's cache_control checked as the provider would, or automatic vs placed breakpoints."""

from __future__ import annotations

import copy

import pytest

from gateway.core.cache_usage import NO_CACHE
from gateway.core.tokens import estimate_counter
from gateway.protocols.anthropic.boundaries import default_boundaries
from gateway.protocols.anthropic.cache_control import (
    CacheControlError,
    check_client_cache_control,
    plan_cache_control,
)

COUNTER = estimate_counter()  # len(text) // 4: exact token counts for these tests
SYSTEM = "s" * 8_000  # 2,000 tokens
EPH = {"type": "ephemeral"}


def _text(text: str, **extra) -> dict:
    return {"type": "text", "text": text, **extra}


def _chat() -> dict:
    return {
        "model": "claude-haiku-4-5",
        "max_tokens": 64,
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": "q" * 400},
            {"role": "assistant", "content": "a" * 400},
            {"role": "user", "content": "n" * 400},
        ],
    }


def _agent(tools: int = 25) -> dict:
    """One user question, an assistant turn with ``tools`` tool calls, and their results: 2 + 2 * tools blocks."""
    return {
        "model": "claude-haiku-4-5",
        "max_tokens": 64,
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": "q" * 400},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": f"t{i}", "name": "grep", "input": {"q": "x" * 40}}
                    for i in range(tools)
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": "r" * 400}
                    for i in range(tools)
                ],
            },
        ],
    }


def _plan(body, ttl="5m", min_tokens=1_024):
    return plan_cache_control(
        body, default_boundaries(body), body["model"], ttl=ttl, min_tokens=min_tokens, counter=COUNTER
    )


def test_a_chat_turn_takes_automatic_caching():
    body = _chat()
    plan = _plan(body)
    assert plan.mode == "automatic"
    assert plan.body["cache_control"] == EPH
    assert plan.body["system"][0]["cache_control"] == EPH  # the stable prefix keeps its own entry
    # reads the previous turn's entry (up to the question it answered), writes the whole request
    assert plan.scores["automatic"] == (2_100, 2_300)
    assert plan.scores["placed"] == (2_100, 2_200)
    assert "cache_control" not in body  # the input is not changed


def test_an_agent_turn_past_the_20_block_lookback_reads_the_previous_request_where_it_ended():
    # the automatic plan puts a breakpoint where the previous request ended (its top-level marker wrote there):
    # read exactly however many blocks the turn added, and the whole request written for the next turn. The
    # placed plan wrote at the newest reply's end and never at the last block, so the turn after it found
    # nothing within 20 blocks (a re-trial read the same 5,471 tokens from turn 3 on of a 12-call loop)
    for calls in (5, 10, 11, 25):
        plan = _plan(_agent(calls))
        assert plan.mode == "automatic" and plan.body["cache_control"] == EPH
        read, write = plan.scores["automatic"]
        assert read == 2_100  # the previous request's entry: the system prompt and the question
        assert write > plan.scores["placed"][1]  # the whole request, tool results included
        assert plan.body["messages"][0]["content"][0]["cache_control"] == EPH  # where the previous one ended


def test_the_ttl_goes_on_every_marker_the_gateway_adds():
    assert _plan(_chat(), ttl="1h").body["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    placed = _plan(_agent(25), ttl="1h").body
    blocks = [b for m in placed["messages"] if isinstance(m["content"], list) for b in m["content"]]
    blocks += [b for b in placed["system"] if isinstance(b, dict)]
    markers = [b["cache_control"] for b in blocks if "cache_control" in b]
    assert len(markers) >= 2
    assert all(m == {"type": "ephemeral", "ttl": "1h"} for m in markers)


def test_minimum_lengths_and_no_cache():
    body = _chat()
    assert _plan(body, min_tokens=4_096).mode == "none"  # Haiku 4.5: 4,096 tokens; this prompt has 2,300
    assert _plan(body, min_tokens=4_096).body is body
    assert _plan(body, ttl=NO_CACHE).mode == "none"
    with pytest.raises(ValueError, match="ttl"):
        _plan(body, ttl="2h")


def test_explicit_client_choices_are_kept_untouched():
    body = _chat()
    body["system"] = [_text(SYSTEM, cache_control={"type": "ephemeral", "ttl": "1h"})]
    body["messages"][1]["content"] = [_text("a" * 400, cache_control=EPH)]
    before = copy.deepcopy(body)
    plan = _plan(body)
    assert plan.mode == "client" and plan.body is body and body == before
    assert [(b.param, b.ttl) for b in plan.client] == [("system.0", "1h"), ("messages.1.content.0", "5m")]
    top = {**_chat(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert _plan(top).mode == "client"


def _error(body) -> CacheControlError:
    with pytest.raises(CacheControlError) as info:
        check_client_cache_control(body)
    assert info.value.status_code == 400
    shape = info.value.anthropic_body()
    assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error"
    return info.value


def test_a_fifth_breakpoint_is_refused_in_anthropic_error_shape():
    body = _chat()
    body["system"] = [_text(f"part {i}", cache_control=EPH) for i in range(4)]
    assert len(check_client_cache_control(body)) == 4
    err = _error({**body, "cache_control": EPH})  # the top-level one takes a slot too
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in str(err)
    assert err.param == "cache_control"
    body["tools"] = [{"name": "t", "input_schema": {"type": "object"}, "cache_control": EPH}]
    assert _error(body).param == "system.3"


def test_1h_after_5m_is_refused():
    body = _chat()
    body["system"] = [
        _text("a", cache_control=EPH),
        _text("b", cache_control={"type": "ephemeral", "ttl": "1h"}),
    ]
    err = _error(body)
    assert err.param == "system.1.cache_control" and "ttl='1h'" in str(err)
    # a 1h top-level (automatic: the last block) after a 5m block breakpoint is refused too
    body = {**_chat(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body["system"] = [_text("a", cache_control={"type": "ephemeral", "ttl": "5m"})]
    assert _error(body).param == "cache_control"


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (_text("x", cache_control={"type": "persistent"}), "type must be 'ephemeral'"),
        (_text("x", cache_control={"type": "ephemeral", "ttl": "2h"}), "ttl must be '5m' or '1h'"),
        (_text("x", cache_control="ephemeral"), "must be an object"),
        (_text("x", cache_control={"type": "ephemeral", "scope": "global"}), "unknown field"),
        (_text("", cache_control=EPH), "empty text blocks"),
        ({"type": "thinking", "thinking": "t", "signature": "s", "cache_control": EPH}, "thinking blocks"),
    ],
)
def test_markers_the_provider_would_reject(block, match):
    body = _chat()
    body["messages"][1]["content"] = [block]
    err = _error(body)
    assert match in str(err)
    assert err.param == "messages.1.content.0.cache_control"


def test_markers_inside_a_tool_result_count():
    body = _agent(1)
    body["messages"][2]["content"][0]["content"] = [_text("r", cache_control=EPH)] * 5
    assert _error(body).param == "messages.2.content.0.content.4"


def _markers(body) -> list[dict]:
    blocks = [b for b in body.get("tools") or []]
    blocks += [b for b in body["system"] if isinstance(b, dict)] if isinstance(body["system"], list) else []
    blocks += [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    return [b["cache_control"] for b in blocks if "cache_control" in b]


def test_a_ttl_per_kind_of_breakpoint_in_the_providers_order():
    one_hour = {"type": "ephemeral", "ttl": "1h"}
    # the prefix key reuses within 5 minutes, the conversation after 20: the earlier marker is lifted to 1h
    lifted = _plan(_agent(25), ttl={"stable": "5m", "history": "1h"})
    assert (
        lifted.mode == "automatic"
        and _markers(lifted.body)
        and all(m == one_hour for m in [*_markers(lifted.body), lifted.body["cache_control"]])
    )
    # 1h then 5m is the provider's own order: kept
    mixed = _plan(_agent(25), ttl={"stable": "1h", "history": "5m"})
    assert mixed.ttl == "mixed"
    assert _markers(mixed.body)[0] == one_hour and _markers(mixed.body)[-1] == EPH
    check_client_cache_control(mixed.body)  # what the gateway sends passes the provider's checks
    # no marker for the history: only the stable prefix is cached, and automatic caching is not a candidate
    stable_only = _plan(_chat(), ttl={"stable": "5m", "history": NO_CACHE})
    assert stable_only.mode == "placed" and stable_only.scores["automatic"] == (0, 0)
    assert _markers(stable_only.body) == [EPH] and "cache_control" in stable_only.body["system"][0]
    # the automatic marker takes the history's TTL
    assert _plan(_chat(), ttl={"stable": "5m", "history": "1h"}).body["cache_control"] == one_hour
    with pytest.raises(ValueError, match="'stable' and 'history'"):
        _plan(_chat(), ttl={"stable": "5m"})
