"""Responses ``truncation: "auto"``: when the input does not fit the model's context, the oldest input items are
dropped until it does, as the OpenAI API reference describes ("dropping items from the beginning of the
conversation"; https://platform.openai.com/docs/api-reference/responses/create#responses-create-truncation).

Owns which items may go and in what units (``droppable_groups``), the body with the oldest groups left out
(``without_oldest``), and how many groups one retry drops (``groups_to_drop``); the endpoint retries with the
truncated body (``gateway.http.responses``).

Invariants: ``instructions`` and system / developer messages are never dropped; the newest item is never dropped
(nothing could be answered without it); a ``function_call`` goes with every ``function_call_output`` (and
``custom_tool_call`` with its ``_output``) that answers it, so no output is left without its call nor a call
without its output; items keep their order. A string ``input`` has nothing to drop. The client's body is never
changed: a new one is returned.
"""

from __future__ import annotations

import json
import math
from typing import Any

KEPT_ROLES = ("system", "developer")
"""Roles of input messages that are instructions, never dropped."""

CALL_TYPES = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}
"""Call item types and the type of the items that answer them (by ``call_id``)."""

MAX_RETRIES = 8
"""Most truncated tries of one request: each drops at least one group, as many as the overflow asks."""


def droppable_groups(items: list[Any]) -> list[list[int]]:
    """Indexes into ``items`` (a Responses ``input`` list) of the units that may be dropped, oldest first: one
    per item, a call together with the outputs that answer it. The newest item's unit and instruction messages
    are left out.

    Args:
        items: the ``input`` list (items the Responses parser accepts; anything else is one unit).

    Returns:
        the units, each a sorted list of item indexes; empty when nothing may be dropped.
    """
    answers: dict[tuple[str, str], list[int]] = {}
    for index, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") in CALL_TYPES.values():
            answers.setdefault((str(item.get("type")), str(item.get("call_id"))), []).append(index)
    groups: list[list[int]] = []
    taken: set[int] = set()
    for index, item in enumerate(items):
        if index in taken or _kept(item):
            continue
        group = [index]
        if isinstance(item, dict) and item.get("type") in CALL_TYPES:
            group += answers.get((CALL_TYPES[str(item["type"])], str(item.get("call_id"))), [])
        taken.update(group)
        groups.append(sorted(group))
    last = len(items) - 1
    return [group for group in groups if last not in group]


def _kept(item: Any) -> bool:
    return (
        isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") in KEPT_ROLES
    )


def without_oldest(body: dict[str, Any], groups: list[list[int]], count: int) -> dict[str, Any]:
    """A copy of ``body`` whose ``input`` leaves out the items of its ``count`` oldest ``groups``."""
    dropped = {index for group in groups[:count] for index in group}
    items = body["input"]
    return {**body, "input": [item for index, item in enumerate(items) if index not in dropped]}


def groups_to_drop(
    items: list[Any], groups: list[list[int]], prompt_tokens: int | None, excess: int | None
) -> int:
    """How many of ``groups`` (the oldest first) to drop from ``items`` for the next try: enough that the dropped
    items' share of the input's characters covers the overflow's share of the prompt (``excess`` tokens over
    the room there is, of ``prompt_tokens``), and at least one. Without counts (an upstream that words its
    overflow otherwise) one.

    Returns:
        a count in ``[1, len(groups)]``; 0 when there are no groups.
    """
    if not groups:
        return 0
    if not prompt_tokens or not excess or excess <= 0:
        return 1
    sizes = [len(json.dumps(item, ensure_ascii=False)) for item in items]
    wanted = math.ceil(sum(sizes) * min(1.0, excess / prompt_tokens))
    dropped = 0
    for count, group in enumerate(groups, start=1):
        dropped += sum(sizes[index] for index in group)
        if dropped >= wanted:
            return count
    return len(groups)
