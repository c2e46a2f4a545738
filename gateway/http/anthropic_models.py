"""Anthropic's Models API shape for ``GET /v1/models`` and ``GET /v1/models/{model}``: the routes are shared with
the OpenAI face (``gateway.http.openai``), and a request carrying ``anthropic-version`` (every Anthropic SDK
request does; no OpenAI SDK request does) is answered as Anthropic's API answers it
(https://docs.anthropic.com/en/api/models-list, https://docs.anthropic.com/en/api/models):

- a model: ``{"type": "model", "id", "display_name", "created_at"}`` (RFC 3339 UTC);
- the list: ``{"data": [...], "has_more", "first_id", "last_id"}``, paged by ``limit`` (1-1000, default 20),
  ``after_id`` (the page after that id) or ``before_id`` (the page before it), in the configured order;
- errors in Anthropic's error JSON (``wants_anthropic_shape``, used by the app's error handler).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.errors import InvalidRequestError

ANTHROPIC_VERSION_HEADER = "anthropic-version"
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


def wants_anthropic_shape(path: str, headers: Mapping[str, str]) -> bool:
    """Whether a request on the shared model routes should get Anthropic's shapes (it names an
    ``anthropic-version``)."""
    return path.startswith("/v1/models") and ANTHROPIC_VERSION_HEADER in headers


def model_object(name: str, created: int) -> dict[str, Any]:
    """One model as Anthropic's API gives it; ``created``: Unix seconds."""
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp}


def model_page(names: Sequence[str], created: int, query: Mapping[str, str]) -> dict[str, Any]:
    """One page of the model list for the query parameters ``limit``, ``after_id``, ``before_id``.

    Raises:
        InvalidRequestError: a ``limit`` that is not an integer in 1..1000, both ``after_id`` and ``before_id``,
            or an id that is not in the list (``param`` names the parameter).
    """
    raw = query.get("limit")
    limit = DEFAULT_LIMIT
    if raw is not None:
        # Plain decimal digits only: int() would also take " 5 " and "1_0" (read as 10).
        limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 4 else 0
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequestError(f"limit: must be an integer from 1 to {MAX_LIMIT}", param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise InvalidRequestError("after_id and before_id cannot both be given", param="after_id")
    names = list(names)
    if after is not None:
        if after not in names:
            raise InvalidRequestError(f"after_id: no model {after!r}", param="after_id")
        rest = names[names.index(after) + 1 :]
        page, has_more = rest[:limit], len(rest) > limit
    elif before is not None:
        if before not in names:
            raise InvalidRequestError(f"before_id: no model {before!r}", param="before_id")
        head = names[: names.index(before)]
        page, has_more = head[-limit:], len(head) > limit
    else:
        page, has_more = names[:limit], len(names) > limit
    return {
        "data": [model_object(name, created) for name in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }
