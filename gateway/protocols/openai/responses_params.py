"""Chat Completions field paths -> the Responses body's own, for errors of ``POST /v1/responses``.

A Responses request is translated into a chat body (``gateway.protocols.openai.responses``) and checked by the
chat parser, the rules and the backend, which name what they refuse in chat terms: ``max_completion_tokens``,
``response_format.json_schema.schema``, ``tools[0].function.parameters``, ``reasoning_effort``,
``messages[3].content[0]``. A client that sent ``max_output_tokens``, ``text.format``, ``tools[0].parameters``,
``reasoning.effort`` or ``input[2].content[0]`` must see those instead. This module owns that mapping; the
messages of the chat body are traced back to their input items by ``MessageOrigin`` (one per chat message,
built while translating).

Invariant: a translated path names a field of the client's Responses body (or, when the chat path has no
counterpart there, the nearest enclosing one: ``input`` for ``messages``), never a chat-only field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.core.errors import APIError


@dataclass
class MessageOrigin:
    """Where one chat message of a translated Responses body came from.

    Attributes:
        item: the Responses path it came from: ``"instructions"``, ``"input"`` (a string input) or
            ``"input[i]"``.
        kind: ``instructions``, ``input_text`` (a string input), ``message``, ``function_call`` (an assistant
            message with ``tool_calls``, one per consecutive ``function_call`` item) or ``function_call_output``
            (a ``tool`` message).
        calls: for ``function_call``: the ``input[i]`` path of each of the message's ``tool_calls``, in order.
    """

    item: str
    kind: str
    calls: list[str] = field(default_factory=list)


_SIMPLE = {
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "verbosity": "text.verbosity",
    "messages": "input",
}
"""Chat fields the translation sets from a Responses field of another name."""

_MESSAGE = re.compile(r"messages\[(\d+)\]((?:\.[A-Za-z_]+|\[\d+\])*)")
_CALL = re.compile(r"\.tool_calls\[(\d+)\]((?:\.[A-Za-z_]+|\[\d+\])*)")
_CALL_FIELDS = {"": "", ".id": ".call_id", ".function": "", ".function.name": ".name"}
_CALL_FIELDS[".function.arguments"] = ".arguments"

PATH = re.compile(
    r"(?<![\w.\[])(?:messages\[\d+\](?:\.[A-Za-z_]+|\[\d+\])*|response_format(?:\.[A-Za-z_]+)*"
    r"|tools\[\d+\]\.function(?:\.[A-Za-z_]+)*|tool_choice\.function(?:\.[A-Za-z_]+)*"
    r"|max_completion_tokens|reasoning_effort|verbosity)"
)
"""A chat field path inside an error message (bare ``messages`` is left alone there: it is also a word)."""


def responses_param(param: str, origins: list[MessageOrigin], tool_paths: list[str] | None = None) -> str:
    """The Responses body's path for a chat body's field path.

    Args:
        param: a chat path such as ``"messages[2].content[0].type"`` or ``"response_format.json_schema.name"``.
        origins: ``chat_message_origins`` of the Responses body, one per chat message.
        tool_paths: ``chat_tool_paths`` of the Responses body, one per chat tool (hosted tools are dropped and
            ``namespace`` tools flattened, so chat ``tools[k]`` may be the client's ``tools[j]`` or
            ``tools[j].tools[i]``); None: the same index.

    Returns:
        The client's path (``"input[1].content[0].type"``, ``"text.format.name"``); ``param`` itself when it
        means the same in both bodies (``temperature``, ``tools[0].type``, ``model``).
    """
    if param in _SIMPLE:
        return _SIMPLE[param]
    if param.startswith("response_format"):
        rest = param[len("response_format") :]
        rest = rest.removeprefix(".json_schema")
        return "text.format" + rest
    tool = re.fullmatch(r"tools\[(\d+)\](\.function)?((?:\.[A-Za-z_]+)*)", param)
    if tool:
        index = int(tool.group(1))
        where = tool_paths[index] if tool_paths is not None and index < len(tool_paths) else f"tools[{index}]"
        return where + tool.group(3)
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param[len("tool_choice.function") :]
    message = _MESSAGE.fullmatch(param)
    if message:
        return _message_param(int(message.group(1)), message.group(2), origins)
    return param


def _message_param(index: int, rest: str, origins: list[MessageOrigin]) -> str:
    """``messages[index]<rest>`` in the Responses body's terms."""
    if index >= len(origins):
        return "input"
    origin = origins[index]
    if origin.kind in ("instructions", "input_text"):
        return origin.item
    if origin.kind == "function_call":
        call = _CALL.fullmatch(rest)
        if call and int(call.group(1)) < len(origin.calls):
            item = origin.calls[int(call.group(1))]
            return item + _CALL_FIELDS.get(call.group(2), "")
        return origin.calls[0] if origin.calls else origin.item
    if origin.kind == "function_call_output":
        if rest.startswith(".content"):
            return origin.item + ".output" + rest[len(".content") :]
        if rest in (".tool_call_id", ".role"):
            return origin.item + ".call_id"
        return origin.item
    return origin.item + rest


def responses_message(message: str, origins: list[MessageOrigin], tool_paths: list[str] | None = None) -> str:
    """An error message with every chat field path in it (``'max_completion_tokens'``,
    ``messages[0].content[0]: ...``) replaced by the Responses body's path (``responses_param``)."""
    return PATH.sub(lambda match: responses_param(match.group(0), origins, tool_paths), message)


def to_responses_error(
    error: APIError, origins: list[MessageOrigin], tool_paths: list[str] | None = None
) -> APIError:
    """``error`` (raised in chat terms) renamed in place to the Responses body's terms: ``param`` and the
    paths in ``message``. Returns the same object."""
    if error.param:
        error.param = responses_param(error.param, origins, tool_paths)
    error.message = responses_message(error.message, origins, tool_paths)
    error.args = (error.message,)
    return error
