"""Client cache markers (``cache_control``) are invisible to the rules: taken off a request before it is
canonicalized and put back on the same messages and parts of the canonical messages after.

Anthropic's multi-turn pattern (and Claude Code's) marks the newest message's last block and moves the marker
forward every turn; LiteLLM-style clients do the same with OpenAI content parts. A marker is a caching hint, not
prompt text: the provider's cache matches the blocks' content whatever markers they carry. Seen by the rules, a
marker that moved changed the canonical bytes of history: a marked text part got a hoisted-value block as a part
of its own where the same part unmarked had it merged into its text, and the transcript memory and the history
memo (keyed by the messages) missed the earlier request, so a reused turn's old values were replaced by the
current ones. Every turn then missed the whole conversation at the provider.

Invariants:

- the canonical messages without markers depend only on the request without markers (so do the memory's and
  the memo's keys and entries: they never hold a marker);
- each marker goes back on the message, or the content part, it was on (a text part a block was merged into
  keeps its marker); a part or a message the rules inserted (a block's own part, a ``note`` or ``new_user``
  message) never gets one;
- where the canonical messages cannot be matched to the request's message by message and part by part (a
  request that already holds blocks in unusual places), ``restore_markers`` says so and the caller
  canonicalizes the request with its markers in place, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rules.placement import SEP, block_message_values, parse_whole_block

MARKER = "cache_control"
"""The key of a cache marker, on a content part (Anthropic block, LiteLLM part) or on a message (a tool result's
marker on a tool message)."""


@dataclass
class Markers:
    """The markers taken off a request's messages.

    Attributes:
        on_messages: message index -> the marker the message itself carried.
        on_parts: (message index, part index) -> the marker of that content part.
    """

    on_messages: dict[int, Any] = field(default_factory=dict)
    on_parts: dict[tuple[int, int], Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.on_messages or self.on_parts)


def take_markers(messages: list[Any]) -> tuple[list[Any], Markers]:
    """``messages`` without cache markers, and the markers taken off.

    Args:
        messages: chat messages in the rules' shape (``rules.messages.check_shape``): dicts whose ``content`` is
            a string, a list of parts or null.

    Returns:
        (a new list: each message or part that held a marker is a shallow copy without it, the others are the
        same objects; the markers by place). Nothing is copied when no message holds a marker.
    """
    markers = Markers()
    out: list[Any] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        content = message.get("content")
        parts = None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and MARKER in part:
                    if parts is None:
                        parts = list(content)
                    markers.on_parts[(i, j)] = part[MARKER]
                    parts[j] = {k: v for k, v in part.items() if k != MARKER}
        if parts is None and MARKER not in message:
            out.append(message)
            continue
        copy = {k: v for k, v in message.items() if k != MARKER}
        if MARKER in message:
            markers.on_messages[i] = message[MARKER]
        if parts is not None:
            copy["content"] = parts
        out.append(copy)
    return (out, markers) if markers else (messages, markers)


def restore_markers(request: list[Any], canonical: list[dict[str, Any]], markers: Markers) -> bool:
    """Put ``markers`` (taken off ``request`` by ``take_markers``) back on the canonical messages, in place.

    ``canonical`` is ``request`` canonicalized: the same messages in the same order (the rules never make or
    remove one), with blocks inserted as messages of their own and as text parts of their own, or merged into a
    text part. Request message ``i`` is matched with the next canonical message of the same role, passing over
    inserted block messages; within it, request part ``j`` with the next canonical part of the same type,
    passing over inserted block parts. A string content that gets a part's marker becomes one text part (it
    renders as the string does).

    Returns:
        True when every marker found its message and part (``canonical`` then carries them); False, with
        ``canonical`` unchanged, when the messages do not match that way.
    """
    placed: list[tuple[int, int | None, Any]] = []
    f = 0
    for i, message in enumerate(request):
        while f < len(canonical) and _inserted_message(canonical[f], message):
            f += 1
        if f >= len(canonical) or canonical[f].get("role") != message.get("role"):
            return False
        if i in markers.on_messages:
            placed.append((f, None, markers.on_messages[i]))
        wanted = [(j, m) for (mi, j), m in markers.on_parts.items() if mi == i]
        if wanted:
            mapping = _part_map(message.get("content"), canonical[f].get("content"))
            if mapping is None:
                return False
            placed.extend((f, mapping[j], m) for j, m in wanted)
        f += 1
    for index, part, marker in placed:
        target = canonical[index]
        if part is None:
            target[MARKER] = marker
            continue
        content = target["content"]
        if isinstance(content, str):
            content = target["content"] = [{"type": "text", "text": content}]
        content[part] = {**content[part], MARKER: marker}
    return True


def _inserted_message(candidate: dict[str, Any], request_message: Any) -> bool:
    """Whether ``candidate`` is a block message the rules inserted before the match of ``request_message``: a
    user message that is exactly one block, where the request's message is not one."""
    return block_message_values(candidate) is not None and not (
        isinstance(request_message, dict) and block_message_values(request_message) is not None
    )


def _is_block_part(part: Any) -> bool:
    """A text part that is one block (an inserted block's own part; ``SEP`` after it when text follows)."""
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        return False
    text = part["text"]
    return parse_whole_block(text[: -len(SEP)] if text.endswith(SEP) else text) is not None


def _part_map(request_content: Any, canonical_content: Any) -> list[int] | None:
    """Canonical part index of each request part, or None where the two contents do not match part by part."""
    if not isinstance(request_content, list):
        return None
    if isinstance(canonical_content, str):
        # a reused turn stored as a string while the request sends it as one part ("a part or a string alike")
        return [0] if len(request_content) == 1 else None
    if not isinstance(canonical_content, list):
        return None
    out: list[int] = []
    k = 0
    for part in request_content:
        inserted_ok = not _is_block_part(part)
        while k < len(canonical_content) and inserted_ok and _is_block_part(canonical_content[k]):
            k += 1
        if k >= len(canonical_content) or _part_type(canonical_content[k]) != _part_type(part):
            return None
        out.append(k)
        k += 1
    return out


def _part_type(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else type(part).__name__
