"""Token buckets and per-key limits on a fake clock; usage per key and tenant."""

from __future__ import annotations

import pytest

from gateway.core.errors import QuotaExceededError, RateLimitError
from gateway.core.events import BackendUsage
from gateway.core.keys import ClientKey, KeyTable, key_digest, presented_key
from gateway.service.limits import OTHER_TENANTS, ClientUsage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(name: str, **limits) -> ClientKey:
    return ClientKey(name=name, digest=key_digest(f"sk-{name}"), tenant=f"t-{name}", **limits)


def usage(prompt: int, completion: int = 0, cached: int = 0) -> BackendUsage:
    return BackendUsage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def test_rpm_bucket_refuses_with_retry_after_and_refills():
    clock = Clock()
    k = key("a", rpm=2)
    limits = ClientUsage([k], clock=clock)
    limits.admit(k)
    limits.admit(k)
    with pytest.raises(RateLimitError) as caught:
        limits.admit(k)
    assert caught.value.retry_after_s == pytest.approx(30.0)  # 2 per minute: one back every 30 s
    clock.now += 29.0
    with pytest.raises(RateLimitError):
        limits.admit(k)
    clock.now += 1.0
    limits.admit(k)
    assert limits.snapshot()["keys"]["a"]["rate_limited"] == 2


def test_a_refusal_is_counted_for_the_requests_tenant_too_but_never_creates_one():
    """Before: every refused request made its tenant's entry, so 429s (with a new salt or header each) could
    fill the bounded table. Now a refusal counts on the tenant's entry only when a request of it ran."""
    clock = Clock()
    k = key("a", rpm=1)
    limits = ClientUsage([k], clock=clock)
    limits.admit(k, "acme/bob")
    limits.record_finish("a", "acme/bob", "m", usage(5))
    for tenant in ("acme/bob", "acme/eve", "acme/eve"):
        with pytest.raises(RateLimitError):
            limits.admit(k, tenant)
    snap = limits.snapshot()
    assert snap["keys"]["a"]["rate_limited"] == 3
    assert {name: c["rate_limited"] for name, c in snap["tenants"].items()} == {"acme/bob": 1}


def test_one_keys_tenants_never_push_a_configured_tenant_into_other():
    """Before: the table held the first ``max_tenants`` tenants seen, so one key's header (or salted)
    sub-tenants pushed every later tenant, configured ones included, into ``(other)`` for good."""
    platform, gina = ClientKey("platform", key_digest("sk-p"), "plat", trusted=True), key("gina")
    limits = ClientUsage([platform, gina], clock=Clock(), max_tenants=3)
    for i in range(10):
        limits.record_finish("platform", f"plat/user-{i}", "m", usage(1))
    limits.record_finish("gina", gina.tenant, "m", usage(7))
    tenants = limits.snapshot()["tenants"]
    assert tenants[gina.tenant]["prompt_tokens"] == 7
    assert tenants[OTHER_TENANTS]["requests"] == 7 and len(tenants) == 5


def test_tpm_charges_tokens_after_the_request():
    clock = Clock()
    k = key("a", tpm=600)  # 10 tokens per second
    limits = ClientUsage([k], clock=clock)
    limits.admit(k)
    limits.record_finish("a", k.tenant, "m", usage(900, 100))  # 1000 tokens: 401 in debt
    with pytest.raises(RateLimitError) as caught:
        limits.admit(k)
    assert caught.value.retry_after_s == pytest.approx(40.1)
    clock.now += 41
    limits.admit(k)


def test_budget_and_spend():
    """Spend is the cost the pipeline priced (``RequestCost.paid``); an unpriced model costs nothing."""
    k = key("a", budget_usd=3.0)
    limits = ClientUsage([k], clock=Clock())
    limits.admit(k)
    limits.record_finish("a", k.tenant, "free", usage(100))
    limits.record_finish("a", k.tenant, "m", usage(2, cached=2), 1.0)
    assert limits.snapshot()["keys"]["a"]["spend_usd"] == 1.0
    limits.record_finish("a", k.tenant, "m", usage(2), 2.0)
    with pytest.raises(RateLimitError) as caught:
        limits.admit(k)
    assert caught.value.code == "insufficient_quota" and getattr(caught.value, "retry_after_s", None) is None


def test_usage_per_key_and_tenant_is_bounded():
    a = key("a")
    limits = ClientUsage([a], clock=Clock(), max_tenants=3)
    for i in range(10):
        limits.record_finish("a", f"tenant-{i}", "m", usage(10, 1, 5))
    doc = limits.snapshot()
    assert doc["keys"]["a"]["requests"] == 10 and doc["keys"]["a"]["cached_tokens"] == 50
    assert len(doc["tenants"]) == 4 and doc["tenants"][OTHER_TENANTS]["requests"] == 7
    assert limits.state_size() == 5


def test_key_table_lookup_and_presented_key():
    table = KeyTable([key("a"), key("b")])
    assert table.lookup("sk-a").name == "a"
    assert table.lookup("sk-c") is None and table.lookup(None) is None and table.lookup("x" * 10_000) is None
    assert presented_key({"authorization": "Bearer  sk-a "}) == "sk-a"
    assert presented_key({"x-api-key": "sk-b"}) == "sk-b"
    assert presented_key({"authorization": "Basic abc"}) is None
    with pytest.raises(ValueError, match="duplicates"):
        KeyTable([key("a"), ClientKey(name="z", digest=key_digest("sk-a"), tenant="t")])


def test_a_budget_reservation_refused_takes_nothing_and_a_release_settles_it():
    """``reserve`` holds a request's cost estimate until ``release``; one that would pass the budget is refused
    with 429 ``insufficient_quota`` (OpenAI's type too) and gives back the rpm token ``admit`` took."""
    k = key("a", rpm=2, budget_usd=1.0)
    limits = ClientUsage([k], clock=Clock())
    limits.admit(k, k.tenant)
    limits.reserve("a", k.tenant, 0.6)
    limits.admit(k, k.tenant)  # the bucket's second token
    with pytest.raises(QuotaExceededError) as caught:
        limits.reserve("a", k.tenant, 0.6)  # 0.6 + 0.6 > 1.0
    assert caught.value.openai_body()["error"]["type"] == "insufficient_quota"
    assert not hasattr(caught.value, "retry_after_s")
    limits.admit(k, k.tenant)  # the refused request's rpm token came back
    limits.reserve("a", k.tenant, 0.3)
    assert limits.snapshot()["keys"]["a"]["reserved_usd"] == 0.9
    limits.release("a", 0.6)
    limits.release("a", 0.3)
    limits.record_finish("a", k.tenant, "m", usage(2, 1), 0.95)
    doc = limits.snapshot()["keys"]["a"]
    assert (doc["reserved_usd"], doc["spend_usd"], doc["rate_limited"]) == (0.0, 0.95, 1)
    with pytest.raises(QuotaExceededError):
        limits.reserve("a", k.tenant, 0.1)
    limits.reserve("a", k.tenant, 0.05)  # what is left fits
    with pytest.raises(QuotaExceededError):
        limits.admit(k, k.tenant)  # spend + reservations reached the budget: refused at admission


def test_an_unfinished_request_is_charged_its_tokens_and_spend_but_not_counted_finished():
    clock = Clock()
    k = key("a", tpm=600)
    limits = ClientUsage([k], clock=clock)
    limits.admit(k)
    limits.record_finish("a", k.tenant, "m", usage(500, 200), 0.25, finished=False)
    doc = limits.snapshot()["keys"]["a"]
    assert (doc["requests"], doc["prompt_tokens"], doc["completion_tokens"], doc["spend_usd"]) == (
        0,
        500,
        200,
        0.25,
    )
    with pytest.raises(RateLimitError):  # 700 tokens charged to a 600-token bucket
        limits.admit(k)
