"""The ``Response`` object of ``POST /v1/responses`` and its stream of typed events, built from backend events
(text, logprobs, tool-call deltas, the finish): ``ResponseBuilder``. The request side (a Responses body -> a chat
body) is ``gateway.protocols.openai.responses``.

Reference: https://platform.openai.com/docs/api-reference/responses (shapes checked against the openai-python
SDK's ``types/responses``: ``Response``, ``ResponseTextDeltaEvent``, ``ResponseCompletedEvent``, ...).
Invariant: every event carries the next ``sequence_number``; the ``Response`` echoes what the request asked
(validated by ``responses_to_chat_body``), never a value of its own in place of one the client sent.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.core.events import BackendUsage, Finish, TokenLogprob
from gateway.protocols.openai.render import chat_logprobs
from gateway.protocols.openai.responses_tools import namespaced_tool_names


def _reasoning_echo(reasoning: Any) -> dict[str, Any]:
    """The Response's ``reasoning``: what the request asked (validated by ``responses_to_chat_body``)."""
    asked = reasoning if isinstance(reasoning, dict) else {}
    return {"effort": asked.get("effort"), "summary": asked.get("summary") or asked.get("generate_summary")}


def responses_usage(usage: BackendUsage) -> dict[str, Any]:
    """Responses ``usage``: ``input_tokens`` (cached ones included) with ``input_tokens_details.cached_tokens``
    and ``cache_write_tokens`` (both required by the openai-python SDK's ``ResponseUsage``), ``output_tokens``,
    ``total_tokens``."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_creation_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseBuilder:
    """The ``Response`` object of one request, and the streamed events that build it, in the order OpenAI sends
    them: ``response.created``, ``response.in_progress``; per output item ``response.output_item.added``, for a
    message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
    ``response.content_part.done``, for a function call ``response.function_call_arguments.delta``...,
    ``response.function_call_arguments.done``; ``response.output_item.done``; then ``response.completed`` (or
    ``response.incomplete`` when ``max_output_tokens`` cut the answer). Every event has a ``sequence_number``.

    Args:
        body: the client's Responses body (echoed fields: instructions, tools, sampling...).
        model: the model name.
        request_id: the gateway's id (``resp_`` + it is the response id).
    """

    def __init__(self, body: dict[str, Any], model: str, request_id: str) -> None:
        self.body = body
        self.model = model
        self.id = f"resp_{request_id}"
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._message: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> function_call item
        self._open: dict[str, Any] | None = None  # the output item being streamed
        self._held: dict[
            str, tuple[dict[str, Any], list[dict[str, Any]]]
        ] = {}  # later calls: item, its events
        self._pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come yet
        self._namespaced = namespaced_tool_names(body)  # model-facing name -> (namespace, name)

    def response(self, status: str, finish: Finish | None = None) -> dict[str, Any]:
        """The ``Response`` object as it stands (``status``: in_progress, completed or incomplete)."""
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": _reasoning_echo(body.get("reasoning")),
            "max_tool_calls": body.get("max_tool_calls"),
            "top_logprobs": body.get("top_logprobs"),
            "service_tier": "default",  # the tier that served it (one tier here), as the chat face says
            "prompt_cache_key": body.get("prompt_cache_key"),
            "prompt_cache_retention": body.get("prompt_cache_retention"),
            "safety_identifier": body.get("safety_identifier"),
            "background": False,
            "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": responses_usage(finish.usage) if finish is not None else None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One stream event: ``{"type": kind, **fields, "sequence_number": n}``."""
        return self._numbered({"type": kind, **fields})

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        """``event`` with the next ``sequence_number`` (numbered as it goes out: a held call's events are numbered
        when they are sent)."""
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = self.response("in_progress")
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def logprobs(self, entries: tuple[TokenLogprob, ...]) -> None:
        """Keep the logprobs of tokens whose text is still held back (an incomplete UTF-8 character, text that
        may open a tool call): they go out with the next piece of text (``text``); a function call that follows
        drops them (``tool_calls``: a call carries no logprobs); at the end they join the message's part."""
        self._pending_logprobs += chat_logprobs(entries)["content"]

    def text(self, delta: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        """Events for a piece of answer text (opening the message item first when needed); ``logprobs``: the
        tokens it came from, when the client asked for them (``include`` / ``top_logprobs``), in OpenAI's ``Logprob`` shape
        (token, logprob, bytes, top_logprobs), after any kept by ``logprobs``."""
        entries = self._pending_logprobs + chat_logprobs(logprobs)["content"]
        self._pending_logprobs = []
        events = []
        if self._message is None or self._message is not self._open:
            events += self._close_open()  # the function calls before it are done
            messages = sum(1 for item in self.output if item["type"] == "message")
            self._message = {
                "id": f"msg_{self.id[5:]}" + (f"_{messages}" if messages else ""),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.output.append(self._message)
            self._open = self._message
            index = len(self.output) - 1
            events.append(
                self.event(
                    "response.output_item.added", output_index=index, item=dict(self._message, content=[])
                )
            )
            self._message["content"].append(
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        self._message["content"][0]["text"] += delta
        self._message["content"][0]["logprobs"] += entries
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=self.output.index(self._message),
                content_index=0,
                delta=delta,
                logprobs=entries,
            )
        )
        return events

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events for tool-call deltas in the chat streaming shape (a new index opens a ``function_call`` item).

        Output items stream one after another, each done before the next is added (as OpenAI's do): a call
        closes the message before it; while a call is open, a later call's item (its ``output_item.added`` and
        deltas) is held and sent whole once the open one is done (chat chunks may interleave parallel calls'
        arguments, and a call has no end of its own there). Before, the message stayed open beside the calls and
        every item was done only at the end (a fresh-user trial)."""
        self._pending_logprobs = []  # the call's own tokens: a function_call item has no logprobs
        events = []
        for delta in deltas:
            index = delta.get("index", 0)
            function = delta.get("function") or {}
            item = self._calls.get(index)
            if item is None:
                call_id = delta.get("id") or f"call_{self.id[5:]}_{index}"
                item = {
                    "id": f"fc_{self.id[5:]}_{index}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": call_id,
                    "name": function.get("name") or "",
                    "arguments": "",
                }
                if (
                    item["name"] in self._namespaced
                ):  # a namespace's function: given back as the client named it
                    namespace, item["name"] = self._namespaced[item["name"]]
                    item["namespace"] = namespace
                if self._open is not None and self._open["type"] == "function_call":
                    self._held[item["id"]] = (item, [])
                else:
                    events += self._close_open()
                    self._open = item
                self._calls[index] = item
                self.output.append(item)
                added = {
                    "type": "response.output_item.added",
                    "output_index": len(self.output) - 1,
                    "item": dict(item),
                }
                self._emit(item, added, events)
            piece = function.get("arguments") or ""
            if piece:
                item["arguments"] += piece
                data = {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": self.output.index(item),
                    "delta": piece,
                }
                self._emit(item, data, events)
        return events

    def _emit(self, item: dict[str, Any], event: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """``event`` (not numbered yet) of ``item`` into ``events``, numbered, or into the item's held events
        while it is held."""
        held = self._held.get(item["id"])
        if held is not None:
            held[1].append(event)
        else:
            events.append(self._numbered(event))

    def _close_open(self, last_status: str = "completed") -> list[dict[str, Any]]:
        """The done events of the open item, then of each held call in order (their held events first); the
        last item closed gets ``last_status``."""
        items = ([self._open] if self._open is not None else []) + [item for item, _ in self._held.values()]
        held = {item_id: events for item_id, (_, events) in self._held.items()}
        self._open = None
        self._held = {}
        events: list[dict[str, Any]] = []
        for n, item in enumerate(items):
            events += [self._numbered(event) for event in held.get(item["id"], [])]
            events += self._done(item, last_status if n == len(items) - 1 else "completed")
        return events

    def _done(self, item: dict[str, Any], status: str) -> list[dict[str, Any]]:
        """The events that close ``item`` (its status set to ``status``)."""
        index = self.output.index(item)
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._pending_logprobs  # an incomplete character at the very end
            self._pending_logprobs = []
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(
                self.event(
                    "response.output_text.done", **common, text=part["text"], logprobs=part["logprobs"]
                )
            )
            events.append(self.event("response.content_part.done", **common, part=dict(part)))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        """The closing events of the open items, then ``response.completed`` / ``response.incomplete``: only the
        item the cut fell in (the last) is incomplete when ``max_output_tokens`` cut the answer."""
        status = "incomplete" if finish.finish_reason == "length" else "completed"
        events = self._close_open(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self.event(kind, response=self.response(status, finish)))
        return events
