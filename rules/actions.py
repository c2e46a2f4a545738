"""What each action does to one text (or to the tool list).

Every function here is pure: text in, text out, plus how many times the action took effect. An
application is counted only when it changes the prompt, so a second pass over an already canonical
prompt counts nothing.

Removal (``hoist`` and ``drop``) tidies what it leaves behind, from the original text around each span:
a line left holding only spaces is removed with its line break; otherwise a space doubled or left
dangling by the removal is removed; blank lines the removal left at the start or end of a text that had
none there are removed too. All matches of one rule in one text are applied in a single
left-to-right rebuild, so the work is linear in the text length however many matches there are.

Patterns match a view of the text in which the no-break and other typographic spaces (U+00A0, U+202F, ...)
read as plain spaces (``match_view``): a label or date typed with them ("Current\u00a0date:", a browser's
"10:14\u202fAM") is matched as it would be with spaces, while what is hoisted or kept is the original text.
The view has the text's length, so every span found in it is a span of the text.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from typing import Any

from rules.markdown import code_ranges, overlaps
from rules.model import ROUND_UNITS, NormalizeOptions, Rule
from rules.patterns import base_group_name, group_span, group_texts

_AM_CJK = {"오후": "오전", "오전": "오전", "午後": "午前", "午前": "午前"}
_AM_ZH = ("上午", "下午", "中午", "晚上", "凌晨", "早上")


SPACE_LIKE = "\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f"
"""Typographic spaces patterns read as U+0020: no-break (U+00A0), en to hair spaces (U+2002-U+200A), narrow
no-break (U+202F, in ICU's "10:14\u202fAM") and the medium mathematical space. The ideographic space (U+3000)
is not here: the CJK patterns name it where it separates."""

_SPACE_LIKE_RE = re.compile(f"[{SPACE_LIKE}]")
_SPACE_VIEW = str.maketrans(dict.fromkeys(SPACE_LIKE, " "))


@functools.lru_cache(maxsize=16)
def match_view(text: str) -> str:
    """``text`` with each ``SPACE_LIKE`` character replaced by a space (``text`` itself when it has none).

    Same length as ``text``, so a match's offsets in the view are offsets in ``text``. Cached: every rule of a
    pass reads the same texts (at most 16 are held).
    """
    if _SPACE_LIKE_RE.search(text) is None:
        return text
    return text.translate(_SPACE_VIEW)


def apply_span_action(rule: Rule, text: str) -> tuple[str, int, list[str]]:
    """Apply a span action (hoist, drop, replace, round, reorder) to every match of ``rule.pattern`` in
    ``text``.

    Returns:
        (new text, number of applications, hoisted values in order of appearance). Hoisted values are the
        matched span stripped of surrounding whitespace and of a trailing item separator (`` |``); where the
        pattern has a group named ``hoisted`` (``HOISTED_GROUP``) that took part, that group's text is the
        value and the rule's ``group`` only says what is removed.
    """
    if rule.action == "keep":
        return text, 0, []  # a keep rule changes nothing itself: it protects text from the other rules
    if rule.action in ("hoist", "drop"):
        return _remove_matches(rule, text)
    edits: list[tuple[int, int, str]] = []
    for match in _matches(rule, text):
        if rule.action == "replace":
            start, end = group_span(match, rule.group)
            if start < 0:
                continue
            new = rule.template.render(group_texts(match))
        elif rule.action == "reorder":
            start, end = match.span()
            new = rule.template.render(group_texts(match))
        else:  # round
            start, end = match.span()
            new = round_match(match, rule.unit)
        if new != text[start:end]:
            edits.append((start, end, new))
    return _splice(text, edits), len(edits), []


HOISTED_GROUP = "hoisted"
"""A hoist pattern's group naming what is moved when it is not all that is removed: a JSON member's
``"key": value`` without the comma that goes with it (``ids.json-member``)."""


def _remove_matches(rule: Rule, text: str) -> tuple[str, int, list[str]]:
    ranges: list[tuple[int, int]] = []
    values: list[str] = []
    named_value = HOISTED_GROUP in rule.pattern.groupindex
    for match in _matches(rule, text):
        start, end = group_span(match, rule.group)
        if start < 0 or not text[start:end].strip():
            continue  # a group that did not take part, or only whitespace: nothing to move or drop
        value_start, value_end = group_span(match, HOISTED_GROUP) if named_value else (start, end)
        if value_start < 0:
            value_start, value_end = start, end
        values.append(_trim_separator(text[value_start:value_end].strip()))
        ranges.append(removal_range(match_view(text), start, end))
    if not ranges:
        return text, 0, []
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    new_text = _splice(text, [(s, e, "") for s, e in merged])
    # lines removed at the start or the end leave no blank line leading or ending the text: the prompt reads as
    # the same prompt written without them
    if new_text.startswith("\n") and not text.startswith("\n"):
        new_text = new_text.lstrip("\n")
    if new_text.endswith("\n") and not text.endswith("\n"):
        new_text = new_text.rstrip("\n")
    return new_text, len(values), (values if rule.action == "hoist" else [])


_ITEM_SEPARATORS = ("|", "·", "•")


def _trim_separator(value: str) -> str:
    """A hoisted value without the item separator (`` | ``) a pattern took along so that the text it leaves
    reads right ("A | B | C" without B is "A | C")."""
    if value.endswith(_ITEM_SEPARATORS) and value[:-1].rstrip() != value[:-1]:
        return value[:-1].rstrip()
    return value


def _matches(rule: Rule, text: str) -> list[Any]:
    """Non-empty matches of the rule's pattern, left to right, minus those whose acted-on span (the rule's
    group for hoist, drop and replace) overlaps text a ``keep`` rule of the same rule set protects
    (``rule.kept_by``) or, when ``rule.skip_code``, a fenced or indented code block.

    A rejected match does not hide a later one that overlaps it: the search goes on from just after the
    rejected match's start (from near the end of the protected range when the match starts inside it, so
    the work stays linear in the number of protected ranges).

    The pattern reads ``match_view(text)``: the matches' groups hold the view's text (plain spaces).
    """
    text = match_view(text)
    if not rule.kept_by and not rule.skip_code:
        return [m for m in rule.pattern.finditer(text) if m.end() > m.start()]
    protected: tuple[tuple[int, int], ...] | None = None
    acted = rule.group if rule.action in ("hoist", "drop", "replace") else 0
    out: list[Any] = []
    pos: int | None = 0
    while pos is not None and pos <= len(text):
        resume = None
        for match in rule.pattern.finditer(text, pos):  # one scan while nothing is rejected
            if match.end() == match.start():
                continue
            if protected is None:
                protected = _protected_ranges(rule.kept_by, rule.skip_code, text)
            if protected and overlaps(protected, *_acted_span(match, acted)):
                inside = _range_containing(protected, match.start())
                resume = match.start() + 1
                if inside is not None:
                    resume = max(resume, inside[1] - _RESUME_SLACK)
                break
            out.append(match)
        pos = resume
    return out


_RESUME_SLACK = 8
"""Characters before the end of a protected range where the search resumes after a match that started inside
it: a pattern may consume a few characters before what it acts on (the end of the previous sentence)."""


def _range_containing(ranges: tuple[tuple[int, int], ...], pos: int) -> tuple[int, int] | None:
    """The range of the sorted, disjoint ``ranges`` holding ``pos``, or None."""
    lo, hi = 0, len(ranges)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges[mid][1] <= pos:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(ranges) and ranges[lo][0] <= pos:
        return ranges[lo]
    return None


def _acted_span(match: Any, group: int | str) -> tuple[int, int]:
    """The span a rule acts on (its group; the whole match when the group did not take part): text
    consumed around it, such as the end of the previous sentence, may be protected."""
    start, end = group_span(match, group)
    return (start, end) if start >= 0 else match.span()


@functools.lru_cache(maxsize=16)
def _protected_ranges(
    keep_rules: tuple[Rule, ...], skip_code: bool, text: str
) -> tuple[tuple[int, int], ...]:
    """Ranges of ``text`` that ``keep_rules`` protect, plus its code blocks when ``skip_code``. Cached: every
    rule of a pass asks about the same texts (a hit costs the hash of the text, which Python keeps; at most
    16 texts are held)."""
    protected = kept_ranges(keep_rules, text)
    if skip_code:
        protected = _merge(protected + code_ranges(text))
    return tuple(protected)


def kept_ranges(keep_rules: tuple[Rule, ...], text: str) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) ranges of ``text`` that ``keep`` rules protect (each rule's ``group``)."""
    ranges: list[tuple[int, int]] = []
    for keep in keep_rules:
        for match in keep.pattern.finditer(text):
            start, end = group_span(match, keep.group)
            if end > start:
                ranges.append((start, end))
    return _merge(ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def removal_range(text: str, start: int, end: int) -> tuple[int, int]:
    """The range to delete so that removing ``text[start:end]`` leaves tidy text.

    A line that would be left blank, or holding only a list marker ("-", "*", "1."), goes with one of its line
    breaks; the last item of a line of items
    ("A | B") takes its separator along; otherwise one of two space runs that would meet is removed, and a
    space run left at a line's end or start is removed.

    Reads only the whitespace runs around the match (never the rest of its line): many matches on one long
    line (a 3 MB one-line JSON prompt) cost time linear in the matches, where slicing the line each time made
    one request take ~50 s (a fresh-user trial).
    """
    n = len(text)
    b = start  # back over the blanks before the match: at a line break (or the start), the line before is blank
    while b > 0 and text[b - 1] in " \t\r":
        b -= 1
    a = end
    while a < n and text[a] in " \t\r":
        a += 1
    before_blank = b == 0 or text[b - 1] == "\n"
    after_blank = a == n or text[a] == "\n"
    if not before_blank and after_blank and b < start:
        # a list item whose whole text goes ("- The user is in Paris."): its marker goes with it
        bullet_line = _list_marker_line_start(text, b)
        if bullet_line is not None:
            b, before_blank = bullet_line, True
    if before_blank and after_blank:
        if a < n:
            return b, a + 1
        return max(b - 1, 0), a
    p = start  # where the text before the match ends without its spaces and tabs
    while p > 0 and text[p - 1] in " \t":
        p -= 1
    s = end  # where the text after the match starts without its spaces and tabs
    while s < n and text[s] in " \t":
        s += 1
    if p > 0 and text[p - 1] in _ITEM_SEPARATORS and after_blank and _text_before_on_line(text, p - 1):
        # the last item of "A | B": its separator goes with it
        r = p - 1
        while r > 0 and text[r - 1] in " \t":
            r -= 1
        return r, s
    spaces_before, spaces_after = start - p, s - end
    if spaces_before and spaces_after:
        return start, s
    if spaces_before and after_blank:
        return p, end
    if spaces_after and (start == 0 or text[start - 1] == "\n"):
        return start, s
    return start, end


_LIST_MARKERS = "-*•+"


def _list_marker_line_start(text: str, at: int) -> int | None:
    """The start of the line holding ``at`` when ``text`` from there to ``at`` is only indentation and one list
    marker ("-", "*", "•", "+", or 1-3 digits and "." or ")"); None otherwise. Reads only that marker and
    indentation."""
    q = at
    if q > 0 and text[q - 1] in _LIST_MARKERS:
        q -= 1
    elif q > 1 and text[q - 1] in ".)":
        r = q - 1
        while r > 0 and q - 1 - r < 3 and "0" <= text[r - 1] <= "9":
            r -= 1
        if r == q - 1:
            return None
        q = r
    else:
        return None
    while q > 0 and text[q - 1] in " \t":
        q -= 1
    return q if q == 0 or text[q - 1] == "\n" else None


def _text_before_on_line(text: str, at: int) -> bool:
    """Whether the line holding ``text[at]`` has a character other than whitespace before ``at``."""
    q = at
    while q > 0 and text[q - 1] != "\n" and text[q - 1].isspace():
        q -= 1
    return q > 0 and text[q - 1] != "\n"


def _splice(text: str, edits: list[tuple[int, int, str]]) -> str:
    """Apply non-overlapping (start, end, replacement) edits, sorted by start, in one pass."""
    if not edits:
        return text
    pieces: list[str] = []
    pos = 0
    for start, end, new in edits:
        pieces.append(text[pos:start])
        pieces.append(new)
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces)


def round_match(match: Any, unit: str) -> str:
    """The matched text with its time truncated (floored) to ``unit`` (minute, hour or day), in the
    original format: the digits of the ``second``/``fraction`` (minute), also ``minute`` (hour), also
    ``hour`` (day) groups become zeros of the same width; for day, a 12-hour clock (an ``ampm`` group took
    part) becomes 12 AM in the clock's own style (AM/am/a.m., 오전, 午前, 上午). ``epoch_s`` and
    ``epoch_ms`` groups are floored to the unit (UTC days). Flooring never changes the date, so the
    date part of the text needs no calendar arithmetic.
    """
    text = match.group(0)
    base = match.start()
    spans: list[tuple[int, int, str]] = []
    for name, index in match.re.groupindex.items():
        start, end = match.span(index)
        if start >= 0:
            spans.append((start - base, end - base, base_group_name(name)))
    twelve_hour = any(kind == "ampm" for _, _, kind in spans)
    zeroed = {
        "minute": ("second", "fraction"),
        "hour": ("second", "fraction", "minute"),
        "day": ("second", "fraction", "minute", "hour"),
    }[unit]
    edits: list[tuple[int, int, str]] = []
    for start, end, kind in spans:
        value = text[start:end]
        if kind in zeroed:
            new = "12" if (kind == "hour" and twelve_hour) else "0" * len(value)
        elif kind == "ampm" and unit == "day":
            new = am_form(value)
        elif kind in ("epoch_s", "epoch_ms") and value.isdigit():
            step = ROUND_UNITS[unit] * (1000 if kind == "epoch_ms" else 1)
            new = str(int(value) - int(value) % step).rjust(len(value), "0")
        else:
            continue
        if new != value:
            edits.append((start, end, new))
    edits.sort()
    kept: list[tuple[int, int, str]] = []
    for edit in edits:  # nested groups: the outer edit wins
        if kept and edit[0] < kept[-1][1]:
            continue
        kept.append(edit)
    return _splice(text, kept)


def am_form(ampm: str) -> str:
    """The ante-meridiem marker in the style of ``ampm`` (PM -> AM, p.m. -> a.m., 오후 -> 오전, 午後 -> 午前,
    下午 -> 上午)."""
    if ampm in _AM_CJK:
        return _AM_CJK[ampm]
    if ampm in _AM_ZH:
        return "上午"
    if ampm[:1] in "Pp":
        return ("A" if ampm[0] == "P" else "a") + ampm[1:]
    return ampm


def normalize_text(text: str, options: NormalizeOptions) -> str:
    """``text`` with Unicode normalized, line endings made LF, trailing spaces and tabs removed from every
    line, and runs of blank lines cut to ``options.blank_lines`` (in that order; with trailing spaces kept,
    only empty lines count as blank).

    With ``options.skip_code`` the lines of fenced and indented code blocks (``rules.markdown.code_ranges``,
    fences included) keep their trailing spaces and their blank-line runs. With ``options.hard_breaks`` a
    Markdown hard line break (a line of text ending in two or more spaces, followed by a line of text,
    CommonMark 6.7) keeps exactly two trailing spaces. The result is a fixed point: normalizing it again
    changes nothing.
    """
    if options.unicode:
        text = unicodedata.normalize(options.unicode, text)
    if options.line_endings:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not options.skip_code and not options.hard_breaks:
        if options.trailing_spaces:
            text = "\n".join(line.rstrip(" \t") for line in text.split("\n"))
        if options.blank_lines is not None:
            keep = options.blank_lines + 1
            text = re.sub("\n{" + str(keep + 1) + ",}", "\n" * keep, text)
        return text
    return _normalize_lines(text, options)


def _normalize_lines(text: str, options: NormalizeOptions) -> str:
    """``normalize_text``'s line pass when code blocks or hard breaks are kept."""
    lines = text.split("\n")
    code_line = [False] * len(lines)
    if options.skip_code:
        starts = [0]
        for line in lines[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        index = 0
        for start, end in code_ranges(text):
            while index < len(lines) and starts[index] < start:
                index += 1
            while index < len(lines) and starts[index] < end:
                code_line[index] = True
                index += 1
    out: list[str] = []
    blank_run = 0
    for i, line in enumerate(lines):
        if code_line[i]:
            out.append(line)
            blank_run = 0
            continue
        if options.trailing_spaces:
            stripped = line.rstrip(" \t")
            if (
                options.hard_breaks
                and stripped.strip()
                and line.endswith("  ")
                and i + 1 < len(lines)
                and lines[i + 1].strip(" \t")
                and not code_line[i + 1]
            ):
                stripped += "  "
            line = stripped
        blank = not line if options.trailing_spaces else line == ""
        if blank:
            blank_run += 1
            if options.blank_lines is not None and blank_run > options.blank_lines:
                continue
        else:
            blank_run = 0
        out.append(line)
    return "\n".join(out)


def canonical_json_value(value: Any) -> Any:
    """``value`` with every object's keys sorted, recursively (arrays keep their order: in JSON Schema,
    ``enum``, ``required``, ``anyOf``... are arrays whose order a model may read)."""
    if isinstance(value, dict):
        return {k: canonical_json_value(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [canonical_json_value(v) for v in value]
    return value


def canonical_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, separators ``,`` and ``:`` without spaces, UTF-8 kept
    (``ensure_ascii=False``). Equal values give equal text."""
    return _CANONICAL_JSON.encode(value)


_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
"""``canonical_json``'s encoder, made once (``json.dumps`` with arguments builds one per call; the rules and the
transcript memory call it several times per request)."""


def tool_name(tool: dict[str, Any]) -> str:
    """A tool's name: OpenAI ``function.name``, else Anthropic's top-level ``name``, else ``""``."""
    function = tool.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return function["name"]
    name = tool.get("name")
    return name if isinstance(name, str) else ""


def sort_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools ordered by name (ties by canonical JSON), each with its keys sorted recursively. Semantics
    are kept: JSON objects are unordered (RFC 8259 section 4), arrays and all values are untouched."""
    canonical = [canonical_json_value(t) for t in tools]
    return sorted(canonical, key=lambda t: (tool_name(t), canonical_json(t)))
