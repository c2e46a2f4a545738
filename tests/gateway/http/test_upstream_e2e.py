"""End to end: the official ``openai`` and ``anthropic`` SDKs, unchanged, through the real gateway (uvicorn)
to stub OpenAI-compatible and Anthropic upstreams on real sockets, and the Anthropic SDK over the embedded
engine."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Literal

import anthropic
import httpx
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.transport.sse import parse_sse
from tests.gateway.conftest import TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS, ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, anthropic_stub, openai_stub

OPENAI_KEY = "sk-e2e-openai-key-00112233445566778899"
ANTHROPIC_KEY = "sk-ant-e2e-anthropic-key-998877665544"
LONG_SYSTEM = " ".join(
    f"Rule {i}: answer every question about the catalogue in one short sentence." for i in range(150)
)


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory):
    """Stub upstreams and a gateway serving ``oa`` (backend openai) and ``an`` (backend anthropic)."""
    states = {"openai": StubState("OAI"), "anthropic": StubState("ANT")}
    stubs = {
        "openai": StubServer(openai_stub(states["openai"])).start(),
        "anthropic": StubServer(anthropic_stub(states["anthropic"])).start(),
    }
    data = {
        "admin": {"token": ADMIN_TOKEN},
        "rules": ["default"],
        "models": [
            {
                "name": "oa",
                "backend": "openai",
                "base_url": f"{stubs['openai'].base_url}/v1",
                "api_key": "env:PG_E2E_OPENAI_KEY",
                "upstream_model": "gpt-upstream",
                "retries": 1,
                "prices": {"input": 2.5, "cached_input": 1.25},
            },
            {
                "name": "an",
                "backend": "anthropic",
                "base_url": stubs["anthropic"].base_url,
                "api_key": "env:PG_E2E_ANTHROPIC_KEY",
                "upstream_model": "claude-sonnet-4-5",
                "retries": 1,
                "prices": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75},
            },
        ],
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PG_E2E_OPENAI_KEY", OPENAI_KEY)
        patch.setenv("PG_E2E_ANTHROPIC_KEY", ANTHROPIC_KEY)
        config = write_config(tmp_path_factory.mktemp("e2e") / "prefixgate.yaml", data)
    gateway = RunningServer(config).start()
    yield gateway, states
    gateway.stop()
    for stub in stubs.values():
        stub.stop()


@pytest.fixture
def oai(upstreams):
    with openai.OpenAI(
        base_url=f"{upstreams[0].base_url}/v1", api_key="client-key", max_retries=0, timeout=30
    ) as sdk:
        yield sdk


@pytest.fixture
def ant(upstreams):
    with anthropic.Anthropic(
        base_url=upstreams[0].base_url, api_key="client-key", max_retries=0, timeout=30
    ) as sdk:
        yield sdk


# ---- OpenAI SDK
# ------------------------------------------------------------------------------------------------


def test_openai_sdk_over_an_openai_upstream(upstreams, oai):
    _, states = upstreams
    messages = [
        {"role": "system", "content": "You sort fruit. " + LONG_SYSTEM},
        {"role": "user", "content": "Apple?"},
    ]
    first = oai.chat.completions.create(model="oa", messages=messages)
    assert first.choices[0].message.content == "served by OAI" and first.model == "oa"
    second = oai.chat.completions.create(model="oa", messages=messages)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the stub's cache hit, passed through
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    sent = states["openai"].requests[-1]
    assert (
        sent["model"] == "gpt-upstream"
        and sent["stream"] is True
        and sent["stream_options"] == {"include_usage": True}
    )
    assert len(sent["prompt_cache_key"]) == 32
    assert states["openai"].headers[-1]["authorization"] == f"Bearer {OPENAI_KEY}"
    raw = oai.chat.completions.with_raw_response.create(model="oa", messages=messages, stream=True)
    # the upstream's own id for its answer, for a ticket with the provider
    assert raw.headers["x-prefixgate-upstream-request-id"] == f"req_{states['openai'].name}"
    list(raw.parse())

    chunks = list(oai.chat.completions.create(model="oa", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "served by OAI"
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage
    chunks = list(
        oai.chat.completions.create(
            model="oa", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_openai_sdk_over_an_anthropic_upstream(upstreams, oai):
    _, states = upstreams
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Which shelf?"}]
    first = oai.chat.completions.create(model="an", messages=messages, max_tokens=50)
    assert first.choices[0].message.content == "served by ANT" and first.choices[0].finish_reason == "stop"
    sent = states["anthropic"].requests[-1]
    assert sent["system"][-1]["cache_control"] == {"type": "ephemeral"}  # automatic breakpoint (long system)
    assert sent["max_tokens"] == 50 and sent["model"] == "claude-sonnet-4-5"
    assert states["anthropic"].headers[-1]["x-api-key"] == ANTHROPIC_KEY
    stream = list(
        oai.chat.completions.create(
            model="an", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = stream[-1].usage
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


# ---- Anthropic SDK
# ---------------------------------------------------------------------------------------------


def test_anthropic_sdk_over_an_anthropic_upstream(upstreams, ant):
    _, states = upstreams
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    message = ant.messages.create(
        model="an", max_tokens=64, system=system, messages=[{"role": "user", "content": "Where?"}]
    )
    assert (
        message.model == "an"
        and message.content[0].text == "served by ANT"
        and message.stop_reason == "end_turn"
    )
    assert states["anthropic"].requests[-1]["system"] == system  # the client's breakpoint, ttl and all
    raw = ant.messages.with_raw_response.create(
        model="an", max_tokens=64, system=system, messages=[{"role": "user", "content": "Where?"}]
    )
    assert raw.headers["x-prefixgate-upstream-request-id"] == f"req_{states['anthropic'].name}"
    with ant.messages.stream(
        model="an", max_tokens=64, system=system, messages=[{"role": "user", "content": "Again?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "served by ANT" and final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0


def test_anthropic_beta_header_reaches_only_the_anthropic_upstream(upstreams, ant):
    _, states = upstreams
    messages = [{"role": "user", "content": "beta?"}]
    ant.messages.create(
        model="an", max_tokens=5, messages=messages, extra_headers={"anthropic-beta": "beta-x"}
    )
    assert states["anthropic"].headers[-1]["anthropic-beta"] == "beta-x"
    ant.messages.create(model="an", max_tokens=5, messages=messages)
    assert "anthropic-beta" not in states["anthropic"].headers[-1]
    ant.messages.create(
        model="oa", max_tokens=5, messages=messages, extra_headers={"anthropic-beta": "beta-x"}
    )
    assert "anthropic-beta" not in states["openai"].headers[-1]


def test_anthropic_sdk_gets_thinking_blocks_through(upstreams, ant):
    with ant.messages.stream(
        model="an",
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "What is a solar eclipse?"}],
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].signature and final.stop_reason == "refusal" and final.usage.output_tokens == 106


def test_anthropic_sdk_over_an_openai_upstream(upstreams, ant):
    messages = [{"role": "user", "content": "Pear?"}]
    first = ant.messages.create(
        model="oa", max_tokens=20, system="You sort vegetables. " + LONG_SYSTEM, messages=messages
    )
    assert first.content[0].text == "served by OAI" and first.stop_reason == "end_turn"
    with ant.messages.stream(
        model="oa", max_tokens=20, system="You sort vegetables. " + LONG_SYSTEM, messages=messages
    ) as stream:
        assert "".join(stream.text_stream) == "served by OAI"
        final = stream.get_final_message()
    usage = final.usage
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert (
        usage.input_tokens + usage.cache_read_input_tokens
        == first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_anthropic_sdk_over_the_embedded_engine(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        kwargs = dict(
            model=TINY_MODEL,
            max_tokens=6,
            messages=[{"role": "user", "content": "Hello there"}],
            extra_body={"temperature": 0.0},  # greedy (this SDK version has no temperature argument)
        )
        whole = ant.messages.create(**kwargs)
        with ant.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    assert whole.content[0].text == streamed.content[0].text  # greedy: same tokens
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 6
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


# ---- errors
# ---------------------------------------------------------------------------------------------------


def test_anthropic_error_json_for_bad_requests(upstreams, ant):
    gateway, _ = upstreams
    with pytest.raises(anthropic.NotFoundError) as info:
        ant.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    # an error carries the request's id, as Anthropic's do (a fresh-user trial: the SDK's request_id was None)
    assert info.value.request_id and info.value.body["request_id"] == info.value.request_id
    response = httpx.post(f"{gateway.base_url}/v1/messages", json={"model": "an", "messages": []}, timeout=10)
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: field required"},
        "request_id": response.headers["request-id"],
    }
    assert response.headers["x-request-id"] == response.headers["request-id"]
    response = httpx.post(f"{gateway.base_url}/v1/messages", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_upstream_overload_reaches_the_client_as_its_error(upstreams, ant, oai):
    _, states = upstreams
    states["anthropic"].fail_next = [529, 529]  # retries: 1 -> two attempts, both overloaded
    with pytest.raises(anthropic.APIStatusError) as info:
        ant.messages.create(model="an", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 529 and info.value.body["error"]["type"] == "overloaded_error"
    # the provider's own id for the failed answer, for a ticket with it
    assert info.value.response.headers["x-prefixgate-upstream-request-id"] == "req_fail_ANT"
    states["openai"].fail_next = [500]  # one failure, then the retry succeeds
    answer = oai.chat.completions.create(model="oa", messages=[{"role": "user", "content": "retry me"}])
    assert answer.choices[0].message.content == "served by OAI"
    states["openai"].fail_next = [429]  # Retry-After: 120, longer than the gateway waits: passed on at once
    with pytest.raises(openai.RateLimitError) as limited:
        oai.chat.completions.create(model="oa", messages=[{"role": "user", "content": "later"}])
    assert limited.value.response.headers["retry-after"] == "120"
    assert limited.value.response.headers["x-prefixgate-upstream-request-id"] == "req_fail_OAI"
    assert limited.value.request_id == limited.value.response.headers["x-request-id"]


def test_a_stream_cut_mid_way_ends_with_an_error_event(upstreams, ant, oai):
    gateway, states = upstreams
    states["anthropic"].cut_next = 1
    with pytest.raises(anthropic.APIStatusError) as info:
        with ant.messages.stream(
            model="an", max_tokens=5, messages=[{"role": "user", "content": "cut"}]
        ) as stream:
            for _ in stream.text_stream:
                pass
    assert "broke off" in str(info.value)
    states["openai"].cut_next = 1
    with pytest.raises(openai.APIError):
        for _ in oai.chat.completions.create(
            model="oa", messages=[{"role": "user", "content": "cut"}], stream=True
        ):
            pass
    states["openai"].cut_next = 1  # the Anthropic face over an OpenAI upstream, read raw
    body = {"model": "oa", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "cut"}]}
    raw = httpx.post(f"{gateway.base_url}/v1/messages", json=body, timeout=10)
    events = parse_sse(raw.content)
    assert raw.status_code == 200 and events[0].event == "message_start" and events[-1].event == "error"
    error = json.loads(events[-1].data)
    assert (
        error["type"] == "error"
        and error["error"]["type"] == "api_error"
        and "broke off" in error["error"]["message"]
    )


def test_stats_count_upstream_cache_and_savings_without_keys(upstreams, ant, oai, caplog):
    gateway, _ = upstreams
    caplog.set_level(logging.DEBUG)
    for _ in range(2):
        oai.chat.completions.create(
            model="oa",
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "q"}],
        )
        ant.messages.create(
            model="an", max_tokens=5, system=LONG_SYSTEM, messages=[{"role": "user", "content": "q"}]
        )
    response = httpx.get(f"{gateway.base_url}/admin/stats", headers=ADMIN_HEADERS, timeout=10)
    stats = response.json()
    for name in ("oa", "an"):
        model = stats["models"][name]
        assert model["cached_tokens"] > 0 and model["cost_saved_usd"] != 0.0
        base_urls = gateway.app.state.gateway.config.model(name).base_url
        assert list(model["replicas"]) == list(base_urls) and model["replicas"][base_urls[0]]["inflight"] == 0
    assert stats["models"]["an"]["cache_creation_tokens"] > 0
    text = response.text + json.dumps([r.getMessage() for r in caplog.records])
    assert OPENAI_KEY not in text and ANTHROPIC_KEY not in text
    metrics = httpx.get(f"{gateway.base_url}/metrics", headers=ADMIN_HEADERS, timeout=10).text
    assert OPENAI_KEY not in metrics and ANTHROPIC_KEY not in metrics
    # the replicas as Prometheus series too (before: /admin/stats and the dashboard only)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    for name in ("oa", "an"):
        replica = list(gateway.app.state.gateway.config.model(name).base_url)[0]
        requests = stats["models"][name]["replicas"][replica]["requests"]
        up = [
            s.value
            for s in families["prefixgate_upstream_replica_state"].samples
            if s.labels == {"model": name, "replica": replica, "state": "up"}
        ]
        served = [
            s.value
            for s in families["prefixgate_upstream_replica_requests"].samples
            if s.labels == {"model": name, "replica": replica} and s.name.endswith("_total")
        ]
        assert up == [1.0] and served == [requests] and requests >= 2


# ---- structured outputs across protocols -------------------------------------------------------------------


class Address(pydantic.BaseModel):
    city: str
    zip: str | None


class Contact(pydantic.BaseModel):
    name: str
    plan: Literal["free", "pro"]
    when: datetime.datetime
    home: Address
    work: Address | None
    tags: list[str]


def test_openai_sdk_parse_reaches_an_anthropic_upstream_as_output_config(upstreams, oai):
    """The openai SDK's ``parse(response_format=Model)`` (its strict schema of a pydantic model) goes to the
    Anthropic upstream as ``output_config.format``, the schema byte for byte (the stub answers prose, which
    the SDK then fails to parse: the request is what is checked here)."""
    _, states = upstreams
    with pytest.raises(pydantic.ValidationError):
        oai.chat.completions.parse(
            model="an", messages=[{"role": "user", "content": "Ada"}], max_tokens=50, response_format=Contact
        )
    sent = states["anthropic"].requests[-1]
    schema = sent["output_config"]["format"]["schema"]
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    assert schema["title"] == "Contact" and schema["additionalProperties"] is False
    assert schema["$defs"]["Address"]["additionalProperties"] is False
    assert "response_format" not in sent and "anthropic-beta" not in states["anthropic"].headers[-1]


def test_a_schema_an_anthropic_upstream_cannot_enforce_is_a_400_through_the_sdk(upstreams, oai):
    _, states = upstreams
    before = len(states["anthropic"].requests)
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0}},
        "required": ["age"],
        "additionalProperties": False,
    }
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="an",
            messages=[{"role": "user", "content": "How old?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": schema}},
        )
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema.properties.age.minimum"
    assert error["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="an",
            messages=[{"role": "user", "content": "JSON?"}],
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"
    assert len(states["anthropic"].requests) == before  # refused before any upstream call


def test_anthropic_sdk_output_config_reaches_an_openai_upstream_as_strict_response_format(upstreams, ant):
    _, states = upstreams
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    ant.messages.create(
        model="oa",
        max_tokens=20,
        messages=[{"role": "user", "content": "Yes?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert states["openai"].requests[-1]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": schema, "strict": True},
    }


def test_a_resent_call_s_arguments_go_to_an_anthropic_upstream_as_strict_json(upstreams, oai):
    """A resent call whose arguments hold ``1e999`` (valid JSON, beyond the float range) goes upstream as the
    largest float; ``NaN`` (not JSON) is a 400 naming the arguments, and nothing is sent upstream."""
    _, states = upstreams
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1e999}'}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    oai.chat.completions.create(model="an", messages=history, max_tokens=5)
    sent = states["anthropic"].requests[-1]
    (use,) = [b for b in sent["messages"][1]["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"a": sys.float_info.max}
    before = len(states["anthropic"].requests)
    call["function"]["arguments"] = '{"a": NaN}'
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="an", messages=history, max_tokens=5)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "NaN" in info.value.body["message"]
    assert len(states["anthropic"].requests) == before
