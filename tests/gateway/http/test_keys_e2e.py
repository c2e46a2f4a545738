"""Client keys end to end, with the official SDKs: 401 / 403 / 404 in each protocol's shape, tenants as cache
salt (engine block ids compared), trusted tenant headers, 429 with Retry-After, per-key usage in stats and
metrics, and a flood of invalid keys that costs no engine work and no state."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import ADMIN_HEADERS, RunningServer, write_config

DAVE = "sk-dave-0123456789"
ALICE, BOB, CAROL, PLATFORM, LIMITED = (
    "sk-alice-0123456789",
    "sk-bob-0123456789",
    "sk-carol-0123456789",
    "sk-platform-0123456789",
    "sk-limited-0123456789",
)
OTHER_MODEL = "tiny-other"
PROMPT = " ".join(f"Clause {i}: every tenant keeps its own cache of this long shared text." for i in range(8))


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    data = tiny_config_data(tiny_checkpoint)
    other = dict(data["models"][0], name=OTHER_MODEL)
    data["models"].append(other)
    data["keys"] = [
        {"name": "alice", "key": ALICE, "tenant": "acme"},
        {"name": "bob", "key": BOB, "tenant": "globex", "models": [TINY_MODEL]},
        {"name": "carol", "key": CAROL, "tenant": "acme"},
        {"name": "dave", "key": DAVE, "tenant": "initech"},
        {"name": "platform", "key": PLATFORM, "tenant": "plat", "trusted": True},
        {"name": "limited", "key": LIMITED, "tenant": "lim", "rpm": 1},
    ]
    config = write_config(tmp_path_factory.mktemp("keys") / "prefixgate.yaml", data)
    running = RunningServer(config).start()
    yield running
    running.stop()


def oai(server, key: str | None, **headers) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key=key or "",
        max_retries=0,
        timeout=60,
        default_headers=headers or None,
    )


def ask(server, key: str, prompt: str = PROMPT, model: str = TINY_MODEL, **headers) -> int:
    """One chat completion; returns its cached prompt tokens."""
    with oai(server, key, **headers) as sdk:
        done = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1, temperature=0
        )
    return done.usage.prompt_tokens_details.cached_tokens


def registered(server, model: str = TINY_MODEL) -> dict[int, tuple]:
    """Physical block id -> extra keys of every block registered in the engine's prefix cache."""
    engine = server.app.state.gateway.registry.get(model).engine
    with engine._cond:
        return {b.block_id: b.extra_keys for b in engine.core.kv.pool.blocks if b.block_hash is not None}


def test_no_key_and_wrong_key_are_401_in_each_protocol(keyed):
    messages = [{"role": "user", "content": "hi"}]
    with oai(keyed, "sk-wrong") as sdk:
        with pytest.raises(openai.AuthenticationError) as caught:
            sdk.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=1)
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            sdk.models.list()
    with anthropic.Anthropic(base_url=keyed.base_url, api_key="sk-wrong", max_retries=0) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as caught_a:
            sdk.messages.create(model=TINY_MODEL, messages=messages, max_tokens=1)
        assert caught_a.value.body["error"]["type"] == "authentication_error"
    # the SDKs refuse to send no key at all: raw requests
    body = {"model": TINY_MODEL, "max_tokens": 1, "messages": messages}
    no_key = httpx.post(f"{keyed.base_url}/v1/chat/completions", json=body, timeout=10)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert no_key.headers["www-authenticate"] == "Bearer"
    no_key = httpx.post(f"{keyed.base_url}/v1/messages", json=body, timeout=10)
    assert no_key.status_code == 401
    assert no_key.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "x-api-key header is required"},
        "request_id": no_key.headers["request-id"],
    }


def test_key_for_another_model(keyed):
    messages = [{"role": "user", "content": "hi"}]
    with oai(keyed, BOB) as sdk:
        with pytest.raises(openai.NotFoundError) as caught:
            sdk.chat.completions.create(model=OTHER_MODEL, messages=messages, max_tokens=1)
        assert caught.value.body["code"] == "model_not_found"
        assert [m.id for m in sdk.models.list()] == [TINY_MODEL]
        with pytest.raises(openai.NotFoundError):
            sdk.models.retrieve(OTHER_MODEL)
    with anthropic.Anthropic(base_url=keyed.base_url, api_key=BOB, max_retries=0) as sdk:
        with pytest.raises(anthropic.PermissionDeniedError) as caught_a:
            sdk.messages.create(model=OTHER_MODEL, messages=messages, max_tokens=1)
        assert caught_a.value.body["error"]["type"] == "permission_error"
        answer = sdk.messages.create(model=TINY_MODEL, messages=messages, max_tokens=1)  # x-api-key works
        assert answer.usage.output_tokens == 1


def test_two_tenants_never_share_a_block(keyed):
    prompt = PROMPT + " tenants"
    assert ask(keyed, ALICE, prompt) == 0
    alice_blocks = registered(keyed)
    assert ask(keyed, DAVE, prompt) == 0  # same prompt, a tenant with nothing cached yet: cold
    after = registered(keyed)
    acme = {i for i, keys in after.items() if "acme" in keys}
    initech = {i for i, keys in after.items() if "initech" in keys}
    assert acme and initech and not acme & initech
    assert {i for i, keys in alice_blocks.items() if "acme" in keys} <= acme  # bob evicted none of them
    assert ask(keyed, CAROL, prompt) > 0  # carol shares alice's tenant: a hit


def test_trusted_header_is_honoured_and_untrusted_is_ignored_and_counted(keyed):
    prompt = "Trusted check. " + PROMPT
    assert ask(keyed, PLATFORM, prompt, **{"x-prefixgate-tenant": "user-1"}) == 0
    assert ask(keyed, PLATFORM, prompt, **{"x-prefixgate-tenant": "user-2"}) == 0  # a separate salt
    assert ask(keyed, PLATFORM, prompt, **{"x-prefixgate-tenant": "user-1"}) > 0
    assert any("plat/user-1" in keys for keys in registered(keyed).values())
    other = "Header check. " + PROMPT
    ask(keyed, BOB, other)
    bob_repeat = ask(keyed, BOB, other)
    before = keyed.stats()["keys"]["alice"]["tenant_header_ignored"]
    # alice claims bob's tenant: ignored (her own salt: at most her own chat-template head is cached), counted
    assert ask(keyed, ALICE, other, **{"x-prefixgate-tenant": "globex"}) < bob_repeat
    assert keyed.stats()["keys"]["alice"]["tenant_header_ignored"] == before + 1
    # whatever an untrusted key's header holds, it is ignored (not a 400): even one over the length limit
    ask(keyed, ALICE, other, **{"x-prefixgate-tenant": "g" * 300})
    assert keyed.stats()["keys"]["alice"]["tenant_header_ignored"] == before + 2


def test_a_cache_salt_narrows_a_keys_tenant_and_never_leaves_it(keyed):
    """vLLM's ``cache_salt`` (what a front gateway with ``cache_salt: true`` sends its tenants in): before, a
    400 "Unrecognized request argument", so a fleet of prefixgate replicas served every front tenant from one
    cache. Now it is a sub-tenant ``<tenant>/<salt>`` of the key's own tenant, trusted key or not."""
    prompt = "Salt check. " + PROMPT

    def salted(key: str, salt: str) -> int:
        with oai(keyed, key) as sdk:
            done = sdk.chat.completions.create(
                model=TINY_MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=1,
                temperature=0,
                extra_body={"cache_salt": salt},
            )
        return done.usage.prompt_tokens_details.cached_tokens

    assert salted(ALICE, "front-alice") == 0
    assert salted(ALICE, "front-bob") == 0  # the same prompt, another salt: cold
    hit = salted(ALICE, "front-alice")
    assert hit > 30
    assert any("acme/front-alice" in keys for keys in registered(keyed).values())
    # carol (acme, no salt) shares none of the salted blocks: at most acme's own chat-template head
    assert ask(keyed, CAROL, prompt) < hit
    assert salted(BOB, "front-alice") < hit  # bob names alice's salt: a sub-tenant of his own tenant
    for bad in ("", 7, "s" * 300):
        response = httpx.post(
            f"{keyed.base_url}/v1/chat/completions",
            headers={"authorization": f"Bearer {ALICE}"},
            json={"model": TINY_MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": bad},
            timeout=30,
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", (
            response.text
        )
    model = keyed.wait_blocks_released(TINY_MODEL)["models"][TINY_MODEL]
    assert model["blocks"]["used"] == 0 and (model["engine"]["running"], model["engine"]["waiting"]) == (0, 0)


def test_rate_limit_answers_429_with_retry_after(keyed, caplog):
    caplog.set_level("INFO", logger="prefixgate.request")
    ask(keyed, LIMITED, "first")
    with oai(keyed, LIMITED) as sdk, pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    retry_after = int(caught.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    raw = httpx.post(
        f"{keyed.base_url}/v1/messages",
        headers={"x-api-key": LIMITED},
        json={"model": TINY_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert raw.status_code == 429 and raw.json()["error"]["type"] == "rate_limit_error"
    refused = [
        r.getMessage()
        for r in caplog.records
        if r.name == "prefixgate.request" and " status=429 " in r.getMessage()
    ]
    assert len(refused) == 2 and all(" key=limited tenant=" in line for line in refused), refused
    assert int(raw.headers["retry-after"]) >= 1
    stats = keyed.stats()
    assert stats["keys"]["limited"]["rate_limited"] == 2
    tenant = stats["keys"]["limited"]["tenant"]
    assert stats["tenants"][tenant]["rate_limited"] == 2  # the dashboard's per-tenant view counts them too


def test_usage_per_key_and_tenant_in_stats_and_metrics_never_the_key(keyed):
    ask(keyed, ALICE, "usage")
    doc = keyed.stats()
    alice = doc["keys"]["alice"]
    assert alice["requests"] >= 1 and alice["prompt_tokens"] > 0 and alice["tenant"] == "acme"
    # her requests are in her tenant or its sub-tenants (a cache_salt narrows it: acme/<salt>)
    acme = sum(t["requests"] for name, t in doc["tenants"].items() if name.split("/")[0] == "acme")
    assert acme >= alice["requests"]
    metrics = httpx.get(f"{keyed.base_url}/metrics", headers=ADMIN_HEADERS, timeout=10).text
    assert 'prefixgate_key_requests_total{key="alice"}' in metrics
    assert 'prefixgate_tenant_cached_tokens_total{tenant="acme"}' in metrics
    text = str(doc) + metrics + repr(keyed.app.state.gateway.keys.lookup(ALICE))
    for secret in (ALICE, BOB, CAROL, DAVE, PLATFORM, LIMITED):
        assert secret not in text


def test_invalid_key_flood_is_cheap(keyed):
    gateway = keyed.app.state.gateway
    size = gateway.clients.state_size()
    engine_requests = keyed.stats()["models"][TINY_MODEL]["engine"]["requests"]
    with httpx.Client(base_url=keyed.base_url, timeout=10) as http:
        for i in range(200):
            response = http.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer sk-guess-{i}"},
                content=b"x" * 1000,  # not even JSON: refused before the body is read
            )
            assert response.status_code == 401
    assert gateway.clients.state_size() == size
    assert keyed.stats()["models"][TINY_MODEL]["engine"]["requests"] == engine_requests


def test_start_up_log_says_whether_the_gateway_is_open(caplog):
    from starlette.testclient import TestClient

    from gateway.config.schema import GatewayConfig
    from gateway.core.keys import ClientKey, key_digest
    from gateway.http.app import create_app

    caplog.set_level("INFO", logger="prefixgate.app")
    with TestClient(create_app(GatewayConfig(), backends={})):
        pass
    assert "the gateway is OPEN" in caplog.text
    caplog.clear()
    keys = (ClientKey(name="a", digest=key_digest(ALICE), tenant="acme"),)
    with TestClient(create_app(GatewayConfig(keys=keys), backends={})):
        pass
    assert "1 client keys, 1 tenants" in caplog.text and "OPEN" not in caplog.text
    assert ALICE not in caplog.text


def test_responses_face_needs_a_key_and_applies_its_tenant(keyed):
    """``/v1/responses`` is behind the same keys as chat: 401 without one, the key's model list, its tenant."""
    no_key = httpx.post(
        f"{keyed.base_url}/v1/responses", json={"model": TINY_MODEL, "input": "hi"}, timeout=10
    )
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    with oai(keyed, "sk-wrong") as sdk, pytest.raises(openai.AuthenticationError):
        sdk.responses.create(model=TINY_MODEL, input="hi", max_output_tokens=1)
    with oai(keyed, BOB) as sdk:
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model=OTHER_MODEL, input="hi", max_output_tokens=1)
        prompt = "Responses isolation. " + PROMPT
        sdk.responses.create(model=TINY_MODEL, input=prompt, max_output_tokens=1)
        again = sdk.responses.create(model=TINY_MODEL, input=prompt, max_output_tokens=1)
    assert again.usage.input_tokens_details.cached_tokens > 0  # bob's own repeat hits
    with oai(keyed, ALICE) as sdk:  # another tenant: none of bob's blocks
        other = sdk.responses.create(model=TINY_MODEL, input=prompt, max_output_tokens=1)
    assert other.usage.input_tokens_details.cached_tokens < again.usage.input_tokens_details.cached_tokens


def test_keys_never_appear_in_logs_or_error_bodies(keyed, caplog):
    """Every log line the gateway writes while serving good, wrong, over-limit and other-model requests
    names keys by name or digest prefix only; error bodies never echo the presented key."""
    caplog.set_level("DEBUG")
    guess = "sk-guess-SECRET-0123456789"
    ask(keyed, ALICE, "log check")
    ask(keyed, PLATFORM, "log check", **{"x-prefixgate-tenant": "user-9"})
    bodies = []
    with httpx.Client(base_url=keyed.base_url, timeout=30) as http:
        body = {"model": OTHER_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        for key in (guess, BOB, LIMITED, LIMITED):
            for path, headers in (
                ("/v1/chat/completions", {"authorization": f"Bearer {key}"}),
                ("/v1/messages", {"x-api-key": key}),
            ):
                response = http.post(path, headers=headers, json=body)
                assert response.status_code in (401, 403, 404, 429), response.text
                bodies.append(response.text)
    text = caplog.text + "".join(bodies)
    assert "prefixgate.request" in {r.name for r in caplog.records}  # the request log was captured
    request_lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.request"]
    assert any(" key=alice tenant=acme " in line and " status=200 " in line for line in request_lines)
    assert any(" key=platform tenant=" in line and "user-9" in line for line in request_lines)
    # a refused request names who was refused (a fresh-user trial: a 429 or a 404 for a model had no key=)
    refused = [line for line in request_lines if " status=404 " in line or " status=403 " in line]
    assert any(" key=bob tenant=" in line for line in refused), refused
    assert not any(" key=" in line for line in request_lines if " status=401 " in line)  # no key: no name
    for secret in (ALICE, BOB, CAROL, DAVE, PLATFORM, LIMITED, guess):
        assert secret not in text
