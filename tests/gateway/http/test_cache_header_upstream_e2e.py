"""``x-prefixgate-cache`` over upstreams, through the real gateway with the official SDKs: the usage's cached
tokens, a prompt below Anthropic's minimum cacheable length explained as ``below_minimum``, and a streamed
OpenAI-compatible answer (its cache is reported only at the end) without a header but still counted."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, anthropic_stub, openai_stub

SYSTEM = "You are the catalogue assistant. Answer every question about the catalogue in one short sentence."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    ant_state = StubState("ANT")
    stubs = {
        "openai": StubServer(openai_stub(StubState("OAI"))).start(),
        "anthropic": StubServer(anthropic_stub(ant_state)).start(),
    }
    data = {
        "admin": {"token": ADMIN_TOKEN},
        "models": [
            {"name": "oa", "backend": "openai", "base_url": f"{stubs['openai'].base_url}/v1", "api_key": "k"},
            {
                "name": "an",
                "backend": "anthropic",
                "base_url": stubs["anthropic"].base_url,
                "api_key": "k",
                "upstream_model": "claude-sonnet-4-5",
            },
        ],
    }
    server = RunningServer(write_config(tmp_path_factory.mktemp("hdr") / "prefixgate.yaml", data)).start()
    server.anthropic_state = ant_state
    yield server
    server.stop()
    for stub in stubs.values():
        stub.stop()


def fields(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


def test_openai_upstream_reports_its_cached_tokens_in_the_header(gateway):
    with openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0) as client:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is in stock ?"}]
        raw = client.chat.completions.with_raw_response.create(model="oa", messages=messages)
        first = fields(raw.headers["x-prefixgate-cache"])
        assert first["miss"] == "cold" and first["cached"] == "0"
        raw = client.chat.completions.with_raw_response.create(model="oa", messages=messages)
        usage = raw.parse().usage
        second = fields(raw.headers["x-prefixgate-cache"])
        assert second["cached"] == str(usage.prompt_tokens_details.cached_tokens)
        # the first prompt was recorded (after its answer went out) before the second was explained
        assert second["miss"] != "cold", second
        streamed = client.chat.completions.with_raw_response.create(
            model="oa", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        assert "x-prefixgate-cache" not in streamed.headers
        list(streamed.parse())
    counters = gateway.stats()["cache_misses"]["models"]["oa"]
    assert counters["requests"] == 3  # the streamed answer is explained at its end


def test_anthropic_upstream_below_its_minimum_is_explained(gateway):
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="x", max_retries=0) as ant:
        raw = ant.messages.with_raw_response.create(
            model="an",
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": "what is in stock ?"}],
        )
    assert fields(raw.headers["x-prefixgate-cache"])["miss"] == "below_minimum"


def test_the_providers_own_miss_reason_is_the_cause_counted(gateway):
    """Anthropic's ``diagnostics.cache_miss_reason`` takes precedence over the local cause, in the header and
    in the same ``cache_misses`` counters (issues 11 and 15: provider diagnostics folded in, not dropped)."""
    long_system = SYSTEM + " Stock levels are updated every night from the warehouse system." * 240
    gateway.anthropic_state.diagnostics = {
        "cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 1200}
    }
    try:
        with anthropic.Anthropic(base_url=gateway.base_url, api_key="x", max_retries=0) as ant:
            raw = ant.messages.with_raw_response.create(
                model="an",
                max_tokens=8,
                system=long_system,
                messages=[{"role": "user", "content": "what is in stock ?"}],
            )
    finally:
        gateway.anthropic_state.diagnostics = None
    assert fields(raw.headers["x-prefixgate-cache"])["miss"] == "tools_changed"
    causes = gateway.stats()["cache_misses"]["models"]["an"]
    assert causes["by_cause"]["tools_changed"] == 1
