"""Backend events -> Anthropic SSE bytes in Anthropic's event order: ``message_start``, per content block
``content_block_start`` (``ping`` after the first), ``content_block_delta``..., ``content_block_stop``; then
``message_delta`` (``stop_reason``, usage) and ``message_stop``. A failure after the start ends the stream
with an ``error`` event. Reference: https://docs.anthropic.com/en/docs/build-with-claude/streaming
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.errors import APIError, anthropic_error_body
from gateway.core.event_stream import encode_event
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.protocols.anthropic.render import MessageBuilder, anthropic_usage, message_id, stop_fields

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


# ==== errors ================================================================================================


def encode_error_event(error: APIError) -> bytes:
    """The SSE ``error`` event that ends a stream which failed after it started (body:
    ``gateway.errors.anthropic_error_body``, the same as the error responses of this path)."""
    return encode_event(anthropic_error_body(error), event="error")


class StreamFormatter:
    """Backend events -> Anthropic SSE bytes, in Anthropic's event order.

    ``message_start`` carries the input counts the first event knows (a ``Delta`` with ``prompt_tokens``, as
    the embedded engine sends, or a ``Finish``), else 0; the final ``message_delta`` carries the whole usage
    (the SDKs overwrite the start's counts with it).

    Each block is ``content_block_start``, its deltas, then ``content_block_stop``, one block after another
    (Anthropic's streaming format). OpenAI's chunks may interleave the argument deltas of parallel tool calls
    (call 0, call 1, call 0 again), and a tool call has no end of its own there: so while a tool_use block is
    open, a later tool call's block is held (its start and deltas) and sent whole, in order, when the open one
    ends (at the end of the answer, or before a later text block). Before, the first block was stopped when the
    second started and its later deltas came after its ``content_block_stop``, where the Anthropic SDK already
    showed ``input: {}`` (a fresh-user trial).
    """

    def __init__(self, model: str, request_id: str) -> None:
        self.model = model
        self.id = message_id(request_id)
        self.builder = MessageBuilder()
        self._open: int | None = None
        self._open_tool = False  # the open block is a tool_use block
        self._held: dict[int, list[bytes]] = {}  # later tool_use blocks' events, by block index (in order)
        self._pinged = False
        self.started = False
        self.finish: Finish | None = None

    def start(self, first: Delta | Finish | None = None) -> bytes:
        """The ``message_start`` event, with the input counts ``first`` knows (see the class docstring)."""
        self.started = True
        usage = {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        if isinstance(first, Finish):
            usage = {**anthropic_usage(first.usage), "output_tokens": 0}
        elif isinstance(first, Delta) and first.prompt_tokens is not None:
            known = BackendUsage(first.prompt_tokens, 0, cached_tokens=first.cached_tokens or 0)
            usage = anthropic_usage(known)
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }
        return encode_event({"type": "message_start", "message": message}, "message_start")

    def feed(self, event: Delta | Finish) -> bytes:
        """SSE bytes for one backend event (``message_start`` first if not sent yet)."""
        out = b"" if self.started else self.start(event)
        if isinstance(event, Finish):
            return out + self._finish(event)
        for step, index, value in self.builder.add(event):
            if step == "start":
                tool = value.get("type") == "tool_use"
                start = encode_event(
                    {"type": "content_block_start", "index": index, "content_block": value},
                    "content_block_start",
                )
                if tool and self._open_tool:
                    self._held[index] = [start]
                    continue
                out += self._stop_open() + start
                self._open, self._open_tool = index, tool
                if not self._pinged:
                    out += encode_event({"type": "ping"}, "ping")
                    self._pinged = True
                continue
            delta = (
                {"type": "text_delta", "text": value}
                if step == "text"
                else {"type": "input_json_delta", "partial_json": value}
            )
            data = encode_event(
                {"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"
            )
            if index in self._held:
                self._held[index].append(data)
            else:
                out += data
        return out

    def _stop_open(self) -> bytes:
        """Stop the open block, then send the held blocks whole, each stopped (see the class docstring)."""
        out = b""
        if self._open is not None:
            index, self._open = self._open, None
            out += encode_event({"type": "content_block_stop", "index": index}, "content_block_stop")
        self._open_tool = False
        for index, events in self._held.items():
            out += b"".join(events)
            out += encode_event({"type": "content_block_stop", "index": index}, "content_block_stop")
        self._held.clear()
        return out

    def _finish(self, finish: Finish) -> bytes:
        self.finish = finish
        stop_reason, stop_sequence = stop_fields(finish)
        out = self._stop_open()
        out += encode_event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": anthropic_usage(finish.usage),
            },
            "message_delta",
        )
        return out + encode_event({"type": "message_stop"}, "message_stop")

    def error(self, error: APIError) -> bytes:
        """The ``error`` event that ends a broken stream (after closing nothing: Anthropic sends it bare)."""
        out = b"" if self.started else self.start()
        return out + encode_error_event(error)
