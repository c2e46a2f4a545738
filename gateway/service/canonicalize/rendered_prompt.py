"""A canonical request rendered as prompt text and tokens, with its segments located as token ranges.

Owns ``render_canonical`` and ``RenderedPrompt``: the rendered text, its token ids and start offsets, the
segments (``tools``, ``system``, ``documents``, ``history``, ``tail``) as ``PromptSegment`` token ranges, and
where the stable prefix ends, and a digest of the tools (the miss explanation tells a changed tool from a
moved cut by it). A template that ignores tools (SmolLM2's does) gets the tools' canonical JSON as
a preamble, since the upstream models users replay for do see them.

``hoisted_value_spans`` finds the values the rules hoisted (their ``<request_context>`` blocks) in the
rendered text: known volatile values for the miss explanation.

Invariants: the segments are contiguous, in order, and cover every token; ``stable_tokens`` never exceeds
the token count. Common prefixes and suffixes come from ``rules.span_diff``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gateway.service.canonicalize.prompt_tokenizers import PromptTokenizer
from gateway.service.miss_explanation import PromptSegment
from rules import Canonical, Position
from rules.actions import canonical_json
from rules.messages import get_text, text_parts
from rules.placement import BLOCK_OPEN, parse_block_at
from rules.segments import message_prefix
from rules.span_diff import common_prefix_len, common_suffix_len

_LEVEL_SEGMENT = {1: "system", 2: "documents", 3: "history", 4: "tail"}


@dataclass(frozen=True)
class RenderedPrompt:
    """A canonical request as prompt text and tokens, with its segments as token ranges."""

    text: str
    tokens: list[int]
    starts: list[int]
    segments: list[PromptSegment]
    stable_tokens: int
    tools_digest: bytes = b""
    """BLAKE2b-128 of the tools' canonical JSON in the order sent; ``b""`` when the request has none."""


def render_canonical(
    canon: Canonical,
    tokenizer: PromptTokenizer,
    encode: Callable[[str], tuple[list[int], list[int]]] | None = None,
) -> RenderedPrompt:
    """Render ``canon`` and locate its segments (the segments of its turns, ``Canonical.turn_segments``, where a
    hoisted-value block an earlier turn holds is history, not the start of the tail): each boundary is where the rendering of the messages cut at
    that position (``rules.segments.message_prefix``) stops agreeing with the full rendering; the tools'
    range is where the renderings with and without tools differ, or a canonical-JSON preamble when the
    template ignores tools. ``encode`` replaces ``tokenizer.encode`` for the text (it must return the same:
    ``token_memo.PieceTokenMemo.encode`` does, from a memo per message).

    Raises:
        TraceLineError: the template refused the messages.
    """
    messages, tools = canon.messages, canon.tools
    body = tokenizer.render(messages, tools, True)
    preamble = ""
    tools_at = (0, 0)
    if tools:
        without = tokenizer.render(messages, None, True)
        if without == body:
            preamble = "<|tools|>\n" + canonical_json(tools) + "\n\n"
            tools_at = (0, len(preamble))
        else:
            start = common_prefix_len(body, without)
            end = len(body) - common_suffix_len(body, without, len(body) - start)
            tools_at = (start, end)
    text = preamble + body

    def boundary(pos: Position) -> int:
        prefix = message_prefix(messages, pos)
        if not prefix:
            return len(preamble) + first_content_start()
        cut = tokenizer.render(prefix, tools, False)
        if body.startswith(cut):  # whole messages rendered alike: the common prefix is the cut (one compare)
            return len(preamble) + len(cut)
        return len(preamble) + common_prefix_len(body, cut)

    @functools.cache
    def first_content_start() -> int:
        """Where the first message's own text starts in ``body`` when the template puts something before it (a
        default system prompt, the tools' system message, where no system message comes first): 0 otherwise.
        Two renderings of that message alone with other texts agree up to it. Computed once per prompt (every
        segment that starts at the first message asks)."""
        first = messages[0] if messages else None
        if first is None or first.get("role") in ("system", "developer"):
            return 0
        try:
            one = tokenizer.render([{**first, "content": "a"}], tools, False)
            two = tokenizer.render([{**first, "content": "b"}], tools, False)
        except Exception:  # noqa: BLE001 - a template that refuses the message alone: no template part known
            return 0
        return min(common_prefix_len(one, two), common_prefix_len(body, one))

    cuts: list[tuple[int, str]] = []
    # the turns' segments: a hoisted-value block an earlier turn holds is history (``Canonical.turn_segments``)
    turn_segments = canon.turn_segments
    for segment in turn_segments if turn_segments is not None else canon.segments:
        start = boundary(Position(segment.start_message, segment.start_part, segment.start_char))
        cuts.append((start, _LEVEL_SEGMENT[segment.level]))
    stable_end = canon.turn_stable_end if turn_segments is not None else canon.stable_end
    stable_chars = boundary(stable_end) if stable_end.message < len(messages) else len(text)
    ids, starts = (encode or tokenizer.encode)(text)

    def tok(c: int) -> int:
        return bisect.bisect_left(starts, c)

    named: list[tuple[int, str]] = []
    if tools_at[1] > tools_at[0]:
        named.append((tools_at[0], "tools"))
        named.append((tools_at[1], "system"))
    named.extend(cuts)
    named.sort(key=lambda x: x[0])
    if not named or named[0][0] > 0:
        # what the template puts before the first cut: part of that segment, or, before the tail, the template's
        # own system part (a default system prompt before a first user message: stable, not the tail)
        first = named[0][1] if named else "tail"
        named.insert(0, (0, "system" if first == "tail" and named else first))
    segments: list[PromptSegment] = []
    pos = 0
    for k, (_, name) in enumerate(named):
        end = tok(named[k + 1][0]) if k + 1 < len(named) else len(ids)
        end = max(end, pos)
        if segments and segments[-1].name == name:
            segments[-1] = PromptSegment(name, segments[-1].start, end)
        else:
            segments.append(PromptSegment(name, pos, end))
        pos = end
    digest = hashlib.blake2b(canonical_json(tools).encode(), digest_size=16).digest() if tools else b""
    return RenderedPrompt(text, ids, starts, segments, min(tok(stable_chars), len(ids)), digest)


def hoisted_value_spans(
    canon: Canonical, text: str, rule_of: Callable[[str], str | None] | None = None
) -> Iterator[tuple[int, int, str]]:
    """``(start, end, rule id)`` character ranges in ``text`` (the rendered prompt of ``canon``) of every value
    inside a hoisted-value block, each message's blocks found where the template put that message's text
    (searched in prompt order). The first value's range starts at its block's opening tag and the last one's
    ends after the closing tag, so a prompt that gained or lost a block diverges inside one. ``rule_of`` names
    the rule that knows a value (``Canonicalizer.rule_value_spans``); ``"hoisted"`` when it names none (or
    is None). A value changed from one request to the next is a known volatile value (``volatile``).
    """
    cursor = 0
    for message in canon.messages:
        for part in text_parts(message):
            body = get_text(message, part)
            if BLOCK_OPEN not in body:
                continue
            at = text.find(body, cursor)
            if at < 0:
                continue
            cursor = at + len(body)
            pos = body.find(BLOCK_OPEN)
            while pos >= 0:
                parsed = parse_block_at(body, pos)
                if parsed is None:
                    pos = body.find(BLOCK_OPEN, pos + 1)
                    continue
                values, end = parsed
                start = pos + len(BLOCK_OPEN) + 1
                for k, value in enumerate(values):
                    first = pos if k == 0 else start
                    last = end if k == len(values) - 1 else start + len(value)
                    name = rule_of(value) if rule_of is not None else None
                    yield at + first, at + last, name or "hoisted"
                    start += len(value) + 1
                pos = body.find(BLOCK_OPEN, end)
