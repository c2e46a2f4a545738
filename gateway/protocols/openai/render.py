"""Backend events -> OpenAI JSON: chat completion and text completion bodies and stream chunks, ``usage`` with
``prompt_tokens_details.cached_tokens``, tool-call delta merging.
Reference: https://platform.openai.com/docs/api-reference/chat/object
"""

from __future__ import annotations

import time
from typing import Any

from gateway.core.event_stream import encode_event, encode_event_value
from gateway.core.events import BackendUsage, Finish, TokenLogprob
from gateway.core.request import ChatRequest
from gateway.core.token_spelling import TokenSpelling


def usage_body(usage: BackendUsage) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` and ``cache_write_tokens`` (input written to a
    provider's cache: Anthropic's ``cache_creation_input_tokens``, OpenAI's own from GPT-5.6; 0 elsewhere), as
    OpenAI's answers carry them and as the Responses and Messages faces report them."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_creation_tokens,
            "audio_tokens": 0,
        },
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


def finish_reason_of(finish: Finish, index: int) -> str:
    """Choice ``index``'s finish reason (``Finish.finish_reasons`` when there are several choices)."""
    return finish.finish_reasons[index] if finish.finish_reasons else finish.finish_reason


def choice_count(finish: Finish) -> int:
    """How many choices the request had (``n``)."""
    return max(1, len(finish.finish_reasons))


def chat_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """Chat ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``.
    Reference: https://platform.openai.com/docs/api-reference/chat/object#chat/object-choices"""
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": list(entry.token_bytes),
                "top_logprobs": [
                    {"token": top.token, "logprob": top.logprob, "bytes": list(top.token_bytes)}
                    for top in entry.top
                ],
            }
            for entry in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: list[TokenLogprob] | tuple[TokenLogprob, ...], spelling: TokenSpelling
) -> dict[str, Any]:
    """Legacy completions ``choices[].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token: logprob}`` object per token, the chosen token among them) and ``text_offset`` (each token's
    start, in characters from the start of the completion text, from the tokens' bytes: ``spelling`` has the
    choice's earlier tokens; a token that finishes a character begun before it starts in that character, where
    counting the tokens' own strings put multi-byte text's offsets past its end, found by a trial)."""
    offsets = spelling.offsets([bytes(entry.token_bytes) for entry in entries])
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            {entry.token: entry.logprob, **{top.token: top.logprob for top in entry.top}} for entry in entries
        ],
        "text_offset": offsets,
    }


def chat_message(text: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """One choice's assistant ``message``."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or not tool_calls else None,
        "refusal": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["annotations"] = []
    return message


def chat_completion_body(
    meta: ResponseMeta,
    text: str,
    tool_calls: list[dict[str, Any]],
    finish: Finish,
    logprobs: list[TokenLogprob] | None = None,
    more_choices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole ``chat.completion`` object; ``logprobs`` (choice 0's tokens) when the client asked for them;
    ``more_choices`` the whole ``choices[]`` entries of choices 1 .. n-1 (``chat_choice``)."""
    return {
        **meta.header("chat.completion"),
        "choices": [chat_choice(0, text, tool_calls, finish, logprobs), *(more_choices or [])],
        "usage": usage_body(finish.usage),
        "service_tier": "default",
        "system_fingerprint": meta.system_fingerprint,
    }


def chat_choice(
    index: int,
    text: str,
    tool_calls: list[dict[str, Any]],
    finish: Finish,
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One ``choices[]`` entry of a ``chat.completion``."""
    return {
        "index": index,
        "message": chat_message(text, tool_calls),
        "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
        "finish_reason": finish_reason_of(finish, index),
    }


def chat_chunk(
    meta: ResponseMeta,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    return {
        **meta.header("chat.completion.chunk"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


_CONTENT_SLOT = "\ufdd0prefixgate-content-slot\ufdd0"
"""A stand-in for a chunk's content while its frame is cut out (U+FDD0 is a noncharacter, so no real model name
or fingerprint is this string; ``ContentChunkFrames`` checks that its JSON string occurs once in the chunk)."""


class ContentChunkFrames:
    """The SSE bytes of the ``chat.completion.chunk`` events that carry only text (``delta: {"content":
    text}``, no logprobs, no finish reason): the most frequent event of a streamed chat completion, one per
    token. Equal, byte for byte, to ``encode_event(chat_chunk(meta, {"content": text}, index=index))``; the
    bytes before and after the content's JSON string are rendered once per choice index and kept, so a token
    costs one JSON string encode instead of building and encoding the whole chunk (docs/serving-path.md).

    Why the pieces concatenate to the same bytes: ``compact_json`` writes a string value inside an object
    exactly as it writes that string alone (``json.dumps`` encodes strings with one function either way), the
    slot is a whole string value, and ``encode_event``'s character translation and UTF-8 encoding map each
    character on its own.
    """

    def __init__(self, meta: ResponseMeta) -> None:
        self._meta = meta
        self._frames: dict[int, tuple[bytes, bytes] | None] = {}

    def content(self, text: str, index: int = 0) -> bytes:
        """The event of a text-only delta of choice ``index``."""
        frame = self._frames.get(index, False)
        if frame is False:
            frame = self._frames[index] = self._frame(index)
        if frame is None:  # a header field is the slot's very string: no frame, the general path
            return encode_event(chat_chunk(self._meta, {"content": text}, index=index))
        return b"".join((frame[0], encode_event_value(text), frame[1]))

    def _frame(self, index: int) -> tuple[bytes, bytes] | None:
        whole = encode_event(chat_chunk(self._meta, {"content": _CONTENT_SLOT}, index=index))
        slot = encode_event_value(_CONTENT_SLOT)
        if whole.count(slot) != 1:
            return None
        head, tail = whole.split(slot)
        return head, tail


def usage_chunk(meta: ResponseMeta, object_name: str, usage: BackendUsage) -> dict[str, Any]:
    """The last chunk under ``include_usage``: empty ``choices`` and the request's ``usage``."""
    return {
        **meta.header(object_name),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [],
        "usage": usage_body(usage),
    }


def completion_body(
    meta: ResponseMeta,
    texts: list[str],
    finish: Finish,
    logprobs: list[list[TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """A whole ``text_completion`` object: ``texts[i]`` is choice i's text, ``logprobs[i]`` its tokens when the
    client asked for logprobs."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [
            {
                "text": text,
                "index": index,
                "logprobs": (
                    completion_logprobs(logprobs[index], TokenSpelling()) if logprobs is not None else None
                ),
                "finish_reason": finish_reason_of(finish, index),
            }
            for index, text in enumerate(texts)
        ],
        "usage": usage_body(finish.usage),
    }


def completion_chunk(
    meta: ResponseMeta,
    text: str,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {
        **meta.header("text_completion"),
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
