"""``GET /openapi.json``: the OpenAPI 3.1 document of the client faces (``gateway.protocols.openapi``), with
the configured model names as examples. No authentication: it describes requests, not data."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.http.request_context import gateway_of
from gateway.protocols.openapi import openapi_document


def _version() -> str:
    try:
        return version("prefixgate")
    except PackageNotFoundError:
        return "0+unknown"


async def openapi_json(http_request: Request) -> Response:
    """``GET /openapi.json``."""
    gateway = gateway_of(http_request)
    return JSONResponse(openapi_document(_version(), gateway.registry.names()))


def routes() -> list[BaseRoute]:
    """This module's route table (``gateway.http.routes`` collects it)."""
    return [Route("/openapi.json", openapi_json, methods=["GET"])]
