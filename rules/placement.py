"""Where hoisted values go: one block per place and turn, rendered, inserted, and found again.

A hoisted value is put back into the prompt inside one block::

    <request_context>
    Current date: 2026-04-24
    Session ID: 3f2c...
    </request_context>

A conversation is cut into *turns* (``turn_spans``): the first turn runs from the start to the first
assistant reply; each later turn runs from an assistant reply to the next one (the reply, then the user
message or tool results that answer it). Turn ``j`` plus everything before it is exactly the request a
client sent when turn ``j`` was the newest one. Blocks are placed per turn, inside that turn only, so the
canonical form of earlier turns never depends on later ones (see docs/history-stability.md).

Placements (``hoist`` rule key ``placement``), inside a turn:

- ``tail_end`` (the default): at the end of the turn's newest user message (after its content, separated by
  a blank line); in a turn of tool results only, a user message of its own after them, never text inside a
  tool's output (which the model would read as what the tool returned; the Messages API carries it as a text
  block after the ``tool_result`` blocks of the same user turn). The next turn resends what comes before it,
  so a 4,000-token tool result before the block stays cached even when a value changed. In the *first* turn the block goes at the start of
  its last user message instead (after its document region): values moved out of the system prompt then
  still precede all conversation text, so a client that later rewrites the first message (compaction, an
  edit) never caches less than without rules (docs/history-stability.md).
- ``last_user_prefix``: at the start of the turn's last user message, after its document region. When the
  turn holds only tool results it falls back to the end of the system prompt (first turn) or to
  ``tail_end``.
- ``before_last_user``: a separate ``user`` message right before the turn's last user message (two user
  messages in a row break templates that require alternation).
- ``system_end``: appended to the last leading system/developer message (first turn only; in later turns
  it is ``tail_end``, because the system prompt is history by then). A value that changes makes the whole
  history after the system prompt miss.

When the chosen place does not exist, the next one is used: the turn's last user message (prefix), the end
of the system prompt (first turn only), a new user message at the end of the turn.

The text around a block is left as sent (a user message that starts with line breaks keeps them after
the block's blank line), so inserting and extracting a block are exact inverses. In a list content the block
goes into the plain text part it lands next to (``block + blank line + text``, ``text + blank line +
block``), so a message sent as one text part renders exactly as the same message sent as a string; it gets a
text part of its own beside a part with other keys, an empty part, text holding a block tag, or a part of a
document region (a list's region is whole parts: the block stays out of it). A client's cache markers
(``cache_control``) are off the parts while the rules run (``rules.cache_markers``), so a marked part takes a
block as the same part unmarked does.

Blocks are found again exactly where they were inserted (``extract_turn_blocks``) before rules run, so
canonicalizing a canonical request changes nothing: the values are carried over and re-inserted in the
same turn at the same place. Recognition is the same before and after a pass: ``extract_text_blocks`` finds
the blocks the rules uncovered in a turn's text (``RuleSet.apply`` takes them too), and a block is never
inserted so that its message becomes exactly one block unless it is a ``note`` or ``new_user`` message.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from rules.messages import leading_system_count
from rules.segments import Position, document_end, document_end_in_text

BLOCK_OPEN = "<request_context>"
BLOCK_CLOSE = "</request_context>"
SEP = "\n\n"

LOCATIONS: tuple[str, ...] = ("system_end", "note", "user_prefix", "tail_end", "new_user")
"""Physical places a block can occupy inside one turn, in prompt order."""

_FIRST_TURN_TAIL_END = ("user_prefix", "system_end", "tail_end")
"""``tail_end`` in the first turn: the start of its last user message (after documents). Text moved out of
the system prompt then still comes before any text of the conversation, so a conversation whose first
message is later rewritten (client-side compaction, an edit) never caches less than without rules."""

_PLACEMENT_ORDER = {
    "tail_end": ("tail_end", "system_end"),
    "last_user_prefix": ("user_prefix", "system_end", "tail_end"),
    "before_last_user": ("note", "system_end", "tail_end"),
    "system_end": ("system_end", "tail_end", "user_prefix"),
}

_REPLY_ROLE = "assistant"
_TAIL_ROLES_EXCLUDED = ("assistant", "system", "developer", "tool")


def turn_spans(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The turns of a conversation as ``[start, end)`` message ranges covering ``messages`` in order.

    A new turn begins at every assistant message that starts a run of assistant messages (index > 0) and is
    followed by a non-assistant message somewhere after the run, i.e. at every reply that a later request
    answered. ``messages[:start]`` of turn ``j > 0`` is the request that reply answered. An empty list gives
    ``[]``; otherwise the spans are never empty.
    """
    n = len(messages)
    if n == 0:
        return []
    roles = [m.get("role") for m in messages]
    last_non_reply = n - 1
    while last_non_reply >= 0 and roles[last_non_reply] == _REPLY_ROLE:
        last_non_reply -= 1
    starts = [0]
    starts.extend(
        i for i in range(1, last_non_reply) if roles[i] == _REPLY_ROLE and roles[i - 1] != _REPLY_ROLE
    )
    return list(zip(starts, [*starts[1:], n], strict=True))


def render_block(values: list[str]) -> str:
    """The block text holding ``values``, one per line."""
    return BLOCK_OPEN + "\n" + "\n".join(values) + "\n" + BLOCK_CLOSE


def parse_block_at(text: str, at: int) -> tuple[list[str], int] | None:
    """(values, end offset) of a block that begins exactly at ``text[at]``, or None. A block never holds its
    own opening tag (no value with a tag is hoisted): a client's literal ``<request_context>`` before one of
    ours is not read as a block reaching to ours (the values taken would have been the client's text)."""
    head = BLOCK_OPEN + "\n"
    if not text.startswith(head, at):
        return None
    close = text.find("\n" + BLOCK_CLOSE, at + len(head))
    if close < 0 or BLOCK_OPEN in text[at + len(head) : close]:
        return None
    return group_element_lines(text[at + len(head) : close].split("\n")), close + 1 + len(BLOCK_CLOSE)


_OPEN_TAG_LINE = re.compile(r"[ \t]*<([A-Za-z_][\w.:-]*)(?:[ \t][^<>\n]*)?>[ \t]*")


def group_element_lines(lines: list[str]) -> list[str]:
    """The values of a block's lines: a line that only opens an element (``<memory>``, ``<current_time>``), the
    lines after it and the first line that only closes it (``</memory>``) are one value, as they were hoisted
    (``render_block`` writes a value holding line breaks as several lines). Other lines are one value each."""
    closes: dict[str, list[int]] = {}  # closing line -> its indices, ascending (linear in the lines)
    for k, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("</") and stripped.endswith(">"):
            closes.setdefault(stripped, []).append(k)
    out: list[str] = []
    i = 0
    while i < len(lines):
        opened = _OPEN_TAG_LINE.fullmatch(lines[i]) if closes else None
        if opened is not None:
            at = closes.get("</" + opened.group(1) + ">", [])
            n = bisect.bisect_right(at, i)
            if n < len(at):
                out.append("\n".join(lines[i : at[n] + 1]))
                i = at[n] + 1
                continue
        out.append(lines[i])
        i += 1
    return out


def parse_whole_block(text: Any) -> list[str] | None:
    """The values when ``text`` is exactly one block, else None."""
    if not isinstance(text, str):
        return None
    parsed = parse_block_at(text, 0)
    if parsed is None or parsed[1] != len(text):
        return None
    return parsed[0]


def _last_user(messages: list[dict[str, Any]], start: int, end: int) -> int | None:
    for i in range(end - 1, start - 1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


def _tail_message(messages: list[dict[str, Any]], start: int, end: int) -> int | None:
    """The turn's newest user message, or None (a turn of tool results only: its block is a ``new_user``
    message, not part of a tool's output)."""
    for i in range(end - 1, start - 1, -1):
        if messages[i].get("role") not in _TAIL_ROLES_EXCLUDED:
            return i
    return None


def resolve_location(placement: str, messages: list[dict[str, Any]], start: int, end: int) -> str:
    """The physical location ``placement`` uses inside the turn ``messages[start:end]`` (block-free).

    Raises:
        KeyError: an unknown placement (the loader only lets the names in ``rules.model.PLACEMENTS`` in).
    """
    has_user = _last_user(messages, start, end) is not None
    has_tail = _tail_message(messages, start, end) is not None
    has_system = start == 0 and leading_system_count(messages) > 0
    order = _FIRST_TURN_TAIL_END if placement == "tail_end" and start == 0 else _PLACEMENT_ORDER[placement]
    for location in order:
        if location in ("user_prefix", "note") and has_user:
            return location
        if location == "tail_end" and has_tail:
            return location
        if location == "system_end" and has_system:
            return location
    return "new_user"


def _is_plain_text_part(part: Any) -> bool:
    return isinstance(part, dict) and set(part) == {"type", "text"} and part["type"] == "text"


def _mergeable(part: Any, block: str) -> bool:
    """Whether ``block`` goes into the text part ``part`` (its text + blank line + block, or the reverse), so a
    message of one text part renders as its string form does: a plain text part with text, neither holding a
    block tag of its own (the merged text then reads back one way only). Otherwise (a part with other keys,
    an empty one, one that holds a tag) the block gets a part of its own."""
    if not _is_plain_text_part(part) or not isinstance(part["text"], str) or not part["text"]:
        return False
    text = part["text"]
    tags = BLOCK_OPEN in text or BLOCK_CLOSE in text
    return not tags and block.count(BLOCK_OPEN) == 1 and block.count(BLOCK_CLOSE) == 1


def block_message_values(message: dict[str, Any]) -> list[str] | None:
    """The values of a message that is exactly one block (a ``note`` or ``new_user`` message: role ``user``,
    no other key), else None."""
    if message.get("role") == "user" and set(message) == {"role", "content"}:
        return parse_whole_block(message.get("content"))
    return None


def extract_turn_blocks(
    messages: list[dict[str, Any]], start: int, end: int
) -> tuple[dict[str, list[str]], int]:
    """Remove the blocks this module inserted into the turn ``messages[start:end]`` (exactly where
    ``insert_turn_blocks`` puts them) in place.

    Returns:
        (values by location, the turn's new end index: a removed note or new user message shortens it).
    """
    found: dict[str, list[str]] = {}
    if end - start >= 2:
        values = block_message_values(messages[end - 1])
        if values is not None:
            found["new_user"] = values
            del messages[end - 1]
            end -= 1
    last = _last_user(messages, start, end)
    if last is not None and last - 1 >= start:
        values = block_message_values(messages[last - 1])
        if values is not None:
            found["note"] = values
            del messages[last - 1]
            end -= 1
    found.update(extract_text_blocks(messages, start, end))
    return found, end


def extract_text_blocks(messages: list[dict[str, Any]], start: int, end: int) -> dict[str, list[str]]:
    """Remove the blocks inside messages' text in the turn ``messages[start:end]`` (in place): the
    ``tail_end``, ``user_prefix`` and ``system_end`` blocks ``extract_turn_blocks`` takes out, found the same
    way; a message that is exactly a block (``note``, ``new_user``) is left, so the turn keeps its messages.

    ``RuleSet.apply`` calls it after the rules ran on a turn whose blocks were taken out: text the rules turned
    into a block where one is looked for is what the next canonicalization would take for one.

    Returns:
        values by location (only locations where a block was found).
    """
    found: dict[str, list[str]] = {}
    tail = _tail_message(messages, start, end)
    if tail is not None:
        values = _extract_tail_end(messages[tail])
        if values is not None:
            found["tail_end"] = values
    last = _last_user(messages, start, end)
    if last is not None:
        values = _extract_user_prefix(messages[last])
        if values is not None:
            found["user_prefix"] = values
    systems = leading_system_count(messages)
    if start == 0 and systems:
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
        elif not end_docs and len(content) == end + len(SEP) and content.endswith(SEP):
            rest = ""  # an empty message's block (``_insert_user_prefix``)
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
        parsed = parse_block_at(text, 0)
        if parsed is not None and text.startswith(SEP, parsed[1]) and len(text) > parsed[1] + len(SEP):
            # a block merged into the text part (``_insert_user_prefix``): the part keeps its own text
            content[q] = {**content[q], "text": text[parsed[1] + len(SEP) :]}
            return parsed[0]
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


def _extract_text_end(message: dict[str, Any]) -> list[str] | None:
    """A block at the very end of a message: after ``SEP`` in a string content (or the whole content), or
    as the last (plain text) part of a list content."""
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
        text = content[-1]["text"]
        values = parse_whole_block(text)
        if values is not None:
            content.pop()
            return values
        at = text.rfind(SEP + BLOCK_OPEN + "\n") if isinstance(text, str) else -1
        if at > 0:  # a block merged into the last text part (``_insert_text_end``), after its own text
            values = parse_whole_block(text[at + len(SEP) :])
            if values is not None:
                content[-1] = {**content[-1], "text": text[:at]}
            return values
    return None


_extract_tail_end = _extract_text_end
_extract_system_end = _extract_text_end


def insert_turn_blocks(
    messages: list[dict[str, Any]], start: int, end: int, values: dict[str, list[str]]
) -> tuple[list[Position], int]:
    """Insert one block per location with values into the turn ``messages[start:end]`` (in place).

    Returns:
        (where each block begins, its separator included, as positions in the final messages; the turn's
        new end index).
    """
    starts: list[Position] = []
    last = _last_user(messages, start, end)
    tail = _tail_message(messages, start, end)
    systems = leading_system_count(messages) if start == 0 else 0
    shift = 0
    if values.get("system_end") and systems:
        starts.append(
            _insert_text_end(messages[systems - 1], render_block(values["system_end"]), systems - 1)
        )
    if values.get("note") and last is not None:
        messages.insert(last, {"role": "user", "content": render_block(values["note"])})
        starts.append(Position(last))
        shift = 1
    if values.get("user_prefix") and last is not None:
        starts.append(
            _insert_user_prefix(messages[last + shift], render_block(values["user_prefix"]), last + shift)
        )
    if values.get("tail_end") and tail is not None:
        starts.append(
            _insert_text_end(messages[tail + shift], render_block(values["tail_end"]), tail + shift)
        )
    end += shift
    if values.get("new_user"):
        messages.insert(end, {"role": "user", "content": render_block(values["new_user"])})
        starts.append(Position(end))
        end += 1
    return starts, end


def _insert_user_prefix(message: dict[str, Any], block: str, index: int) -> Position:
    content = message.get("content")
    if isinstance(content, list):
        docs = document_end(message)
        q = docs.part if docs is not None else 0
        if q < len(content) and _mergeable(content[q], block):
            # into the text part itself: one text part renders as the same string content would
            content[q] = {**content[q], "text": block + SEP + content[q]["text"]}
            return Position(index, q, 0)
        text = block + (SEP if q < len(content) else "")
        content.insert(q, {"type": "text", "text": text})
        return Position(index, q, 0)
    text = content if isinstance(content, str) else ""
    end_docs = document_end_in_text(text)
    rest = text[end_docs:]
    if not text:
        # an empty user message keeps a separator after its block: a message that is exactly one block is a
        # ``new_user`` or ``note`` message this module created, which ``extract_turn_blocks`` removes whole
        message["content"] = block + SEP
        return Position(index, 0, 0)
    message["content"] = text[:end_docs] + (SEP if end_docs else "") + block + (SEP + rest if rest else "")
    return Position(index, 0, end_docs)


def _insert_text_end(message: dict[str, Any], block: str, index: int) -> Position:
    content = message.get("content")
    if isinstance(content, list):
        docs = document_end(message)
        in_docs = docs is not None and docs.part >= len(content)  # a list's document region is whole parts
        if content and not in_docs and _mergeable(content[-1], block):
            # at the end of the last text part: one text part renders as the same string content would
            last = content[-1]["text"]
            content[-1] = {**content[-1], "text": last + SEP + block}
            return Position(index, len(content) - 1, len(last))
        content.append({"type": "text", "text": block})
        return Position(index, len(content) - 1, 0)
    text = content if isinstance(content, str) else ""
    if text:
        message["content"] = text + SEP + block
    elif block_message_values({**message, "content": block}) is not None:
        # an empty user message that would be exactly one block is a ``note`` or ``new_user`` message this module
        # created: the next pass would remove it and move its block (``_extract_text_end`` takes the separator
        # back off)
        message["content"] = SEP + block
    else:
        message["content"] = block
    return Position(index, 0, len(text))
