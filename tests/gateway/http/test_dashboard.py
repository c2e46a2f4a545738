"""The dashboard's endpoints without a browser: the login form (CSRF, same origin, the wrong-token delay by
count, the session cookie's flags), the page's redirects (no, forged or expired session), the data endpoint
(auth, cross-origin refusal, shape, no prompt text) and the static files; the session cookie's signing."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.config.loader import parse_config
from gateway.core.events import BackendUsage
from gateway.http.app import create_app
from gateway.http.dashboard_session import (
    CSRF_COOKIE,
    SESSION_COOKIE,
    DashboardAuth,
    session_valid,
    sign_session,
)
from tests.gateway.conftest import TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS, ADMIN_TOKEN

TOKEN = "dashboard-unit-admin-token"
ORIGIN = "http://testserver"


class Sleeps:
    """Records the delays a wrong token asked for (instead of sleeping)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


TENANT_KEY = "sk-tenant-0123456789"


def client_for(token: str | None, keys: bool = False) -> tuple[TestClient, DashboardAuth, Sleeps]:
    data = {
        "rules": [],
        "models": [
            {"name": "gpt", "backend": "openai", "api_key": "sk-x", "base_url": "https://a.example/v1"}
        ],
    }
    if token:
        data["admin"] = {"token": token}
    if keys:
        data["keys"] = [{"name": "acme", "key": TENANT_KEY, "tenant": "acme"}]
    app = create_app(parse_config(data))
    sleeps = Sleeps()
    auth = DashboardAuth(failure_delay_s=0.75, sleep=sleeps)
    app.state.dashboard_auth = auth
    return TestClient(app, base_url=ORIGIN, follow_redirects=False), auth, sleeps


def csrf_of(client: TestClient) -> str:
    page = client.get("/admin/login")
    assert page.status_code == 200 and CSRF_COOKIE in page.cookies
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)


def log_in(client: TestClient, token: str, **headers) -> httpx.Response:
    csrf = csrf_of(client)
    return client.post(
        "/admin/login",
        content=f"token={token}&csrf={csrf}",
        headers={"content-type": "application/x-www-form-urlencoded", "origin": ORIGIN, **headers},
    )


def test_logged_out_page_redirects_to_login_and_login_sets_a_strict_httponly_cookie():
    client, auth, sleeps = client_for(TOKEN)
    response = client.get("/admin/")
    assert response.status_code == 303 and response.headers["location"] == "/admin/login"
    assert client.get("/admin").headers["location"] == "/admin/"

    ok = log_in(client, TOKEN)
    assert ok.status_code == 303 and ok.headers["location"] == "/admin/"
    cookie = ok.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=") and TOKEN not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
    page = client.get("/admin/")
    assert page.status_code == 200 and 'id="panel-hit-rate"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert auth.failed_logins == 0 and sleeps.calls == []

    out = client.post("/admin/logout", headers={"origin": ORIGIN})
    assert out.status_code == 303 and f'{SESSION_COOKIE}=""' in out.headers["set-cookie"]


def test_a_wrong_token_waits_says_so_and_gives_no_hint():
    client, auth, sleeps = client_for(TOKEN)
    for attempt in (1, 2):
        response = log_in(client, TOKEN[:-1] + "X")
        assert response.status_code == 401 and "Wrong admin token." in response.text
        assert TOKEN not in response.text and SESSION_COOKIE not in response.headers.get("set-cookie", "")
        assert auth.failed_logins == attempt and sleeps.calls == [0.75] * attempt
    assert client.get("/admin/").status_code == 303


def test_login_needs_the_csrf_value_and_the_same_origin():
    client, auth, _ = client_for(TOKEN)
    csrf_of(client)
    no_csrf = client.post(
        "/admin/login",
        content=f"token={TOKEN}",
        headers={"content-type": "application/x-www-form-urlencoded", "origin": ORIGIN},
    )
    assert no_csrf.status_code == 403 and "expired" in no_csrf.text
    forged = client.post(
        "/admin/login",
        content=f"token={TOKEN}&csrf=forged",
        headers={"content-type": "application/x-www-form-urlencoded", "origin": ORIGIN},
    )
    assert forged.status_code == 403
    cross = log_in(client, TOKEN, origin="https://evil.example")
    assert cross.status_code == 403 and "Cross-origin" in cross.text
    cross_site = log_in(client, TOKEN, **{"sec-fetch-site": "cross-site"})
    assert cross_site.status_code == 403
    too_big = client.post(
        "/admin/login",
        content="token=" + "a" * 5000,
        headers={"content-type": "application/x-www-form-urlencoded", "origin": ORIGIN},
    )
    assert too_big.status_code == 413
    too_many_fields = client.post(  # before: a 500 (parse_qs raised on a fifth field), no token needed
        "/admin/login",
        content="a&b&c&d&e",
        headers={"content-type": "application/x-www-form-urlencoded", "origin": ORIGIN},
    )
    assert too_many_fields.status_code == 400 and "Invalid login request" in too_many_fields.text
    assert auth.failed_logins == 0 and SESSION_COOKIE not in client.cookies


def test_forged_and_expired_cookies_redirect_to_login():
    client, auth, _ = client_for(TOKEN)
    forged = "9999999999.nonce." + "0" * 64
    expired = sign_session(TOKEN, auth.clock() - 100, ttl_s=10)
    other_token = sign_session("another-token", auth.clock())
    for value in (forged, expired, other_token, "garbage"):
        client.cookies.set(SESSION_COOKIE, value)
        response = client.get("/admin/")
        assert response.status_code == 303 and response.headers["location"] == "/admin/login"
        data = client.get("/admin/dashboard/data")
        assert data.status_code == 401 and data.json()["error"]["code"] == "invalid_api_key"


def test_data_endpoint_auth_and_cross_origin_refusal():
    client, _, _ = client_for(TOKEN)
    assert client.get("/admin/dashboard/data").status_code == 401
    assert client.get("/admin/dashboard/data", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert (
        client.get("/admin/dashboard/data", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    )
    log_in(client, TOKEN)
    assert client.get("/admin/dashboard/data").status_code == 200
    assert client.get("/admin/dashboard/data", headers={"sec-fetch-site": "same-origin"}).status_code == 200
    for headers in ({"origin": "https://evil.example"}, {"sec-fetch-site": "cross-site"}):
        refused = client.get("/admin/dashboard/data", headers=headers)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"


READ_ENDPOINTS = ("/admin/stats", "/admin/cache", "/admin/rules/learned")


def test_the_login_session_opens_the_read_only_admin_endpoints():
    client, auth, _ = client_for(TOKEN)
    for path in READ_ENDPOINTS:  # no cookie: 401 in the OpenAI error shape
        refused = client.get(path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "/admin/login" in refused.json()["error"]["message"]
    assert log_in(client, TOKEN).status_code == 303
    stats = client.get("/admin/stats")
    assert stats.status_code == 200 and "models" in stats.json()
    assert client.get("/admin/cache").json()["object"] == "list"
    assert client.get("/admin/rules/learned").headers["content-type"].startswith("application/yaml")
    for path in READ_ENDPOINTS:
        assert client.get(path, headers={"sec-fetch-site": "same-origin"}).status_code == 200, path
        for headers in ({"origin": "https://evil.example"}, {"sec-fetch-site": "cross-site"}):
            cross = client.get(path, headers=headers)
            assert cross.status_code == 403 and cross.json()["error"]["code"] == "permission_denied"
    # the bearer token keeps working without a cookie; a wrong one is still refused
    bearer, _, _ = client_for(TOKEN)
    for path in READ_ENDPOINTS:
        assert bearer.get(path, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        assert bearer.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401, path
    # an expired or forged session opens nothing
    for value in (sign_session(TOKEN, auth.clock() - 100, ttl_s=10), "9999999999.nonce." + "0" * 64):
        bearer.cookies.set(SESSION_COOKIE, value)
        assert all(bearer.get(path).status_code == 401 for path in READ_ENDPOINTS)


def test_the_login_session_cannot_change_state_or_scrape_metrics():
    # a cookie travels with any request the browser makes, so the endpoints that change the cache take the
    # bearer token only (no CSRF); /metrics lies outside the cookie's Path=/admin
    client, _, _ = client_for(TOKEN)
    log_in(client, TOKEN)
    assert client.get("/admin/stats").status_code == 200
    same = {"origin": ORIGIN, "sec-fetch-site": "same-origin"}
    dropped = client.delete("/admin/cache?model=gpt", headers=same)
    assert dropped.status_code == 401 and dropped.json()["error"]["code"] == "invalid_api_key"
    warmed = client.post("/admin/cache/warm", json={"model": "gpt", "system": "x"}, headers=same)
    assert warmed.status_code == 401
    value = client.cookies.get(SESSION_COOKIE)
    assert client.get("/metrics", headers={"cookie": f"{SESSION_COOKIE}={value}"}).status_code == 401
    assert client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_without_an_admin_token_the_dashboard_is_open_but_still_same_origin_only():
    client, _, _ = client_for(None)
    assert client.get("/admin/").status_code == 200
    assert client.get("/admin/login").headers["location"] == "/admin/"
    assert client.get("/admin/dashboard/data").status_code == 200
    assert client.get("/admin/dashboard/data", headers={"origin": "https://evil.example"}).status_code == 403


def test_static_files_are_served_and_vendored_uplot_is_there():
    client, _, _ = client_for(TOKEN)
    for path in (
        "dashboard.js",
        "dashboard.css",
        "uplot/uPlot.iife.min.js",
        "uplot/uPlot.min.css",
        "uplot/LICENSE",
    ):
        assert client.get(f"/admin/static/{path}").status_code == 200, path
    assert client.get("/admin/static/../dashboard.py").status_code == 404


def test_data_shape_of_an_upstream_only_gateway():
    client, _, _ = client_for(TOKEN)
    gateway = client.app.state.gateway
    gateway.stats.record_rules("gpt", {"r": 1})
    gateway.stats.record_finish(
        "gpt", BackendUsage(prompt_tokens=100, completion_tokens=1, cached_tokens=60), 0.03, "k" * 32, "acme"
    )
    gateway.stats.record_finish(
        "gpt", BackendUsage(prompt_tokens=100, completion_tokens=1, cached_tokens=0), 0.3, "k" * 32, "acme"
    )
    doc = client.get("/admin/dashboard/data", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert set(doc) == {"series", "totals", "ttft", "prefixes", "replicas", "learned", "tiers"}
    assert doc["totals"]["requests"] == 2 and doc["totals"]["rules_requests"] == 1
    assert doc["prefixes"] == [
        {
            "prefix_key": "k" * 32,
            "model": "gpt",
            "tenant": "acme",
            "level": None,
            "cached_now_tokens": None,
            "requests": 2,
            "prompt_tokens": 200,
            "cached_tokens": 60,
            "hit_rate": 0.3,
        }
    ]
    buckets = doc["ttft"]["buckets_s"]
    assert len(doc["ttft"]["hit"]) == len(doc["ttft"]["miss"]) == len(buckets) + 1
    assert doc["ttft"]["hit"][buckets.index(0.04)] == 1 and doc["ttft"]["miss"][buckets.index(0.5)] == 1
    assert doc["replicas"] == [
        {
            "model": "gpt",
            "replica": "https://a.example/v1",
            "state": "up",
            "inflight": 0,
            "failures": 0,
            "requests": 0,
            "share": None,
            "away": 0,
        }
    ]


def test_data_of_a_running_gateway_has_every_panel_and_no_prompt_text(server):
    secret_words = "zanzibar quokka marmalade"
    for question in ("first", "second"):
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={
                "model": TINY_MODEL,
                "messages": [
                    {"role": "system", "content": f"You answer about {secret_words} in one line."},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 2,
            },
            timeout=60,
        )
        assert response.status_code == 200
    response = httpx.get(f"{server.base_url}/admin/dashboard/data", headers=ADMIN_HEADERS, timeout=30)
    assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
    doc = response.json()
    assert not any(word in response.text for word in secret_words.split())
    series = doc["series"]
    assert all(len(column) == len(series["t"]) for column in series["models"][TINY_MODEL].values())
    assert doc["totals"]["requests"] >= 2 and doc["totals"]["blocks"]["total"] == 128
    assert sum(doc["ttft"]["hit"]) + sum(doc["ttft"]["miss"]) >= 2
    assert any(row["model"] == TINY_MODEL and row["level"] for row in doc["prefixes"])
    assert json.dumps(doc)  # plain JSON, no NaN
    assert httpx.get(f"{server.base_url}/admin/dashboard/data", timeout=30).status_code == 401
    assert ADMIN_TOKEN not in response.text


def test_session_signing():
    now = 1_000_000.0
    value = sign_session(TOKEN, now, ttl_s=60)
    assert session_valid(TOKEN, value, now + 59) and not session_valid(TOKEN, value, now + 61)
    assert not session_valid("other", value, now)
    expiry, nonce, mac = value.split(".")
    assert not session_valid(TOKEN, f"{int(expiry) + 1000}.{nonce}.{mac}", now)  # extended expiry: mac fails
    assert not session_valid(TOKEN, None, now) and not session_valid(TOKEN, "a.b", now)
    assert sign_session(TOKEN, now) != sign_session(TOKEN, now)  # a fresh nonce each login


@pytest.mark.parametrize("method", ["DELETE", "PUT"])
def test_other_methods_are_refused(method):
    client, _, _ = client_for(TOKEN)
    assert client.request(method, "/admin/dashboard/data").status_code == 405


ADMIN_ENDPOINTS = (
    ("GET", "/admin/stats"),
    ("GET", "/admin/cache"),
    ("GET", "/admin/rules/learned"),
    ("DELETE", "/admin/cache?model=gpt"),
    ("POST", "/admin/cache/warm"),
    ("GET", "/metrics"),
    ("GET", "/admin/"),
    ("GET", "/admin/login"),
    ("POST", "/admin/login"),
    ("GET", "/admin/dashboard/data"),
)


@pytest.mark.parametrize("bearer", [None, TENANT_KEY, "anything"])
def test_with_client_keys_and_no_admin_token_every_admin_endpoint_is_closed(bearer, caplog):
    # Before: /admin/*, DELETE /admin/cache and /metrics answered anyone once keys were configured without
    # an admin token, and nothing was logged.
    client, _, _ = client_for(None, keys=True)
    headers = {"origin": ORIGIN, **({"authorization": f"Bearer {bearer}"} if bearer else {})}
    with caplog.at_level("WARNING"), client:
        for method, path in ADMIN_ENDPOINTS:
            response = client.request(method, path, headers=headers, json={"system": "x"})
            assert response.status_code == 403, (method, path, response.status_code)
            error = response.json()["error"]
            assert error["code"] == "permission_denied", path
            assert "admin.token" in error["message"] and "PREFIXGATE_ADMIN_TOKEN" in error["message"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("no admin token" in w and "CLOSED" in w for w in warnings), warnings
    assert not any("gateway is OPEN" in w for w in warnings)


def test_without_client_keys_and_admin_token_the_admin_endpoints_stay_open_with_the_open_warning(caplog):
    client, _, _ = client_for(None)
    with caplog.at_level("WARNING"), client:
        assert client.get("/admin/stats").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.delete("/admin/cache?model=gpt").status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("gateway is OPEN" in w for w in warnings) and not any("CLOSED" in w for w in warnings)


def test_with_client_keys_and_an_admin_token_the_bearer_and_the_dashboard_login_work(caplog):
    client, _, _ = client_for(TOKEN, keys=True)
    with caplog.at_level("WARNING"), client:
        assert client.get("/admin/stats").status_code == 401
        assert (
            client.get("/admin/stats", headers={"authorization": f"Bearer {TENANT_KEY}"}).status_code == 401
        )
        assert client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert client.get("/admin/").headers["location"] == "/admin/login"
        ok = log_in(client, TOKEN)
        assert ok.status_code == 303 and ok.headers["location"] == "/admin/"
        assert client.get("/admin/").status_code == 200
        assert client.get("/admin/dashboard/data").status_code == 200
        assert client.get("/admin/stats").status_code == 200
    assert not any("CLOSED" in r.getMessage() for r in caplog.records)


def test_cached_now_is_what_ram_or_a_tier_holds_of_the_prefix_now(monkeypatch):
    """A trial: "cached now" showed the listed prefix's full token count (480) with 272 tokens in RAM and none on
    disk."""
    from gateway.service import dashboard_data

    client, _, _ = client_for(TOKEN)
    gateway = client.app.state.gateway
    gateway.stats.record_finish(
        "gpt", BackendUsage(prompt_tokens=500, completion_tokens=1, cached_tokens=0), 0.3, "k" * 32, "acme"
    )
    rows = [{"prefix_key": "k" * 32, "level": "system", "tokens": 480, "tiers": {"ram": 272, "disk": 0}}]
    monkeypatch.setattr(dashboard_data, "list_cached", lambda gateway, **filters: rows)
    doc = client.get("/admin/dashboard/data", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert [(p["level"], p["cached_now_tokens"]) for p in doc["prefixes"]] == [("system", 272)]
