"""``GatewayApp``'s short path for the model routes: which requests take it, and that they are answered as
Starlette's own path answers them (answers, handled errors, an unhandled one)."""

from __future__ import annotations

import pytest
from starlette.middleware import Middleware
from starlette.routing import Router
from starlette.testclient import TestClient

from gateway.config.loader import parse_config
from gateway.core.errors import UpstreamError
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.core.headers import INSTANCE_HEADER
from gateway.http.app import create_app
from tests.gateway.http.test_midstream_errors import ScriptedBackend

USAGE = BackendUsage(prompt_tokens=10, completion_tokens=2, cached_tokens=0, counted_by="upstream")


@pytest.fixture
def make_client():
    clients: list[TestClient] = []

    def make(short: bool) -> TestClient:
        backends = {
            "ok": ScriptedBackend("ok", [Delta("hi"), Finish("stop", USAGE)]),
            "refused": ScriptedBackend("refused", [UpstreamError("no replica")]),
            "crashes": ScriptedBackend("crashes", [RuntimeError("bug")]),
        }
        config = parse_config(
            {
                "rules": [],
                "models": [{"name": n, "backend": "openai", "base_url": "http://x"} for n in backends],
            }
        )
        app = create_app(config, backends=backends)
        if not short:
            app._direct = {}  # every request through Starlette's stack
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def test_model_posts_skip_the_router_and_the_rest_do_not(make_client, monkeypatch):
    client = make_client(short=True)
    assert set(client.app._direct_routes()) == {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
    }
    routed: list[str] = []
    original = Router.__call__

    async def spy(self, scope, receive, send):
        routed.append(scope["path"])
        await original(self, scope, receive, send)

    monkeypatch.setattr(Router, "__call__", spy)
    body = {"model": "ok", "messages": [{"role": "user", "content": "hello"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/chat/completions").status_code == 405  # not a POST: Starlette's answer
    assert routed == ["/v1/models", "/v1/chat/completions"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "ok", "messages": [{"role": "user", "content": "hello"}]}, 200),
        ({"model": "ok", "messages": [{"role": "user", "content": "hello"}], "stream": True}, 200),
        ({"model": "refused", "messages": [{"role": "user", "content": "hello"}]}, 502),
        ({"model": "nope", "messages": [{"role": "user", "content": "hello"}]}, 404),
        ({"model": "ok", "messages": "not a list"}, 400),
        ({"model": "crashes", "messages": [{"role": "user", "content": "hello"}]}, 500),
    ],
)
def test_the_short_path_answers_what_starlettes_path_answers(make_client, body, status):
    answers = []
    for short in (True, False):
        response = make_client(short).post("/v1/chat/completions", json=body)
        shape = response.json() if "json" in response.headers["content-type"] else response.text
        if isinstance(shape, dict):
            shape.pop("id", None), shape.pop("created", None)
        elif isinstance(shape, str):
            shape = [line for line in shape.splitlines() if not line.startswith("data: {")]
        per_app = ("x-request-id", "content-length", INSTANCE_HEADER)  # each app names itself
        headers = {k: v for k, v in response.headers.items() if k not in per_app}
        answers.append((response.status_code, shape, headers))
        assert (INSTANCE_HEADER in response.headers) == (response.status_code == 200)
    assert answers[0] == answers[1]
    assert answers[0][0] == status
    if status == 500:
        assert answers[0][2]["connection"] == "close" and "RuntimeError" in answers[0][1]["error"]["message"]


def test_a_middleware_other_than_the_start_clock_turns_the_short_path_off(make_client):
    client = make_client(short=True)
    app = client.app
    seen: list[str] = []

    class Spy:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            seen.append(scope.get("path", ""))
            await self.inner(scope, receive, send)

    app.user_middleware.append(Middleware(Spy))
    app.middleware_stack = None  # rebuilt with the spy on the next request
    assert app._direct_routes() == {}
    app._direct = None
    body = {"model": "ok", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert "/v1/chat/completions" in seen
