"""Issue 15 wired in: respx-mocked upstreams answering with recorded provider responses written from the
documented shapes (tests/gateway/fixtures/provider_caching): client cache_control refused before any call,
the TTL and retention choices in the bodies sent, cache_salt, usage split by TTL, usage of the wrong type as a
502, and cost / write waste / provider miss reasons in the stats."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import respx

from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.price_table import shipped_price_table
from gateway.core.errors import APIError
from gateway.core.events import BackendUsage, Finish
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.service.cache_ttl import ReuseTracker
from gateway.service.cost_ledger import CostLedger
from gateway.service.retention import RetentionPolicy, attach_retention_policy
from gateway.service.stats import GatewayStats
from gateway.transport.failures import UpstreamStreamCut
from rules import load_ruleset
from tests.gateway.upstream_helpers import API_KEY, Sleeps, chat_request, drain

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "provider_caching"
ANT_BASE, OAI_BASE = "https://api.anthropic.test", "https://api.openai.test/v1"
TABLE = shipped_price_table()
HAIKU = TABLE.lookup("claude-haiku-4-5")
GPT = TABLE.lookup("gpt-5.6")
EPH = {"type": "ephemeral"}
SYSTEM = " ".join(f"policy{i}" for i in range(6000))  # well over Haiku 4.5's 4,096-token minimum


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture
async def http():
    async with httpx.AsyncClient() as client:
        yield client


def _anthropic(http, **kwargs) -> AnthropicUpstreamBackend:
    return AnthropicUpstreamBackend(
        "claude", [ANT_BASE], api_key=API_KEY, upstream_model="claude-haiku-4-5", retries=0, client=http,
        sleep=Sleeps(), prices=HAIKU, **kwargs,
    )  # fmt: skip


def _messages_request(body: dict, tenant: str = "t1"):
    request = parse_messages_body({"model": "claude", "max_tokens": 64, "stream": False, **body})
    request.canonical = load_ruleset([]).apply(request.messages, request.tools)
    request.prefix_key = "ab" * 16
    request.tenant = tenant
    return request


@respx.mock
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"system": [{"type": "text", "text": f"s{i}", "cache_control": EPH} for i in range(5)]}, "system.4"),
        (
            {
                "system": [{"type": "text", "text": "a", "cache_control": EPH}],
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
            "cache_control",
        ),
    ],
)
async def test_a_client_cache_control_the_provider_would_refuse_never_reaches_it(http, body, param):
    route = respx.post(f"{ANT_BASE}/v1/messages").mock(return_value=httpx.Response(200, json={}))
    request = _messages_request({**body, "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(APIError) as info:
        await drain(_anthropic(http).stream(request))
    assert info.value.status_code == 400 and info.value.error_type == "invalid_request_error"
    assert info.value.param == param
    assert not route.called


@respx.mock
async def test_anthropic_ttl_choice_and_usage_split_by_ttl(http):
    route = respx.post(f"{ANT_BASE}/v1/messages").mock(
        return_value=httpx.Response(200, json=_fixture("anthropic_write_1h.json"))
    )
    now = [0.0]
    backend = _anthropic(http)
    attach_retention_policy({"claude": backend}, RetentionPolicy(ReuseTracker(clock=lambda: now[0])))
    sent, finishes = [], []
    for minute in (0, 20, 40, 60):  # the same conversation prefix comes back every 20 minutes
        now[0] = minute * 60.0
        body = {"system": SYSTEM, "messages": [{"role": "user", "content": "same question"}]}
        events = await drain(backend.stream(_messages_request(body)))
        sent.append(json.loads(route.calls.last.request.content))
        finishes.append(events[-1])
    # first request: nothing known, the default 5m; after three 20-minute returns: 1h everywhere
    assert sent[0]["system"][0]["cache_control"] == EPH
    assert sent[-1]["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    usage = finishes[0].usage
    assert isinstance(finishes[0], Finish)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_creation_tokens) == (6_050, 0, 6_000)
    assert usage.cache_writes == (("1h", 5_000), ("5m", 1_000))


@respx.mock
async def test_a_clients_cache_salt_reaches_the_upstream_only_as_the_tenant(http):
    """The client's ``cache_salt`` is folded into the tenant (``acme/alice``, ``gateway.http.auth``): an upstream
    with ``cache_salt: true`` gets that tenant, one without never sees the field (OpenAI refuses it)."""
    route = respx.post(f"{OAI_BASE}/chat/completions").mock(
        return_value=httpx.Response(200, json=_fixture("openai_gpt56_write.json"))
    )
    body = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "alice"}
    request = chat_request(body["messages"], model="gpt", body=body, tenant="acme/alice")
    await drain(_openai(http, cache_salt=True).stream(request))
    assert json.loads(route.calls.last.request.content)["cache_salt"] == "acme/alice"
    await drain(_openai(http).stream(request))
    assert "cache_salt" not in json.loads(route.calls.last.request.content)


@respx.mock
async def test_anthropic_usage_of_the_wrong_type_is_a_502(http):
    respx.post(f"{ANT_BASE}/v1/messages").mock(
        return_value=httpx.Response(200, json=_fixture("anthropic_bad_usage.json"))
    )
    request = _messages_request({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(UpstreamStreamCut) as info:
        await drain(_anthropic(http).stream(request))
    assert info.value.status_code == 502


@respx.mock
async def test_anthropic_miss_reason_reaches_the_finish(http):
    respx.post(f"{ANT_BASE}/v1/messages").mock(
        return_value=httpx.Response(200, json=_fixture("anthropic_miss_system_changed.json"))
    )
    request = _messages_request({"messages": [{"role": "user", "content": "hi"}]})
    events = await drain(_anthropic(http).stream(request))
    assert events[-1].cache_miss_reason == "system_changed"


def _openai(http, **kwargs) -> OpenAIUpstreamBackend:
    return OpenAIUpstreamBackend(
        "gpt", [OAI_BASE], api_key=API_KEY, upstream_model="gpt-5.6", retries=0, client=http, sleep=Sleeps(),
        prices=GPT, **kwargs,
    )  # fmt: skip


@respx.mock
async def test_openai_retention_cache_salt_and_usage(http):
    route = respx.post(f"{OAI_BASE}/chat/completions").mock(
        return_value=httpx.Response(200, json=_fixture("openai_gpt56_write.json"))
    )
    backend = _openai(http, cache_salt=True)
    attach_retention_policy({"gpt": backend}, RetentionPolicy(ReuseTracker(clock=lambda: 0.0)))
    request = chat_request([{"role": "user", "content": "hi"}], model="gpt", tenant="acme")
    events = await drain(backend.stream(request))
    sent = json.loads(route.calls.last.request.content)
    # both retentions cost the same (the pricing page): 24h dominates in_memory
    assert sent["prompt_cache_retention"] == "24h"
    assert sent["cache_salt"] == "acme"
    finish = events[-1]
    assert finish.cache_retention == "24h"
    assert (finish.usage.prompt_tokens, finish.usage.cached_tokens, finish.usage.cache_creation_tokens) == (
        4_000,
        2_048,
        1_024,
    )
    # a client's own choice is kept; no salt without the flag; none for a model with a single retention
    body = {
        "model": "gpt",
        "messages": [{"role": "user", "content": "hi"}],
        "prompt_cache_retention": "in_memory",
    }
    client = chat_request(body["messages"], model="gpt", body=body, tenant="acme")
    await drain(_openai(http, retention_chooser=lambda r: "24h").stream(client))
    sent = json.loads(route.calls.last.request.content)
    assert sent["prompt_cache_retention"] == "in_memory" and "cache_salt" not in sent
    plain = _openai(http)
    plain.prices = TABLE.lookup("gpt-4o")
    attach_retention_policy({"gpt": plain}, RetentionPolicy())
    assert plain.retention_chooser is None


@respx.mock
async def test_openai_usage_of_the_wrong_type_is_a_502(http):
    respx.post(f"{OAI_BASE}/chat/completions").mock(
        return_value=httpx.Response(200, json=_fixture("openai_bad_usage.json"))
    )
    with pytest.raises(UpstreamStreamCut) as info:
        await drain(_openai(http).stream(chat_request([{"role": "user", "content": "hi"}], model="gpt")))
    assert info.value.status_code == 502


def test_stats_show_cost_saved_and_write_waste_per_model_key_and_tenant():
    now = [0.0]
    stats = GatewayStats({"claude": HAIKU, "local": None}, prices_checked=TABLE.checked, ledger=CostLedger(
        clock=lambda: now[0]))  # fmt: skip
    write = BackendUsage(6_050, 12, 0, 6_000, cache_writes=(("1h", 5_000), ("5m", 1_000)))
    cost = stats.record_finish("claude", write, None, "pk1", tenant="t1")
    assert cost.header_value() == (  # 12 output tokens at Haiku 4.5's $5 / MTok
        "paid=0.01130000; saved=0.00000000; write_premium=0.00525000; output=0.00006000"
    )
    now[0] = 1_200.0  # 20 minutes later: the 1h part is read, the 5m part expired unread
    read = BackendUsage(5_100, 9, 5_000, 0)
    stats.record_finish("claude", read, None, "pk1", tenant="t1", cache_miss_reason="system_changed")
    now[0] = 2_000.0
    doc = stats.snapshot({"claude": None, "local": None})
    assert doc["prices_checked"] == TABLE.checked
    model = doc["models"]["claude"]
    assert model["cost_saved_usd"] == pytest.approx(5_000 * 0.9 / 1e6)
    assert model["write_waste_usd"] == pytest.approx(1_000 * 0.25 / 1e6)
    assert doc["costs"]["by_key"]["pk1"]["wasted_write_tokens"] == 1_000
    assert doc["costs"]["by_tenant"]["t1"]["requests"] == 2
    # the provider said the prefix could not be fully reused: counted under the gateway's own cause
    assert doc["provider_cache_misses"]["by_cause"]["system_changed"] == 1
    stats.record_finish(
        "claude", BackendUsage(5_100, 9, 0, 0), None, "pk1", cache_miss_reason="messages_changed"
    )
    assert stats.snapshot({})["provider_cache_misses"]["by_cause"]["history_rewritten"] == 1
    assert stats.record_finish("local", read, None, "pk2") is None
