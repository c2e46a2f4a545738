"""The tool fields of an OpenAI chat body: ``tools``, ``tool_choice``, an assistant message's ``tool_calls`` and
the rule that every tool call is answered before the next non-tool message, each checked with OpenAI's own
error messages (400, the field's full path). Pure functions, no I/O.
Reference: https://platform.openai.com/docs/api-reference/chat/create
"""

from __future__ import annotations

import re
from typing import Any

from gateway.core.errors import InvalidRequestError
from gateway.protocols.openai.field_errors import invalid_type, missing_param


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls``: an array of ``{id, type: "function", function: {name,
    arguments}}``, each field required and a string, as OpenAI requires (``arguments`` is not parsed here: an
    upstream takes any string; the embedded engine checks it is JSON)."""
    if not isinstance(calls, list):
        raise invalid_type(where, "an array", calls)
    for call_index, call in enumerate(calls):
        at = f"{where}[{call_index}]"
        if not isinstance(call, dict):
            raise invalid_type(at, "an object", call)
        if call.get("type", "function") != "function":
            raise InvalidRequestError(
                f"Invalid value for '{at}.type': supported values are: 'function'.",
                param=f"{at}.type",
                code="invalid_value",
            )
        function = call.get("function")
        if function is None:
            raise missing_param(f"{at}.function")
        if not isinstance(function, dict):
            raise invalid_type(f"{at}.function", "an object", function)
        for field_name, value in (("id", call.get("id")), ("function.name", function.get("name"))):
            if value is None:
                raise missing_param(f"{at}.{field_name}")
            if not isinstance(value, str):
                raise invalid_type(f"{at}.{field_name}", "a string", value)
        arguments = function.get("arguments")
        if arguments is None:
            raise missing_param(f"{at}.function.arguments")
        if not isinstance(arguments, str):
            raise invalid_type(f"{at}.function.arguments", "a string", arguments)


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools``: None when absent, else the array of ``{type: "function", function: {name, ...}}`` as given.

    Raises:
        InvalidRequestError: a non-array or an empty one, a tool of another type, a function without a valid
            name, an ill-typed ``parameters``, ``strict`` or ``description``.
    """
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_type("tools", "an array", tools)
    if not tools:  # OpenAI's answer to an empty tools array
        raise InvalidRequestError(
            "Invalid 'tools': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            param="tools",
            code="empty_array",
        )
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"Invalid value for '{where}.type': supported values are: 'function'.",
                param=f"{where}.type",
                code="invalid_value",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise missing_param(f"{where}.function")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise missing_param(f"{where}.function.name")
        check_function_name(function["name"], f"{where}.function.name")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise invalid_type(f"{where}.function.parameters", "an object", function["parameters"])
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise invalid_type(f"{where}.function.strict", "a boolean", function["strict"])
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise invalid_type(f"{where}.function.description", "a string", function["description"])
    return tools


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]+")
MAX_FUNCTION_NAME = 64
"""OpenAI's function names: ``^[a-zA-Z0-9_-]{1,64}$``
(https://platform.openai.com/docs/api-reference/chat/create#chat-create-tools)."""


def check_function_name(name: str, param: str) -> None:
    """A function name (or a ``json_schema`` response format's name) as OpenAI accepts it: ``[a-zA-Z0-9_-]``, at
    most ``MAX_FUNCTION_NAME`` (64) characters.

    Raises:
        InvalidRequestError: naming ``param``.
    """
    if len(name) > MAX_FUNCTION_NAME:
        raise InvalidRequestError(
            f"Invalid '{param}': string too long. Expected a string with maximum length {MAX_FUNCTION_NAME}, "
            f"but got a string with length {len(name)} instead.",
            param=param,
            code="string_above_max_length",
        )
    if not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"Invalid '{param}': string does not match pattern. Expected a string that matches the pattern "
            "'^[a-zA-Z0-9_-]+$'.",
            param=param,
            code="invalid_value",
        )


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message answers a call of the assistant message with ``tool_calls`` before it (only
    ``tool`` messages in between), by that call's ``id``, and every call is answered before the next other
    message, as OpenAI requires (a trailing unanswered turn is left alone: it asks for nothing)."""
    calls: set[str] | None = None  # ids of the open assistant turn's calls; None: no such turn
    unanswered: list[str] = []  # the open turn's call ids no tool message answered yet, in order
    for index, message in enumerate(messages):
        role = message["role"]
        if role != "tool" and unanswered:
            raise InvalidRequestError(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                "'tool_call_id'. The following tool_call_ids did not have response messages: "
                f"{', '.join(unanswered)}",
                param=f"messages[{index}].role",
                code=None,
            )
        if role == "tool":
            if calls is None:
                raise InvalidRequestError(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                    "with 'tool_calls'.",
                    param=f"messages[{index}].role",
                    code=None,
                )
            if message["tool_call_id"] not in calls:
                raise InvalidRequestError(
                    f"Invalid parameter: 'tool_call_id' of '{message['tool_call_id']}' not found in "
                    "'tool_calls' of previous message.",
                    param=f"messages[{index}].tool_call_id",
                    code=None,
                )
            unanswered = [call_id for call_id in unanswered if call_id != message["tool_call_id"]]
        elif role == "assistant" and message.get("tool_calls"):
            unanswered = [call["id"] for call in message["tool_calls"]]
            calls = set(unanswered)
        else:
            calls = None


TOOL_CHOICE_MODES = frozenset({"none", "auto", "required"})


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    """``tool_choice``: ``"none" | "auto" | "required"`` or ``{"type": "function", "function": {"name"}}``,
    only with ``tools`` (OpenAI answers 400 ``tool_choice`` without ``tools``, whatever its value)."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise InvalidRequestError(
                f"Invalid value: '{choice}'. Supported values are: 'none', 'auto', and 'required'.",
                param="tool_choice",
                code="invalid_value",
            )
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequestError(
                "Invalid value for 'tool_choice.type': supported values are: 'function'.",
                param="tool_choice.type",
                code="invalid_value",
            )
        function = choice.get("function")
        if not isinstance(function, dict):
            raise missing_param("tool_choice.function")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise missing_param("tool_choice.function.name")
    else:
        raise invalid_type("tool_choice", "a string or an object", choice)
    if not tools:
        raise InvalidRequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            param="tool_choice",
            code=None,
        )
    return choice
