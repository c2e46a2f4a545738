"""Reading an Anthropic upstream's answer: its SSE events up to ``message_stop`` (``anthropic_events``),
turned into OpenAI-shaped ``Delta`` events and the final usage / stop reason (``EventReader``), or assembled
into the Message a non-streamed call returns (``MessageAssembler``). A malformed event is an
``UpstreamStreamCut`` of kind ``protocol`` (502); an ``error`` event carries the upstream's error object.
Reference: https://docs.anthropic.com/en/docs/build-with-claude/streaming
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import jiter

from gateway.backends.upstream import error_body
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.protocols.anthropic.render import FINISH_REASONS, backend_usage_from_anthropic
from gateway.protocols.provider_usage import anthropic_miss_reason
from gateway.transport.failures import FailureKind, UpstreamStreamCut
from gateway.transport.redact import redact_url
from gateway.transport.upstream_http import OpenedResponse


def checked_usage(opened: OpenedResponse, message: dict[str, Any]) -> BackendUsage:
    """The usage of a Message; a cut (protocol, 502) when its ``stop_reason`` is not a string or its usage
    counts are not integers."""
    stop = message.get("stop_reason")
    usage = message.get("usage")
    try:
        if stop is not None and not isinstance(stop, str):
            raise TypeError("stop_reason")
        return backend_usage_from_anthropic(usage if isinstance(usage, dict) else {})
    except (TypeError, ValueError):
        raise opened.cut(
            "the upstream sent a malformed stop_reason or usage", kind=FailureKind.PROTOCOL
        ) from None


class MessageAssembler:
    """Anthropic stream events -> the Message a non-streamed call returns (the accumulation the Anthropic SDKs
    do: https://docs.anthropic.com/en/docs/build-with-claude/streaming, "Event types" and "Content block delta
    types").

    Deltas: ``text_delta`` (appended to ``text``), ``input_json_delta`` (``partial_json`` pieces parsed into
    ``input`` at ``content_block_stop``, in jiter's partial mode as the SDKs do, so an input cut short by
    ``max_tokens`` keeps its complete members), ``thinking_delta``, ``signature_delta``, ``citations_delta``
    (appended to ``citations``). Blocks that arrive whole (server tool results) are kept as they come. A delta
    type this list does not know raises a protocol cut rather than return a Message missing part of its
    content.
    """

    def __init__(self, opened: OpenedResponse) -> None:
        self._opened = opened
        self._message: dict[str, Any] | None = None
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, str] = {}

    def _fail(self, what: str) -> UpstreamStreamCut:
        return self._opened.cut(f"cannot assemble the upstream's Message: {what}", kind=FailureKind.PROTOCOL)

    def add(self, data: dict[str, Any]) -> None:
        """Fold one event in (``ping`` and ``message_stop`` change nothing)."""
        kind = data.get("type")
        if kind == "message_start":
            message = data.get("message")
            if not isinstance(message, dict):
                raise self._fail("message_start without a message")
            self._message = {**message, "content": []}
            return
        if self._message is None:
            if kind == "ping":
                return
            raise self._fail(f"{kind!r} before message_start")
        index = data.get("index")
        if kind == "content_block_start":
            block = data.get("content_block")
            if not isinstance(index, int) or not isinstance(block, dict):
                raise self._fail("content_block_start without an index and a block")
            self._blocks[index] = copy.deepcopy(block)
        elif kind == "content_block_delta":
            self._delta(index, data.get("delta"))
        elif kind == "content_block_stop":
            block = self._blocks.get(index)  # type: ignore[arg-type]
            if block is None:
                raise self._fail(f"content_block_stop for unknown block {index!r}")
            if index in self._json:
                text = self._json.pop(index)  # type: ignore[arg-type]
                try:
                    # partial mode, as the Anthropic SDKs parse it: a tool input cut short by max_tokens keeps
                    # its complete members (the stop reason says it was cut) instead of failing the answer
                    block["input"] = jiter.from_json(text.encode(), partial_mode=True) if text else {}
                except ValueError:
                    raise self._fail(f"block {index} has tool input that is not JSON") from None
        elif kind == "message_delta":
            delta = data.get("delta") if isinstance(data.get("delta"), dict) else {}
            self._message.update(delta)
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            merged = dict(self._message.get("usage") or {})
            merged.update({k: v for k, v in usage.items() if v is not None})
            self._message["usage"] = merged
            if isinstance(data.get("diagnostics"), dict):  # cache diagnostics come with the final delta
                self._message["diagnostics"] = data["diagnostics"]

    def _delta(self, index: Any, delta: Any) -> None:
        block = self._blocks.get(index) if isinstance(index, int) else None
        if block is None or not isinstance(delta, dict):
            raise self._fail(f"content_block_delta for unknown block {index!r}")
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + str(delta.get("text", ""))
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + str(delta.get("partial_json", ""))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature", "")
        elif kind == "citations_delta":
            block["citations"] = [
                *(block.get("citations") or []),
                delta.get("citation"),
            ]  # a start may say null
        else:
            raise self._fail(f"a delta of unknown type {kind!r} (stream the request to receive it)")

    def message(self) -> dict[str, Any]:
        """The assembled Message (after ``message_stop``)."""
        if self._message is None:
            raise self._fail("no message_start")
        self._message["content"] = [self._blocks[i] for i in sorted(self._blocks)]
        return self._message


class EventReader:
    """Anthropic stream events -> OpenAI-shaped ``Delta`` (text, tool calls) and the final usage / stop
    reason."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] = {}
        self.block_tool: dict[int, int] = {}  # content block index -> OpenAI tool-call index
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.ttft_s: float | None = None
        self.cache_miss_reason: str | None = None

    def read(self, data: dict[str, Any]) -> Delta | None:
        """Update the state with one event; the Delta it implies, if any."""
        kind = data.get("type")
        if kind == "message_start":
            self.usage.update((data.get("message") or {}).get("usage") or {})
            self.cache_miss_reason = anthropic_miss_reason(data.get("message")) or self.cache_miss_reason
        elif kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self.block_tool.setdefault(data.get("index", 0), len(self.block_tool))
                call = {"index": index, "id": block.get("id"), "type": "function"}
                return Delta(
                    tool_calls=[{**call, "function": {"name": block.get("name", ""), "arguments": ""}}]
                )
            if block.get("type") == "text" and block.get("text"):
                return Delta(text=block["text"])
        elif kind == "content_block_delta":
            change = data.get("delta") or {}
            if change.get("type") == "text_delta" and change.get("text"):
                return Delta(text=change["text"])
            if change.get("type") == "input_json_delta" and data.get("index") in self.block_tool:
                if change.get("partial_json"):
                    fragment = {"arguments": change["partial_json"]}
                    return Delta(tool_calls=[{"index": self.block_tool[data["index"]], "function": fragment}])
        elif kind == "message_delta":
            delta = data.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.stop_sequence = delta.get("stop_sequence")
            self.usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
            self.cache_miss_reason = anthropic_miss_reason(data) or self.cache_miss_reason
        return None

    def finish(self, replica: str, native: bool) -> Finish:
        """The ``Finish`` after ``message_stop``."""
        if self.stop_reason is not None and not isinstance(self.stop_reason, str):
            raise TypeError(f"stop_reason {self.stop_reason!r} is not a string")
        reason = FINISH_REASONS.get(self.stop_reason or "", "stop")
        return Finish(
            reason,
            backend_usage_from_anthropic(self.usage),
            self.ttft_s,
            stop_sequence=self.stop_sequence
            if isinstance(self.stop_sequence, str) and self.stop_sequence
            else None,
            anthropic_stop_reason=self.stop_reason or None,
            native=native,
            replica=redact_url(replica),
            cache_miss_reason=self.cache_miss_reason,
        )


async def anthropic_events(opened: OpenedResponse) -> AsyncIterator[dict[str, Any]]:
    """Parsed Anthropic SSE events up to ``message_stop`` (pings included); raises a cut on an ``error``
    event, bad JSON, or an end before ``message_stop``."""
    if opened.content_type == "application/json":  # not the event stream asked for: an error, or a refusal
        data = opened.json_object(await opened.read(), "an answer")
        error = error_body(data)
        if error is not None:  # an error answered as JSON (with 200): the upstream's own words
            raise opened.cut(f"the upstream answered an error: {error['message']}", upstream_error=error)
        raise opened.cut(
            "the upstream answered JSON where an event stream was asked for", kind=FailureKind.PROTOCOL
        )
    async with aclosing(opened.events()) as events:
        async for event in events:
            data = opened.json_object(event.data, "an event")
            if event.event == "error" or data.get("type") == "error":
                error = data.get("error") if isinstance(data.get("error"), dict) else {"type": "api_error"}
                raise opened.cut(
                    f"the upstream reported an error mid-stream: {error.get('message', '')}",
                    upstream_error=error,
                )
            if data.get("type") == "message_stop":
                opened.completed()  # the rest of the body is read on close: the connection is kept
                yield data
                return
            yield data
    raise opened.cut("the upstream stream ended before message_stop")
