"""Backend events -> Anthropic Message JSON: usage as Anthropic defines it (``input_tokens`` excludes cache
reads and writes), ``stop_reason`` / ``stop_sequence``, content blocks from text and tool-call deltas, and the
relay of an Anthropic upstream's own events (``NativeDelta``).
Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jiter

from gateway.core.errors import APIError
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.core.json_types import finite_json
from gateway.protocols.provider_usage import UpstreamUsageError, anthropic_cache_usage

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
    "abort": "end_turn",
}
"""OpenAI-style finish reason -> Anthropic ``stop_reason``."""

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}
"""Anthropic ``stop_reason`` -> OpenAI-style finish reason."""


# ==== usage and responses
# =====================================================================================


def anthropic_usage(usage: BackendUsage) -> dict[str, int]:
    """BackendUsage -> Anthropic usage: ``input_tokens`` excludes cache reads and writes."""
    uncached = max(usage.prompt_tokens - usage.cached_tokens - usage.cache_creation_tokens, 0)
    return {
        "input_tokens": uncached,
        "cache_creation_input_tokens": usage.cache_creation_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def backend_usage_from_anthropic(usage: Mapping[str, Any], counted_by: str = "upstream") -> BackendUsage:
    """Anthropic usage -> BackendUsage (``prompt_tokens`` = input + cache read + cache write; writes split by
    TTL from ``cache_creation``).

    Raises:
        UpstreamUsageError (a ValueError): a count that is not an integer >= 0 (the caller answers 502).
    """
    cache = anthropic_cache_usage(usage)
    output = usage.get("output_tokens")
    if output is not None and (isinstance(output, bool) or not isinstance(output, int) or output < 0):
        raise UpstreamUsageError("output_tokens", output)
    return BackendUsage(
        prompt_tokens=cache.prompt_tokens,
        completion_tokens=output or 0,
        cached_tokens=cache.cache_read_tokens,
        cache_creation_tokens=cache.written,
        counted_by=counted_by,
        cache_writes=tuple(sorted((str(k), v) for k, v in cache.cache_write_tokens.items())),
    )


def message_id(request_id: str) -> str:
    """A ``msg_`` id for a response."""
    return "msg_" + (request_id.replace("-", "")[:24] or uuid.uuid4().hex[:24])


def stop_fields(finish: Finish) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a Finish: an upstream Anthropic reason wins; a matched stop
    string (``Finish.stop_sequence``) gives ``stop_sequence``."""
    native = finish.anthropic_stop_reason
    sequence = finish.stop_sequence
    if isinstance(native, str):
        return native, sequence if isinstance(sequence, str) else None
    if isinstance(sequence, str) and finish.finish_reason == "stop":
        return "stop_sequence", sequence
    return STOP_REASONS.get(finish.finish_reason, "end_turn"), None


class MessageBuilder:
    """Accumulates backend events into content blocks: text, and tool_use from OpenAI tool-call deltas.

    ``add`` returns the stream steps each Delta implies: ``("start", i, block)`` (a new block; the open one
    stops), ``("text", i, str)`` and ``("json", i, str)`` (a fragment of a tool's input JSON).
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.current: int | None = None  # index of the open block
        self._tool_json: dict[int, str] = {}  # block index -> arguments JSON so far
        self._tool_block: dict[int, int] = {}  # OpenAI tool-call index -> block index

    def _open(self, block: dict[str, Any], steps: list[tuple[str, int, Any]]) -> int:
        self.blocks.append(block)
        self.current = len(self.blocks) - 1
        steps.append(("start", self.current, copy.deepcopy(block)))
        return self.current

    def add(self, delta: Delta) -> list[tuple[str, int, Any]]:
        """Apply one Delta; returns its stream steps."""
        steps: list[tuple[str, int, Any]] = []
        if delta.text:
            if self.current is None or self.blocks[self.current]["type"] != "text":
                self._open({"type": "text", "text": ""}, steps)
            assert self.current is not None
            self.blocks[self.current]["text"] += delta.text
            steps.append(("text", self.current, delta.text))
        for call in delta.tool_calls or []:
            index = int(call.get("index", 0))
            function = call.get("function") or {}
            if index not in self._tool_block:
                block = {
                    "type": "tool_use",
                    "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": function.get("name") or "",
                    "input": {},
                }
                self._tool_block[index] = self._open(block, steps)
                self._tool_json[self._tool_block[index]] = ""
            fragment = function.get("arguments") or ""
            if fragment:
                block_index = self._tool_block[index]
                self._tool_json[block_index] += fragment
                steps.append(("json", block_index, fragment))
        return steps

    def content(self) -> list[dict[str, Any]]:
        """The finished blocks; tool inputs parsed from their JSON in jiter's partial mode, as the Anthropic
        SDK reads the same ``input_json_delta`` fragments of a stream: a call cut by ``max_tokens`` keeps the
        members it completed (an unfinished string, number or literal is left out), so a streamed and a
        non-streamed Message hold the same ``input`` (``tool_input``)."""
        out = []
        for i, block in enumerate(self.blocks):
            block = dict(block)
            if block["type"] == "tool_use":
                block["input"] = tool_input(self._tool_json.get(i, ""))
            out.append(block)
        return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input`` for a call's arguments text: parsed in jiter's partial mode, as the
    Anthropic SDK reads a stream's ``input_json_delta`` fragments (a call cut by ``max_tokens`` keeps the members
    it completed; an unfinished string, number or literal is left out); ``{}`` when nothing parses or it is not
    an object; a number beyond the float range as the largest float of its sign (``finite_json``), so the
    Message is written as strict JSON. What a client resends as that call in its next turn."""
    try:
        parsed = jiter.from_json(arguments.encode(), partial_mode=True) if arguments.strip() else {}
        parsed = finite_json(parsed)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


@dataclass(frozen=True)
class NativeDelta(Delta):
    """A Delta that also carries the upstream's own Anthropic events, which this face relays verbatim (an
    Anthropic upstream answering an Anthropic-face request). ``text`` / ``tool_calls`` mirror the events in
    OpenAI's shape so the protocol-independent bookkeeping (TTFT) works unchanged; the ``Finish`` that follows
    has ``native=True`` and adds no event of its own. For a non-streamed request ``events`` holds one
    whole Message object."""

    events: tuple[dict[str, Any], ...] = ()


def relay_event(event: dict[str, Any], model: str) -> dict[str, Any]:
    """An upstream event or Message as the client sees it: ``model`` is the client-facing name."""
    if event.get("type") == "message_start" and isinstance(event.get("message"), dict):
        return {**event, "message": {**event["message"], "model": model}}
    if event.get("type") == "message":
        return {**event, "model": model}
    return event


async def build_message(
    events: AsyncIterator[Delta | Finish], model: str, request_id: str
) -> tuple[dict[str, Any], Finish]:
    """Drain a backend's events into a non-streamed Message (``{"id", "type": "message", ...}``); a native
    upstream Message is returned as it came (``model`` renamed).

    Raises:
        APIError: the backend ended without a ``Finish``; whatever the backend raises.
    """
    builder = MessageBuilder()
    native: dict[str, Any] | None = None
    finish: Finish | None = None
    async for event in events:
        if isinstance(event, Finish):
            finish = event
            break
        if isinstance(event, NativeDelta):
            native = next((relay_event(e, model) for e in event.events if e.get("type") == "message"), native)
            continue
        builder.add(event)
    if finish is None:
        raise APIError("The backend ended the response without a finish.")
    if native is not None:
        return native, finish
    stop_reason, stop_sequence = stop_fields(finish)
    message = {
        "id": message_id(request_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": builder.content(),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": anthropic_usage(finish.usage),
    }
    return message, finish
