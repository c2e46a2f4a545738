"""Warming and the cache admin: prefilling prompt heads into an embedded model's prefix cache (the config's
``warm:`` entries at start, ``POST /admin/cache/warm`` at run time), listing cached prefixes and dropping them.

A warm prompt takes the path of a request up to the backend: it is validated as a chat body, canonicalized by
the rules (so its prefix key and blocks are those a real request with the same head gets) and its blocks are
tagged with the levels of its segments (``system``, ``documents``, ``history``), which choose their TTL and
byte-budget share in the tiers. Nothing is generated. Listing never returns text: prefix keys, tenants,
levels, token counts, tiers, times.

Invariant: a bad warm entry (not a valid message list, unreadable file, over the context) is reported with its
index and skipped; the other entries still warm.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from engine.api import WarmResult
from gateway.backends.base import Backend
from gateway.config.schema import WARM_CONTENT_KEYS, WarmEntry
from gateway.core.errors import APIError, InvalidRequestError
from gateway.core.keys import ClientKey
from gateway.core.tenants import unreachable_tenant_problem
from gateway.protocols.openai.parse import parse_chat_request
from gateway.service.gateway import Gateway
from gateway.service.pipeline import canonicalize_off_loop
from gateway.service.prompt_levels import level_ends

logger = logging.getLogger("prefixgate.warm")


class WarmEntryError(ValueError):
    """A warm entry that cannot be warmed; the message says why (never the prompt's text)."""


@dataclass(frozen=True)
class WarmOutcome:
    """What warming one entry did.

    Attributes:
        index: the entry's index (in the config's ``warm:`` list; 0 for an admin call).
        model: the model it was warmed on.
        tenant: its cache salt.
        result: the engine's answer (prefix key, prompt tokens, cached tokens (whole blocks), pinned blocks,
            pin id, reusable tokens (what the conversation's next request reuses, token-granular)).
    """

    index: int
    model: str
    tenant: str
    result: WarmResult

    def to_dict(self) -> dict[str, Any]:
        """The JSON answer of ``POST /admin/cache/warm``."""
        r = self.result
        return {
            "model": self.model,
            "tenant": self.tenant,
            "prefix_key": r.prefix_key,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "computed_tokens": r.computed_tokens,
            "reusable_tokens": r.reusable_tokens,
            "pinned_blocks": r.pinned_blocks,
            "pin_id": r.pin_id,
        }


def entry_tail_level(entry: WarmEntry) -> str:
    """The level of a warm entry's last part: ``history`` for a message list, ``documents`` when it has
    documents, else ``system``."""
    if entry.messages is not None or any(key == "messages" for key, _ in entry.files):
        return "history"
    if entry.documents is not None or any(key == "documents" for key, _ in entry.files):
        return "documents"
    return "system"


def entry_messages(entry: WarmEntry) -> list[Any]:
    """The message list an entry prefills: ``messages``, or ``system`` then ``documents`` as a user message;
    ``*_file`` values read now.

    Raises:
        WarmEntryError: an unreadable file, a messages file that is not JSON/YAML.
    """
    values: dict[str, Any] = {
        "system": entry.system,
        "documents": entry.documents,
        "messages": entry.messages,
    }
    for key, path in entry.files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WarmEntryError(f"{key}_file: cannot read {path} ({exc})") from exc
        if key == "messages":
            try:
                values[key] = yaml.safe_load(text)  # JSON is YAML
            except yaml.YAMLError as exc:
                raise WarmEntryError(f"{key}_file: {path} is neither JSON nor YAML") from exc
        else:
            values[key] = text
    if values["messages"] is not None:
        return values["messages"]
    messages: list[Any] = []
    if values["system"] is not None:
        messages.append({"role": "system", "content": values["system"]})
    if values["documents"] is not None:
        messages.append({"role": "user", "content": values["documents"]})
    return messages


async def warm_messages(
    gateway: Gateway,
    model: str,
    tenant: str,
    messages: Any,
    pin: bool,
    index: int = 0,
    tail_level: str | None = None,
) -> WarmOutcome:
    """Canonicalize ``messages`` as a chat request of ``model`` and ``tenant`` and prefill it.

    ``tail_level``: the level of the prompt's last part (``entry_tail_level``); None: ``system`` for a lone
    system message, else ``history``.

    Raises:
        InvalidRequestError: not a valid message list, or the model keeps no cache of its own (400).
        ModelNotFoundError: unknown model (404).
        ContextLengthExceededError: the prompt is over the model's context (400).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("expected a non-empty list of messages", param="messages")
    request = parse_chat_request({"model": model, "messages": messages}, {})
    request.tenant = tenant
    backend = gateway.registry.get(model)
    await canonicalize_off_loop(gateway, request)
    tail = "history" if len(messages) > 2 or messages[-1].get("role") != "system" else "system"
    if tail_level is not None:
        tail = tail_level
    result = await backend.warm(request, level_ends(request, backend, tail), pin)
    if result is None:
        raise InvalidRequestError(
            f"The model `{model}` keeps no prefix cache of its own (only embedded models with prefix caching "
            "can be warmed).",
            param="model",
        )
    return WarmOutcome(index, model, tenant, result)


async def warm_entries(gateway: Gateway, entries: Sequence[WarmEntry]) -> list[WarmOutcome]:
    """Warm the config's entries in order with a progress bar in the log; a bad entry is logged with its index
    and the reason, and skipped.

    Returns:
        The outcomes of the entries that warmed.
    """
    outcomes: list[WarmOutcome] = []
    if not entries:
        return outcomes
    bar = tqdm(
        total=len(entries), desc="warming prefix cache", unit="prompt", file=_LogStream(), mininterval=1
    )
    try:
        for index, entry in enumerate(entries):
            try:
                messages = entry_messages(entry)
                outcome = await warm_messages(
                    gateway,
                    entry.model or "",
                    entry.tenant,
                    messages,
                    entry.pin,
                    index,
                    entry_tail_level(entry),
                )
            except (WarmEntryError, APIError) as exc:
                logger.warning("warm[%d] skipped: %s", index, _reason(exc))
            else:
                outcomes.append(outcome)
                logger.info(
                    "warm[%d] %s tenant=%r: prefix %s, %d tokens cached in whole blocks, %d reused by the "
                    "next turn%s",
                    index,
                    outcome.model,
                    outcome.tenant,
                    outcome.result.prefix_key,
                    outcome.result.cached_tokens,
                    outcome.result.reusable_tokens,
                    f", {outcome.result.pinned_blocks} blocks pinned" if entry.pin else "",
                )
            bar.update(1)
    finally:
        bar.close()
    return outcomes


def warm_body(body: dict[str, Any], default_model: str | None, keys: Collection[ClientKey] = ()) -> WarmEntry:
    """A ``POST /admin/cache/warm`` body as a ``WarmEntry`` (inline content only: files are the config's);
    ``keys``: the configured client keys (empty: the gateway runs open), which decide what tenants a request
    can have (``gateway.core.tenants.reachable_tenant``).

    Raises:
        InvalidRequestError: unknown or ill-typed fields, a tenant no request can have, nothing to warm,
            ``messages`` with other content.
    """
    known = {"model", "tenant", "pin", *WARM_CONTENT_KEYS}
    for key in body:
        if key not in known:
            raise InvalidRequestError(
                f"Unknown field '{key}' (valid: {', '.join(sorted(known))}).", param=key
            )
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must be the name of an embedded model.", param="model")
    tenant = body.get("tenant", "")
    if not isinstance(tenant, str):
        raise InvalidRequestError("'tenant' must be a string.", param="tenant")
    problem = unreachable_tenant_problem(tenant, keys)
    if problem is not None:
        raise InvalidRequestError(f"Invalid 'tenant': {problem}.", param="tenant")
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise InvalidRequestError("'pin' must be a boolean.", param="pin")
    for key in ("system", "documents"):
        if key in body and not isinstance(body[key], str):
            raise InvalidRequestError(f"'{key}' must be a string.", param=key)
    given = [key for key in WARM_CONTENT_KEYS if key in body]
    if not given:
        raise InvalidRequestError("Give 'messages', or 'system' and/or 'documents'.", param="messages")
    if "messages" in given and len(given) > 1:
        raise InvalidRequestError("'messages' is a whole prompt: give it alone.", param="messages")
    return WarmEntry(
        model=model,
        tenant=tenant,
        pin=pin,
        system=body.get("system"),
        documents=body.get("documents"),
        messages=body.get("messages"),
    )


def list_cached(
    gateway: Gateway, *, prefix_key: str | None, tenant: str | None, model: str | None
) -> list[dict[str, Any]]:
    """Cached prefixes of every model with a cache of its own (or of ``model``), as JSON rows: prefix key,
    model, tenant, level, tokens, tokens per tier, last use and expiry per tier (Unix seconds), pinned.

    Raises:
        ModelNotFoundError: ``model`` is not a configured model (404, as ``POST /admin/cache/warm`` answers).
    """
    rows: list[dict[str, Any]] = []
    for name, backend in _backends(gateway, model):
        for row in backend.cached_prefixes(prefix_key=prefix_key, tenant=tenant) or ():
            rows.append(
                {
                    "prefix_key": row.prefix_key,
                    "model": name,
                    "tenant": row.tenant,
                    "level": row.level,
                    "tokens": row.tokens,
                    "tiers": dict(row.tiers),
                    "last_use": row.last_use,
                    "expires_at": dict(row.expires_at),
                    "pinned": row.pinned,
                }
            )
    return rows


def drop_cached(
    gateway: Gateway, *, prefix_key: str | None, tenant: str | None, model: str | None
) -> tuple[dict[str, int], list[dict[str, str]]]:
    """Drop matching prefixes in every tier of every model with a cache (or of ``model``): summed counts
    ``{"prefixes", "ram", "disk", "redis"}``, and the tiers that could not be (fully) dropped, as
    ``{"model", "tier", "reason"}`` rows (a tier that fails, e.g. Redis down, costs nothing else: RAM and the
    other tiers are dropped, and the answer names it instead of failing).

    Raises:
        InvalidRequestError: no filter at all (dropping everything needs ``model=``), or an empty ``prefix_key``
            (no prefix has one: ``?prefix_key=`` is a filter left blank, not a silent "dropped nothing").
        ModelNotFoundError: ``model`` is not a configured model (404: a typo is not a silent "dropped nothing").
    """
    if prefix_key is None and tenant is None and model is None:
        raise InvalidRequestError("Give prefix_key, tenant or model.", param="prefix_key")
    if prefix_key == "":
        raise InvalidRequestError("prefix_key must not be empty.", param="prefix_key")
    total = {"prefixes": 0, "ram": 0, "disk": 0, "redis": 0}
    skipped: list[dict[str, str]] = []
    for name, backend in _backends(gateway, model):
        dropped = backend.drop_cached(prefix_key=prefix_key, tenant=tenant) or {}
        for key in total:
            total[key] += int(dropped.get(key, 0))
        for tier, reason in sorted((dropped.get("skipped_tiers") or {}).items()):
            skipped.append({"model": name, "tier": tier, "reason": reason})
    return total, skipped


def _backends(gateway: Gateway, model: str | None) -> Iterable[tuple[str, Backend]]:
    """Every configured model's ``(name, backend)``, or only ``model``'s.

    Raises:
        ModelNotFoundError: ``model`` is not a configured model.
    """
    return gateway.registry.items() if model is None else [(model, gateway.registry.get(model))]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        param = getattr(exc, "param", None)
        return f"{exc.message}" + (f" (param {param})" if param else "")
    return str(exc)


class _LogStream:
    """A file for ``tqdm`` that writes each progress line to the log (INFO)."""

    def write(self, text: str) -> int:
        line = text.strip("\r\n ")
        if line:
            logger.info("%s", line)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""
