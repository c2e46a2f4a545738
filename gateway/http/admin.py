"""Admin endpoints: ``GET /admin/stats`` (JSON), ``GET /metrics`` (Prometheus text) and
``GET /admin/rules/learned`` (the learned volatile slots as a YAML rule file; ``?model=`` and ``?tenant=``
narrow it), which ``prefixgate rules learned`` fetches. The prefix cache: ``GET /admin/cache`` (cached prefixes,
never text; ``?prefix_key=``, ``?tenant=``, ``?model=`` narrow it), ``DELETE /admin/cache`` (drops in every tier
by the same filters, at least one), ``POST /admin/cache/warm`` (prefills a prompt head; returns its prefix key
and token counts).

When ``admin.token`` is configured all of them need ``Authorization: Bearer <token>`` (else 401): ``/metrics`` names
the rules and models in use and reveals traffic volumes, and Prometheus sends bearer tokens natively
(``authorization: {credentials: ...}`` in a scrape config). Without a token:

- no client keys either (the local open mode, a gateway bound to 127.0.0.1): all of them are open, as the
  chat endpoints are;
- client keys configured (``keys:``): all of them, and the dashboard, are *closed*: 403 with the protocol's
  error JSON (``permission_denied``) saying to set ``admin.token`` / ``PREFIXGATE_ADMIN_TOKEN``, and a
  warning at start-up (``log_admin_mode``). 403 rather than 401: 401 asks for credentials, and none exists
  that would be accepted; a tenant's API key never opens the admin endpoints.

The dashboard's login session (``gateway.http.dashboard_session``) also opens the read-only endpoints under
``/admin`` (``GET /admin/stats``, ``GET /admin/cache``, ``GET /admin/rules/learned``; ``require_admin_read``),
so an operator logged in to the dashboard can open the documents behind its panels in the same browser; a
cookie request from another origin is 403. The endpoints that change state (``DELETE /admin/cache``,
``POST /admin/cache/warm``) take the bearer token only: a cookie is sent by the browser on its own, a bearer
header never is, so no cross-site form or script can reach them (no CSRF). ``/metrics`` lies outside the
cookie's ``Path=/admin`` and stays bearer-only.
"""

from __future__ import annotations

import hmac
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.core.errors import AuthenticationError, PermissionDeniedError
from gateway.http.body import read_json_object
from gateway.http.dashboard_session import SESSION_COOKIE, dashboard_auth_of, same_origin, session_valid
from gateway.http.request_context import gateway_of
from gateway.service.cache_warm import (
    drop_cached,
    entry_messages,
    entry_tail_level,
    list_cached,
    warm_body,
    warm_messages,
)
from gateway.service.gateway import Gateway
from gateway.service.metrics import CONTENT_TYPE, render

logger = logging.getLogger("prefixgate.admin")


ADMIN_CLOSED_MESSAGE = (
    "The admin endpoints are closed: client keys are configured but no admin token is. Set admin.token in "
    "the config (or the PREFIXGATE_ADMIN_TOKEN environment variable) and send 'Authorization: Bearer <admin "
    "token>'."
)
"""The 403's message on every admin endpoint of a gateway with client keys and no admin token."""


def admin_closed(gateway: Gateway) -> bool:
    """Whether the admin endpoints are closed: client keys configured (``keys:``) but no ``admin.token``."""
    return bool(gateway.keys) and not gateway.config.admin.token


def log_admin_mode(gateway: Gateway) -> None:
    """At start-up: a warning when the admin endpoints are closed (keys without an admin token); nothing
    otherwise (the open mode has its own "gateway is OPEN" warning)."""
    if admin_closed(gateway):
        logger.warning(
            "client keys are configured but no admin token: /admin/*, /metrics and the dashboard are CLOSED "
            "(403); set admin.token in the config or PREFIXGATE_ADMIN_TOKEN to open them with a bearer token"
        )


def refuse_when_closed(http_request: Request) -> None:
    """Raise when the admin endpoints are closed (``admin_closed``).

    Raises:
        PermissionDeniedError: client keys configured and no admin token (403).
    """
    if admin_closed(gateway_of(http_request)):
        raise PermissionDeniedError(ADMIN_CLOSED_MESSAGE)


def require_admin(http_request: Request) -> None:
    """Check the bearer token when one is configured (constant-time comparison); without one, open in the
    open mode (no client keys) and closed with client keys.

    Raises:
        AuthenticationError: missing or wrong ``Authorization: Bearer <token>`` (401).
        PermissionDeniedError: client keys configured and no admin token (403).
    """
    token = gateway_of(http_request).config.admin.token
    if not token:
        refuse_when_closed(http_request)
        return
    header = http_request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
        raise AuthenticationError(
            "Admin endpoints need 'Authorization: Bearer <admin token>' (config admin.token)."
            if not header
            else "Incorrect admin token provided."
        )


def has_session(http_request: Request) -> bool:
    """Whether the request carries a valid, unexpired dashboard session cookie (False without an admin token:
    there is no session to have)."""
    token = gateway_of(http_request).config.admin.token
    if not token:
        return False
    auth = dashboard_auth_of(http_request)
    return session_valid(token, http_request.cookies.get(SESSION_COOKIE), auth.clock())


def require_admin_read(http_request: Request) -> None:
    """Authorize a read-only (GET) admin endpoint: without an admin token open (no client keys) or closed
    (client keys); else the dashboard's session cookie from this origin, or ``Authorization: Bearer <token>``
    (``require_admin``).

    Raises:
        PermissionDeniedError: a valid session cookie sent from another origin (403, see ``same_origin``);
            client keys configured and no admin token (403).
        AuthenticationError: neither a valid session nor the right bearer token (401).
    """
    if not gateway_of(http_request).config.admin.token:
        refuse_when_closed(http_request)
        return
    if has_session(http_request):
        if not same_origin(http_request):
            raise PermissionDeniedError("Cross-origin requests to the admin endpoints are refused.")
        return
    if "authorization" not in http_request.headers:
        raise AuthenticationError(
            "Admin endpoints need 'Authorization: Bearer <admin token>' (config admin.token) or the "
            "dashboard's login session (/admin/login)."
        )
    require_admin(http_request)


async def admin_stats(http_request: Request) -> Response:
    """``GET /admin/stats``: the stats document (see ``gateway.service.stats``)."""
    require_admin_read(http_request)
    return JSONResponse(gateway_of(http_request).stats_snapshot())


async def metrics(http_request: Request) -> Response:
    """``GET /metrics``: the same counters in the Prometheus text format."""
    require_admin(http_request)
    gateway = gateway_of(http_request)
    if gateway.metrics is None:
        return Response(b"", media_type=CONTENT_TYPE)
    return Response(render(gateway.metrics), media_type=CONTENT_TYPE)


async def learned_rules(http_request: Request) -> Response:
    """``GET /admin/rules/learned``: the slots the running gateway learned, as a rule file (``application/yaml``)
    for a person to review and commit: anchors (template text), never a value. ``?model=`` naming no configured
    model is a 404 ``model_not_found``, as on ``/admin/cache`` (a typo is not an empty file)."""
    require_admin_read(http_request)
    params = http_request.query_params
    gateway = gateway_of(http_request)
    model = params.get("model")
    if model is not None:
        gateway.registry.get(model)  # raises ModelNotFoundError
    text = gateway.canonicalizer.learned_yaml(model, params.get("tenant"))
    return Response(text, media_type="application/yaml")


async def cache_list(http_request: Request) -> Response:
    """``GET /admin/cache``: ``{"object": "list", "data": [rows]}`` (``gateway.service.cache_warm.list_cached``)."""
    require_admin_read(http_request)
    params = http_request.query_params
    rows = list_cached(
        gateway_of(http_request),
        prefix_key=params.get("prefix_key"),
        tenant=params.get("tenant"),
        model=params.get("model"),
    )
    return JSONResponse({"object": "list", "data": rows})


async def cache_drop(http_request: Request) -> Response:
    """``DELETE /admin/cache?prefix_key=|tenant=|model=``: ``{"dropped": {"prefixes", "ram", "disk",
    "redis"}, "skipped_tiers": [{"model", "tier", "reason"}]}`` (a tier that could not be dropped, e.g. Redis
    down: still a 200, RAM and the other tiers dropped); 400 without a filter."""
    require_admin(http_request)
    params = http_request.query_params
    dropped, skipped = drop_cached(
        gateway_of(http_request),
        prefix_key=params.get("prefix_key"),
        tenant=params.get("tenant"),
        model=params.get("model"),
    )
    return JSONResponse({"dropped": dropped, "skipped_tiers": skipped})


async def cache_warm(http_request: Request) -> Response:
    """``POST /admin/cache/warm``: body ``{model?, tenant?, pin?, messages | system and/or documents}``;
    answers the prefix key and token counts (``WarmOutcome.to_dict``)."""
    require_admin(http_request)
    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    default_model = next((m.name for m in gateway.config.models if m.backend == "embedded"), None)
    entry = warm_body(body, default_model, list(gateway.keys))
    outcome = await warm_messages(
        gateway, entry.model or "", entry.tenant, entry_messages(entry), entry.pin, 0, entry_tail_level(entry)
    )
    return JSONResponse(outcome.to_dict())


def routes() -> list[BaseRoute]:
    """The admin route table."""
    return [
        Route("/admin/stats", admin_stats, methods=["GET"]),
        Route("/admin/rules/learned", learned_rules, methods=["GET"]),
        Route("/admin/cache", cache_list, methods=["GET"]),
        Route("/admin/cache", cache_drop, methods=["DELETE"]),
        Route("/admin/cache/warm", cache_warm, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
