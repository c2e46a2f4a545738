"""OpenAI-shaped (canonical) messages and tools -> an Anthropic ``system`` / ``messages`` / ``tools`` prompt,
with the ``BlockPath`` of every part so breakpoints can be placed on the blocks the rules' segments end at.
Inverse of ``parse``: what Anthropic needs and OpenAI cannot say is restored from the opaque parts.
Reference: https://docs.anthropic.com/en/api/messages
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jiter

from gateway.core.errors import InvalidRequestError
from gateway.core.json_types import finite_json, json_kind
from gateway.protocols.anthropic.parse import OPAQUE, extra_keys
from gateway.protocols.anthropic.validate import bad_param

if TYPE_CHECKING:  # the pipeline pulls in the rules engine; the translation helpers here must not need it
    pass


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
    """A message part the target protocol cannot carry (e.g. audio for Anthropic, a server tool for
    OpenAI)."""


def part_to_block(part: Any, param: str) -> dict[str, Any]:
    """One OpenAI content part -> one Anthropic block.

    Raises:
        UnsupportedContentError: a part type Anthropic has no block for (``input_audio``, ``file``).
    """
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise bad_param(f"expected a content part object, got {json_kind(part)}", param)
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", ""), **extra_keys(part, {"type", "text"})}
    if kind == "refusal":
        return {"type": "text", "text": part.get("refusal", "")}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise bad_param("image_url needs a url", f"{param}.image_url.url")
        extra = extra_keys(part, {"type", "image_url"})
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
        raise bad_param(f"expected a string or an array of parts, got {json_kind(content)}", param)
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
        raise bad_param("tool messages need a tool_call_id", f"{param}.tool_call_id")
    if isinstance(content, list):
        block["content"], _ = _content_blocks(content, f"{param}.content")
    elif content is not None:
        block["content"] = content if isinstance(content, str) else str(content)
    block.update(extra_keys(message, {"role", "content", "tool_call_id", "name"}))
    return block


def _tool_use_block(call: Any, param: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_param("expected {'id', 'type': 'function', 'function': {'name', 'arguments'}}", param)
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        # a call cut by max_tokens as it came back to the client, resent: its members that were complete, read
        # in jiter's partial mode as the Anthropic SDKs read a cut tool_use input
        try:
            parsed = jiter.from_json(arguments.encode(), partial_mode=True)
        except ValueError:
            raise bad_param("function.arguments is not valid JSON", f"{param}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise bad_param("function.arguments must be a JSON object", f"{param}.function.arguments")
    try:  # the body goes upstream as strict JSON: a number beyond the float range as the largest float
        parsed = finite_json(parsed)
    except ValueError:
        raise bad_param("function.arguments is not valid JSON (NaN)", f"{param}.function.arguments") from None
    block = {
        "type": "tool_use",
        "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
        "name": function.get("name", ""),
        "input": parsed,
    }
    block.update(extra_keys(call, {"id", "type", "function", "index"}))
    return block


def openai_to_anthropic(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> AnthropicPrompt:
    """Canonical OpenAI-shaped messages/tools -> Anthropic ``system`` / ``messages`` / ``tools``.

    Leading ``system``/``developer`` messages become the top-level ``system`` (one string message stays a
    string); a later one becomes text in a user turn (the Messages API takes a mid-conversation system message
    only under a beta, ``mid-conversation-system-2026-04-07``, that an upstream may not have; moving it to the
    top would put volatile text in front of the cached prefix). ``tool`` messages become
    ``tool_result`` blocks of one user turn, together with the user message right after them. Other turns
    keep their boundaries (the API merges consecutive same-role turns itself); a later message with nothing
    to send (empty text) becomes no turn.

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
            if not blocks and out:
                # nothing to send (a later system message whose only line the rules hoisted, an empty user
                # text): no turn, since the Messages API refuses an empty one; it ends where the last one did
                prompt.part_blocks[i] = [None] * len(where)
                prompt.last_block[i] = prompt.last_block[i - 1]
                continue
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
            raise bad_param(f"unsupported role {role!r}", f"{param}.role")
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
    """OpenAI ``tool_choice`` (+ ``parallel_tool_calls``) -> Anthropic ``tool_choice`` (None = leave
    unset)."""
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
        raise bad_param("expected 'auto', 'required', 'none' or {'type': 'function', ...}", "tool_choice")
    if parallel_tool_calls is False:
        result = dict(result or {"type": "auto"})
        if result["type"] != "none":
            result["disable_parallel_tool_use"] = True
    return result
