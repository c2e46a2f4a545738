"""Backend events -> OpenAI JSON: chat completion and text completion bodies and stream chunks, ``usage`` with
``prompt_tokens_details.cached_tokens``, tool-call delta merging.
Reference: https://platform.openai.com/docs/api-reference/chat/object
"""

from __future__ import annotations

import time
from typing import Any

from gateway.core.events import BackendUsage, Finish
from gateway.core.request import ChatRequest


def usage_body(usage: BackendUsage) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


class ResponseMeta:
    """The fields every response object and chunk of one request repeats."""

    def __init__(self, request: ChatRequest, system_fingerprint: str | None) -> None:
        prefix = "chatcmpl-" if request.kind == "chat" else "cmpl-"
        self.id = prefix + request.request_id
        self.created = int(time.time())
        self.model = request.model
        self.system_fingerprint = system_fingerprint

    def header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def merge_tool_call_deltas(calls: dict[int, dict[str, Any]], fragments: list[dict[str, Any]]) -> None:
    """Fold streaming ``tool_calls`` fragments (by ``index``) into whole calls, as the OpenAI SDK does."""
    for fragment in fragments:
        index = fragment.get("index", len(calls))
        call = calls.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]


def chat_completion_body(
    meta: ResponseMeta, text: str, tool_calls: list[dict[str, Any]], finish: Finish
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or not tool_calls else None,
        "refusal": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["annotations"] = []
    return {
        **meta.header("chat.completion"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish.finish_reason}
        ],
        "usage": usage_body(finish.usage),
        "service_tier": "default",
        "system_fingerprint": meta.system_fingerprint,
    }


def chat_chunk(meta: ResponseMeta, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    return {
        **meta.header("chat.completion.chunk"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(meta: ResponseMeta, object_name: str, usage: BackendUsage) -> dict[str, Any]:
    """The last chunk under ``include_usage``: empty ``choices`` and the request's ``usage``."""
    return {
        **meta.header(object_name),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [],
        "usage": usage_body(usage),
    }


def completion_body(meta: ResponseMeta, text: str, finish: Finish) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish.finish_reason}],
        "usage": usage_body(finish.usage),
    }


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
