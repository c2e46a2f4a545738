"""Layered sharing through the server (OpenAI SDK, one key per tenant): a declared public system prompt is
prefilled once for N tenants, and no tenant ever hits another tenant's blocks after it (hypothesis over
random tenant / prompt sequences, each request's cached tokens checked against an exact model of the cache)."""

from __future__ import annotations

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import GenerationRequest
from engine.partial_hits import common_prefix_len
from tests.gateway.conftest import BLOCK_SIZE, TINY_MODEL, tiny_config_data
from tests.gateway.server import RunningServer, write_config

TENANTS = 4
PUBLIC = " ".join(f"Policy {i}: answer briefly and politely, cite the handbook section." for i in range(6))
USERS = [
    " ".join(f"Case {c}-{i}: the customer asks about invoice number {c * 100 + i}." for i in range(3))
    for c in range(3)
]
SUFFIXES = ["", " Please hurry.", " Second question follows."]


def key_of(i: int) -> str:
    return f"sk-tenant-{i}-0123456789"


@pytest.fixture(scope="module")
def shared_server(tiny_checkpoint, tmp_path_factory):
    data = tiny_config_data(tiny_checkpoint, num_blocks=1024)
    data["keys"] = [{"name": f"t{i}", "key": key_of(i), "tenant": f"tenant-{i}"} for i in range(TENANTS)]
    data["shared_prefixes"] = [{"segment": "tools_system"}]
    config = write_config(tmp_path_factory.mktemp("shared") / "prefixgate.yaml", data)
    running = RunningServer(config).start()
    yield running
    running.stop()


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": PUBLIC}, {"role": "user", "content": user}]


def send(server, tenant: int, user: str) -> tuple[int, int]:
    """One chat completion of ``tenant``; returns (prompt tokens, cached tokens)."""
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key_of(tenant), max_retries=0) as sdk:
        done = sdk.chat.completions.create(
            model=TINY_MODEL, messages=messages(user), max_tokens=1, temperature=0
        )
    return done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens


def engine_of(server):
    return server.app.state.gateway.registry.get(TINY_MODEL).engine


def reset(server) -> None:
    assert engine_of(server).reset_prefix_cache()


def public_blocks(server, user: str) -> int:
    engine = engine_of(server)
    prompt = engine.render_chat(messages(user))
    request = GenerationRequest(messages=messages(user), shared_prefix_messages=1)
    return engine.shared_prefix_tokens(request, prompt) // BLOCK_SIZE


def test_public_prompt_is_prefilled_once_for_n_tenants(shared_server):
    reset(shared_server)
    shared = public_blocks(shared_server, USERS[0]) * BLOCK_SIZE
    assert shared >= 4 * BLOCK_SIZE
    before = shared_server.stats()["models"][TINY_MODEL]["prefill_tokens"]
    prompt_tokens, cached = send(shared_server, 0, USERS[0])
    assert cached == 0
    total = prompt_tokens
    for tenant in range(1, TENANTS):
        prompt_tokens, cached = send(shared_server, tenant, USERS[tenant % len(USERS)])
        assert cached == shared  # the public blocks, computed by tenant 0
        total += prompt_tokens - cached
    after = shared_server.stats()["models"][TINY_MODEL]["prefill_tokens"]
    assert after - before == total  # the public prompt was prefilled once


def test_another_tenants_suffix_is_never_hit(shared_server):
    reset(shared_server)
    _, cached = send(shared_server, 0, USERS[1])
    assert cached == 0
    shared = public_blocks(shared_server, USERS[1]) * BLOCK_SIZE
    # tenant 1 sends tenant 0's very prompt: only the public blocks hit
    assert send(shared_server, 1, USERS[1])[1] == shared
    # tenant 0's repeat hits its own suffix too
    prompt_tokens, cached = send(shared_server, 0, USERS[1])
    assert cached == prompt_tokens - 1 > shared  # whole blocks, then its kept partial block


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sequence=st.lists(
        st.tuples(st.integers(0, TENANTS - 1), st.integers(0, len(USERS) - 1), st.integers(0, 2)),
        min_size=2,
        max_size=6,
    )
)
def test_random_tenant_sequences_hit_only_what_they_are_entitled_to(shared_server, sequence):
    """Exact model: a request hits its public blocks when anyone sent them, and beyond them only the
    blocks its own tenant computed for the same token prefix, then (token-granular hits) the longest common
    token prefix of the next block with a prompt its own tenant computed after the same blocks (capped below
    its last token)."""
    reset(shared_server)
    engine = engine_of(shared_server)
    computed: dict[int, list[list[int]]] = {}
    anyone = False
    for tenant, user_index, suffix in sequence:
        user = USERS[user_index] + SUFFIXES[suffix]
        tokens = engine.render_chat(messages(user))
        public = public_blocks(shared_server, user)
        cap = (len(tokens) - 1) // BLOCK_SIZE
        expected = 0
        for j in range(cap):
            prefix = tokens[: (j + 1) * BLOCK_SIZE]
            if j < public:
                ok = anyone
            else:
                ok = any(t[: (j + 1) * BLOCK_SIZE] == prefix for t in computed.get(tenant, []))
            if not ok:
                break
            expected = j + 1
        start = expected * BLOCK_SIZE
        want = tokens[start : min(start + BLOCK_SIZE, len(tokens) - 1)]
        own = (
            [t for t in computed.get(tenant, []) if t[:start] == tokens[:start]] if expected >= public else []
        )
        partial = max((common_prefix_len(t[start : start + BLOCK_SIZE], want) for t in own), default=0)
        _, cached = send(shared_server, tenant, user)
        assert cached == start + partial, (tenant, user_index, suffix)
        computed.setdefault(tenant, []).append(tokens)
        anyone = True
