"""Validation of Anthropic Messages request bodies: field types, ranges, content blocks, tools,
``tool_choice``, ``cache_control``. Raises ``InvalidRequestError`` naming the offending ``param``; accepts
exactly what the Messages API documents (https://docs.anthropic.com/en/api/messages). Pure functions, no I/O.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gateway.core.errors import InvalidRequestError
from gateway.core.json_types import json_kind

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


_TOOL_RESULT_BLOCKS = frozenset({"text", "image", "document", "search_result"})
_CACHE_TTLS = frozenset({"5m", "1h"})
_TOOL_CHOICE_TYPES = frozenset({"auto", "any", "tool", "none"})
MESSAGES_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature",
        "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers",
        "context_management", "output_config", "output_format", "cache_control", "inference_geo",
        "diagnostics", "speed", "user_profile_id", "workspace_id",
    }
)  # fmt: skip
"""Top-level fields of a Messages body (https://docs.anthropic.com/en/api/messages); any other is refused as
Anthropic refuses it ("Extra inputs are not permitted") unless ``server.unknown_fields: ignore``."""

COUNT_TOKENS_FIELDS = frozenset(
    {
        "model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "output_config",
        "speed", "user_profile_id", "workspace_id",
        # the beta count endpoint's (anthropic-beta): MCP connector, context editing, structured outputs
        "mcp_servers", "context_management", "output_format",
    }
)  # fmt: skip
"""Top-level fields of a ``/v1/messages/count_tokens`` body
(https://docs.anthropic.com/en/api/messages-count-tokens): what shapes the prompt, not the generation. The
Messages-only rest (``max_tokens``, ``stream``, ``temperature``, ``metadata``, ``service_tier``...) is refused
as any unknown field is, unless ``server.unknown_fields: ignore``."""


EMPTY_MESSAGE = "all messages must have non-empty content except for the optional final assistant message"
"""Anthropic's 400 for a message whose ``content`` is ``""`` or ``[]`` (a final assistant turn, a prefill, may
be empty)."""

EMPTY_TEXT_BLOCK = "text content blocks must be non-empty"
"""Anthropic's 400 for a ``{"type": "text", "text": ""}`` block in a message or in ``system``."""

BLANK_TEXT_BLOCK = "text content blocks must contain non-whitespace text"
"""Anthropic's 400 for a text block of whitespace only."""

TRAILING_WHITESPACE = "final assistant content cannot end with trailing whitespace"
"""Anthropic's 400 for a prefill (a final assistant turn) whose text ends in whitespace."""

USER_ID_CHARS = 256
"""The longest ``metadata.user_id`` the Messages API takes (its reference: ``maxLength`` 256)."""

SERVICE_TIERS = ("auto", "standard_only")
"""The Messages API's ``service_tier`` values."""


# ==== validation ============================================================================================


def bad_param(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param, code="invalid_value")


def _require_str(value: Any, param: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise bad_param(f"expected a string, got {json_kind(value)}", param)
    if not allow_empty and not value:
        raise bad_param("must not be empty", param)
    return value


def _number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_param(f"expected a number, got {json_kind(value)}", param)
    if not low <= value <= high:
        raise bad_param(f"expected a number in [{low}, {high}], got {value}", param)
    return float(value)


def _integer(value: Any, param: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(f"expected an integer, got {json_kind(value)}", param)
    if value < low:
        raise bad_param(f"expected an integer >= {low}, got {value}", param)
    return value


MESSAGE_ROLES = ("user", "assistant", "system")
"""Roles of ``messages``: ``system`` is a mid-conversation system message (the Messages API's
``mid-conversation-system-2026-04-07`` beta; Claude Code puts its agent list in one on every request), text only;
it is the OpenAI shape's later system message inside the gateway."""


def validate_cache_control(value: Any, param: str) -> None:
    """``{"type": "ephemeral", "ttl"?: "5m" | "1h"}``. Raises ``InvalidRequestError``."""
    if not isinstance(value, dict):
        raise bad_param(f"expected an object, got {json_kind(value)}", param)
    if value.get("type") != "ephemeral":
        raise bad_param("type must be 'ephemeral'", f"{param}.type")
    if "ttl" in value and (not isinstance(value["ttl"], str) or value["ttl"] not in _CACHE_TTLS):
        raise bad_param("ttl must be '5m' or '1h'", f"{param}.ttl")


def _check_text(block: dict[str, Any], param: str) -> None:
    """A text block's text is not empty and not whitespace only (Anthropic's two 400s)."""
    if block["type"] != "text":
        return
    if not block["text"]:
        raise bad_param(EMPTY_TEXT_BLOCK, param)
    if not block["text"].strip():
        raise bad_param(BLANK_TEXT_BLOCK, param)


def _check_tool_use_ids(messages: list[Any]) -> None:
    """Every ``tool_use`` id of the conversation is used once (Anthropic: "tool_use ids must be unique")."""
    seen: dict[str, str] = {}
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") != "assistant" or not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            if block.get("type") != "tool_use":
                continue
            where = f"messages[{i}].content[{j}].id"
            if block["id"] in seen:
                raise bad_param(
                    f"tool_use ids must be unique: {block['id']!r} is also {seen[block['id']]}", where
                )
            seen[block["id"]] = where


def _validate_block(block: Any, param: str, role: str) -> None:
    if not isinstance(block, dict):
        raise bad_param(f"expected a content block object, got {json_kind(block)}", param)
    kind = block.get("type")
    if not isinstance(kind, str) or not kind:
        raise bad_param("content block needs a string 'type'", f"{param}.type")
    if "cache_control" in block:
        validate_cache_control(block["cache_control"], f"{param}.cache_control")
    if kind == "text":
        _require_str(block.get("text"), f"{param}.text")
    elif kind == "image":
        source = block.get("source")
        if not isinstance(source, dict):
            raise bad_param("image block needs a 'source' object", f"{param}.source")
        stype = source.get("type")
        if stype == "base64":
            _require_str(source.get("media_type"), f"{param}.source.media_type", allow_empty=False)
            _require_str(source.get("data"), f"{param}.source.data", allow_empty=False)
        elif stype == "url":
            _require_str(source.get("url"), f"{param}.source.url", allow_empty=False)
        elif stype != "file":
            raise bad_param("image source type must be 'base64', 'url' or 'file'", f"{param}.source.type")
    elif kind == "tool_use":
        if role != "assistant":
            raise bad_param("tool_use blocks belong to assistant messages", param)
        _require_str(block.get("id"), f"{param}.id", allow_empty=False)
        _require_str(block.get("name"), f"{param}.name", allow_empty=False)
        if not isinstance(block.get("input"), dict):
            raise bad_param(f"expected an object, got {json_kind(block.get('input'))}", f"{param}.input")
    elif kind == "tool_result":
        if role != "user":
            raise bad_param("tool_result blocks belong to user messages", param)
        _require_str(block.get("tool_use_id"), f"{param}.tool_use_id", allow_empty=False)
        content = block.get("content", "")
        if isinstance(content, list):
            for j, inner in enumerate(content):
                _validate_block(inner, f"{param}.content[{j}]", "user")
                if inner["type"] not in _TOOL_RESULT_BLOCKS:
                    raise bad_param(
                        f"tool_result content cannot hold a {inner['type']!r} block", f"{param}.content[{j}]"
                    )
        elif not isinstance(content, str):
            raise bad_param(
                f"expected a string or an array of blocks, got {json_kind(content)}", f"{param}.content"
            )
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise bad_param("expected a boolean", f"{param}.is_error")


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""A custom tool's name: ``^[a-zA-Z0-9_-]{1,128}$``, the Messages API reference's pattern (the tool-use guide
asks for at most 64 characters; the API takes 128)."""


def _check_tool_results(messages: list[Any]) -> None:
    """Each ``tool_result`` block answers a ``tool_use`` block of the message just before (an assistant turn),
    by its ``id``, and each ``tool_use`` block of an assistant turn that has a next message is answered there,
    as Anthropic requires (a final assistant turn, a prefill, is left alone). The ``tool_result`` blocks of a
    message come before any other block of it (Anthropic's tool-use guide: text goes after all tool results;
    the API answers 400 otherwise)."""
    for i, message in enumerate(messages):
        content = message["content"]
        previous = messages[i - 1] if i > 0 else None
        blocks = previous["content"] if previous is not None and previous["role"] == "assistant" else []
        used = [b["id"] for b in blocks if isinstance(b, dict) and b["type"] == "tool_use"]
        answered = set()
        other_first: int | None = None  # the first block that is not a tool_result
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if block["type"] != "tool_result":
                if other_first is None:
                    other_first = j
                continue
            if other_first is not None:
                raise bad_param(
                    f"tool_result blocks must come first in a message's content: messages[{i}].content"
                    f"[{other_first}] is a {content[other_first]['type']!r} block before this tool_result "
                    "(any text goes after all tool results)",
                    f"messages[{i}].content[{j}]",
                )
            if block["tool_use_id"] not in used:
                raise bad_param(
                    f"unexpected tool_use_id {block['tool_use_id']!r} in a tool_result block: each tool_result "
                    "block must answer a tool_use block of the previous (assistant) message",
                    f"messages[{i}].content[{j}].tool_use_id",
                )
            answered.add(block["tool_use_id"])
        missing = [tool_use_id for tool_use_id in used if tool_use_id not in answered]
        if missing:
            raise bad_param(
                f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(missing)}. "
                "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                f"messages[{i - 1}]",
            )


def _check_prefill_end(messages: list[Any]) -> None:
    """A final assistant turn (a prefill) may not end in whitespace, as Anthropic requires: the model would go
    on after a space it would have written itself (found by a trial: accepted, the answer began with a second
    space). Checked on its text, or its last block when that is a text block."""
    last = messages[-1]
    if last["role"] != "assistant":
        return
    content = last["content"]
    if isinstance(content, list):
        content = content[-1].get("text") if content and content[-1]["type"] == "text" else None
    if isinstance(content, str) and content and content[-1].isspace():
        raise bad_param(TRAILING_WHITESPACE, f"messages[{len(messages) - 1}]")


def _validate_tool(tool: Any, param: str) -> None:
    if not isinstance(tool, dict):
        raise bad_param(f"expected a tool object, got {json_kind(tool)}", param)
    if "cache_control" in tool:
        validate_cache_control(tool["cache_control"], f"{param}.cache_control")
    _require_str(tool.get("name"), f"{param}.name", allow_empty=False)
    if tool.get("type", "custom") == "custom":
        if not TOOL_NAME.fullmatch(tool["name"]):
            raise bad_param(
                f"String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$', got {tool['name']!r}",
                f"{param}.name",
            )
        if "input_schema" not in tool:
            raise bad_param("Field required", f"{param}.input_schema")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_param(
                f"expected a JSON schema object, got {json_kind(schema)}", f"{param}.input_schema"
            )
        if "description" in tool:
            _require_str(tool["description"], f"{param}.description")


def _validate_tool_choice(choice: Any, tool_names: set[str]) -> None:
    if (
        not isinstance(choice, dict)
        or not isinstance(choice.get("type"), str)
        or choice["type"] not in _TOOL_CHOICE_TYPES
    ):
        raise bad_param("expected {'type': 'auto' | 'any' | 'tool' | 'none', ...}", "tool_choice")
    if choice["type"] == "tool":
        name = _require_str(choice.get("name"), "tool_choice.name", allow_empty=False)
        if tool_names and name not in tool_names:
            raise bad_param(f"names a tool that is not in tools: {name!r}", "tool_choice.name")
    if "disable_parallel_tool_use" in choice and not isinstance(choice["disable_parallel_tool_use"], bool):
        raise bad_param("expected a boolean", "tool_choice.disable_parallel_tool_use")


def validate_body(
    body: Any,
    require_max_tokens: bool = True,
    refuse_unknown: bool = True,
    fields: frozenset[str] = MESSAGES_FIELDS,
) -> None:
    """Check a Messages request body (the fields prefixgate reads; other fields pass through untouched).

    Args:
        body: the parsed JSON body.
        require_max_tokens: False for ``/v1/messages/count_tokens`` bodies, which have no ``max_tokens``
            (one that is there is still checked).
        refuse_unknown: refuse a top-level field not in ``fields`` (else it passes through).
        fields: the endpoint's top-level fields (``MESSAGES_FIELDS``, or ``COUNT_TOKENS_FIELDS``).

    Raises:
        InvalidRequestError: with ``param`` naming the field (``messages[2].content[0].text``).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    if refuse_unknown:
        for key in body:
            if key not in fields:
                raise InvalidRequestError(
                    f"{key}: Extra inputs are not permitted", param=key, code="unknown_parameter"
                )
    if "model" not in body:
        raise bad_param("field required", "model")
    _require_str(body["model"], "model", allow_empty=False)
    if "max_tokens" in body:
        _integer(body["max_tokens"], "max_tokens", 1)
    elif require_max_tokens:
        raise bad_param("field required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_param(f"expected an array of messages, got {json_kind(messages)}", "messages")
    if not messages:
        raise bad_param("at least one message is required", "messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_param(f"expected a message object, got {json_kind(message)}", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise bad_param(f"role must be 'user', 'assistant' or 'system', got {role!r}", f"{param}.role")
        content = message.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                _validate_block(block, f"{param}.content[{j}]", role)
                if role == "system" and block["type"] != "text":
                    raise bad_param("system messages hold text blocks only", f"{param}.content[{j}].type")
                _check_text(block, f"{param}.content[{j}].text")
        elif not isinstance(content, str):
            raise bad_param(
                f"expected a string or an array of content blocks, got {json_kind(content)}",
                f"{param}.content",
            )
        if not content and not (role == "assistant" and i == len(messages) - 1):
            raise bad_param(EMPTY_MESSAGE, param)
    _check_prefill_end(messages)
    _check_tool_results(messages)
    _check_tool_use_ids(messages)
    system = body.get("system")
    if isinstance(system, list):
        for j, block in enumerate(system):
            _validate_block(block, f"system[{j}]", "system")
            if block["type"] != "text":
                raise bad_param("system blocks must be text blocks", f"system[{j}].type")
            _check_text(block, f"system[{j}].text")
    elif system is not None and not isinstance(system, str):
        raise bad_param(f"expected a string or an array of text blocks, got {json_kind(system)}", "system")
    tools = body.get("tools")
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_param(f"expected an array of tools, got {json_kind(tools)}", "tools")
        for j, tool in enumerate(tools):
            _validate_tool(tool, f"tools[{j}]")
            if tool["name"] in names:
                raise bad_param(f"duplicate tool name {tool['name']!r}", f"tools[{j}].name")
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
            raise bad_param("expected an array of non-empty strings", "stop_sequences")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_param(f"expected a boolean, got {json_kind(body['stream'])}", "stream")
    if "cache_control" in body:
        validate_cache_control(body["cache_control"], "cache_control")
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        raise bad_param(
            f"expected one of {', '.join(repr(t) for t in SERVICE_TIERS)}, got {body['service_tier']!r}",
            "service_tier",
        )
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_param(f"expected an object, got {json_kind(metadata)}", "metadata")
        for key in metadata:
            if key != "user_id":
                raise bad_param("Extra inputs are not permitted", f"metadata.{key}")
        if metadata.get("user_id") is not None:
            _require_str(metadata["user_id"], "metadata.user_id")
            if len(metadata["user_id"]) > USER_ID_CHARS:
                raise bad_param(
                    f"String should have at most {USER_ID_CHARS} characters, got {len(metadata['user_id'])}",
                    "metadata.user_id",
                )
