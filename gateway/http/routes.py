"""The app's route table, written out: every path the gateway serves, in matching order.

OpenAI face (https://platform.openai.com/docs/api-reference): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /healthz``;
``POST /v1/responses`` (stateless Responses API).
Anthropic face (https://docs.anthropic.com/en/api/messages): ``POST /v1/messages``,
``POST /v1/messages/count_tokens``. ``GET /openapi.json``: both faces' request schemas.
Admin: ``/admin/*`` and ``/metrics``; the dashboard: ``/admin/`` and its login, data and static files.

Each face module keeps its own ``routes()`` list; this module only joins them, so a new route is one line in
its face's module and the whole table is visible here. The faces are not wrapped in a ``Mount`` each: both
protocols share the ``/v1`` prefix, and a ``Mount("/v1/messages")`` would stop matching the bare path
(Starlette mounts match ``<prefix>/...``), which would change the served paths.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from gateway.http import admin, anthropic, count_tokens, dashboard, openai, openapi, responses


def route_table() -> list[BaseRoute]:
    """Every face's routes: OpenAI, OpenAI Responses, Anthropic, Anthropic token counting, admin (first match wins)."""
    return [
        *openai.routes(),
        *responses.routes(),
        *anthropic.routes(),
        *count_tokens.routes(),
        *admin.routes(),
        *dashboard.routes(),
        *openapi.routes(),
    ]
