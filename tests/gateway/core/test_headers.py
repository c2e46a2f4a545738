"""``gateway.core.headers``: the tenant header read as the client wrote it (UTF-8 over Latin-1-decoded bytes), the
rules header's values."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.config.loader import parse_config
from gateway.core.errors import InvalidRequestError
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.core.headers import TENANT_HEADER, check_tenant, rules_enabled, tenant
from gateway.http.app import create_app
from tests.gateway.http.test_midstream_errors import ScriptedBackend


def _as_server_gives(raw: bytes) -> dict[str, str]:
    return {TENANT_HEADER: raw.decode("latin-1")}  # what the ASGI server hands over for these bytes


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"acme", "acme"),
        ("租户".encode(), "租户"),
        ("équipe-7".encode(), "équipe-7"),
        (b"caf\xe9", "café"),  # Latin-1 bytes, not UTF-8: as the server decoded them
        (b"\xff\xfe", "\xff\xfe"),
    ],
)
def test_the_tenant_is_read_as_utf8_where_the_bytes_are_utf8(raw, expected):
    assert tenant(_as_server_gives(raw)) == expected


def test_no_tenant_header_is_the_empty_tenant_and_long_ones_are_refused():
    assert tenant({}) == ""
    assert check_tenant("é" * 256) == "é" * 256
    with pytest.raises(InvalidRequestError, match="longer than 256"):
        check_tenant("x" * 257)


def test_rules_header():
    assert rules_enabled({}) and rules_enabled({"x-prefixgate-rules": " ON "})
    assert not rules_enabled({"x-prefixgate-rules": "off"})
    with pytest.raises(InvalidRequestError):
        rules_enabled({"x-prefixgate-rules": "maybe"})


def test_a_utf8_tenant_shows_as_sent_in_the_stats():
    usage = BackendUsage(prompt_tokens=3, completion_tokens=1, cached_tokens=0, counted_by="upstream")
    backend = ScriptedBackend("m", [Delta("hi"), Finish("stop", usage)])
    config = parse_config(
        {"rules": [], "models": [{"name": "m", "backend": "openai", "base_url": "http://x"}]}
    )
    with TestClient(create_app(config, backends={"m": backend})) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        answer = client.post("/v1/chat/completions", json=body, headers={TENANT_HEADER: "租户".encode()})
        assert answer.status_code == 200
        assert "租户" in client.get("/admin/stats").json()["tenants"]
