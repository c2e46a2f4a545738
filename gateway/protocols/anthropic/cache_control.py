"""Anthropic prompt caching for one Messages request: check the client's ``cache_control`` the way the provider
would, or, when the client sent none, choose between automatic caching and placed breakpoints.

Rules (https://platform.claude.com/docs/en/build-with-claude/prompt-caching):

- *automatic caching*: one top-level ``cache_control`` on the request; the provider puts the breakpoint on the
  last cacheable block and moves it forward as the conversation grows. It takes one of the 4 breakpoint slots.
- *explicit breakpoints*: ``cache_control`` on blocks (tools -> system -> messages), at most 4 per request.
- a hit is looked up at most ``LOOKBACK_BLOCKS`` (20) blocks before each breakpoint;
- TTL ``5m`` (default) or ``1h``; a ``1h`` breakpoint must not come after a ``5m`` one;
- a prefix below the model's minimum (512 to 4,096 tokens) is not cached (no error);
- ``type`` is ``"ephemeral"``; empty text blocks and thinking blocks cannot carry ``cache_control``.

``check_client_cache_control`` raises ``CacheControlError`` (Anthropic's ``invalid_request_error``, 400, in
Anthropic's own error body) for what the provider would reject: a fifth breakpoint, a ``1h`` after a ``5m``, an
unknown ``ttl`` or ``type``, a marker on an empty text or a thinking block. A client that sent any
``cache_control`` keeps it untouched.

``plan_cache_control`` (no client ``cache_control``) scores two candidates over the flat block list of
``gateway.protocols.anthropic.breakpoints``: *automatic* (the top-level marker, whose breakpoint is the last
cacheable block, plus block breakpoints at the stable boundaries, tools / system / documents, so other
conversations of the prefix still find an entry; the top-level marker takes one of the 4 slots) and *placed*
(``add_breakpoints`` at every segment boundary, the history's included, plus lookback breakpoints).
Score = (read reach, write reach): the read reach is the longest prefix, in tokens, ending at a *read point*
that lies within the lookback of one of the plan's breakpoints (read points: the stable segment boundaries,
tools / system / documents, and the end of the previous turn, i.e. the last block of the message before the last
assistant message: where earlier requests of this prefix wrote their entries; not the history boundary, which
ends in the newest assistant message, after every entry an earlier request could have written); the write
reach is the prefix up to the plan's last breakpoint. Only prefixes at or above the minimum count. The higher
score wins, ties go to automatic (one slot, moves forward by itself); when neither caches anything the body is
left alone. The TTL (``5m``, ``1h`` or ``NO_CACHE``) comes from the caller (``gateway.service.cache_ttl``); every
marker the gateway adds carries it.

Pure functions over JSON-like dicts; the input body is never modified.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.core.cache_usage import NO_CACHE
from gateway.core.tokens import TokenCounter, default_counter
from gateway.protocols.anthropic.breakpoints import (
    LOOKBACK_BLOCKS,
    MAX_BREAKPOINTS,
    UNCACHEABLE_BLOCKS,
    BlockPath,
    Boundary,
    _cacheable,
    _flatten,
    _resolve,
    add_breakpoints,
    min_cacheable_tokens,
)

TTLS = ("5m", "1h")


class CacheControlError(ValueError):
    """A client ``cache_control`` the provider would reject; answered before any upstream call with
    ``anthropic_body()`` and ``status_code`` (400). ``param`` is the offending field's path."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param

    def anthropic_body(self) -> dict[str, Any]:
        """``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``."""
        return {"type": "error", "error": {"type": self.error_type, "message": str(self)}}


@dataclass(frozen=True)
class ClientBreakpoint:
    """One client ``cache_control``: its path (``"cache_control"`` for the top-level one, else the block's path
    such as ``"messages.2.content.0"``), its order in the prompt (top-level: after every block) and its TTL."""

    param: str
    order: tuple[int, ...]
    ttl: str


def _block_paths(body: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], Any]]:
    """Every block that may carry ``cache_control``, in prompt order: (param, order key, block)."""
    out: list[tuple[str, tuple[int, ...], Any]] = []
    tools = body.get("tools")
    if isinstance(tools, list):
        out.extend((f"tools.{i}", (0, i), tool) for i, tool in enumerate(tools))
    system = body.get("system")
    if isinstance(system, list):
        out.extend((f"system.{j}", (1, j), block) for j, block in enumerate(system))
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                continue
            for j, block in enumerate(content):
                out.append((f"messages.{i}.content.{j}", (2, i, j), block))
                inner = block.get("content") if isinstance(block, Mapping) else None
                if (
                    isinstance(block, Mapping)
                    and block.get("type") == "tool_result"
                    and isinstance(inner, list)
                ):
                    out.extend(
                        (f"messages.{i}.content.{j}.content.{k}", (2, i, j, k), sub)
                        for k, sub in enumerate(inner)
                    )
    return out


def _marker_ttl(value: Any, param: str) -> str:
    if not isinstance(value, Mapping):
        raise CacheControlError("cache_control must be an object", param)
    if value.get("type") != "ephemeral":
        raise CacheControlError(f"cache_control.type must be 'ephemeral', got {value.get('type')!r}", param)
    ttl = value.get("ttl", "5m")
    if ttl not in TTLS:
        raise CacheControlError(f"cache_control.ttl must be '5m' or '1h', got {ttl!r}", param)
    unknown = set(value) - {"type", "ttl"}
    if unknown:
        raise CacheControlError(f"cache_control: unknown field(s) {sorted(unknown)}", param)
    return ttl


def drop_null_markers(body: Any) -> Any:
    """``body`` without its ``cache_control: null`` entries (top level, system, tools, message content blocks and
    tool results' blocks): the SDK's types allow null and the Messages API reads it as no marker. A new body
    (objects copied down to the blocks); ``body`` is not changed. A body that is not an object is returned as
    it is (validation names it)."""
    if not isinstance(body, dict) or not _has_null_marker(body):
        return body  # the common case: nothing to take out, nothing copied

    def block(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = {k: v for k, v in value.items() if not (k == "cache_control" and v is None)}
        if isinstance(out.get("content"), list):
            out["content"] = [block(item) for item in out["content"]]
        return out

    def blocks(value: Any) -> Any:
        return [block(item) for item in value] if isinstance(value, list) else value

    out = {k: v for k, v in body.items() if not (k == "cache_control" and v is None)}
    for key in ("system", "tools"):
        if key in out:
            out[key] = blocks(out[key])
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {**m, "content": blocks(m["content"])} if isinstance(m, dict) and "content" in m else m
            for m in out["messages"]
        ]
    return out


def _has_null_marker(value: Any) -> bool:
    """Whether ``value`` (a body, a list, a block) holds ``cache_control: null`` at any depth ``drop_null_markers``
    looks at (a scan without copies)."""
    if isinstance(value, dict):
        if "cache_control" in value and value["cache_control"] is None:
            return True
        return any(
            _has_null_marker(value[k]) for k in ("system", "tools", "messages", "content") if k in value
        )
    if isinstance(value, list):
        return any(_has_null_marker(item) for item in value)
    return False


def check_client_cache_control(
    body: Mapping[str, Any], max_breakpoints: int = MAX_BREAKPOINTS
) -> list[ClientBreakpoint]:
    """The client's breakpoints in prompt order, after the provider's checks.

    Raises:
        CacheControlError: more than ``max_breakpoints`` (the top-level one included), a ``1h`` breakpoint after
            a ``5m`` one, a marker that is not ``{"type": "ephemeral", "ttl"?: "5m"|"1h"}``, or one on an empty
            text block or a thinking block.
    """
    found: list[ClientBreakpoint] = []
    for param, order, block in _block_paths(body):
        if not isinstance(block, Mapping) or "cache_control" not in block:
            continue
        where = f"{param}.cache_control"
        if block["cache_control"] is None:
            continue
        ttl = _marker_ttl(block["cache_control"], where)
        if block.get("type") in UNCACHEABLE_BLOCKS:
            raise CacheControlError(f"cache_control cannot be set on {block.get('type')} blocks", where)
        if block.get("type") == "text" and not block.get("text"):
            raise CacheControlError("cache_control cannot be set for empty text blocks", where)
        found.append(ClientBreakpoint(param, order, ttl))
    if body.get("cache_control") is not None:
        found.append(
            ClientBreakpoint("cache_control", (9,), _marker_ttl(body["cache_control"], "cache_control"))
        )
    if len(found) > max_breakpoints:
        raise CacheControlError(
            f"A maximum of {max_breakpoints} blocks with cache_control may be provided. Found {len(found)}.",
            found[max_breakpoints].param,
        )
    seen_5m: ClientBreakpoint | None = None
    for point in found:
        if point.ttl == "5m" and seen_5m is None:
            seen_5m = point
        elif point.ttl == "1h" and seen_5m is not None:
            raise CacheControlError(
                f"a ttl='1h' cache_control must not come after a ttl='5m' one (at {seen_5m.param})",
                f"{point.param}.cache_control" if point.param != "cache_control" else "cache_control",
            )
    return found


def has_client_cache_control(body: Mapping[str, Any]) -> bool:
    """Whether the client put any ``cache_control`` anywhere (top level or on a block)."""
    if body.get("cache_control") is not None:
        return True
    return any(
        isinstance(b, Mapping) and b.get("cache_control") is not None for _, _, b in _block_paths(body)
    )


@dataclass(frozen=True)
class CachePlan:
    """What ``plan_cache_control`` chose.

    Attributes:
        mode: ``"client"`` (the client's markers, untouched), ``"automatic"`` (top-level ``cache_control``),
            ``"placed"`` (breakpoints on blocks) or ``"none"`` (nothing cacheable, or TTL ``none``).
        body: the body to send (the input itself for ``client`` and ``none``, else a new dict).
        ttl: the TTL of the markers the gateway added (None when it added none).
        scores: candidate -> (read reach, write reach) in tokens, for ``automatic`` and ``placed``.
        min_tokens: the minimum cacheable prefix used.
        client: the client's breakpoints (``client`` mode).
    """

    mode: str
    body: Mapping[str, Any]
    ttl: str | None = None
    scores: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    min_tokens: int = 0
    client: Sequence[ClientBreakpoint] = ()


STABLE_KINDS = frozenset({"tools", "system", "documents"})
"""Boundary kinds whose entries other requests of the prefix wrote (read points of the score); ``history`` ends
in the newest assistant message, which no earlier request held."""


def _marker(ttl: str) -> dict[str, Any]:
    return {"type": "ephemeral", "ttl": "1h"} if ttl == "1h" else {"type": "ephemeral"}


def _previous_turn_end(body: Mapping[str, Any], position_of: Mapping[BlockPath, int]) -> int | None:
    messages = body.get("messages") or []
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is None or last_assistant == 0:
        return None
    positions = [
        pos for path, pos in position_of.items() if path[0] == "messages" and path[1] == last_assistant - 1
    ]
    return max(positions) if positions else None


def _with_ttls(body: Mapping[str, Any], ttls: Iterator[str]) -> dict[str, Any]:
    """``body`` (a fresh copy from ``add_breakpoints``, holding only the gateway's markers) with its markers, in
    prompt order, set to the next TTL of ``ttls`` (``NO_CACHE``: the marker removed)."""

    def mark(block: Any) -> Any:
        if not isinstance(block, dict) or "cache_control" not in block:
            return block
        ttl = next(ttls)
        if ttl == NO_CACHE:
            return {k: v for k, v in block.items() if k != "cache_control"}
        return {**block, "cache_control": _marker(ttl)}

    out = dict(body)
    for key in ("tools", "system"):
        if isinstance(out.get(key), list):
            out[key] = [mark(b) for b in out[key]]
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {**m, "content": [mark(b) for b in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in out["messages"]
        ]
    return out


def plan_cache_control(
    body: Mapping[str, Any],
    boundaries: Mapping[str, BlockPath | Boundary],
    model: str,
    *,
    ttl: str | Mapping[str, str] = "5m",
    min_tokens: int | None = None,
    counter: TokenCounter | None = None,
    lookback_blocks: int = LOOKBACK_BLOCKS,
    max_breakpoints: int = MAX_BREAKPOINTS,
) -> CachePlan:
    """Check the client's ``cache_control``, or choose automatic vs placed caching (module docstring).

    Args:
        body: the Anthropic Messages body.
        boundaries: segment boundaries (``gateway.protocols.anthropic.breakpoints.boundaries_from_segments`` or
            ``default_boundaries``).
        model: upstream model name (for the minimum when ``min_tokens`` is None).
        ttl: ``"5m"``, ``"1h"`` or ``NO_CACHE`` for every marker, or ``{"stable": ..., "history": ...}``:
            one for the tools / system / documents breakpoints (chosen by the prefix key's reuse), one for the
            history and lookback breakpoints and the automatic marker (chosen by the conversation's reuse). An
            earlier ``5m`` marker is lifted to ``1h`` when a later one takes ``1h`` (the provider's order).
        min_tokens: the model's minimum cacheable prefix (the price table's; default: ``gateway.protocols.anthropic.breakpoints``).
        counter: token counter (default: ``default_counter()``).

    Raises:
        CacheControlError: the client's ``cache_control`` would be rejected by the provider.
        ValueError: an unknown ``ttl``.
        KeyError: a boundary that is not a block of ``body``.
    """
    ttls = _ttl_map(ttl)
    if has_client_cache_control(body):
        client = check_client_cache_control(body, max_breakpoints)
        return CachePlan("client", body, None, {}, 0, client)
    counter = counter or default_counter()
    minimum = min_tokens if min_tokens is not None else min_cacheable_tokens(model)
    if ttls["stable"] == NO_CACHE and ttls["history"] == NO_CACHE:
        return CachePlan("none", body, None, {}, minimum)
    slots = _flatten(body, counter)
    if not slots:
        return CachePlan("none", body, None, {}, minimum)
    position_of = {slot.path: pos for pos, slot in enumerate(slots)}
    cumulative: list[int] = []
    total = 0
    for slot in slots:
        total += slot.tokens
        cumulative.append(total)

    read_points: list[tuple[int, int]] = []  # (position, prefix tokens)
    for kind, boundary in boundaries.items():
        if kind not in STABLE_KINDS:  # the history boundary is new in this request: nobody wrote there yet
            continue
        mark = _resolve(slots, position_of, kind, boundary)
        if mark is not None and mark[1] is None:
            read_points.append((mark[0], cumulative[mark[0]]))
        elif mark is not None:
            before = cumulative[mark[0] - 1] if mark[0] else 0
            text = (
                slots[mark[0]].block
                if isinstance(slots[mark[0]].block, str)
                else slots[mark[0]].block["text"]
            )
            read_points.append((mark[0], before + counter.count(text[: mark[1]])))
    previous = _previous_turn_end(body, position_of)
    if previous is not None:
        read_points.append((previous, cumulative[previous]))
    read_points = [(pos, tokens) for pos, tokens in read_points if tokens >= minimum]

    def reach(breakpoints: list[tuple[int, int]]) -> tuple[int, int]:
        usable = [(pos, tokens) for pos, tokens in breakpoints if tokens >= minimum]
        write = max((tokens for _, tokens in usable), default=0)
        read = max(
            (
                tokens
                for pos, tokens in read_points
                if any(bp >= pos and bp - pos <= lookback_blocks for bp, _ in usable)
            ),
            default=0,
        )
        return read, write

    last = next((pos for pos in range(len(slots) - 1, -1, -1) if _cacheable(slots[pos].block)), None)

    def candidate(
        kinds: Sequence[str], slots_left: int, extra: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Any], list[Any], list[str]]:
        chosen = {kind: boundaries[kind] for kind in kinds if kind in boundaries}
        chosen.update(extra or {})
        new_body, plan = add_breakpoints(
            body,
            chosen,
            model,
            min_tokens=minimum,
            counter=counter,
            max_breakpoints=slots_left,
            lookback_blocks=lookback_blocks,
        )
        return new_body, plan.added, [ttls[_ttl_kind(b.kind)] for b in plan.added]

    def kept(added: list[Any], markers: list[str]) -> list[tuple[int, int]]:
        return [
            (b.position, b.prefix_tokens)
            for b, marker in zip(added, markers, strict=True)
            if b.position is not None and marker != NO_CACHE
        ]

    # automatic: the stable boundaries as blocks (an entry other conversations of the prefix reuse) plus the
    # top-level marker on the last block (the conversation's own entry, moving forward each turn), and a
    # breakpoint where the previous request ended (its own top-level marker wrote there): read exactly however
    # many blocks this turn added (an agent turn of 12 parallel calls adds ~25, past the 20-block lookback), and
    # written on a request whose history was never sent alone (a few-shot prompt's examples: the next question
    # reads them)
    at_previous = {"history": Boundary(slots[previous].path)} if previous is not None else None
    auto_body, auto_added, auto_markers = candidate(
        tuple(sorted(STABLE_KINDS)), max_breakpoints - 1, at_previous
    )
    automatic = (0, 0)
    if ttls["history"] != NO_CACHE and last is not None:
        auto_markers = _ordered_ttls([*auto_markers, ttls["history"]])
        top_ttl = auto_markers.pop()
        automatic = reach([*kept(auto_added, auto_markers), (last, cumulative[last])])
    placed_body, placed_added, placed_markers = candidate(tuple(boundaries), max_breakpoints)
    placed_markers = _ordered_ttls(placed_markers)
    placed = reach(kept(placed_added, placed_markers))
    scores = {"automatic": automatic, "placed": placed}
    if automatic == (0, 0) and placed == (0, 0):
        return CachePlan("none", body, None, scores, minimum)
    if automatic >= placed:
        out = _with_ttls(auto_body, iter(auto_markers)) if auto_added else dict(body)
        out["cache_control"] = _marker(top_ttl)
        return CachePlan("automatic", out, _shown([*auto_markers, top_ttl]), scores, minimum)
    return CachePlan(
        "placed", _with_ttls(placed_body, iter(placed_markers)), _shown(placed_markers), scores, minimum
    )


def _shown(markers: Sequence[str]) -> str | None:
    used = {m for m in markers if m != NO_CACHE}
    return None if not used else used.pop() if len(used) == 1 else "mixed"


def _ttl_map(ttl: str | Mapping[str, str]) -> dict[str, str]:
    allowed = (*TTLS, NO_CACHE)
    if isinstance(ttl, str):
        if ttl not in allowed:
            raise ValueError(f"ttl must be one of {allowed}, got {ttl!r}")
        return {"stable": ttl, "history": ttl}
    if set(ttl) != {"stable", "history"} or any(v not in allowed for v in ttl.values()):
        raise ValueError(f"ttl must map 'stable' and 'history' to one of {allowed}, got {dict(ttl)!r}")
    return dict(ttl)


def _ttl_kind(kind: str) -> str:
    return "history" if kind in ("history", "lookback") else "stable"


def _ordered_ttls(ttls: list[str]) -> list[str]:
    """Markers in prompt order with every ``5m`` before a later ``1h`` lifted to ``1h`` (no marker stays none)."""
    out = list(ttls)
    later_long = False
    for i in range(len(out) - 1, -1, -1):
        if out[i] == "1h":
            later_long = True
        elif out[i] == "5m" and later_long:
            out[i] = "1h"
    return out
