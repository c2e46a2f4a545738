"""``GET /v1/models`` and ``/v1/models/{model}`` for the Anthropic SDK: a request with ``anthropic-version`` gets
Anthropic's model objects, paging and error JSON (``gateway.http.anthropic_models``); one without keeps OpenAI's."""

from __future__ import annotations

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from gateway.config.loader import parse_config
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.http.app import create_app
from tests.gateway.http.test_midstream_errors import ScriptedBackend
from tests.gateway.server import RunningServer

NAMES = ["m1", "m2", "m3", "m4", "m5"]
ANTHROPIC = {"anthropic-version": "2023-06-01", "x-api-key": "k"}


@pytest.fixture
def client():
    usage = BackendUsage(prompt_tokens=1, completion_tokens=1, cached_tokens=0, counted_by="upstream")
    backends = {n: ScriptedBackend(n, [Delta("hi"), Finish("stop", usage)]) for n in NAMES}
    config = parse_config(
        {"rules": [], "models": [{"name": n, "backend": "openai", "base_url": "http://x"} for n in NAMES]}
    )
    with TestClient(create_app(config, backends=backends), raise_server_exceptions=False) as test_client:
        yield test_client


def test_an_anthropic_request_gets_anthropic_model_objects(client):
    body = client.get("/v1/models", headers=ANTHROPIC).json()
    assert body["has_more"] is False and body["first_id"] == "m1" and body["last_id"] == "m5"
    assert [m["id"] for m in body["data"]] == NAMES
    first = body["data"][0]
    assert set(first) == {"type", "id", "display_name", "created_at"}
    assert first["type"] == "model" and first["display_name"] == "m1"
    assert first["created_at"].endswith("Z") and first["created_at"][4] == "-"
    one = client.get("/v1/models/m2", headers=ANTHROPIC).json()
    assert one == {**first, "id": "m2", "display_name": "m2"}


def test_an_openai_request_keeps_openai_shapes(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["object"] for m in body["data"]] == ["model"] * 5
    assert client.get("/v1/models/m2").json()["owned_by"] == "prefixgate"
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("query", "ids", "has_more"),
    [
        ("limit=2", ["m1", "m2"], True),
        ("limit=2&after_id=m2", ["m3", "m4"], True),
        ("limit=2&after_id=m3", ["m4", "m5"], False),
        ("after_id=m5", [], False),
        ("limit=2&before_id=m4", ["m2", "m3"], True),
        ("limit=3&before_id=m4", ["m1", "m2", "m3"], False),
        ("limit=1000", NAMES, False),
    ],
)
def test_pages(client, query, ids, has_more):
    body = client.get(f"/v1/models?{query}", headers=ANTHROPIC).json()
    assert [m["id"] for m in body["data"]] == ids and body["has_more"] is has_more
    assert (body["first_id"], body["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=two", "limit"),
        ("limit=1_0", "limit"),  # before: read as 10 (int() takes underscores and spaces)
        ("limit=%205%20", "limit"),
        ("after_id=nope", "after_id"),
        ("before_id=nope", "before_id"),
        ("after_id=m1&before_id=m3", "after_id"),
    ],
)
def test_bad_paging_is_an_anthropic_400(client, query, needle):
    answer = client.get(f"/v1/models?{query}", headers=ANTHROPIC)
    assert answer.status_code == 400
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"]


def test_an_unknown_model_is_an_anthropic_404(client):
    answer = client.get("/v1/models/nope", headers=ANTHROPIC)
    assert answer.status_code == 404
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "not_found_error"


def test_the_official_sdks_read_their_own_shapes():
    usage = BackendUsage(prompt_tokens=1, completion_tokens=1, cached_tokens=0, counted_by="upstream")
    backends = {n: ScriptedBackend(n, [Delta("hi"), Finish("stop", usage)]) for n in NAMES}
    config = parse_config(
        {"rules": [], "models": [{"name": n, "backend": "openai", "base_url": "http://x"} for n in NAMES]}
    )
    server = RunningServer(config, backends=backends).start()
    try:
        with anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0) as claude:
            page = claude.models.list(limit=2)
            assert [m.id for m in page.data] == ["m1", "m2"] and page.data[0].display_name == "m1"
            assert [m.id for m in page] == NAMES  # the SDK's auto-paging follows last_id as after_id
            assert claude.models.retrieve("m3").created_at.year >= 2026
            with pytest.raises(anthropic.NotFoundError):
                claude.models.retrieve("nope")
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0) as gpt:
            assert [m.id for m in gpt.models.list()] == NAMES
            assert gpt.models.retrieve("m3").owned_by == "prefixgate"
    finally:
        server.stop()
