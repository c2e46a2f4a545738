"""Issue 13 through the real server, over the tiny checkpoint: KV tiers configured in the model's ``engine:``,
prefixes surviving a restart (disk), two gateways sharing one Redis, warming (config at start and
``POST /admin/cache/warm``), listing and dropping cached prefixes, and the admin token on all of it.

Each test has its own disk directory and Redis key prefix (deleted afterwards), so no test sees another's
blocks."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from tests.gateway.conftest import BLOCK_SIZE, TINY_MODEL, tiny_config_data
from tests.gateway.server import ADMIN_HEADERS, RunningServer, write_config

SECRET = "kv-tier-test-secret-0123456789"
SYSTEM = (
    "You are the assistant of the tier test. Answer every question about the capital of france, the quick "
    "brown fox and the lazy dog in one short answer. Each answer names the document and the block table."
)
DOCUMENTS = "the quick brown fox jumps over the lazy dog. paris is the capital of france. " * 3


@pytest.fixture
def redis_prefix():
    prefix = f"pgtest-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def start(tmp_path: Path, checkpoint: Path, name: str, top: dict | None = None, **engine) -> RunningServer:
    data = tiny_config_data(checkpoint, **engine)
    data.update(top or {})
    config = write_config(tmp_path / f"{name}.yaml", data)
    return RunningServer(config).start()


def chat(server: RunningServer, messages: list[dict], tenant: str) -> dict:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": TINY_MODEL, "messages": messages, "max_tokens": 2, "temperature": 0},
        headers={"x-prefixgate-tenant": tenant},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def usable(prompt_tokens: int) -> int:
    """Tokens of the full blocks a prompt's lookup may hit (the last token is always prefilled)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def conversation(question: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": DOCUMENTS + question},
    ]


def test_a_prefix_survives_a_restart_through_the_disk_tier(tmp_path, tiny_checkpoint):
    disk = {"tiers": ["disk"], "tier_disk": {"directory": str(tmp_path / "kv")}, "deployment_secret": SECRET}
    messages = conversation("what is the capital of france ?")
    first = start(tmp_path, tiny_checkpoint, "a", **disk)
    try:
        before = chat(first, messages, "acme")
        assert cached(before) == 0
    finally:
        first.stop()
    second = start(tmp_path, tiny_checkpoint, "b", **disk)
    try:
        after = chat(second, messages, "acme")
        assert after["prompt_tokens"] == before["prompt_tokens"]
        assert cached(after) == usable(after["prompt_tokens"]) > 0
        counters = second.stats()["models"][TINY_MODEL]["engine"]["tier_counters"]
        assert counters["disk.hit_tokens"] == cached(after)
        metrics = httpx.get(f"{second.base_url}/metrics", headers=ADMIN_HEADERS, timeout=30).text
        assert 'prefixgate_tier_hit_tokens_total{model="tiny",tier="disk"}' in metrics
        (row,) = httpx.get(
            f"{second.base_url}/admin/cache", params={"tenant": "acme"}, headers=ADMIN_HEADERS, timeout=30
        ).json()["data"]
        assert row["level"] == "system"  # the request's segments tagged its blocks (system outlives the rest)
        assert 0 < row["tokens"] <= usable(after["prompt_tokens"]) and row["tokens"] % BLOCK_SIZE == 0
        assert row["tiers"]["disk"] == row["tokens"]  # the restarted gateway found all of it on disk
        other_tenant = chat(second, messages, "other")
        assert cached(other_tenant) == 0
    finally:
        second.stop()
    fresh = start(
        tmp_path, tiny_checkpoint, "c", tiers=["disk"], tier_disk={"directory": str(tmp_path / "kv2")}
    )
    try:
        assert cached(chat(fresh, messages, "acme")) == 0
    finally:
        fresh.stop()


def test_gateway_b_loads_from_redis_what_gateway_a_warmed(tmp_path, tiny_checkpoint, redis_prefix):
    tiers = {
        "tiers": ["redis"],
        "tier_redis": {"url": "redis://127.0.0.1:6379/0", "prefix": redis_prefix},
        "deployment_secret": SECRET,
    }
    a = start(tmp_path, tiny_checkpoint, "a", **tiers)
    try:
        response = httpx.post(
            f"{a.base_url}/admin/cache/warm",
            json={"model": TINY_MODEL, "tenant": "acme", "system": SYSTEM, "documents": DOCUMENTS},
            headers=ADMIN_HEADERS,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        warmed = response.json()
        assert warmed["cached_tokens"] == warmed["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE > 0
        assert warmed["prefix_key"]
    finally:
        a.stop()  # flushes its cached blocks down to Redis
    b = start(tmp_path, tiny_checkpoint, "b", **tiers)
    try:
        usage = chat(
            b, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOCUMENTS}], "acme"
        )
        assert usage["prompt_tokens"] == warmed["prompt_tokens"]
        assert cached(usage) == usable(usage["prompt_tokens"])
        counters = b.stats()["models"][TINY_MODEL]["engine"]["tier_counters"]
        assert counters["redis.hit_tokens"] == cached(usage)
    finally:
        b.stop()


def test_warm_at_start_then_admin_warm_list_and_delete(tmp_path, tiny_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="prefixgate.warm")
    (tmp_path / "system.txt").write_text(SYSTEM)
    warm = [
        {"system_file": "system.txt", "tenant": "acme", "pin": True},
        {"messages": "not a message list", "tenant": "acme"},
        {"system": "lorem ipsum dolor " * 400, "tenant": "acme"},
        {"messages": [{"role": "user"}], "tenant": "acme"},
        {"messages_file": "missing.json"},
    ]
    server = start(tmp_path, tiny_checkpoint, "w", top={"warm": warm, "warm_before_ready": True})
    try:
        skipped = sorted(r.getMessage().split(" ")[0] for r in caplog.records if "skipped" in r.getMessage())
        assert skipped == ["warm[1]", "warm[2]", "warm[3]", "warm[4]"]
        assert any("warming prefix cache" in r.getMessage() for r in caplog.records)

        rows = httpx.get(f"{server.base_url}/admin/cache", headers=ADMIN_HEADERS, timeout=30).json()["data"]
        assert len(rows) == 1
        (row,) = rows
        assert (row["model"], row["tenant"], row["pinned"], row["level"]) == (
            TINY_MODEL,
            "acme",
            True,
            "system",
        )
        assert row["tokens"] > 0 and row["tiers"]["ram"] == row["tokens"]

        response = httpx.post(
            f"{server.base_url}/admin/cache/warm",
            json={"tenant": "globex", "messages": conversation("and the fox ?")},
            headers=ADMIN_HEADERS,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        warmed = response.json()
        listing = httpx.get(
            f"{server.base_url}/admin/cache", params={"tenant": "globex"}, headers=ADMIN_HEADERS, timeout=30
        )
        assert [r["prefix_key"] for r in listing.json()["data"]] == [warmed["prefix_key"]]
        assert "capital of france" not in listing.text and "capital of france" not in response.text

        usage = chat(server, conversation("and the fox ?"), "globex")
        # the warmed prompt's whole blocks and its last, partial block (kept in RAM): all but the last token
        assert cached(usage) == usage["prompt_tokens"] - 1
        # its next turn (the reply, then a question) starts with the whole warmed prompt
        assert warmed["reusable_tokens"] == warmed["prompt_tokens"] == usage["prompt_tokens"]

        dropped = httpx.delete(
            f"{server.base_url}/admin/cache",
            params={"prefix_key": warmed["prefix_key"]},
            headers=ADMIN_HEADERS,
            timeout=30,
        )
        assert dropped.status_code == 200 and dropped.json()["dropped"]["prefixes"] == 1
        after = httpx.get(f"{server.base_url}/admin/cache", headers=ADMIN_HEADERS, timeout=30).json()["data"]
        assert [r["tenant"] for r in after] == ["acme"]

        bad = httpx.post(
            f"{server.base_url}/admin/cache/warm",
            json={"messages": [{"role": "user", "content": "x " * 2000}]},
            headers=ADMIN_HEADERS,
            timeout=60,
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
        no_filter = httpx.delete(f"{server.base_url}/admin/cache", headers=ADMIN_HEADERS, timeout=30)
        assert no_filter.status_code == 400
        blank = httpx.delete(f"{server.base_url}/admin/cache?prefix_key=", headers=ADMIN_HEADERS, timeout=30)
        assert blank.status_code == 400 and blank.json()["error"]["param"] == "prefix_key", blank.text
    finally:
        server.stop()


def test_a_pinned_warm_reports_what_the_next_request_reuses(tmp_path, tiny_checkpoint):
    """``POST /admin/cache/warm`` of a system prompt: ``cached_tokens`` counts its whole blocks (pinned),
    ``reusable_tokens`` what a request with that system prompt then reuses, token-granular, which the request's
    own ``cached_tokens`` matches exactly (before: only the whole blocks were reported, here more than the
    request could use)."""
    server = start(tmp_path, tiny_checkpoint, "r")
    try:
        response = httpx.post(
            f"{server.base_url}/admin/cache/warm",
            json={"tenant": "acme", "system": SYSTEM, "pin": True},
            headers=ADMIN_HEADERS,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        warmed = response.json()
        assert warmed["cached_tokens"] == warmed["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert warmed["pinned_blocks"] == warmed["cached_tokens"] // BLOCK_SIZE
        # the user turn leaves the warmed generation prompt at token 111, inside the last whole block (96-112):
        # the next request reuses 6 whole blocks and 15 tokens copied from the 7th, not all 112 tokens
        assert (warmed["prompt_tokens"], warmed["cached_tokens"], warmed["reusable_tokens"]) == (
            119,
            112,
            111,
        )
        usage = chat(
            server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}], "acme"
        )
        assert cached(usage) == warmed["reusable_tokens"]
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/cache"), ("DELETE", "/admin/cache?tenant=acme"), ("POST", "/admin/cache/warm")],
)
def test_cache_admin_needs_the_token(server, method, path):
    response = httpx.request(method, f"{server.base_url}{path}", json={"system": "x"}, timeout=30)
    assert response.status_code == 401
    wrong = httpx.request(
        method,
        f"{server.base_url}{path}",
        json={"system": "x"},
        headers={"Authorization": "Bearer no"},
        timeout=30,
    )
    assert wrong.status_code == 401


def test_warm_after_ready_and_an_unreachable_redis_cost_no_start(tmp_path, tiny_checkpoint, caplog):
    caplog.set_level(logging.WARNING)
    server = start(
        tmp_path,
        tiny_checkpoint,
        "late",
        top={"warm": [{"system": SYSTEM, "tenant": "late"}], "warm_before_ready": False},
        tiers=["redis"],
        tier_redis={"url": "redis://127.0.0.1:1/0", "prefix": "pgtest-unreachable", "retry_s": 60},
        deployment_secret=SECRET,
    )
    try:
        assert httpx.get(f"{server.base_url}/healthz", timeout=30).status_code == 200
        rows: list = []
        for _ in range(600):  # bounded poll: the warm task runs in the background
            rows = httpx.get(
                f"{server.base_url}/admin/cache", params={"tenant": "late"}, headers=ADMIN_HEADERS, timeout=30
            ).json()["data"]
            if rows:
                break
            time.sleep(0.05)
        assert [(r["tenant"], r["level"]) for r in rows] == [("late", "system")]
        usage = chat(server, conversation("hello ?"), "late")
        assert usage["prompt_tokens"] > 0
        # the Redis that is down shows in /metrics (a fresh-user trial saw it only in /admin/stats)
        metrics = httpx.get(f"{server.base_url}/metrics", headers=ADMIN_HEADERS, timeout=30).text.splitlines()
        assert f'prefixgate_tier_up{{model="{TINY_MODEL}",tier="redis"}} 0.0' in metrics
        skipped = [line for line in metrics if line.startswith("prefixgate_tier_skipped_down_total{")]
        assert skipped and float(skipped[0].split()[-1]) >= 1
        # counters that never moved are there from 0, so rate() is defined before the first event
        assert f'prefixgate_tier_written_bytes_total{{model="{TINY_MODEL}",tier="redis"}} 0.0' in metrics
        # ... those with labels too (before: no sample until the first event)
        for line in (
            f'prefixgate_tier_expired_total{{level="history",model="{TINY_MODEL}",tier="redis"}} 0.0',
            f'prefixgate_tier_rejected_total{{cause="corrupt",model="{TINY_MODEL}"}} 0.0',
            f'prefixgate_tier_writes_dropped_total{{model="{TINY_MODEL}"}} 0.0',
            f'prefixgate_tier_loaded_blocks_total{{model="{TINY_MODEL}"}} 0.0',
        ):
            assert line in metrics, line
        admin_errors = f'prefixgate_tier_admin_errors_total{{model="{TINY_MODEL}",tier="redis"}}'
        errors_before = next(float(x.split()[-1]) for x in metrics if x.startswith(admin_errors))
        # a purge with Redis down: before, a 500 (the Redis scan's ConnectionError) after RAM was dropped; now
        # RAM is dropped and the answer names the tier it could not purge, counted
        dropped = httpx.delete(
            f"{server.base_url}/admin/cache", params={"tenant": "late"}, headers=ADMIN_HEADERS, timeout=30
        )
        assert dropped.status_code == 200, dropped.text
        body = dropped.json()
        assert (
            body["dropped"]["prefixes"] == 1 and body["dropped"]["ram"] > 0 and body["dropped"]["redis"] == 0
        )
        assert [(row["model"], row["tier"]) for row in body["skipped_tiers"]] == [(TINY_MODEL, "redis")]
        # the prefix stays listed (Redis may hold it) for the purge to be made again once Redis is back
        rows = httpx.get(
            f"{server.base_url}/admin/cache", params={"tenant": "late"}, headers=ADMIN_HEADERS, timeout=30
        ).json()["data"]
        assert [(r["tenant"], r["tiers"]) for r in rows] == [("late", {"ram": 0, "redis": 0})]
        by_model = httpx.delete(
            f"{server.base_url}/admin/cache", params={"model": TINY_MODEL}, headers=ADMIN_HEADERS, timeout=30
        )
        assert by_model.status_code == 200 and by_model.json()["skipped_tiers"][0]["tier"] == "redis"
        metrics = httpx.get(f"{server.base_url}/metrics", headers=ADMIN_HEADERS, timeout=30).text.splitlines()
        # the listing's presence check and the two purges' scans (the records wait for Redis: no deletes)
        assert f"{admin_errors} {errors_before + 3}" in metrics
    finally:
        server.stop()
    assert any("redis" in r.getMessage().lower() for r in caplog.records if r.levelno >= logging.WARNING)
