"""``POST /v1/messages/count_tokens``: the input tokens of a Messages request, without running it.

Reference: https://docs.anthropic.com/en/api/messages-count-tokens. The body is a Messages body without
``max_tokens`` (``model``, ``messages``, optional ``system``, ``tools``, ``tool_choice``, ``thinking``, ...); the
answer is ``{"input_tokens": <int>}``; errors are Anthropic error JSON, as on ``/v1/messages`` (the app's
error handler shapes every path under ``/v1/messages`` so).

The body is parsed, validated and canonicalized exactly as ``/v1/messages`` does it (``gateway.protocols.anthropic.validate``
parsing, the same headers: ``x-prefixgate-rules``, ``x-prefixgate-tenant``, ``anthropic-beta``; the configured
rules), so the count is the count of what the model would be sent. Then, by the backend of the named model:

- **embedded engine**: the canonical request is turned into the engine request a completion would get
  (``backends.embedded.generation_request``) and rendered by the checkpoint's chat template into token ids
  (``AsyncEngine.prompt_token_ids``, the render path of ``generate``). ``input_tokens`` = the number of ids,
  the generation prompt included, i.e. the ``prompt_tokens`` a completion of the same body reports. Nothing is
  scheduled: no block is taken, no prefix-cache entry is touched, no step runs. The count is returned even
  when the prompt would not fit the context window (``/v1/messages`` would answer ``context_length_exceeded``).
- **Anthropic upstream**: the body a ``/v1/messages`` passthrough would send (``build_body``: rules applied,
  ``model`` mapped, automatic breakpoints), without the fields only a Messages request takes
  (``MESSAGES_ONLY_FIELDS``), is POSTed to the upstream's ``/v1/messages/count_tokens`` with the same key,
  headers, replica choice, retries and error mapping (``UpstreamBackend.post``). Its ``input_tokens`` is
  returned as it came.
- **any other backend** (an OpenAI-compatible upstream: OpenAI has no count endpoint): an estimate, counted
  here and never sent upstream: ``breakpoints.default_counter()`` (tiktoken ``cl100k_base``, else characters
  / 4) over ``estimate_text``, the JSON of the messages and tools the OpenAI-compatible upstream would be sent.
  JSON punctuation is counted (an overcount of a few tokens per message against a chat template) and so is the
  URL of an image part (a ``data:`` URL in full), while the server's own tokenizer may differ from cl100k.

Every answer carries ``x-prefixgate-counted-by`` (``chat-template:<engine model id>``, ``upstream``, or the
counter's name such as ``tiktoken:cl100k_base``) and ``x-prefixgate-count-estimate`` (``true`` for the local
estimate, else ``false``).

A count is not a served request: it adds nothing to the stats' request, token or rule counters (an error answer
is counted as an error by the app's handler, as every error is). It is logged once in the request log with
``prompt_tokens`` = the count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from engine.errors import EngineError
from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.backends.base import Backend
from gateway.backends.embedded import EmbeddedBackend, generation_request
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.core.errors import ServiceUnavailableError, from_engine_error
from gateway.core.request import ChatRequest
from gateway.core.tokens import default_counter
from gateway.http.body import read_json_object
from gateway.http.request_context import begin, request_id_of, started_at
from gateway.http.state import gateway_of
from gateway.protocols.anthropic.parse import apply_request_headers, parse_messages_body
from gateway.protocols.anthropic.strip import plain_messages, plain_tools
from gateway.service.pipeline import canonicalize
from gateway.service.request_log import RequestRecord, log_request

PATH = "/v1/messages/count_tokens"
COUNTED_BY_HEADER = "x-prefixgate-counted-by"
ESTIMATE_HEADER = "x-prefixgate-count-estimate"

MESSAGES_ONLY_FIELDS = frozenset(
    {"max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata", "service_tier"}
)
"""Fields of a Messages body that ``/v1/messages/count_tokens`` does not take (they shape the generation, not the
prompt; https://docs.anthropic.com/en/api/messages-count-tokens). They are checked like ``/v1/messages`` checks
them, then left out of the count and of the upstream's count request; any other field is sent on, as the
Messages passthrough does."""


@dataclass(frozen=True)
class TokenCount:
    """The answer of a count.

    Attributes:
        input_tokens: tokens of the prompt.
        counted_by: how they were counted (the ``x-prefixgate-counted-by`` header).
        estimate: True when the count is a local estimate rather than the model's own tokenizer's.
    """

    input_tokens: int
    counted_by: str
    estimate: bool = False


def parse_count_body(body: Any, request_id: str = "") -> ChatRequest:
    """Validate a count body and build the internal request ``/v1/messages`` would build (not streamed).

    Raises:
        InvalidRequestError: a missing or ill-typed field (``param`` names it), as ``/v1/messages`` answers.
    """
    request = parse_messages_body(body, request_id=request_id, require_max_tokens=False)
    request.stream = False
    return request


async def count_request(backend: Backend, request: ChatRequest) -> TokenCount:
    """Count the input tokens of a canonical request on ``backend`` (see the module docstring for each kind).

    Raises:
        InvalidRequestError: content or parameters the backend cannot take (the same 400 ``/v1/messages`` gives).
        ServiceUnavailableError: the embedded model is not started.
        UpstreamCallError: the Anthropic upstream refused or failed (mapped as for ``/v1/messages``).
        UpstreamStreamCut: its answer was not a token count (502).
    """
    if isinstance(backend, EmbeddedBackend):
        return count_embedded(backend, request)
    if isinstance(backend, AnthropicUpstreamBackend):
        return await count_upstream(backend, request)
    target = "an OpenAI-compatible" if isinstance(backend, OpenAIUpstreamBackend) else "this"
    return count_estimate(request, target)


def count_embedded(backend: EmbeddedBackend, request: ChatRequest) -> TokenCount:
    """The number of prompt token ids the engine would prefill for ``request`` (chat template, generation prompt
    included). Runs on the calling thread; takes no engine lock and no block.

    Raises:
        ServiceUnavailableError: the engine is not started.
        InvalidRequestError: what ``generation_request`` refuses, or a template failure (engine error mapped).
    """
    engine = backend.engine
    if engine is None:
        raise ServiceUnavailableError(f"The model `{backend.name}` is not started.")
    generation = generation_request(request)
    try:
        token_ids = engine.prompt_token_ids(generation)
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    return TokenCount(len(token_ids), f"chat-template:{engine.model_id}")


async def count_upstream(backend: AnthropicUpstreamBackend, request: ChatRequest) -> TokenCount:
    """The upstream's own count: ``POST {base_url}/v1/messages/count_tokens`` with the Messages body the
    passthrough would send, less ``MESSAGES_ONLY_FIELDS``.

    Raises:
        UpstreamCallError: refused (4xx passes through) or failed after retries, as for ``/v1/messages``.
        UpstreamStreamCut: kind ``protocol`` (502): the answer is not JSON with an integer ``input_tokens``.
        InvalidRequestError / UnsupportedContentError: what ``build_body`` refuses.
    """
    body, _ = backend.build_body(request, stream=False)
    body = {key: value for key, value in body.items() if key not in MESSAGES_ONLY_FIELDS}
    headers = backend.headers_for(
        request
    )  # the key, version and forwarded headers, as /v1/messages sends them
    opened = await backend.post(request.prefix_key or request.request_id, PATH, headers, body)
    try:
        answer = opened.json_object(await opened.read(), "a token count")
        tokens = answer.get("input_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise opened.cut(
                "the upstream answered a token count without an integer input_tokens", kind="protocol"
            )
    finally:
        await opened.aclose()
    return TokenCount(tokens, "upstream")


def estimate_text(request: ChatRequest, target: str = "an OpenAI-compatible") -> str:
    """The text the estimate counts: the JSON (``json.dumps``, ``ensure_ascii=False``, default separators, as the
    OpenAI upstream backend's own usage estimate) of the messages, then, when there are tools, a newline and the
    JSON of the tools, both as an OpenAI-compatible upstream would receive them (``plain_messages`` /
    ``plain_tools``: Anthropic-only keys dropped, thinking blocks dropped).

    Raises:
        UnsupportedContentError: Anthropic-only content such a backend cannot take (the same 400 as
            ``/v1/messages``); ``target`` names the backend in the message.
    """
    text = json.dumps(plain_messages(request.messages, target), ensure_ascii=False)
    tools = plain_tools(request.tools, target)
    if tools:
        text += "\n" + json.dumps(tools, ensure_ascii=False)
    return text


def count_estimate(request: ChatRequest, target: str = "an OpenAI-compatible") -> TokenCount:
    """``breakpoints.default_counter()`` over ``estimate_text(request)``; ``counted_by`` is the counter's name.

    Raises:
        UnsupportedContentError: see ``estimate_text``.
    """
    counter = default_counter()
    return TokenCount(counter.count(estimate_text(request, target)), counter.counted_by, estimate=True)


async def count_tokens_endpoint(http_request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` with ``x-prefixgate-counted-by`` and
    ``x-prefixgate-count-estimate`` headers (see the module docstring).

    Errors (Anthropic error JSON, by the app's handler): 400 not JSON / a bad field / content the backend cannot
    take, 404 unknown model, 413 body over ``server.max_body_bytes``, and the upstream's errors mapped as for
    ``/v1/messages``.
    """
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_count_body(body, request_id=request_id_of(http_request))
    apply_request_headers(request, http_request.headers)
    begin(http_request, request)
    backend = gateway.registry.get(request.model)
    canonicalize(gateway, request)
    count = await count_request(backend, request)
    log_request(
        RequestRecord(
            request_id=request.request_id,
            path=http_request.url.path,
            status=200,
            model=request.model,
            prompt_tokens=count.input_tokens,
            duration_s=time.monotonic() - started_at(http_request),
            prefix_key=request.prefix_key or None,
        )
    )
    headers = {
        "request-id": request.request_id,
        "x-request-id": request.request_id,
        COUNTED_BY_HEADER: count.counted_by,
        ESTIMATE_HEADER: "true" if count.estimate else "false",
    }
    return JSONResponse({"input_tokens": count.input_tokens}, headers=headers)


def routes() -> list[BaseRoute]:
    """This module's route table (``gateway.http.app`` collects it with the faces')."""
    return [Route(PATH, count_tokens_endpoint, methods=["POST"])]
