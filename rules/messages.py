"""Text access to OpenAI-shaped chat messages, and the shape check done before canonicalizing.

A message's *text slots* are where rules read and write text: the ``content`` string itself, or each
``{"type": "text", "text": ...}`` part of a list ``content``. Other parts (images, audio, tool_use...)
and other keys (``tool_calls``, ``name``...) are never touched. A slot is addressed by its part index;
a string ``content`` is part 0.
"""

from __future__ import annotations

import copy
from typing import Any

from rules.errors import RequestShapeError

_ATOMS = frozenset({str, int, float, bool, type(None)})


def copy_json(value: Any) -> Any:
    """A deep copy of JSON data (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``), several
    times cheaper than ``copy.deepcopy``; any other value inside is copied with ``copy.deepcopy``. Unlike
    ``copy.deepcopy`` it does not keep objects that occur twice shared in the copy (JSON parsed from a request
    never shares objects, so the copies are the same)."""
    t = type(value)
    if t is dict:
        out = value.copy()
        for k, v in out.items():
            if type(v) not in _ATOMS:
                out[k] = copy_json(v)  # an existing key: the dict does not change size while iterated
        return out
    if t is list:
        items: list[Any] = []
        for v in value:  # a message list: its dicts copied here, one call fewer per message
            tv = type(v)
            if tv is dict:
                c = v.copy()
                for k, x in c.items():
                    if type(x) not in _ATOMS:
                        c[k] = copy_json(x)
                items.append(c)
            else:
                items.append(v if tv in _ATOMS else copy_json(v))
        return items
    if t in _ATOMS:
        return value
    return copy.deepcopy(value)


def check_shape(messages: Any, tools: Any) -> None:
    """Raise RequestShapeError unless ``messages`` is a list of OpenAI chat messages and ``tools`` is
    None or a list of objects.

    Accepted: each message a dict with a string ``role``; ``content`` absent, None, a string, or a list of
    dict parts where every ``type: text`` part has a string ``text``.
    """
    if not isinstance(messages, list):
        raise RequestShapeError(f"messages must be a list, not {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestShapeError(f"messages[{i}] must be an object, not {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise RequestShapeError(f"messages[{i}].role must be a string")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestShapeError(f"messages[{i}].content must be a string, a list of parts or null")
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise RequestShapeError(f"messages[{i}].content[{j}] must be an object")
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise RequestShapeError(f"messages[{i}].content[{j}].text must be a string")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestShapeError(f"tools must be a list or null, not {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestShapeError(f"tools[{i}] must be an object, not {type(tool).__name__}")


def text_parts(message: dict[str, Any]) -> list[int]:
    """Part indices of the message's text slots (``[0]`` for a string content, ``[]`` for none)."""
    content = message.get("content")
    if isinstance(content, str):
        return [0]
    if isinstance(content, list):
        return [
            j for j, p in enumerate(content) if p.get("type") == "text" and isinstance(p.get("text"), str)
        ]
    return []


def get_text(message: dict[str, Any], part: int) -> str:
    """The text of slot ``part`` (see ``text_parts``)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return content[part]["text"]


def set_text(message: dict[str, Any], part: int, text: str) -> None:
    """Replace the text of slot ``part`` in place (the part's other keys are kept)."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = text
    else:
        content[part] = {**content[part], "text": text}


def part_count(message: dict[str, Any]) -> int:
    """Number of content parts (a string content counts as one part, no content as zero)."""
    content = message.get("content")
    if isinstance(content, str):
        return 1
    if isinstance(content, list):
        return len(content)
    return 0


def last_user_index(messages: list[dict[str, Any]]) -> int | None:
    """Index of the last ``user`` message, or None."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


def newest_input_index(messages: list[dict[str, Any]]) -> int | None:
    """Where the newest turn's input begins: the first of the ``tool`` messages the request ends with (an agent
    loop's turn: the results of the calls its last reply made), else the last ``user`` message; None when
    there is neither."""
    start = len(messages)
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    return start if start < len(messages) else last_user_index(messages)


def leading_system_count(messages: list[dict[str, Any]]) -> int:
    """How many messages at the start are ``system`` or ``developer`` (the level-1 block)."""
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n
