"""The Starlette app: route table, lifespan (start and close backends; sample the stats history for the
dashboard; close the transcript memory's Redis connections), and the one exception handler.

Routes come from ``gateway.http.routes.route_table`` (written out, no discovery); a caller can also pass
``extra_routes`` to ``create_app``.

Every error raised by a handler (``gateway.core.errors.APIError``, an engine error, Starlette's 404/405)
becomes one JSON error response in ``handle_error``, shaped for the protocol of the path (OpenAI by default,
Anthropic on ``/v1/messages``), and is counted in the stats and logged once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.errors import EngineError
from gateway.backends.base import Backend
from gateway.backends.registry import create_backend
from gateway.config.engine_section import model_start_error
from gateway.config.price_table import shipped_price_table
from gateway.config.schema import ConfigError, GatewayConfig
from gateway.core.errors import (
    APIError,
    AuthenticationError,
    anthropic_error_body,
    as_api_error,
    error_shape_for,
    status_error,
)
from gateway.core.gateway_loops import LoopDetected, enter, incoming_chain, leave, new_instance_id
from gateway.core.keys import KeyTable
from gateway.http.admin import log_admin_mode
from gateway.http.anthropic_models import wants_anthropic_shape
from gateway.http.request_context import ClientDisconnected, request_id_of
from gateway.http.routes import route_table
from gateway.service.cache_explain import CacheExplanations
from gateway.service.cache_warm import warm_entries
from gateway.service.canonicalize import Canonicalizer
from gateway.service.gateway import Gateway
from gateway.service.limits import ClientUsage
from gateway.service.metrics import build_registry
from gateway.service.pipeline import UPSTREAM_REQUEST_ID_HEADER
from gateway.service.registry import ModelRegistry
from gateway.service.request_log import CLIENT_CLOSED, RequestRecord, log_request
from gateway.service.retention import RetentionPolicy, attach_retention_policy
from gateway.service.shared_prefix import check_declared_rules
from gateway.service.stats import GatewayStats
from gateway.service.timeseries import StatsHistory, sample_every

logger = logging.getLogger("prefixgate.app")


def create_app(
    config: GatewayConfig,
    backends: Mapping[str, Backend] | None = None,
    extra_routes: Sequence[BaseRoute] = (),
) -> GatewayApp:
    """Build the ASGI app for ``config`` (a Starlette app with a short path for the model routes,
    ``GatewayApp``).

    Args:
        config: validated config.
        backends: model name -> backend to use instead of building them from ``config`` (tests).
        extra_routes: routes added after the faces' routes.

    Raises:
        ConfigError: a model's backend kind is not installed; a ``shared_prefixes`` rule id no loaded rule has.
        whatever ``rules.load_ruleset`` raises for a bad rule file.
    """
    if backends is None:
        backends = {model.name: create_backend(model) for model in config.models}
    attach_retention_policy(backends, RetentionPolicy())
    registry = ModelRegistry(backends)
    stats = GatewayStats(
        {name: config.prices(name) for name in registry.names()}, prices_checked=shipped_price_table().checked
    )
    canonicalizer = Canonicalizer(config.rules, config.transcript, config.rules_learning)
    try:
        base_rules = canonicalizer.ruleset_for("", "")  # the loaded rules (nothing is learned yet)
        check_declared_rules(config.shared_prefixes, base_rules.rule_ids if base_rules else (), config.source)
    except ConfigError:
        canonicalizer.close()
        raise
    gateway = Gateway(
        config=config,
        registry=registry,
        canonicalizer=canonicalizer,
        stats=stats,
        cache=CacheExplanations(canonicalizer),
        keys=KeyTable(config.keys),
        clients=ClientUsage(config.keys),
    )
    gateway.metrics = build_registry(gateway.stats_snapshot, gateway.engine_stats)
    gateway.history = StatsHistory(gateway.stats_snapshot)

    app = GatewayApp(
        routes=[*route_table(), *extra_routes],
        middleware=[Middleware(_StartClock)],
        exception_handlers={
            APIError: handle_error,
            EngineError: handle_error,
            HTTPException: handle_error,
            ClientDisconnected: handle_disconnect,
            Exception: handle_error,
        },
        lifespan=_lifespan(gateway),
    )
    app.state.gateway = gateway
    return app


def _lifespan(gateway: Gateway):
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        backends = [backend for _, backend in gateway.registry.items()]
        started: list[Backend] = []
        if gateway.keys:
            logger.info(
                "%d client keys, %d tenants: requests need a key; cache salt = the key's tenant",
                len(gateway.keys),
                len(gateway.keys.tenants()),
            )
            log_admin_mode(gateway)
        else:
            logger.warning(
                "no client keys configured: the gateway is OPEN (no authentication; the cache salt is the "
                "client's x-prefixgate-tenant header)"
            )
        warming: asyncio.Task | None = None
        sampling: asyncio.Task | None = None
        try:
            for backend in backends:
                try:
                    await backend.start()
                except (ValueError, EngineError) as exc:
                    # an embedded model's setting only its checkpoint could refuse: a config error naming the
                    # key, kept on app.state for ``prefixgate serve`` to print as one line
                    error = model_start_error(gateway.config, backend.name, exc)
                    if error is None:
                        raise
                    app.state.start_error = error
                    raise error from exc
                started.append(backend)
                logger.info("model %s ready (%s)", backend.name, type(backend).__name__)
            config = gateway.config
            shared = [b.name for b in backends if b.routing_share_stats() is not None]
            if shared and config.rules and config.transcript.redis_url is None:
                logger.warning(
                    "routing_share (%s) without transcript.redis_url: each gateway keeps its own canonical "
                    "transcripts, so a conversation whose turns reach different gateways is rendered differently "
                    "by each, its block hashes do not match across them, and the shared placements miss; set "
                    "transcript.redis_url to the same Redis (docs/routing.md)",
                    ", ".join(shared),
                )
            if config.warm and config.warm_before_ready:
                await warm_entries(gateway, config.warm)
            elif config.warm:
                warming = asyncio.create_task(warm_entries(gateway, config.warm), name="prefixgate-warm")
            if gateway.history is not None:
                sampling = asyncio.create_task(sample_every(gateway.history), name="prefixgate-stats-history")
            yield
        finally:
            for task in (warming, sampling):
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*(backend.close() for backend in started), return_exceptions=True)
            gateway.canonicalizer.close()

    return lifespan


class GatewayApp(Starlette):
    """The Starlette app, with a short path for the model routes: a ``POST`` to a fixed ``/v1/`` path (chat
    completions, completions, messages, responses) goes straight to its handler instead of through
    Starlette's middleware stack, router and per-route wrapper (five nested ASGI calls, a ``send`` wrapper at
    two of them, and a route scan per request; docs/overhead.md, session 6).

    What the short path keeps of the long one: the arrival time (``_StartClock``), ``scope["app"]``, the
    exception handlers with Starlette's rules (the handler of the exception's nearest class; a handled
    exception after the response started is a ``RuntimeError``; anything unhandled goes to the ``Exception``
    handler, whose response is sent when the response had not started, and is raised again so the server
    logs it and drops the connection), and the route it serves: a pair is short only when Starlette's router
    would pick that same route for it (first full match). Every other request (other paths and methods, a
    ``root_path``, lifespan) is Starlette's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance_id = new_instance_id()
        """This gateway's id in ``x-prefixgate-via`` (``gateway.core.gateway_loops``)."""
        self._direct: dict[tuple[str, str], Any] | None = None
        self._handled: dict[Any, Any] = {}
        self._server_error: Any = None

    def _direct_routes(self) -> dict[tuple[str, str], Any]:
        direct: dict[tuple[str, str], Any] = {}
        if any(m.cls is not _StartClock for m in self.user_middleware):
            return direct  # the short path stands in for ``_StartClock`` only: other middleware must see everything
        for route in self.router.routes:
            path, methods = getattr(route, "path", ""), getattr(route, "methods", None) or ()
            endpoint = getattr(route, "endpoint", None)
            if (
                not isinstance(route, Route)
                or "{" in path
                or not path.startswith("/v1/")
                or "POST" not in methods
            ):
                continue
            if not inspect.iscoroutinefunction(endpoint):
                continue
            probe = {"type": "http", "path": path, "method": "POST", "root_path": ""}
            first = next((r for r in self.router.routes if r.matches(probe)[0] == Match.FULL), None)
            if first is route and ("POST", path) not in direct:
                direct[("POST", path)] = endpoint
        for key, handler in self.exception_handlers.items():
            if key in (500, Exception):
                self._server_error = handler
            elif not isinstance(key, int):
                self._handled[key] = handler
        return direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._serve(scope, receive, send)
            return
        try:  # a request back from one of its own upstream calls is refused before any work (gateway_loops)
            chain = incoming_chain(scope.get("headers") or [], self.instance_id)
        except LoopDetected as exc:
            scope["app"] = self
            scope.setdefault("state", {})["started_at"] = time.monotonic()
            response = await handle_error(Request(scope, receive, send), exc)
            await response(scope, receive, send)
            return
        token = enter(chain, self.instance_id)
        try:
            await self._serve(scope, receive, send)
        finally:
            leave(token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._direct is None:
            self._direct = self._direct_routes()
        endpoint = None
        if scope["type"] == "http" and not scope.get("root_path"):
            endpoint = self._direct.get((scope["method"], scope["path"]))
        if endpoint is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        scope.setdefault("state", {})["started_at"] = time.monotonic()
        started = False

        async def sender(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        request = Request(scope, receive, send)
        try:
            try:
                response = await endpoint(request)
                await response(scope, receive, sender)
            except Exception as exc:
                handler = next((self._handled[c] for c in type(exc).__mro__ if c in self._handled), None)
                if handler is None:
                    raise
                if started:
                    raise RuntimeError("Caught handled exception, but response already started.") from exc
                response = await handler(request, exc)
                await response(scope, receive, sender)
                exc.__traceback__ = None
        except Exception as exc:
            if self._server_error is None:
                raise
            response = await self._server_error(Request(scope), exc)
            if not started:
                await response(scope, receive, send)
            raise


class _StartClock:
    """Stamps ``request.state.started_at`` (monotonic seconds) as the request arrives, for durations and
    TTFT."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["started_at"] = time.monotonic()
        await self.app(scope, receive, send)


async def handle_error(http_request: Request, exc: Exception) -> Response:
    """The one exception handler: typed error -> protocol-shaped JSON, counted and logged once."""
    error = request_error(http_request, exc)
    gateway = getattr(http_request.app.state, "gateway", None)
    model = getattr(http_request.state, "model", None)
    if gateway is not None:
        gateway.stats.record_error(model, error.status_code)
    started = getattr(http_request.state, "started_at", None)
    key = getattr(http_request.state, "client_key", None)  # who was refused (a 429, a 404 for a model)
    request_id = request_id_of(http_request)
    upstream_id = getattr(error, "upstream_request_id", None)  # a relayed upstream error's own id
    log_request(
        RequestRecord(
            request_id=request_id,
            path=http_request.url.path,
            status=error.status_code,
            model=model,
            key=getattr(key, "name", None),
            tenant=getattr(http_request.state, "tenant", None),
            stream=bool(getattr(http_request.state, "stream", False)),
            duration_s=time.monotonic() - started if started is not None else None,
            error_code=error.code or error.error_type,
            upstream_request_id=upstream_id,
        )
    )
    # the ids of an answer, as on a 200: the gateway's (the SDKs' ``request_id`` of an error) and the upstream's
    headers = {"x-request-id": request_id}
    if upstream_id:
        headers[UPSTREAM_REQUEST_ID_HEADER] = upstream_id
    if isinstance(error, AuthenticationError):
        headers["www-authenticate"] = "Bearer"
    retry_after = getattr(error, "retry_after_s", None)
    if (
        isinstance(retry_after, int | float) and 0 <= retry_after < 10**9
    ):  # an upstream's Retry-After (RFC 9110)
        headers["retry-after"] = str(math.ceil(retry_after))
    if error.status_code >= 500:
        # Starlette re-raises an unexpected exception after this response, and the server then drops the
        # connection: say so, so the client opens a new one for its next request instead of being reset.
        headers["connection"] = "close"
    path = http_request.url.path
    anthropic = (
        wants_anthropic_shape(path, http_request.headers) or error_shape_for(path) is anthropic_error_body
    )
    body = (anthropic_error_body if anthropic else error_shape_for(path))(error)
    if anthropic:  # Anthropic's error JSON and headers carry the request's id (its SDK reads ``request-id``)
        headers["request-id"] = request_id
        body["request_id"] = request_id
    return JSONResponse(body, status_code=error.status_code, headers=headers)


async def handle_disconnect(http_request: Request, exc: Exception) -> Response:
    """A client that left before its answer (nobody reads this response): logged as 499 here when the pipeline
    had not logged it (the client left while its body was read); not an error in the stats."""
    if not getattr(exc, "logged", True):
        started = getattr(http_request.state, "started_at", None)
        log_request(
            RequestRecord(
                request_id=request_id_of(http_request),
                path=http_request.url.path,
                status=CLIENT_CLOSED,
                model=getattr(http_request.state, "model", None),
                duration_s=time.monotonic() - started if started is not None else None,
            )
        )
    return Response(status_code=CLIENT_CLOSED)


def request_error(http_request: Request, exc: Exception) -> APIError:
    """Any exception as the API error the client gets: Starlette's 404/405 by status, the rest by
    ``gateway.errors.as_api_error`` (an unexpected one as a 500; the server logs its traceback)."""
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return status_error(404, f"Invalid URL ({http_request.method} {http_request.url.path})")
        return status_error(exc.status_code, exc.detail if isinstance(exc.detail, str) else None)
    if not isinstance(exc, APIError | EngineError):
        name, path = type(exc).__name__, http_request.url.path
        logger.error("unhandled %s on %s (traceback logged by the server)", name, path)
    return as_api_error(exc)
