"""Tenants through the running gateway: a trusted key's UTF-8 tenant header, per-tenant stats that refused
requests and invented salts cannot fill, and admin endpoints that refuse what no request can reach."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import ADMIN_HEADERS, RunningServer, write_config

ALICE, PLATFORM, LIMITED = "sk-alice-0123456789", "sk-platform-0123456789", "sk-limited-0123456789"


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    data = tiny_config_data(tiny_checkpoint)
    data["keys"] = [
        {"name": "alice", "key": ALICE, "tenant": "acme"},
        {"name": "platform", "key": PLATFORM, "tenant": "plat", "trusted": True},
        {"name": "limited", "key": LIMITED, "tenant": "lim", "rpm": 1},
    ]
    config = write_config(tmp_path_factory.mktemp("tenants") / "prefixgate.yaml", data)
    running = RunningServer(config).start()
    yield running
    running.stop()


def chat(server, key: str, prompt: str = "hello", headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}", **(headers or {})},
        json={
            "model": TINY_MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            **body,
        },
        timeout=60,
    )


def registered_salts(server) -> set:
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    with engine._cond:
        return {
            b.extra_keys[1] for b in engine.core.kv.pool.blocks if b.block_hash is not None and b.extra_keys
        }


def test_a_trusted_keys_utf8_header_is_read_as_utf8(keyed):
    """Before: the keyed path used the raw Latin-1 header value, so ``租户`` became ``plat/ç§\\x9fæ\\x88·`` in
    stats, metrics and the cache salt, while the open mode decoded it (``gateway.core.headers.tenant``)."""
    response = chat(keyed, PLATFORM, "utf-8 tenant", headers={"x-prefixgate-tenant": "租户".encode()})
    assert response.status_code == 200, response.text
    assert "plat/租户" in keyed.stats()["tenants"]
    assert "plat/租户" in registered_salts(keyed)


def test_salts_and_refused_requests_take_no_rows_of_the_tenant_table(keyed):
    """Before: each new ``cache_salt`` made a tenant row, and so did each refused (429) request; 1,030 salted
    requests pushed real tenants into ``(other)``. Now a salted request counts under the tenant it narrows (its
    cache is still the salted sub-tenant's), and a refused one creates nothing."""
    for i in range(3):
        assert chat(keyed, ALICE, "salted", cache_salt=f"salt-{i}").status_code == 200
    doc = keyed.stats()
    assert doc["tenants"]["acme"]["requests"] >= 3
    assert not [name for name in doc["tenants"] if name.startswith("acme/")]
    assert {"acme/salt-0", "acme/salt-1"} <= registered_salts(keyed)  # cache isolation is unchanged
    assert chat(keyed, LIMITED, "first").status_code == 200
    before = keyed.stats()["tenants"]
    for i in range(5):
        assert chat(keyed, LIMITED, "again", cache_salt=f"refused-{i}").status_code == 429
        assert chat(keyed, "sk-wrong", "again", cache_salt=f"wrong-{i}").status_code == 401
    after = keyed.stats()["tenants"]
    assert set(after) == set(before)
    assert after["lim"]["rate_limited"] == before["lim"]["rate_limited"] + 5  # counted on its existing row


@pytest.mark.parametrize("tenant", ["no-such-tenant", "acme" + "x" * 296])
def test_warming_a_tenant_no_key_can_reach_is_a_400(keyed, tenant):
    """Before: 200, prefilling blocks no request could ever hit."""
    response = httpx.post(
        f"{keyed.base_url}/admin/cache/warm",
        json={"system": "You are a warm tenant test.", "tenant": tenant},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tenant" and "no key can reach tenant" in error["message"]


@pytest.mark.parametrize("tenant", ["", "acme", "acme/front-1"])
def test_warming_a_reachable_tenant_works(keyed, tenant):
    response = httpx.post(
        f"{keyed.base_url}/admin/cache/warm",
        json={"system": "You are a warm tenant test.", "tenant": tenant},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["tenant"] == tenant, response.text


def test_learned_rules_of_an_unknown_model_is_a_404_as_the_cache_answers(keyed):
    """Before: ``GET /admin/rules/learned?model=nope`` was 200 with an empty file, ``/admin/cache?model=nope``
    a 404."""
    url = f"{keyed.base_url}/admin/rules/learned"
    unknown = httpx.get(url, params={"model": "nope"}, headers=ADMIN_HEADERS, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    known = httpx.get(url, params={"model": TINY_MODEL}, headers=ADMIN_HEADERS, timeout=30)
    assert known.status_code == 200
