"""Where hoisted values go: one block per place, rendered, inserted, and found again.

A hoisted value is put back into the prompt inside one block::

    <request_context>
    Current date: 2026-04-24
    Session ID: 3f2c...
    </request_context>

Placements (``hoist`` rule key ``placement``):

- ``last_user_prefix`` (the default): at the start of the last user turn, after its document region if it
  has one. Tools, system, documents and the whole history stay byte-identical between requests and
  between turns, and no message is added, so templates that demand strict user/assistant alternation
  (Llama 2, Mistral, Gemma...) still render. The cost is one short block in the uncached tail. In a
  multi-turn chat the previous turn's user message held its own block, which the client does not send
  back, so the new request re-uses the cache up to the start of the previous user turn.
- ``before_last_user``: a separate ``user`` message right before the last user turn. Same caching as the
  default, but two user messages in a row break templates that require alternation.
- ``system_end``: appended to the last leading system/developer message. Only tools and system are
  cacheable: the volatile text then precedes the whole history, so every turn's history misses.

When the chosen place does not exist (no user message, or no system message), the next one in this
order is used: last user turn, end of system, a new user message at the end.

Inserting the block at the start of the last user turn also removes line breaks at the start of that
turn's text (after its documents), so that the block is always followed by exactly one blank line.

Blocks are found again exactly where they were inserted (``extract_blocks``) before rules run, so
canonicalizing a canonical request changes nothing: the values are carried over and re-inserted.
"""

from __future__ import annotations

from typing import Any

from rules.messages import last_user_index, leading_system_count
from rules.segments import Position, document_end, document_end_in_text

BLOCK_OPEN = "<request_context>"
BLOCK_CLOSE = "</request_context>"
SEP = "\n\n"

LOCATIONS: tuple[str, ...] = ("system_end", "note", "user_prefix", "new_user")
"""Physical places a block can occupy, in prompt order."""

_PLACEMENT_ORDER = {
    "last_user_prefix": ("user_prefix", "system_end"),
    "before_last_user": ("note", "system_end"),
    "system_end": ("system_end", "user_prefix"),
}


def render_block(values: list[str]) -> str:
    """The block text holding ``values``, one per line."""
    return BLOCK_OPEN + "\n" + "\n".join(values) + "\n" + BLOCK_CLOSE


def parse_block_at(text: str, at: int) -> tuple[list[str], int] | None:
    """(values, end offset) of a block that begins exactly at ``text[at]``, or None."""
    head = BLOCK_OPEN + "\n"
    if not text.startswith(head, at):
        return None
    close = text.find("\n" + BLOCK_CLOSE, at + len(head))
    if close < 0:
        return None
    return text[at + len(head) : close].split("\n"), close + 1 + len(BLOCK_CLOSE)


def parse_whole_block(text: Any) -> list[str] | None:
    """The values when ``text`` is exactly one block, else None."""
    if not isinstance(text, str):
        return None
    parsed = parse_block_at(text, 0)
    if parsed is None or parsed[1] != len(text):
        return None
    return parsed[0]


def resolve_location(placement: str, messages: list[dict[str, Any]]) -> str:
    """The physical location a placement uses for these (block-free) messages."""
    has_user = last_user_index(messages) is not None
    has_system = leading_system_count(messages) > 0
    for location in _PLACEMENT_ORDER[placement]:
        if location in ("user_prefix", "note") and has_user:
            return location
        if location == "system_end" and has_system:
            return location
    return "new_user"


def _is_plain_text_part(part: Any) -> bool:
    return isinstance(part, dict) and set(part) == {"type", "text"} and part["type"] == "text"


def extract_blocks(messages: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Remove blocks this module inserted (exactly where ``insert_blocks`` puts them) from ``messages``
    in place; return their values by location (``user_prefix`` also covers ``new_user``)."""
    found: dict[str, list[str]] = {}
    last = last_user_index(messages)
    if last is not None and last >= 1:
        note = messages[last - 1]
        if note.get("role") == "user" and set(note) == {"role", "content"}:
            values = parse_whole_block(note.get("content"))
            if values is not None:
                found["note"] = values
                del messages[last - 1]
    last = last_user_index(messages)
    if last is not None:
        values = _extract_user_prefix(messages[last])
        if values is not None:
            found["user_prefix"] = values
    systems = leading_system_count(messages)
    if systems:
        values = _extract_system_end(messages[systems - 1])
        if values is not None:
            found["system_end"] = values
    return found


def _extract_user_prefix(message: dict[str, Any]) -> list[str] | None:
    content = message.get("content")
    if isinstance(content, str):
        end_docs = document_end_in_text(content)
        sep = SEP if end_docs else ""
        if not content.startswith(sep + BLOCK_OPEN, end_docs):
            return None
        parsed = parse_block_at(content, end_docs + len(sep))
        if parsed is None:
            return None
        values, end = parsed
        if end == len(content):
            rest = ""
        elif content.startswith(SEP, end) and len(content) > end + len(SEP):
            rest = content[end + len(SEP) :]
        else:
            return None
        message["content"] = content[:end_docs] + rest
        return values
    if isinstance(content, list):
        docs = document_end(message)
        q = docs.part if docs is not None else 0
        if q >= len(content) or not _is_plain_text_part(content[q]):
            return None
        text = content[q]["text"]
        if q + 1 < len(content):
            if not text.endswith(SEP):
                return None
            text = text[: -len(SEP)]
        values = parse_whole_block(text)
        if values is None:
            return None
        del content[q]
        return values
    return None


def _extract_system_end(message: dict[str, Any]) -> list[str] | None:
    content = message.get("content")
    if isinstance(content, str):
        # the block inserted last is the last one: look for "\n\n<block>" at the end first, so that text
        # before it that happens to start with the block's tag is never taken for part of it
        at = content.rfind(SEP + BLOCK_OPEN + "\n")
        if at >= 0:
            values = parse_whole_block(content[at + len(SEP) :])
            if values is not None:
                message["content"] = content[:at]
                return values
        values = parse_whole_block(content)
        if values is not None:
            message["content"] = ""
        return values
    if isinstance(content, list) and content and _is_plain_text_part(content[-1]):
        values = parse_whole_block(content[-1]["text"])
        if values is not None:
            content.pop()
        return values
    return None


def strip_tail_newlines(messages: list[dict[str, Any]]) -> bool:
    """Remove line breaks where the ``user_prefix`` block goes (start of the last user turn, after its
    documents), so that inserting and extracting the block are exact inverses. Returns whether it changed
    anything."""
    last = last_user_index(messages)
    if last is None or not isinstance(messages[last].get("content"), str):
        return False
    text = messages[last]["content"]
    end_docs = document_end_in_text(text)
    stripped = text[end_docs:].lstrip("\r\n")
    if len(stripped) == len(text) - end_docs:
        return False
    messages[last]["content"] = text[:end_docs] + stripped
    return True


def insert_blocks(messages: list[dict[str, Any]], values: dict[str, list[str]]) -> list[Position]:
    """Insert one block per location with values (in place); return where each block begins (its
    separator included), as positions in the final messages."""
    starts: list[Position] = []
    last = last_user_index(messages)
    systems = leading_system_count(messages)
    user_block: Position | None = None
    if values.get("user_prefix") and last is not None:
        user_block = _insert_user_prefix(messages[last], render_block(values["user_prefix"]), last)
    if values.get("system_end") and systems:
        starts.append(
            _insert_system_end(messages[systems - 1], render_block(values["system_end"]), systems - 1)
        )
    if values.get("note") and last is not None:
        messages.insert(last, {"role": "user", "content": render_block(values["note"])})
        starts.append(Position(last))
        if user_block is not None:
            user_block = Position(user_block.message + 1, user_block.part, user_block.char)
    if user_block is not None:
        starts.append(user_block)
    if values.get("new_user"):
        messages.append({"role": "user", "content": render_block(values["new_user"])})
        starts.append(Position(len(messages) - 1))
    return starts


def _insert_user_prefix(message: dict[str, Any], block: str, index: int) -> Position:
    content = message.get("content")
    if isinstance(content, list):
        docs = document_end(message)
        q = docs.part if docs is not None else 0
        text = block + (SEP if q < len(content) else "")
        content.insert(q, {"type": "text", "text": text})
        return Position(index, q, 0)
    text = content if isinstance(content, str) else ""
    end_docs = document_end_in_text(text)
    rest = text[end_docs:]
    message["content"] = text[:end_docs] + (SEP if end_docs else "") + block + (SEP + rest if rest else "")
    return Position(index, 0, end_docs)


def _insert_system_end(message: dict[str, Any], block: str, index: int) -> Position:
    content = message.get("content")
    if isinstance(content, list):
        content.append({"type": "text", "text": block})
        return Position(index, len(content) - 1, 0)
    text = content if isinstance(content, str) else ""
    message["content"] = text + SEP + block if text else block
    return Position(index, 0, len(text))
