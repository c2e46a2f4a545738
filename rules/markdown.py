"""Markdown structure the rules must respect: fenced code blocks.

Shipped packs set ``match.skip_code: true`` so that a value inside a code example
(``sha = 'deadbeefdeadbeef00'``, ``created = 1715692800``) is never hoisted out of the code.
"""

from __future__ import annotations


def fenced_code_ranges(text: str) -> list[tuple[int, int]]:
    """Character ranges [start, end) of fenced code blocks, fences included.

    Follows CommonMark (https://spec.commonmark.org/0.31.2/#fenced-code-blocks): an opening fence is a
    line indented at most 3 spaces starting with 3+ backticks or tildes; the block closes at a line
    (indented at most 3 spaces) of the same character, at least as long, followed only by spaces; an
    unclosed block runs to the end of the text. Linear in ``len(text)``.
    """
    ranges: list[tuple[int, int]] = []
    fence_char = ""
    fence_len = 0
    block_start = 0
    pos = 0
    for line in text.splitlines(keepends=True):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        body = stripped.rstrip("\r\n")
        if indent <= 3 and body[:1] in ("`", "~"):
            char = body[0]
            run = len(body) - len(body.lstrip(char))
            if not fence_char and run >= 3 and not (char == "`" and "`" in body[run:]):
                fence_char, fence_len, block_start = char, run, pos
            elif fence_char and char == fence_char and run >= fence_len and not body[run:].strip(" \t"):
                ranges.append((block_start, pos + len(line)))
                fence_char = ""
        pos += len(line)
    if fence_char:
        ranges.append((block_start, len(text)))
    return ranges


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
