"""Where a handler finds its app's ``Gateway``: ``request.app.state.gateway``."""

from __future__ import annotations

from starlette.requests import Request

from gateway.service.gateway import Gateway


def gateway_of(request: Request) -> Gateway:
    """The ``Gateway`` of the app serving ``request``."""
    return request.app.state.gateway
