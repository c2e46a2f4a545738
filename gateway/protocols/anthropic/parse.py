"""Anthropic Messages body -> ``ChatRequest`` (``anthropic_body`` set): messages and tools translated to the
OpenAI shape every backend reads; the original body kept in ``ChatRequest.anthropic_body`` for native
passthrough. Anthropic-only content rides along as opaque parts (``OPAQUE``); see docs/protocols.md for the
round trip.
Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.api import SamplingParams
from gateway.core.json_types import compact_json
from gateway.core.request import ChatRequest, given_sampling, nucleus_zero_as_greedy
from gateway.protocols.anthropic.validate import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS, validate_body

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


OPAQUE = "x-anthropic"
"""Part/tool type (and tool key) carrying Anthropic-only content through the OpenAI shape."""

THINKING_TYPES = frozenset({"thinking", "redacted_thinking"})


# ==== Anthropic -> OpenAI ===================================================================================


def extra_keys(obj: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in known}


def block_to_part(block: dict[str, Any]) -> dict[str, Any]:
    """One Anthropic content block (not tool_use / tool_result) -> one OpenAI content part."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": block["text"], **extra_keys(block, {"type", "text"})}
    if kind == "image" and block["source"].get("type") in ("base64", "url"):
        source = block["source"]
        if source["type"] == "base64":
            url = f"data:{source['media_type']};base64,{source['data']}"
        else:
            url = source["url"]
        return {"type": "image_url", "image_url": {"url": url}, **extra_keys(block, {"type", "source"})}
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
        if role == "system":  # a mid-conversation system message: text blocks
            out.append({"role": "system", "content": [block_to_part(b) for b in content]})
            continue
        if role == "assistant":
            parts: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            for block in content:
                if block["type"] == "tool_use":
                    call = {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": compact_json(block["input"])},
                    }
                    call.update(extra_keys(block, {"type", "id", "name", "input"}))
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
                tool_msg.update(extra_keys(block, {"type", "tool_use_id", "content"}))
                out.append(tool_msg)
            else:
                parts.append(block_to_part(block))
        if parts or not content:
            out.append({"role": "user", "content": parts})
    return out


def anthropic_to_openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools -> OpenAI function tools (server tools ride as ``{"type": "x-anthropic", "tool":
    ...}``; a tool's ``strict`` is also ``function.strict``, which the embedded engine honours)."""
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
        if isinstance(tool.get("strict"), bool):  # also kept among the extras, for an Anthropic upstream
            function["strict"] = tool["strict"]
        entry: dict[str, Any] = {"type": "function", "function": function}
        extra = extra_keys(tool, {"name", "description", "input_schema"})
        if extra:
            entry[OPAQUE] = extra
        out.append(entry)
    return out


def anthropic_to_openai_tool_choice(choice: Mapping[str, Any] | None) -> Any:
    """``{"type": auto|any|tool|none}`` -> ``"auto"`` / ``"required"`` / ``{"type": "function", ...}`` /
    ``"none"``."""
    if choice is None:
        return None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def parse_messages_body(
    body: Any,
    request_id: str = "",
    require_max_tokens: bool = True,
    refuse_unknown: bool = True,
    fields: frozenset[str] = MESSAGES_FIELDS,
) -> ChatRequest:
    """Validate a ``/v1/messages`` body and build the internal request (``rules_enabled``, ``tenant`` and
    ``forward_headers`` are the endpoint's to set from headers, see ``apply_request_headers``).

    Args:
        body: the parsed JSON body.
        request_id: the gateway's id (a ``msg_`` id is made from it when formatting).
        require_max_tokens: False for ``/v1/messages/count_tokens`` bodies (then ``params.max_tokens`` is None
            when the body has none).
        refuse_unknown: refuse an unknown top-level field (``server.unknown_fields: refuse``).
        fields: the endpoint's known top-level fields (``validate.COUNT_TOKENS_FIELDS`` for a count).

    Raises:
        InvalidRequestError: a missing or ill-typed field (``param`` names it).
    """
    validate_body(body, require_max_tokens, refuse_unknown, fields)
    stops = tuple(body.get("stop_sequences") or ())
    params = SamplingParams(
        max_tokens=body.get("max_tokens"),
        temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
        top_k=int(body["top_k"]) if body.get("top_k") is not None else 0,
        stop=stops,
    )
    params = nucleus_zero_as_greedy(params)
    metadata = body.get("metadata") or {}
    return ChatRequest(
        model=body["model"],
        messages=anthropic_to_openai_messages(body),
        params=params,
        tools=anthropic_to_openai_tools(body.get("tools")),
        tool_choice=anthropic_to_openai_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=parallel_tool_calls(body),
        stream=bool(body.get("stream", False)),
        include_usage=True,
        user=metadata.get("user_id"),
        anthropic_body=body,
        sampling_given=given_sampling(body),
        request_id=request_id or uuid.uuid4().hex,
        continue_final_message=is_prefill(body["messages"][-1]),
    )


def is_prefill(message: Mapping[str, Any]) -> bool:
    """Whether a final message is an assistant prefill the answer continues (Anthropic's semantics): an
    assistant turn with text and no ``tool_use``."""
    if message["role"] != "assistant":
        return False
    content = message["content"]
    if isinstance(content, str):
        return bool(content.strip())
    texts = [block.get("text", "") for block in content if block["type"] == "text"]
    return any(block["type"] == "tool_use" for block in content) is False and bool("".join(texts).strip())


COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
"""Anthropic's token counting endpoint (https://docs.anthropic.com/en/api/messages-count-tokens)."""

MESSAGES_ONLY_FIELDS = MESSAGES_FIELDS - COUNT_TOKENS_FIELDS
"""Fields of a Messages body that ``/v1/messages/count_tokens`` does not take (they shape the generation, not
the prompt): refused there as Anthropic refuses them; with ``server.unknown_fields: ignore`` they are checked
as ``/v1/messages`` checks them, then left out of the count and of an upstream's count request. Any other
field is sent on, as the Messages passthrough does."""


def parse_count_body(body: Any, request_id: str = "", refuse_unknown: bool = True) -> ChatRequest:
    """Validate a ``/v1/messages/count_tokens`` body (``COUNT_TOKENS_FIELDS``: a Messages body without the
    generation's fields) and build the internal request ``/v1/messages`` would build (not streamed).

    Raises:
        InvalidRequestError: a missing or ill-typed field (``param`` names it), as ``/v1/messages`` answers;
            a field the count endpoint does not take (``max_tokens``, ``stream``...: "Extra inputs are not
            permitted") unless ``refuse_unknown`` is False.
    """
    request = parse_messages_body(
        body,
        request_id=request_id,
        require_max_tokens=False,
        refuse_unknown=refuse_unknown,
        fields=COUNT_TOKENS_FIELDS,
    )
    request.stream = False
    return request


def parallel_tool_calls(body: Mapping[str, Any]) -> bool | None:
    """False when ``tool_choice.disable_parallel_tool_use`` is true (at most one tool call), else None."""
    choice = body.get("tool_choice")
    return False if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") else None


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
    from gateway.core.headers import rules_enabled, tenant

    request.rules_enabled = rules_enabled(headers)
    request.tenant = tenant(headers)
    request.forward_headers = {name: headers[name] for name in FORWARDED_HEADERS if name in headers}
