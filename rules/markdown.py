"""Markdown structure the rules must respect: fenced and indented code blocks.

Shipped packs set ``match.skip_code: true`` so that a value inside a code example
(``sha = 'deadbeefdeadbeef00'``, ``created = 1715692800``) is never hoisted out of the code, and the
whitespace pack leaves code blocks exactly as sent.

Invariants: every function is linear in ``len(text)``; ranges are sorted, disjoint ``[start, end)``
character offsets that start and end on line boundaries.
"""

from __future__ import annotations

PROSE_INFO = frozenset(
    {"", "markdown", "md", "text", "txt", "plaintext", "plain", "prompt", "system", "instructions"}
)
"""Info strings of a fence that, when it wraps the whole text, marks prose rather than code: a prompt sent
wrapped in one fence still gets its rules."""


def _fence(line: str) -> tuple[str, int, str, int] | None:
    """(fence character, run length, info string, indentation) when ``line`` is a fence line (any
    indentation), else None."""
    stripped = line.strip(" \t\r\n")
    if stripped[:1] not in ("`", "~"):
        return None
    char = stripped[0]
    run = len(stripped) - len(stripped.lstrip(char))
    if run < 3:
        return None
    info = stripped[run:].strip(" \t")
    if char == "`" and "`" in info:
        return None  # inline code such as ```a``` is not a fence (CommonMark 4.5)
    return char, run, info, _indent(line)


def _fenced_ranges(lines: list[str], nested: bool) -> tuple[list[tuple[int, int]], bool]:
    """Fenced ranges over ``lines`` (kept ends). With ``nested``, a fence line with an info string inside an
    open block opens a nested block (closed by the next bare fence), as people write a ```python example
    inside a ```markdown one; without, CommonMark's rule (the first fence at least as long closes).
    Returns (ranges, whether a block was left open at the end)."""
    ranges: list[tuple[int, int]] = []
    stack: list[tuple[str, int, int]] = []
    block_start = 0
    pos = 0
    for line in lines:
        fence = _fence(line)
        if fence is not None:
            char, run, info, indent = fence
            if not stack:
                stack.append((char, run, indent))
                block_start = pos
            elif char == stack[-1][0] and run >= stack[-1][1] and not info and indent <= stack[-1][2] + 3:
                stack.pop()
                if not stack:
                    ranges.append((block_start, pos + len(line)))
            elif nested and info and char == stack[-1][0] and run <= stack[-1][1]:
                stack.append((char, run, indent))
        pos += len(line)
    if stack:
        ranges.append((block_start, pos))
    return ranges, bool(stack)


def fenced_code_ranges(text: str) -> list[tuple[int, int]]:
    """Character ranges [start, end) of fenced code blocks, fences included.

    Follows CommonMark (https://spec.commonmark.org/0.31.2/#fenced-code-blocks) for what a fence is (3+
    backticks or tildes; a backtick fence's info string holds no backtick; a closing fence has no info
    string, is at least as long as the opening one and indented at most 3 columns more), with three
    differences that keep real prompts right: a fence may be indented any amount (fences inside list items
    and indented examples; a closing fence is then measured from its opening fence), a fence
    with an info string inside an open block opens a nested block when that reading closes every block
    and the CommonMark reading does not, and a fence wrapping the whole text with a prose info string
    (``PROSE_INFO``) is not code: the ranges inside it are returned instead. An unclosed block runs to the
    end of the text.
    """
    lines = text.splitlines(keepends=True)
    if not lines:
        return []
    wrapped = _whole_text_fence(lines)
    if wrapped is not None:
        first, last = wrapped
        offset = sum(len(line) for line in lines[: first + 1])
        inner = "".join(lines[first + 1 : last])
        return [(s + offset, e + offset) for s, e in fenced_code_ranges(inner)]
    nested, nested_open = _fenced_ranges(lines, nested=True)
    if not nested_open:
        return nested
    flat, flat_open = _fenced_ranges(lines, nested=False)
    if not flat_open:
        return flat
    return nested if nested[-1][0] >= flat[-1][0] else flat


def _whole_text_fence(lines: list[str]) -> tuple[int, int] | None:
    """(index of the opening line, index of the closing line) when the first and last non-blank lines are a
    prose fence pair (same character, bare closing fence at least as long), else None."""
    body = [i for i, line in enumerate(lines) if line.strip()]
    if len(body) < 2:
        return None
    first, last = body[0], body[-1]
    opening, closing = _fence(lines[first]), _fence(lines[last])
    if opening is None or closing is None or closing[2] or opening[2].lower() not in PROSE_INFO:
        return None
    if closing[0] != opening[0] or closing[1] < opening[1]:
        return None
    inner, inner_open = _fenced_ranges(lines[first + 1 : last], nested=True)
    if inner_open:
        return None  # the last fence closes something inside: the first fence is not a wrapper
    return first, last


def _is_blank(line: str) -> bool:
    return not line.strip(" \t\r\n")


def _indent(line: str) -> int:
    width = 0
    for ch in line:
        if ch == " ":
            width += 1
        elif ch == "\t":
            width += 4 - width % 4
        else:
            break
    return width


def _is_list_item(line: str) -> bool:
    stripped = line.lstrip(" \t")
    if stripped[:2] in ("- ", "* ", "+ ", "• ") or stripped[:1] in ("-", "*", "+") and stripped[1:2] == "\t":
        return True
    digits = len(stripped) - len(stripped.lstrip("0123456789"))
    return (
        0 < digits <= 9
        and stripped[digits : digits + 1] in (".", ")")
        and stripped[digits + 1 : digits + 2] in (" ", "\t", "\n", "")
    )


def indented_code_ranges(text: str, fenced: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Character ranges [start, end) of indented code blocks (CommonMark 4.4): a run of lines indented 4+
    columns (blank lines inside it included, trailing blank lines not) that follows a blank line or the start
    of the text and is not a list item's continuation (the last non-blank line before it is not a list item
    or itself indented) nor inside a fenced block (``fenced``, computed when None)."""
    fenced = fenced_code_ranges(text) if fenced is None else fenced
    lines = text.splitlines(keepends=True)
    ranges: list[tuple[int, int]] = []
    pos = 0
    prev_blank = True
    last_text = ""  # the last non-blank line outside code
    block: tuple[int, int] | None = None
    fence_index = 0
    for line in lines:
        while fence_index < len(fenced) and fenced[fence_index][1] <= pos:
            fence_index += 1
        in_fence = fence_index < len(fenced) and fenced[fence_index][0] <= pos
        blank = _is_blank(line)
        if block is not None:
            if blank:
                pos += len(line)
                continue
            if _indent(line) >= 4 and not in_fence:
                block = (block[0], pos + len(line))
                pos += len(line)
                continue
            ranges.append(block)
            block = None
            prev_blank = False  # a run of blank lines ended the block, or text interrupted it
        if (
            not in_fence
            and not blank
            and _indent(line) >= 4
            and prev_blank
            and not _is_list_item(last_text)
            and _indent(last_text) < 2
        ):
            block = (pos, pos + len(line))
        elif not blank:
            last_text = line if not in_fence else ""
        prev_blank = blank
        pos += len(line)
    if block is not None:
        ranges.append(block)
    return ranges


def code_ranges(text: str) -> list[tuple[int, int]]:
    """Fenced and indented code block ranges of ``text``, sorted and merged."""
    if "```" not in text and "~~~" not in text and "    " not in text and "\t" not in text:
        return []
    fenced = fenced_code_ranges(text)
    merged: list[tuple[int, int]] = []
    for start, end in sorted(fenced + indented_code_ranges(text, fenced)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """True when [start, end) overlaps any of the sorted, disjoint ``ranges``."""
    lo, hi = 0, len(ranges)
    while lo < hi:  # first range whose end is after start
        mid = (lo + hi) // 2
        if ranges[mid][1] <= start:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(ranges) and ranges[lo][0] < end
