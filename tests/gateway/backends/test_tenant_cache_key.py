"""The ``prompt_cache_key`` an OpenAI-compatible upstream receives carries the tenant."""

from __future__ import annotations

import json

import respx

from gateway.core.keys import tenant_cache_key
from tests.gateway.backends.test_openai_upstream import CACHED_STREAM, MESSAGES, URL, backend, http  # noqa: F401
from tests.gateway.upstream_helpers import chat_request, drain, sse_response


@respx.mock
async def test_client_prompt_cache_key_is_salted_with_the_tenant(http):  # noqa: F811
    route = respx.post(URL).mock(return_value=sse_response(CACHED_STREAM))
    sent = []
    for tenant in ("acme", "globex"):
        body = {"model": "gw-model", "messages": MESSAGES, "prompt_cache_key": "mine"}
        request = chat_request(MESSAGES, body=body)
        request.tenant = tenant
        await drain(backend(http).stream(request))
        sent.append(json.loads(route.calls.last.request.content)["prompt_cache_key"])
    assert sent == [tenant_cache_key("acme", "mine"), tenant_cache_key("globex", "mine")]
    assert len(set(sent)) == 2 and "acme" not in sent[0] and len(sent[0]) == 32
