"""The Anthropic Messages face: ``POST /v1/messages`` bodies in, Message JSON / SSE out.

Reference: https://docs.anthropic.com/en/api/messages (request and response shapes),
https://docs.anthropic.com/en/docs/build-with-claude/streaming (event order), and the recorded streams in
``/work/shared/fixtures/protocol/anthropic``.

Three jobs:

1. **Parse and validate** a body into a ``ChatRequest`` (``protocol="anthropic"``). Messages and tools are
   translated to OpenAI's shape so rules, routing and every backend see one shape; the original body stays in
   ``ChatRequest.body`` for native passthrough to an Anthropic upstream.
2. **Translate back** (``openai_to_anthropic``): canonical OpenAI-shaped messages -> Anthropic ``system`` /
   ``messages`` / ``tools``. The two translations round-trip: what Anthropic needs and OpenAI cannot say rides
   along in the OpenAI shapes and is restored (see "Round trip" below).
3. **Format** backend events (``Delta`` / ``Finish``) as a Message or as SSE in Anthropic's event order:
   ``message_start``, then per content block ``content_block_start``, (``ping`` after the first block start),
   ``content_block_delta``..., ``content_block_stop``; then ``message_delta`` (``stop_reason``, usage) and
   ``message_stop``. A failure after the stream started ends it with an ``error`` event.

Round trip (Anthropic -> OpenAI -> Anthropic):
- top-level ``system`` -> one leading ``system`` message (a string stays a string, blocks become text parts);
- ``text`` blocks -> ``text`` parts, keeping extra keys (``cache_control``, ``citations``) on the part;
- ``image`` blocks -> ``image_url`` parts (base64 -> ``data:`` URL, ``url`` source -> its URL), keeping
  ``cache_control``; a ``file`` source rides as an opaque part;
- ``tool_use`` blocks -> assistant ``tool_calls`` (``arguments`` = compact JSON of ``input``), keeping
  ``cache_control`` on the tool call; text and other blocks of that turn stay in ``content`` in their order,
  tool uses follow them;
- ``tool_result`` blocks -> ``tool`` messages (``tool_call_id``; ``is_error`` and ``cache_control`` kept);
  the ``tool`` messages and the user message that follows them merge back into one user turn;
- any other block type (``thinking``, ``redacted_thinking``, ``document``, ``search_result``, server tool
  blocks, ...) -> an opaque part ``{"type": "x-anthropic", "block": <block>}``, restored verbatim; backends that
  are not Anthropic reject those (400) except thinking blocks, which they drop;
- custom tools -> ``{"type": "function", "function": {name, description, parameters}}`` with extra keys
  (``cache_control``, ``strict``, ...) under ``"x-anthropic"``; server tools (a ``type`` other than ``custom``)
  -> ``{"type": "x-anthropic", "tool": <tool>}``.
Rules must keep unknown keys of messages, parts and tools (they rewrite text only).

Usage as Anthropic defines it: ``input_tokens`` are the input tokens after the last cache breakpoint (neither
read from nor written to the cache), so ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``
is the whole prompt; ``BackendUsage.prompt_tokens`` counts the whole prompt.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from engine.api import SamplingParams
from gateway.backends.base import BackendUsage, Delta, Finish
from gateway.body import read_json_object
from gateway.errors import APIError, InvalidRequestError, anthropic_error_body
from gateway.request import ChatRequest
from gateway.sse import EventStreamResponse, encode_event

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    from gateway.pipeline import OpenedStream

OPAQUE = "x-anthropic"
"""Part/tool type (and tool key) carrying Anthropic-only content through the OpenAI shape."""

THINKING_TYPES = frozenset({"thinking", "redacted_thinking"})
_TOOL_RESULT_BLOCKS = frozenset({"text", "image", "document", "search_result"})
_CACHE_TTLS = frozenset({"5m", "1h"})
_TOOL_CHOICE_TYPES = frozenset({"auto", "any", "tool", "none"})

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


# ==== errors ================================================================================================


def encode_error_event(error: APIError) -> bytes:
    """The SSE ``error`` event that ends a stream which failed after it started (body:
    ``gateway.errors.anthropic_error_body``, the same as the error responses of this path)."""
    return encode_event(anthropic_error_body(error), event="error")


# ==== validation ============================================================================================


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param, code="invalid_value")


def _require_str(value: Any, param: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise _bad(f"expected a string, got {_kind(value)}", param)
    if not allow_empty and not value:
        raise _bad("must not be empty", param)
    return value


def _number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"expected a number, got {_kind(value)}", param)
    if not low <= value <= high:
        raise _bad(f"expected a number in [{low}, {high}], got {value}", param)
    return float(value)


def _integer(value: Any, param: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"expected an integer, got {_kind(value)}", param)
    if value < low:
        raise _bad(f"expected an integer >= {low}, got {value}", param)
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def validate_cache_control(value: Any, param: str) -> None:
    """``{"type": "ephemeral", "ttl"?: "5m" | "1h"}``. Raises ``InvalidRequestError``."""
    if not isinstance(value, dict):
        raise _bad(f"expected an object, got {_kind(value)}", param)
    if value.get("type") != "ephemeral":
        raise _bad("type must be 'ephemeral'", f"{param}.type")
    if "ttl" in value and value["ttl"] not in _CACHE_TTLS:
        raise _bad("ttl must be '5m' or '1h'", f"{param}.ttl")


def _validate_block(block: Any, param: str, role: str) -> None:
    if not isinstance(block, dict):
        raise _bad(f"expected a content block object, got {_kind(block)}", param)
    kind = block.get("type")
    if not isinstance(kind, str) or not kind:
        raise _bad("content block needs a string 'type'", f"{param}.type")
    if "cache_control" in block:
        validate_cache_control(block["cache_control"], f"{param}.cache_control")
    if kind == "text":
        _require_str(block.get("text"), f"{param}.text")
    elif kind == "image":
        source = block.get("source")
        if not isinstance(source, dict):
            raise _bad("image block needs a 'source' object", f"{param}.source")
        stype = source.get("type")
        if stype == "base64":
            _require_str(source.get("media_type"), f"{param}.source.media_type", allow_empty=False)
            _require_str(source.get("data"), f"{param}.source.data", allow_empty=False)
        elif stype == "url":
            _require_str(source.get("url"), f"{param}.source.url", allow_empty=False)
        elif stype != "file":
            raise _bad("image source type must be 'base64', 'url' or 'file'", f"{param}.source.type")
    elif kind == "tool_use":
        if role != "assistant":
            raise _bad("tool_use blocks belong to assistant messages", param)
        _require_str(block.get("id"), f"{param}.id", allow_empty=False)
        _require_str(block.get("name"), f"{param}.name", allow_empty=False)
        if not isinstance(block.get("input"), dict):
            raise _bad(f"expected an object, got {_kind(block.get('input'))}", f"{param}.input")
    elif kind == "tool_result":
        if role != "user":
            raise _bad("tool_result blocks belong to user messages", param)
        _require_str(block.get("tool_use_id"), f"{param}.tool_use_id", allow_empty=False)
        content = block.get("content", "")
        if isinstance(content, list):
            for j, inner in enumerate(content):
                _validate_block(inner, f"{param}.content[{j}]", "user")
                if inner["type"] not in _TOOL_RESULT_BLOCKS:
                    raise _bad(
                        f"tool_result content cannot hold a {inner['type']!r} block", f"{param}.content[{j}]"
                    )
        elif not isinstance(content, str):
            raise _bad(f"expected a string or an array of blocks, got {_kind(content)}", f"{param}.content")
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise _bad("expected a boolean", f"{param}.is_error")


def _validate_tool(tool: Any, param: str) -> None:
    if not isinstance(tool, dict):
        raise _bad(f"expected a tool object, got {_kind(tool)}", param)
    if "cache_control" in tool:
        validate_cache_control(tool["cache_control"], f"{param}.cache_control")
    _require_str(tool.get("name"), f"{param}.name", allow_empty=False)
    if tool.get("type", "custom") == "custom":
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"expected a JSON schema object, got {_kind(schema)}", f"{param}.input_schema")
        if "description" in tool:
            _require_str(tool["description"], f"{param}.description")


def _validate_tool_choice(choice: Any, tool_names: set[str]) -> None:
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICE_TYPES:
        raise _bad("expected {'type': 'auto' | 'any' | 'tool' | 'none', ...}", "tool_choice")
    if choice["type"] == "tool":
        name = _require_str(choice.get("name"), "tool_choice.name", allow_empty=False)
        if tool_names and name not in tool_names:
            raise _bad(f"names a tool that is not in tools: {name!r}", "tool_choice.name")
    if "disable_parallel_tool_use" in choice and not isinstance(choice["disable_parallel_tool_use"], bool):
        raise _bad("expected a boolean", "tool_choice.disable_parallel_tool_use")


def validate_body(body: Any, require_max_tokens: bool = True) -> None:
    """Check a Messages request body (the fields prefixgate reads; other fields pass through untouched).

    Args:
        body: the parsed JSON body.
        require_max_tokens: False for ``/v1/messages/count_tokens`` bodies, which have no ``max_tokens``
            (one that is there is still checked).

    Raises:
        InvalidRequestError: with ``param`` naming the field (``messages[2].content[0].text``).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    if "model" not in body:
        raise _bad("field required", "model")
    _require_str(body["model"], "model", allow_empty=False)
    if "max_tokens" in body:
        _integer(body["max_tokens"], "max_tokens", 1)
    elif require_max_tokens:
        raise _bad("field required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad(f"expected an array of messages, got {_kind(messages)}", "messages")
    if not messages:
        raise _bad("at least one message is required", "messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"expected a message object, got {_kind(message)}", param)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"role must be 'user' or 'assistant', got {role!r}", f"{param}.role")
        content = message.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                _validate_block(block, f"{param}.content[{j}]", role)
        elif not isinstance(content, str):
            raise _bad(
                f"expected a string or an array of content blocks, got {_kind(content)}", f"{param}.content"
            )
    system = body.get("system")
    if isinstance(system, list):
        for j, block in enumerate(system):
            _validate_block(block, f"system[{j}]", "system")
            if block["type"] != "text":
                raise _bad("system blocks must be text blocks", f"system[{j}].type")
    elif system is not None and not isinstance(system, str):
        raise _bad(f"expected a string or an array of text blocks, got {_kind(system)}", "system")
    tools = body.get("tools")
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad(f"expected an array of tools, got {_kind(tools)}", "tools")
        for j, tool in enumerate(tools):
            _validate_tool(tool, f"tools[{j}]")
            if tool["name"] in names:
                raise _bad(f"duplicate tool name {tool['name']!r}", f"tools[{j}].name")
            names.add(tool["name"])
    if body.get("tool_choice") is not None:
        _validate_tool_choice(body["tool_choice"], names)
    if body.get("temperature") is not None:
        _number(body["temperature"], "temperature", 0.0, 1.0)
    if body.get("top_p") is not None:
        _number(body["top_p"], "top_p", 0.0, 1.0)
    if body.get("top_k") is not None:
        _integer(body["top_k"], "top_k", 0)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("expected an array of non-empty strings", "stop_sequences")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise _bad(f"expected a boolean, got {_kind(body['stream'])}", "stream")
    if "cache_control" in body:
        validate_cache_control(body["cache_control"], "cache_control")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _bad(f"expected an object, got {_kind(metadata)}", "metadata")
        if metadata.get("user_id") is not None:
            _require_str(metadata["user_id"], "metadata.user_id")


# ==== Anthropic -> OpenAI ===================================================================================


def _extras(obj: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in known}


def block_to_part(block: dict[str, Any]) -> dict[str, Any]:
    """One Anthropic content block (not tool_use / tool_result) -> one OpenAI content part."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": block["text"], **_extras(block, {"type", "text"})}
    if kind == "image" and block["source"].get("type") in ("base64", "url"):
        source = block["source"]
        if source["type"] == "base64":
            url = f"data:{source['media_type']};base64,{source['data']}"
        else:
            url = source["url"]
        return {"type": "image_url", "image_url": {"url": url}, **_extras(block, {"type", "source"})}
    return {"type": OPAQUE, "block": copy.deepcopy(block)}


def _tool_result_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    return [block_to_part(b) for b in content]


def anthropic_to_openai_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The body's ``system`` + ``messages`` as OpenAI chat messages (see "Round trip" in the module doc)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        out.append({"role": "system", "content": [block_to_part(b) for b in system]})
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if role == "assistant":
            parts: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            for block in content:
                if block["type"] == "tool_use":
                    call = {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": _dumps(block["input"])},
                    }
                    call.update(_extras(block, {"type", "id", "name", "input"}))
                    calls.append(call)
                else:
                    parts.append(block_to_part(block))
            msg: dict[str, Any] = {"role": "assistant", "content": parts if parts else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        parts = []
        for block in content:
            if block["type"] == "tool_result":
                tool_msg = {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _tool_result_content(block.get("content", "")),
                }
                tool_msg.update(_extras(block, {"type", "tool_use_id", "content"}))
                out.append(tool_msg)
            else:
                parts.append(block_to_part(block))
        if parts or not content:
            out.append({"role": "user", "content": parts})
    return out


def anthropic_to_openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools -> OpenAI function tools (server tools ride as ``{"type": "x-anthropic", "tool": ...}``)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if tool.get("type", "custom") != "custom":
            out.append({"type": OPAQUE, "tool": copy.deepcopy(tool)})
            continue
        function: dict[str, Any] = {"name": tool["name"]}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = copy.deepcopy(tool["input_schema"])
        entry: dict[str, Any] = {"type": "function", "function": function}
        extra = _extras(tool, {"name", "description", "input_schema"})
        if extra:
            entry[OPAQUE] = extra
        out.append(entry)
    return out


def anthropic_to_openai_tool_choice(choice: Mapping[str, Any] | None) -> Any:
    """``{"type": auto|any|tool|none}`` -> ``"auto"`` / ``"required"`` / ``{"type": "function", ...}`` / ``"none"``."""
    if choice is None:
        return None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def parse_messages_body(body: Any, request_id: str = "", require_max_tokens: bool = True) -> ChatRequest:
    """Validate a ``/v1/messages`` body and build the internal request (``rules_enabled``, ``tenant`` and
    ``forward_headers`` are the endpoint's to set from headers, see ``apply_request_headers``).

    Args:
        body: the parsed JSON body.
        request_id: the gateway's id (a ``msg_`` id is made from it when formatting).
        require_max_tokens: False for ``/v1/messages/count_tokens`` bodies (then ``params.max_tokens`` is None
            when the body has none).

    Raises:
        InvalidRequestError: a missing or ill-typed field (``param`` names it).
    """
    validate_body(body, require_max_tokens)
    stops = tuple(body.get("stop_sequences") or ())
    params = SamplingParams(
        max_tokens=body.get("max_tokens"),
        temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
        top_k=int(body["top_k"]) if body.get("top_k") is not None else 0,
        stop=stops,
    )
    metadata = body.get("metadata") or {}
    return ChatRequest(
        model=body["model"],
        messages=anthropic_to_openai_messages(body),
        params=params,
        tools=anthropic_to_openai_tools(body.get("tools")),
        tool_choice=anthropic_to_openai_tool_choice(body.get("tool_choice")),
        stream=bool(body.get("stream", False)),
        include_usage=True,
        user=metadata.get("user_id"),
        protocol="anthropic",
        body=body,
        request_id=request_id or uuid.uuid4().hex,
    )


# ==== OpenAI -> Anthropic ===================================================================================

BlockPath = tuple[Any, ...]
"""Where a block sits in an Anthropic body: ``("tools", i)``, ``("system", j)`` or ``("messages", i, j)``."""


@dataclass
class AnthropicPrompt:
    """OpenAI-shaped messages/tools translated for the Messages API.

    Attributes:
        system: ``None``, a string, or a list of text blocks.
        messages: Anthropic messages (user/assistant turns).
        tools: Anthropic tools or None.
        last_block: per input message index, the ``BlockPath`` of the last block it produced (None when it
            produced none). A string ``content`` counts as one block (index 0).
        part_blocks: per input message index, per content part index, the ``BlockPath`` of the block that
            part became (None for an empty text, which is sent as no block); a string ``content`` is part 0.
            Empty for ``tool`` messages (their result is one block) and tool calls are not parts.
    """

    system: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    last_block: list[BlockPath | None] = field(default_factory=list)
    part_blocks: list[list[BlockPath | None]] = field(default_factory=list)


def _paths(where: list[int | None], prefix: tuple[Any, ...], offset: int) -> list[BlockPath | None]:
    """Block paths of a message's parts once its blocks sit at ``offset`` of ``prefix``'s list (``where``: per
    part, its block's index among the message's blocks, from ``_content_blocks``)."""
    return [None if k is None else (*prefix, offset + k) for k in where]


def _last(paths: list[BlockPath | None]) -> BlockPath | None:
    return next((p for p in reversed(paths) if p is not None), None)


class UnsupportedContentError(InvalidRequestError):
    """A message part the target protocol cannot carry (e.g. audio for Anthropic, a server tool for OpenAI)."""


def part_to_block(part: Any, param: str) -> dict[str, Any]:
    """One OpenAI content part -> one Anthropic block.

    Raises:
        UnsupportedContentError: a part type Anthropic has no block for (``input_audio``, ``file``).
    """
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise _bad(f"expected a content part object, got {_kind(part)}", param)
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", ""), **_extras(part, {"type", "text"})}
    if kind == "refusal":
        return {"type": "text", "text": part.get("refusal", "")}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise _bad("image_url needs a url", f"{param}.image_url.url")
        extra = _extras(part, {"type", "image_url"})
        if url.startswith("data:"):
            header, _, data = url[5:].partition(",")
            media_type, _, encoding = header.partition(";")
            if encoding != "base64" or not data:
                raise UnsupportedContentError(
                    "Only base64 data: URLs can be sent as Anthropic images.", param=f"{param}.image_url.url"
                )
            return {
                "type": "image",
                "source": {"type": "base64", "media_type": media_type, "data": data},
                **extra,
            }
        return {"type": "image", "source": {"type": "url", "url": url}, **extra}
    if kind == OPAQUE and isinstance(part.get("block"), dict):
        return copy.deepcopy(part["block"])
    raise UnsupportedContentError(
        f"Content part type {kind!r} cannot be sent to an Anthropic model.", param=f"{param}.type"
    )


def _content_blocks(content: Any, param: str) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The Anthropic blocks of an OpenAI ``content``, and per part the index of its block (None: no block).

    An empty text part becomes no block: the Messages API refuses empty text blocks, and a rule that hoists a
    whole part (a system block holding only ``Current date: ...``) leaves one behind. Its ``cache_control``
    moves to the block before it, which ends the same prefix, unless that block has its own.
    """
    if content is None:
        return [], []
    if isinstance(content, str):
        return ([{"type": "text", "text": content}], [0]) if content else ([], [None])
    if not isinstance(content, list):
        raise _bad(f"expected a string or an array of parts, got {_kind(content)}", param)
    blocks: list[dict[str, Any]] = []
    where: list[int | None] = []
    for j, part in enumerate(content):
        block = part_to_block(part, f"{param}[{j}]")
        if block["type"] == "text" and not block["text"]:
            if "cache_control" in block and blocks and "cache_control" not in blocks[-1]:
                blocks[-1]["cache_control"] = block["cache_control"]
            where.append(None)
            continue
        where.append(len(blocks))
        blocks.append(block)
    return blocks, where


def _tool_result_block(message: Mapping[str, Any], param: str) -> dict[str, Any]:
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.get("tool_call_id")}
    if not isinstance(block["tool_use_id"], str) or not block["tool_use_id"]:
        raise _bad("tool messages need a tool_call_id", f"{param}.tool_call_id")
    if isinstance(content, list):
        block["content"], _ = _content_blocks(content, f"{param}.content")
    elif content is not None:
        block["content"] = content if isinstance(content, str) else str(content)
    block.update(_extras(message, {"role", "content", "tool_call_id", "name"}))
    return block


def _tool_use_block(call: Any, param: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _bad("expected {'id', 'type': 'function', 'function': {'name', 'arguments'}}", param)
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise _bad("function.arguments is not valid JSON", f"{param}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise _bad("function.arguments must be a JSON object", f"{param}.function.arguments")
    block = {
        "type": "tool_use",
        "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
        "name": function.get("name", ""),
        "input": parsed,
    }
    block.update(_extras(call, {"id", "type", "function", "index"}))
    return block


def openai_to_anthropic(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> AnthropicPrompt:
    """Canonical OpenAI-shaped messages/tools -> Anthropic ``system`` / ``messages`` / ``tools``.

    Leading ``system``/``developer`` messages become the top-level ``system`` (one string message stays a
    string); a later one becomes text in a user turn (Anthropic has no mid-conversation system role; moving it
    to the top would put volatile text in front of the cached prefix). ``tool`` messages become
    ``tool_result`` blocks of one user turn, together with the user message right after them. Other turns
    keep their boundaries (the API merges consecutive same-role turns itself).

    Raises:
        InvalidRequestError / UnsupportedContentError: content Anthropic cannot carry.
    """
    prompt = AnthropicPrompt(last_block=[None] * len(messages), part_blocks=[[] for _ in messages])
    index = 0
    system_blocks: list[dict[str, Any]] = []
    system_string: str | None = None
    while index < len(messages) and messages[index].get("role") in ("system", "developer"):
        content = messages[index].get("content")
        if (
            isinstance(content, str)
            and index == 0
            and (len(messages) == 1 or messages[1].get("role") not in ("system", "developer"))
        ):
            system_string = content
            prompt.part_blocks[index] = [("system", 0) if content else None]
        else:
            blocks, where = _content_blocks(content, f"messages[{index}].content")
            for block in blocks:
                if block.get("type") != "text":
                    raise UnsupportedContentError(
                        "System messages sent to an Anthropic model may only hold text.",
                        param=f"messages[{index}].content",
                    )
            prompt.part_blocks[index] = _paths(where, ("system",), len(system_blocks))
            system_blocks.extend(blocks)
        prompt.last_block[index] = _last(prompt.part_blocks[index])
        index += 1
    prompt.system = system_string or system_blocks or None  # an empty system prompt is sent as none

    out = prompt.messages
    pending_tool_results = False  # the last user turn was opened by tool messages
    for i in range(index, len(messages)):
        message = messages[i]
        role = message.get("role")
        param = f"messages[{i}]"
        if role == "tool":
            block = _tool_result_block(message, param)
            if pending_tool_results:
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
                pending_tool_results = True
            prompt.last_block[i] = ("messages", len(out) - 1, len(out[-1]["content"]) - 1)
            continue  # a tool result is one block: no part inside it can end a segment
        content = message.get("content")
        if role in ("system", "developer", "user"):
            blocks, where = _content_blocks(content, f"{param}.content")
            keep_string = role == "user" and isinstance(content, str) and not pending_tool_results
            if pending_tool_results:
                offset = len(out[-1]["content"])
                out[-1]["content"].extend(blocks)
            else:
                offset = 0
                out.append({"role": "user", "content": content if keep_string else blocks})
        elif role == "assistant":
            blocks, where = _content_blocks(content, f"{param}.content")
            calls = message.get("tool_calls") or []
            uses = [_tool_use_block(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(calls)]
            offset = 0
            out.append(
                {
                    "role": "assistant",
                    "content": content if not calls and isinstance(content, str) else blocks + uses,
                }
            )
        else:
            raise _bad(f"unsupported role {role!r}", f"{param}.role")
        pending_tool_results = False
        turn = len(out) - 1
        prompt.part_blocks[i] = _paths(where, ("messages", turn), offset)
        last_content = out[-1]["content"]
        if isinstance(last_content, str):
            prompt.last_block[i] = ("messages", turn, 0)
        elif len(last_content) > offset:
            prompt.last_block[i] = ("messages", turn, len(last_content) - 1)
    prompt.tools = openai_to_anthropic_tools(tools)
    return prompt


def openai_to_anthropic_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI function tools -> Anthropic tools (``x-anthropic`` extras and opaque server tools restored).

    Raises:
        UnsupportedContentError: a tool that is neither a function nor an opaque Anthropic tool.
    """
    if tools is None:
        return None
    out = []
    for j, tool in enumerate(tools):
        if tool.get("type") == OPAQUE and isinstance(tool.get("tool"), dict):
            out.append(copy.deepcopy(tool["tool"]))
            continue
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise UnsupportedContentError(
                f"Tool type {tool.get('type')!r} cannot be sent to an Anthropic model.",
                param=f"tools[{j}].type",
            )
        entry: dict[str, Any] = {"name": function.get("name", "")}
        if function.get("description") is not None:
            entry["description"] = function["description"]
        entry["input_schema"] = copy.deepcopy(
            function.get("parameters") or {"type": "object", "properties": {}}
        )
        if isinstance(tool.get(OPAQUE), dict):
            entry.update(copy.deepcopy(tool[OPAQUE]))
        if "cache_control" in tool:
            entry["cache_control"] = copy.deepcopy(tool["cache_control"])
        out.append(entry)
    return out


def openai_to_anthropic_tool_choice(
    choice: Any, parallel_tool_calls: bool | None = None
) -> dict[str, Any] | None:
    """OpenAI ``tool_choice`` (+ ``parallel_tool_calls``) -> Anthropic ``tool_choice`` (None = leave unset)."""
    result: dict[str, Any] | None
    if choice is None:
        result = None
    elif choice == "auto":
        result = {"type": "auto"}
    elif choice == "required":
        result = {"type": "any"}
    elif choice == "none":
        result = {"type": "none"}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        result = {"type": "tool", "name": choice["function"].get("name", "")}
    else:
        raise _bad("expected 'auto', 'required', 'none' or {'type': 'function', ...}", "tool_choice")
    if parallel_tool_calls is False:
        result = dict(result or {"type": "auto"})
        if result["type"] != "none":
            result["disable_parallel_tool_use"] = True
    return result


_PLAIN_PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}}


def plain_messages(messages: list[dict[str, Any]], target: str = "this") -> list[dict[str, Any]]:
    """Messages of an Anthropic-face request for a backend that is not Anthropic (an OpenAI-compatible server,
    the embedded engine): without what the translation carries along (Anthropic-only part keys such as
    ``cache_control`` and ``citations``; ``is_error`` and ``cache_control`` of tool messages; tool-call
    extras), thinking blocks dropped (the model cannot use another model's thinking).

    Raises:
        UnsupportedContentError: an Anthropic-only block other than thinking (document, server tool result, ...).
    """
    out = []
    for i, message in enumerate(messages):
        clean = {k: v for k, v in message.items() if k not in ("is_error", "cache_control")}
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    parts.append(part)
                    continue
                kind = part.get("type")
                if kind == OPAQUE:
                    block = part.get("block") or {}
                    if block.get("type") in THINKING_TYPES:
                        continue
                    raise UnsupportedContentError(
                        f"A {block.get('type')!r} content block cannot be sent to {target} model.",
                        param=f"messages[{i}].content[{j}]",
                    )
                keys = _PLAIN_PART_KEYS.get(kind)
                parts.append({k: v for k, v in part.items() if k in keys} if keys else part)
            if message.get("role") == "assistant" and not parts:
                clean["content"] = None
            elif message.get("role") == "tool" and all(p.get("type") == "text" for p in parts):
                clean["content"] = "".join(p.get("text", "") for p in parts)  # tool content: text only
            else:
                clean["content"] = parts
        if message.get("tool_calls"):
            clean["tool_calls"] = [
                {k: v for k, v in call.items() if k in ("id", "type", "function")}
                for call in message["tool_calls"]
            ]
        out.append(clean)
    return out


def plain_tools(tools: list[dict[str, Any]] | None, target: str = "this") -> list[dict[str, Any]] | None:
    """Function tools without the ``x-anthropic`` extras. Raises ``UnsupportedContentError`` on server tools."""
    if tools is None:
        return None
    out = []
    for j, tool in enumerate(tools):
        if tool.get("type") == OPAQUE:
            name = (tool.get("tool") or {}).get("type")
            raise UnsupportedContentError(
                f"The Anthropic server tool {name!r} cannot be used with {target} model.",
                param=f"tools[{j}]",
            )
        out.append({k: v for k, v in tool.items() if k not in (OPAQUE, "cache_control")})
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ==== usage and responses =====================================================================================


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
    """Anthropic usage -> BackendUsage (``prompt_tokens`` = input + cache read + cache write)."""
    read = int(usage.get("cache_read_input_tokens") or 0)
    written = int(usage.get("cache_creation_input_tokens") or 0)
    return BackendUsage(
        prompt_tokens=int(usage.get("input_tokens") or 0) + read + written,
        completion_tokens=int(usage.get("output_tokens") or 0),
        cached_tokens=read,
        cache_creation_tokens=written,
        counted_by=counted_by,
    )


def message_id(request_id: str) -> str:
    """A ``msg_`` id for a response."""
    return "msg_" + (request_id.replace("-", "")[:24] or uuid.uuid4().hex[:24])


def stop_fields(finish: Finish) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a Finish: an upstream Anthropic reason wins; a matched stop string
    (``extra["stop_sequence"]``) gives ``stop_sequence``."""
    native = finish.extra.get("anthropic_stop_reason")
    sequence = finish.extra.get("stop_sequence")
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
        """The finished blocks; tool inputs parsed from their JSON (``{}`` when it is empty or cut short)."""
        out = []
        for i, block in enumerate(self.blocks):
            block = dict(block)
            if block["type"] == "tool_use":
                raw = self._tool_json.get(i, "")
                try:
                    parsed = json.loads(raw) if raw else {}
                except ValueError:
                    parsed = {}
                block["input"] = parsed if isinstance(parsed, dict) else {}
            out.append(block)
        return out


@dataclass(frozen=True)
class NativeDelta(Delta):
    """A Delta that also carries the upstream's own Anthropic events, which this face relays verbatim (an
    Anthropic upstream answering an Anthropic-face request). ``text`` / ``tool_calls`` mirror the events in
    OpenAI's shape so the protocol-independent bookkeeping (TTFT) works unchanged; the ``Finish`` that follows
    has ``extra["native"] = True`` and adds no event of its own. For a non-streamed request ``events`` holds one
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


class StreamFormatter:
    """Backend events -> Anthropic SSE bytes, in Anthropic's event order.

    ``message_start`` carries ``usage`` with ``input_tokens`` 0 (backends report usage at the end); the final
    ``message_delta`` carries the whole usage (the SDKs overwrite the start's counts with it).
    """

    def __init__(self, model: str, request_id: str) -> None:
        self.model = model
        self.id = message_id(request_id)
        self.builder = MessageBuilder()
        self._open: int | None = None
        self._pinged = False
        self.started = False
        self.finish: Finish | None = None

    def start(self) -> bytes:
        """The ``message_start`` event."""
        self.started = True
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        return encode_event({"type": "message_start", "message": message}, "message_start")

    def feed(self, event: Delta | Finish) -> bytes:
        """SSE bytes for one backend event (``message_start`` first if not sent yet)."""
        out = b"" if self.started else self.start()
        if isinstance(event, Finish):
            return out + self._finish(event)
        for step, index, value in self.builder.add(event):
            if step == "start":
                out += self._stop_open()
                out += encode_event(
                    {"type": "content_block_start", "index": index, "content_block": value},
                    "content_block_start",
                )
                self._open = index
                if not self._pinged:
                    out += encode_event({"type": "ping"}, "ping")
                    self._pinged = True
            elif step == "text":
                out += encode_event(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": value},
                    },
                    "content_block_delta",
                )
            else:
                out += encode_event(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": value},
                    },
                    "content_block_delta",
                )
        return out

    def _stop_open(self) -> bytes:
        if self._open is None:
            return b""
        index, self._open = self._open, None
        return encode_event({"type": "content_block_stop", "index": index}, "content_block_stop")

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


# ==== HTTP =================================================================================================

FORWARDED_HEADERS = ("anthropic-beta",)
"""Client headers an Anthropic upstream receives too (set on ``ChatRequest.forward_headers``)."""


def apply_request_headers(request: ChatRequest, headers: Mapping[str, str]) -> None:
    """Set what the client's headers ask for on a parsed request: ``rules_enabled`` (``x-prefixgate-rules``),
    ``tenant`` (``x-prefixgate-tenant``) and ``forward_headers`` (``FORWARDED_HEADERS``).

    Raises:
        InvalidRequestError: a bad ``x-prefixgate-rules`` value or an over-long tenant.
    """
    # canonical pulls in the rules engine: imported here, so the helpers above stay importable on their own
    from gateway.canonical import rules_enabled
    from gateway.openai_face import tenant

    request.rules_enabled = rules_enabled(headers)
    request.tenant = tenant(headers)
    request.forward_headers = {name: headers[name] for name in FORWARDED_HEADERS if name in headers}


async def message_sse(opened: OpenedStream) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed Message from a ``gateway.pipeline.OpenedStream``: native events relayed,
    other backends' events formatted; an error after the start becomes an ``error`` event that ends the stream."""
    request = opened.request
    formatter = StreamFormatter(request.model, request.request_id)
    async with aclosing(opened.guarded_events(formatter.error)) as events:
        async for event in events:
            if isinstance(event, bytes):
                yield event  # the error event, already encoded by formatter.error
            elif isinstance(event, NativeDelta):
                formatter.started = True
                for raw in event.events:
                    yield encode_event(relay_event(raw, request.model), str(raw.get("type", "message")))
            elif isinstance(event, Finish) and event.extra.get("native"):
                continue
            else:
                yield formatter.feed(event)


async def collect_message(opened: OpenedStream) -> dict[str, Any]:
    """The Message JSON of a non-streamed request (see ``build_message``)."""
    request = opened.request
    message, _ = await build_message(opened.events(), request.model, request.request_id)
    return message


async def messages_endpoint(http_request: Request) -> Response:
    """``POST /v1/messages``: the Anthropic Messages API over every backend.

    Services come from ``request.app.state.gateway`` (``gateway.state.Gateway``) through
    ``gateway.pipeline``: rules, prefix key, routing, stats and the request log are the pipeline's; errors
    before the response starts propagate to the app's handler, which answers Anthropic error JSON on this path.
    Headers: ``x-prefixgate-rules: on|off``, ``x-prefixgate-tenant`` (cache salt), ``anthropic-beta``
    (forwarded to Anthropic upstreams).
    """
    # The pipeline pulls in the rules engine: imported here, so the translation helpers above stay importable
    # by the backends on their own.
    from gateway.pipeline import begin, open_stream, request_id_of, run_unless_disconnected
    from gateway.state import gateway_of

    gateway = gateway_of(http_request)
    body = await read_json_object(http_request, gateway.config.server.max_body_bytes)
    request = parse_messages_body(body, request_id=request_id_of(http_request))
    apply_request_headers(request, http_request.headers)
    begin(http_request, request)
    opened = await open_stream(gateway, request, http_request)
    headers = {"request-id": request.request_id, "x-request-id": request.request_id}
    if request.stream:
        return EventStreamResponse(message_sse(opened), headers=headers)
    message = await run_unless_disconnected(http_request, collect_message(opened), opened)
    return JSONResponse(message, headers=headers)


def routes() -> list[BaseRoute]:
    """This face's route table (``gateway.app`` collects it)."""
    return [Route("/v1/messages", messages_endpoint, methods=["POST"])]
