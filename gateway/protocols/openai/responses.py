"""OpenAI Responses API (``POST /v1/responses``), stateless: a Responses body -> the equivalent Chat Completions
body (parsed by ``gateway.protocols.openai.parse``, so the request takes the chat path: canonicalization, prefix
cache, every backend). Backend events -> the ``Response`` object or its stream of typed events is
``gateway.protocols.openai.response_builder``'s.

Supported: ``input`` as a string or a list of items (messages with ``input_text`` / ``output_text`` parts,
``function_call`` and ``function_call_output`` items; ``reasoning`` items are dropped: the models served here
read no earlier reasoning), ``instructions`` (a leading system message), function ``tools`` (``namespace`` tools
flattened into theirs, named ``<namespace>__<name>`` for the model and given back as ``name`` + ``namespace``)
and ``tool_choice``, ``text.format`` (as ``response_format``), ``max_output_tokens``, sampling, ``stream``;
hosted tools (``web_search``, ``file_search``, ``mcp``, ...) are dropped from what the model sees (logged at
info). Refused with a 400 naming the field: ``previous_response_id``, ``conversation``, ``store: true``,
``background: true``, ``prompt`` (all need stored state), ``custom`` and unknown tools, a ``tool_choice`` forcing
a hosted tool, item references. The tools' translation is ``gateway.protocols.openai.responses_tools``'s.
Reference: https://platform.openai.com/docs/api-reference/responses (shapes checked against the openai-python
SDK's ``types/responses``: ``Response``, ``ResponseTextDeltaEvent``, ``ResponseCompletedEvent``, ...).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.core.errors import InvalidRequestError
from gateway.protocols.openai.field_errors import check_enums, check_types, invalid_type
from gateway.protocols.openai.parse import CHAT_ENUMS
from gateway.protocols.openai.responses_params import MessageOrigin
from gateway.protocols.openai.responses_tools import (
    flat_tool_name,
    namespaced_tool_names,
    string_field,
    tool_choice_to_chat,
    tools_to_chat,
    unsupported,
)

RESPONSES_FIELDS = frozenset(
    {
        "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
        "stream", "stream_options", "metadata", "store", "previous_response_id", "parallel_tool_calls",
        "text", "reasoning", "truncation", "user", "include", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "safety_identifier", "service_tier", "background", "conversation", "prompt",
        "top_logprobs", "max_tool_calls", "access_programs", "background_options", "context_management",
        "image", "moderation", "client_metadata",
    }
)  # fmt: skip
"""Top-level fields of a Responses body: the openai-python SDK's ``responses.create`` arguments, and
``client_metadata`` (string values about the calling client, e.g. the OpenAI Codex CLI's
``x-codex-installation-id``; the SDK sends it through ``extra_body``), which is checked and then ignored (never
passed to the model nor echoed)."""


STATEFUL = ("previous_response_id", "conversation", "prompt", "context_management")
"""Fields that need response storage, which this gateway does not keep: refused when set."""

RESPONSES_TYPES: dict[str, str] = {
    "store": "a boolean", "background": "a boolean", "stream_options": "an object",
    "parallel_tool_calls": "a boolean", "prompt_cache_key": "a string", "safety_identifier": "a string",
    "prompt_cache_options": "an object", "moderation": "an object", "image": "an object",
    "access_programs": "an object", "background_options": "an object",
}  # fmt: skip
"""Responses fields passed on or ignored, typed as the openai-python SDK's ``ResponseCreateParams`` types them."""

PASSED_ON = ("temperature", "top_p", "metadata", "parallel_tool_calls", "user", "prompt_cache_key",
             "prompt_cache_retention", "safety_identifier", "service_tier")  # fmt: skip
"""Fields with the same name and meaning in a Chat Completions body."""


def responses_to_chat_body(body: dict[str, Any], refuse_unknown: bool = True) -> dict[str, Any]:
    """The Chat Completions body equivalent to a Responses body (``stream_options.include_usage`` set when
    streamed, so usage is always known).

    Raises:
        InvalidRequestError: an unknown field (when ``refuse_unknown``), a stateful field, an ill-typed value,
            an unsupported tool or input item; ``param`` names it in the Responses body's terms.
    """
    if refuse_unknown:
        for key in body:
            if key not in RESPONSES_FIELDS:
                raise InvalidRequestError(f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    check_types(body, RESPONSES_TYPES)
    _check_string_values(body, "client_metadata")
    for key in STATEFUL:
        if body.get(key) is not None:
            raise unsupported(key, "prefixgate's Responses API is stateless (no stored responses)")
    if body.get("store") is True:
        raise unsupported("store", "prefixgate stores no responses; send store: false or omit it")
    if body.get("background") is True:
        raise unsupported("background", "background responses need stored state")
    if "input" not in body:
        raise InvalidRequestError(
            "Missing required parameter: 'input'.", param="input", code="missing_required_parameter"
        )
    check_enums(body, RESPONSES_ENUMS)
    _check_int(body, "max_tool_calls")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    if "model" not in body:
        del chat["model"]  # parse_chat_request names it missing
    for key in PASSED_ON:
        if key in body:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if "stream" in body:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    tools: list[dict[str, Any]] = []
    if body.get("tools") is not None:
        tools = tools_to_chat(body["tools"])
        if tools:  # the Responses API takes an empty array (agent SDKs send one); chat refuses it
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        choice = tool_choice_to_chat(body["tool_choice"], tools, namespaced_tool_names(body))
        if not tools and body.get("tools") and choice == "required":
            raise unsupported(
                "tool_choice",
                "'required' forces a tool call, but every tool sent is a hosted tool prefixgate cannot run "
                "(hosted tools are dropped from the request)",
            )
        if tools or not body.get("tools") or choice not in ("auto", "none"):
            chat["tool_choice"] = choice  # "auto" / "none" over hosted tools alone: no tools left to choose
    _text_config(body.get("text"), chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid_type("reasoning", "an object", reasoning)
        _known_keys(reasoning, "reasoning", ("effort", "summary", "generate_summary"))
        for key in ("summary", "generate_summary"):
            check_enums({f"reasoning.{key}": reasoning.get(key)}, {f"reasoning.{key}": SUMMARIES})
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    top_asked = body.get("top_logprobs") not in (None, 0)  # 0 alternatives alone ask for nothing
    include = _include(body)  # checked whether or not top_logprobs already asks for logprobs
    if top_asked or LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
        top = body.get("top_logprobs")
        chat["top_logprobs"] = 0 if top is None else top
    return chat


RESPONSES_ENUMS: dict[str, tuple[str, ...]] = {
    **CHAT_ENUMS,
    "truncation": ("auto", "disabled"),
}
"""String fields of a Responses body with a closed set of values (``truncation``: with ``auto`` a prompt that does
not fit is tried again without its oldest input items, ``gateway.protocols.openai.responses_truncation``)."""

SUMMARIES = ("auto", "concise", "detailed")
"""Values of ``reasoning.summary``: accepted and echoed; the models served here produce no reasoning items, so
there is nothing to summarise."""

INCLUDE_VALUES = (
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
)
"""The ``include`` values of OpenAI's API reference. Only the first adds anything here (the answer's token
logprobs); the others name items this gateway never produces (no built-in tools, no reasoning items), so they
include nothing."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the answer text's token logprobs (``output_text.logprobs``); so does a
``top_logprobs`` above 0 (0 alternatives per token when only ``include`` asks; ``top_logprobs: 0`` alone asks
for nothing)."""


def _include(body: dict[str, Any]) -> list[str]:
    """The ``include`` list (empty when absent).

    Raises:
        InvalidRequestError: not an array of strings (``invalid_type``, param ``include`` / ``include[i]``).
    """
    include = body.get("include")
    if include is None:
        return []
    if not isinstance(include, list):
        raise invalid_type("include", "an array of strings", include)
    for index, value in enumerate(include):
        if not isinstance(value, str):
            raise invalid_type(f"include[{index}]", "a string", value)
        if value not in INCLUDE_VALUES:
            raise InvalidRequestError(
                f"Invalid value for 'include[{index}]': {json.dumps(value)}. Supported values are: "
                + ", ".join(f"'{v}'" for v in INCLUDE_VALUES)
                + ".",
                param=f"include[{index}]",
                code="invalid_value",
            )
    return include


def _check_string_values(body: dict[str, Any], key: str) -> None:
    """``body[key]``, when present and not null, is an object of string values (``invalid_type`` otherwise,
    param ``key`` or ``key.<name>``)."""
    value = body.get(key)
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid_type(key, "an object", value)
    for name, item in value.items():
        if not isinstance(item, str):
            raise invalid_type(f"{key}.{name}", "a string", item)


def _known_keys(value: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    for key in value:
        if key not in known:
            raise InvalidRequestError(
                f"Unknown parameter: '{where}.{key}'.", param=f"{where}.{key}", code="unknown_parameter"
            )


def _check_int(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise invalid_type(key, "a non-negative integer", value)


def chat_message_origins(body: dict[str, Any]) -> list[MessageOrigin]:
    """Where each message of the chat body ``responses_to_chat_body`` builds came from in the Responses body
    (``instructions``, ``input`` or one input item), index for index, so an error the chat path raises about
    ``messages[k]...`` can name the client's own field (``gateway.protocols.openai.responses_params``).

    Raises:
        InvalidRequestError: as ``responses_to_chat_body`` does for a bad ``input`` or ``instructions``.
    """
    origins: list[MessageOrigin] = []
    _messages(body, origins)
    return origins


def _messages(body: dict[str, Any], origins: list[MessageOrigin] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a Responses body; ``origins``, when given, gets one ``MessageOrigin`` per message."""
    messages: list[dict[str, Any]] = []
    origins = [] if origins is None else origins
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_type("instructions", "a string", instructions)
        messages.append({"role": "system", "content": instructions})
        origins.append(MessageOrigin("instructions", "instructions"))
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        origins.append(MessageOrigin("input", "input_text"))
        return messages
    open_calls: set[str] | None = None  # call ids of the open function_call run; None: no such run
    unanswered: dict[str, str] = {}  # the open run's call ids no output answered yet -> their item's path
    if not isinstance(items, list):
        raise invalid_type("input", "a string or an array of input items", items)
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid_type(where, "an object", item)
        kind = item.get("type", "message")
        starts_turn = kind == "message" or (kind == "function_call" and not _continues_calls(messages))
        if starts_turn and unanswered:
            call_id, call_where = next(iter(unanswered.items()))
            raise InvalidRequestError(
                f"No tool output found for function call {call_id}: each function_call item needs its "
                "function_call_output item before the next message or turn.",
                param=f"{call_where}.call_id",
                code="invalid_value",
            )
        if kind == "message":
            messages.append(_message(item, where))
            origins.append(MessageOrigin(where, "message"))
            open_calls = None
        elif kind == "reasoning":
            _reasoning_item(item, where)  # the models served here read no earlier reasoning: dropped
        elif kind == "function_call":
            name = string_field(item, "name", where)
            namespace = item.get("namespace")
            if namespace is not None:
                if not isinstance(namespace, str):
                    raise invalid_type(f"{where}.namespace", "a string", namespace)
                name = flat_tool_name(namespace, name)
            call = {
                "id": string_field(item, "call_id", where),
                "type": "function",
                "function": {"name": name, "arguments": string_field(item, "arguments", where)},
            }
            if _continues_calls(messages):
                messages[-1]["tool_calls"].append(call)  # parallel calls of one turn
                origins[-1].calls.append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(MessageOrigin(where, "function_call", [where]))
                open_calls = set()
            if open_calls is not None:
                open_calls.add(call["id"])
                unanswered[call["id"]] = where
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _parts(output, f"{where}.output")
            elif not isinstance(output, str):
                raise invalid_type(f"{where}.output", "a string or an array of content parts", output)
            call_id = string_field(item, "call_id", where)
            if open_calls is None or call_id not in open_calls:
                raise InvalidRequestError(
                    f"No tool call found for function call output with call_id {call_id!r}: a "
                    "function_call_output item answers a function_call item of the same turn (only other "
                    "function_call / function_call_output items in between).",
                    param=f"{where}.call_id",
                    code="invalid_value",
                )
            unanswered.pop(call_id, None)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            origins.append(MessageOrigin(where, "function_call_output"))
        elif kind == "item_reference":
            raise unsupported(where, "item references need stored items (prefixgate is stateless)")
        else:
            raise InvalidRequestError(
                f"Invalid value for '{where}.type': prefixgate accepts 'message', 'function_call', "
                f"'function_call_output' and 'reasoning' input items, got {kind!r}.",
                param=f"{where}.type",
                code="invalid_value",
            )
    if not messages:
        raise InvalidRequestError(
            "Invalid 'input': empty array. Expected at least one input item.",
            param="input",
            code="empty_array",
        )
    return messages


def _reasoning_item(item: dict[str, Any], where: str) -> None:
    """Check a ``reasoning`` input item loosely (what a client sends back of an earlier response's reasoning,
    with ``store: false`` its ``encrypted_content``): ``summary`` and ``content``, when present, are arrays.

    Raises:
        InvalidRequestError: ``invalid_type`` naming ``input[i].summary`` / ``input[i].content``.
    """
    for key in ("summary", "content"):
        if item.get(key) is not None and not isinstance(item[key], list):
            raise invalid_type(f"{where}.{key}", "an array", item[key])


def _continues_calls(messages: list[dict[str, Any]]) -> bool:
    """Whether a ``function_call`` item joins the last message (an assistant turn made of calls only)."""
    return bool(messages) and messages[-1]["role"] == "assistant" and messages[-1].get("content") is None


_ROLES = frozenset({"user", "assistant", "system", "developer"})


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidRequestError(
            f"Invalid value for '{where}.role': supported values are 'user', 'assistant', 'system' and "
            "'developer'.",
            param=f"{where}.role",
            code="invalid_value",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of content parts", content)
    return {"role": role, "content": _parts(content, f"{where}.content")}


_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def _parts(parts: list[Any], where: str) -> list[dict[str, Any]]:
    """Responses content parts -> chat content parts: text kinds become ``text``; other kinds keep their type
    (a backend that cannot take them names them in its 400)."""
    out = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            raise invalid_type(f"{where}[{index}]", "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError(
                f"Missing required parameter: '{where}[{index}].type'.",
                param=f"{where}[{index}].type",
                code="missing_required_parameter",
            )
        if kind in _TEXT_PARTS:
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise invalid_type(f"{where}[{index}].text", "a string", text)
            out.append({"type": "text", "text": text})
        else:
            out.append(dict(part))
    return out


def _text_config(text: Any, chat: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise invalid_type("text", "an object", text)
    _known_keys(text, "text", ("format", "verbosity"))
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        _known_keys(fmt, "text.format", ("type", "name", "schema", "strict", "description"))
        for key in ("name", "schema"):  # both required by the Responses API (chat nests them in json_schema)
            if fmt.get(key) is None:
                raise InvalidRequestError(
                    f"Missing required parameter: 'text.format.{key}'.",
                    param=f"text.format.{key}",
                    code="missing_required_parameter",
                )
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise InvalidRequestError(
            "Invalid value for 'text.format.type': supported values are 'text', 'json_object' and "
            "'json_schema'.",
            param="text.format.type",
            code="invalid_value",
        )


# ---- rendering -------------------------------------------------------------------------------------------
