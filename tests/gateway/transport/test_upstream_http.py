"""Shared upstream plumbing (gateway.transport.upstream_http): redaction, backoff, Retry-After. SSE:
test_sse.py."""

from __future__ import annotations

import email.utils

import pytest

from gateway.transport.redact import REDACTED, redact, redact_url
from gateway.transport.retry import RetryPolicy, parse_retry_after


def test_redact_removes_known_secrets_and_key_shapes():
    secret = "my-very-secret-upstream-key"
    text = (
        f"failed with key {secret}; Incorrect API key provided: sk-proj-abcdefghijklmnop1234; "
        "anthropic sk-ant-api03-AbCdEf123456; Authorization: Bearer abc.def-ghi_jkl; "
        'url https://x/v1?api_key=zzzzzzzz123 {"x-api-key": "qwertyuiop"}'
    )
    out = redact(text, [secret])
    for leaked in (
        secret,
        "sk-proj-abcdefghijklmnop1234",
        "sk-ant-api03",
        "abc.def-ghi_jkl",
        "zzzzzzzz123",
        "qwertyuiop",
    ):
        assert leaked not in out
    assert out.count(REDACTED) == 6
    assert "Bearer [REDACTED]" in out and "api_key=[REDACTED]" in out


def test_redact_keeps_ordinary_text():
    text = "upstream http://vllm-0:8000/v1 answered 503: model is loading (tokens: 1024, sk=3)"
    assert redact(text, ["", "abc"]) == text  # short or empty secrets are not redacted (would eat words)


def test_redact_url_drops_credentials_and_query():
    assert redact_url("https://user:pw@host:8443/v1?key=123#x") == "https://host:8443/v1"


def test_backoff_is_full_jitter_capped_and_respects_retry_after():
    policy = RetryPolicy(retries=5, backoff_base_s=0.5, backoff_max_s=4.0)
    assert [policy.delay(a, rng=lambda: 1.0) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.delay(3, rng=lambda: 0.0) == 0.0
    assert policy.delay(0, retry_after_s=7.0, rng=lambda: 1.0) == 7.0


def test_parse_retry_after_seconds_and_http_date():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    assert (
        parse_retry_after("inf") is None
        and parse_retry_after("1e400") is None
        and parse_retry_after("nan") is None
    )
    now = 1_700_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 20, usegmt=True), now=now) == pytest.approx(20.0)
    assert parse_retry_after(email.utils.formatdate(now - 20, usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
