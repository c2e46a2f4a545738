"""Loops between gateways: every upstream call carries the chain of gateway instances it passed through, and a
request that comes back to one of them is refused.

A front gateway whose `base_url` names itself (or two gateways naming each other) turned one request into
hundreds of nested ones in seconds (a trial: 588 in 5 s). Each gateway (each app: `new_instance_id`) has a
random id; an upstream call sends `x-prefixgate-via: <id>,<id>,...` (the ids the incoming request carried, then
this gateway's), and a request whose `x-prefixgate-via` holds this gateway's id, or more than `MAX_HOPS` ids,
is answered 508 Loop Detected (RFC 5842 section 7.2) in the protocol's error JSON before any work is done.

Invariant: while a request is served, the context variable holds its outgoing chain (the incoming ids, then
the serving gateway's), read by every upstream call made then (tasks made then copy it); outside a request
(a warm at start) an upstream call names this process alone.
"""

from __future__ import annotations

import secrets
from contextvars import ContextVar, Token

from gateway.core.errors import APIError

VIA_HEADER = "x-prefixgate-via"
"""The header (lower case, as ASGI gives header names) holding the chain of gateway instance ids."""
MAX_HOPS = 16
"""Most gateways a request may have passed through before this one (a chain longer than any real deployment:
a front, a tier of replicas, a few proxies)."""
PROCESS_ID = secrets.token_hex(6)
"""The chain of an upstream call made outside any request (12 hex characters, new at each start)."""

_outgoing: ContextVar[tuple[str, ...]] = ContextVar("prefixgate_via", default=())


def new_instance_id() -> str:
    """A gateway's id in the chain (12 random hex characters; ``create_app`` makes one per app)."""
    return secrets.token_hex(6)


class LoopDetected(APIError):
    """A request that already passed through this gateway (508, ``code: loop_detected``)."""

    status_code = 508
    error_type = "invalid_request_error"
    default_code = "loop_detected"


def incoming_chain(headers: list[tuple[bytes, bytes]], own_id: str) -> tuple[str, ...]:
    """The gateway ids of an ASGI request's ``x-prefixgate-via`` headers, in order (empty when absent).

    Raises:
        LoopDetected: the chain holds ``own_id`` (this gateway's), or more than ``MAX_HOPS`` ids.
    """
    chain: list[str] = []
    for name, value in headers:
        if name == b"x-prefixgate-via":
            chain += [part.strip() for part in value.decode("latin-1").split(",") if part.strip()]
    if own_id in chain:
        raise LoopDetected(
            "this request already passed through this gateway (x-prefixgate-via): an upstream's base_url "
            "leads back to the gateway itself; point it at the model server instead"
        )
    if len(chain) > MAX_HOPS:
        raise LoopDetected(
            f"this request passed through {len(chain)} gateways (x-prefixgate-via; at most {MAX_HOPS}): the "
            "upstreams' base_urls form a loop"
        )
    return tuple(chain)


def enter(chain: tuple[str, ...], own_id: str) -> Token[tuple[str, ...]]:
    """Serve a request that came through ``chain``: upstream calls now send ``chain`` then ``own_id``;
    ``leave`` with the token when done."""
    return _outgoing.set((*chain, own_id))


def leave(token: Token[tuple[str, ...]]) -> None:
    """Undo ``enter``."""
    _outgoing.reset(token)


def outgoing_via() -> str:
    """The ``x-prefixgate-via`` value of an upstream call made now (see the module docstring)."""
    return ",".join(_outgoing.get() or (PROCESS_ID,))
