"""The tools of a Responses body as chat tools (``gateway.protocols.openai.responses``): function tools as they
are, ``namespace`` tools flattened into their function tools (``<namespace>__<name>``, as the Codex CLI spells
them; ``namespaced_tool_names`` maps a flat name back, so calls return with their ``namespace``), hosted tools
the gateway cannot run dropped with a log line (a ``tool_choice`` forcing one is a 400), and ``tool_choice``
translated.

Invariant: errors name the client's own path (``tools[1].tools[0].parameters``), never the chat body's.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.core.errors import InvalidRequestError
from gateway.protocols.openai.field_errors import invalid_type, missing_param

logger = logging.getLogger(__name__)


HOSTED_TOOLS = frozenset(
    {
        "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
        "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
        "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
        "programmatic_tool_calling",
    }
)  # fmt: skip
"""Tool types of the openai-python SDK's ``ToolParam`` (and ``tool_choice`` types) that OpenAI runs itself or
answers with items of their own (``web_search_call``, ``local_shell_call``, ...): prefixgate can run none of
them nor produce those items, so they are dropped from what the model sees (as vLLM and LiteLLM do), and a
``tool_choice`` that forces one is a 400. ``custom`` (free-form) tools and unknown types stay a 400."""

NAMESPACE_DELIMITER = "__"
"""Between a ``namespace`` tool's name and one of its functions' in the flat name the model sees (the OpenAI Codex
CLI's own flat spelling of a namespaced tool)."""


def flat_tool_name(namespace: str, name: str) -> str:
    """The name the model sees for function ``name`` of namespace ``namespace``: ``<namespace>__<name>``, with
    underscores around the delimiter trimmed (``multi_agent_v1`` + ``spawn_agent`` ->
    ``multi_agent_v1__spawn_agent``)."""
    return namespace.rstrip("_") + NAMESPACE_DELIMITER + name.lstrip("_")


def _function_tools(
    tools: Any,
) -> tuple[list[tuple[str, dict[str, Any], tuple[str, str] | None]], list[str]]:
    """The function tools of a Responses ``tools`` array, ``namespace`` tools flattened: ``(path, tool, origin)``
    each (``tool`` a flat Responses function tool whose ``name`` is the model's; ``origin`` the ``(namespace,
    name)`` the client gave a namespace's function, None for a top-level one), and the types of the hosted tools
    dropped.

    Raises:
        InvalidRequestError: not an array, a tool that is not an object, a ``custom`` or unknown tool, a function
            without a name, a namespace without a name or ``tools`` array, two tools of the same flat name where
            one is namespaced.
    """
    if not isinstance(tools, list):
        raise invalid_type("tools", "an array", tools)
    out: list[tuple[str, dict[str, Any], tuple[str, str] | None]] = []
    dropped: list[str] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool)
        kind = tool.get("type")
        if kind == "function":
            string_field(tool, "name", where)
            out.append((where, tool, None))
        elif kind == "namespace":
            namespace = string_field(tool, "name", where)
            if tool.get("description") is not None and not isinstance(tool["description"], str):
                raise invalid_type(f"{where}.description", "a string", tool["description"])
            members = tool.get("tools")
            if not isinstance(members, list):
                if members is None:
                    raise missing_param(f"{where}.tools")
                raise invalid_type(f"{where}.tools", "an array", members)
            for inner, member in enumerate(members):
                at = f"{where}.tools[{inner}]"
                if not isinstance(member, dict):
                    raise invalid_type(at, "an object", member)
                if member.get("type") != "function":
                    raise unsupported(
                        f"{at}.type",
                        f"only function tools are supported in a namespace, got {member.get('type')!r}",
                    )
                name = string_field(member, "name", at)
                out.append((at, {**member, "name": flat_tool_name(namespace, name)}, (namespace, name)))
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:
            dropped.append(kind)
        else:
            raise unsupported(
                f"{where}.type",
                f"only function and namespace tools are supported (hosted tools such as 'web_search' are "
                f"dropped), got {kind!r}",
            )
    seen: dict[str, tuple[str, str] | None] = {}
    for where, tool, origin in out:
        name = tool["name"]
        if name in seen and (origin is not None or seen[name] is not None):
            raise InvalidRequestError(
                f"Invalid value for '{where}.name': {name!r} is also the name of another tool (a namespaced "
                f"tool's model-facing name is '<namespace>{NAMESPACE_DELIMITER}<name>').",
                param=f"{where}.name",
                code="invalid_value",
            )
        seen[name] = origin
    return out, dropped


def tools_to_chat(tools: Any) -> list[dict[str, Any]]:
    """The chat ``tools`` of a Responses ``tools`` array (hosted tools dropped, with one info log line)."""
    functions, dropped = _function_tools(tools)
    if dropped:
        logger.info(
            "Responses request: dropped hosted tools prefixgate cannot run: %s",
            ", ".join(sorted(set(dropped))),
        )
    out = []
    for _, tool, _ in functions:
        function = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_paths(body: dict[str, Any]) -> list[str]:
    """The Responses path of each chat tool ``responses_to_chat_body`` builds, index for index (``tools[2]``,
    ``tools[1].tools[0]`` for a namespace's function), so an error about ``tools[k]...`` names the client's tool;
    empty when ``tools`` is absent or ill-formed."""
    try:
        functions, _ = _function_tools(body.get("tools") or [])
    except InvalidRequestError:
        return []
    return [where for where, _, _ in functions]


def namespaced_tool_names(body: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The model-facing name of each function of the body's ``namespace`` tools -> ``(namespace, name)``, so a
    call the model makes is given back as the client named it (``name`` + ``namespace``)."""
    try:
        functions, _ = _function_tools(body.get("tools") or [])
    except InvalidRequestError:
        return {}
    return {tool["name"]: origin for _, tool, origin in functions if origin is not None}


def tool_choice_to_chat(
    choice: Any, tools: list[dict[str, Any]], namespaced: dict[str, tuple[str, str]]
) -> Any:
    """The chat ``tool_choice``; ``tools``: the chat tools; ``namespaced``: ``namespaced_tool_names`` (a forced
    function named as one namespace's member names it, when no tool has that very name: the SDK's
    ``tool_choice`` function has no ``namespace``).

    Raises:
        InvalidRequestError: a choice forcing a hosted tool (dropped), ``required`` when every tool sent was a
            hosted one, a ``custom`` / ``allowed_tools`` / unknown choice, an ill-typed one.
    """
    if isinstance(choice, str):
        return choice  # none | auto | required: checked by the chat parser
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = string_field(choice, "name", "tool_choice")
        if all(tool["function"]["name"] != name for tool in tools):
            members = [flat for flat, (_, plain) in namespaced.items() if plain == name]
            if len(members) == 1:
                name = members[0]
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] in HOSTED_TOOLS:
        raise unsupported(
            "tool_choice.type",
            f"it forces the hosted tool {choice['type']!r}, which prefixgate cannot run (hosted tools are dropped "
            "from the request); force a function tool or use 'auto'",
        )
    if isinstance(choice, dict):
        raise unsupported(
            "tool_choice.type", f"only function tools are supported, got {choice.get('type')!r}"
        )
    raise invalid_type("tool_choice", "a string or an object", choice)


def string_field(item: dict[str, Any], key: str, where: str) -> str:
    """``item[key]``, a string.

    Raises:
        InvalidRequestError: missing (``missing_required_parameter``) or not a string (``invalid_type``), naming
            ``where.key``.
    """
    value = item.get(key)
    if not isinstance(value, str):
        if value is None:
            raise missing_param(f"{where}.{key}")
        raise invalid_type(f"{where}.{key}", "a string", value)
    return value


def unsupported(param: str, why: str) -> InvalidRequestError:
    """``Unsupported parameter: '<param>': <why>.`` (400, ``unsupported_parameter``)."""
    return InvalidRequestError(
        f"Unsupported parameter: '{param}': {why}.", param=param, code="unsupported_parameter"
    )
