"""Fuzz pass over both faces: bodies generated from the request schemas of the served ``/openapi.json``
(hypothesis-jsonschema), and arbitrary JSON mutations of them, are sent to the real server; no answer is a
5xx, every error has its protocol's shape, and no block is left in use. Bounded (examples per path, no
deadline per example, ``max_tokens`` clamped) so it stays fast."""

from __future__ import annotations

import copy

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.http.test_protocol_exact_e2e import assert_no_block_in_use
from tests.gateway.schema_strategy import from_schema

PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
]
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
FUZZ = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def document(server) -> dict:
    response = httpx.get(server.base_url + "/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def request_schema(document: dict, path: str) -> dict:
    """The path's body schema, with ``model`` fixed to the served model so bodies get past the registry."""
    schema = copy.deepcopy(
        document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    )
    schema["properties"]["model"] = {"const": TINY_MODEL}
    return schema


def test_the_document_covers_both_faces_with_valid_schemas(document):
    assert document["openapi"].startswith("3.1")
    assert set(PATHS) <= set(document["paths"])
    for path in PATHS:
        operation = document["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["model"]["examples"] == [TINY_MODEL]
        assert {"200", "400"} <= set(operation["responses"])


def send(server, document: dict, path: str, body) -> httpx.Response:
    if isinstance(body, dict):
        for key in MAX_TOKEN_FIELDS:
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
                body[key] = 4  # keep generation short; the value's range is not what is fuzzed
    with httpx.Client(timeout=60) as http:
        response = http.post(server.base_url + path, json=body)
        response.read()
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        error = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        jsonschema.validate(response.json(), document["components"]["schemas"][error])
    elif response.headers["content-type"].startswith("application/json"):  # an answer, not a stream
        answer = document["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), answer)
    return response


def test_the_document_describes_the_read_paths_and_what_they_answer(server, document):
    """A fresh-user trial: ``/v1/models``, ``/v1/models/{id}`` and ``/healthz`` were missing, every 200 was
    ``{"type": "object"}``, and the count_tokens body listed ``max_tokens``, which the endpoint refuses."""
    for path, url in (
        ("/v1/models", "/v1/models"),
        ("/v1/models/{model}", f"/v1/models/{TINY_MODEL}"),
        ("/healthz", "/healthz"),
    ):
        answer = document["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator.check_schema(answer)
        jsonschema.validate(httpx.get(server.base_url + url, timeout=30).json(), answer)
    count = document["paths"]["/v1/messages/count_tokens"]["post"]["requestBody"]["content"][
        "application/json"
    ]
    assert "max_tokens" not in count["schema"]["properties"] and "stream" not in count["schema"]["properties"]
    refused = httpx.post(
        server.base_url + "/v1/messages/count_tokens",
        json={"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        timeout=30,
    )
    assert refused.status_code == 400


@pytest.mark.parametrize("path", PATHS)
def test_bodies_from_the_schema_never_get_a_5xx(server, document, path):
    schema = request_schema(document, path)
    validator = jsonschema.Draft202012Validator(schema)

    @FUZZ
    @given(body=from_schema(schema))
    def check(body):
        assert validator.is_valid(body)
        send(server, document, path, body)

    check()
    assert_no_block_in_use(server)


@pytest.mark.parametrize("path", PATHS)
def test_mutated_bodies_never_get_a_5xx(server, document, path):
    schema = request_schema(document, path)
    fields = sorted(schema["properties"])

    @FUZZ
    @given(
        body=from_schema(schema),
        changes=st.dictionaries(st.sampled_from(fields) | st.text(max_size=8), JSON, min_size=1, max_size=3),
        drop=st.lists(st.sampled_from(fields), max_size=2),
    )
    def check(body, changes, drop):
        body.update(changes)
        for key in drop:
            body.pop(key, None)
        send(server, document, path, body)

    check()
    assert_no_block_in_use(server)


@settings(max_examples=30, deadline=None)
@given(body=JSON, path=st.sampled_from(PATHS))
def test_any_json_body_never_gets_a_5xx(server, document, body, path):
    send(server, document, path, body)
