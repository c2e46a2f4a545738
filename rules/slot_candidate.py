"""A candidate slot and its value shape: what is kept of the values seen between two anchors, and the RE2
value class and escaping built from it.

Owns ``SlotCandidate`` (anchors, value hashes, lengths, character classes, counts, when it became a slot),
``value_classes``, ``escape_re2``, ``value_class`` (the bounded RE2 value class), ``short_hash`` and
``describe``.

Invariants: values are never stored, only 8-byte BLAKE2b hashes (``short_hash``), lengths and character
classes; at most ``max_value_hashes`` hashes per candidate; a value whose characters are too varied
(more than 24 distinct punctuation characters together with the earlier ones) is refused; every RE2 source
built here is linear-time (escaped literals and a bounded character class, no backreference).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")

_MAX_PUNCT = 24


@dataclass
class SlotCandidate:
    """A candidate slot of one model+tenant: its anchors, and the shape of the values seen between them
    (hashes, lengths, character classes; never a value). It is a learned slot from ``slot_since`` on."""

    left: str
    right: str
    at_start: bool
    at_end: bool
    value_hashes: set[bytes] = field(default_factory=set)
    min_len: int = 1 << 30
    max_len: int = 0
    classes: set[str] = field(default_factory=set)
    punct: set[str] = field(default_factory=set)
    observations: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    slot_since: float | None = None

    def add_value(self, value: str, digest: bytes, cap: int) -> bool:
        """Record one value's shape; False when its characters are too varied to be a value class."""
        classes, punct = value_classes(value)
        if len(self.punct | punct) > _MAX_PUNCT:
            return False
        self.classes |= classes
        self.punct |= punct
        self.min_len = min(self.min_len, len(value))
        self.max_len = max(self.max_len, len(value))
        if len(self.value_hashes) < cap:
            self.value_hashes.add(digest)
        return True


def value_classes(value: str) -> tuple[set[str], set[str]]:
    """(character classes, punctuation characters) of a value: classes among ``digit``, ``lower``, ``upper``,
    ``space``, ``letter`` (non-ASCII letters), ``number`` (non-ASCII digits); every other character is
    returned as itself in the second set."""
    classes: set[str] = set()
    punct: set[str] = set()
    for c in value:
        if "0" <= c <= "9":
            classes.add("digit")
        elif "a" <= c <= "z":
            classes.add("lower")
        elif "A" <= c <= "Z":
            classes.add("upper")
        elif c in " \t":
            classes.add("space")
        elif c in _ASCII_PUNCT:
            punct.add(c)
        elif c.isalpha():
            classes.add("letter")
        elif c.isdigit():
            classes.add("number")
        else:
            punct.add(c)
    return classes, punct


def escape_re2(text: str) -> str:
    """``text`` as an RE2 literal: ASCII punctuation backslash-escaped (``%`` too, so no ``%{NAME}`` fragment
    reference can appear), ``\\n``/``\\t``/``\\r`` written as escapes, other control characters as
    ``\\x{HH}``; letters, digits, spaces and non-ASCII characters kept as they are."""
    out: list[str] = []
    for c in text:
        if c == "\n":
            out.append(r"\n")
        elif c == "\t":
            out.append(r"\t")
        elif c == "\r":
            out.append(r"\r")
        elif c in _ASCII_PUNCT:
            out.append("\\" + c)
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\x{{{ord(c):02X}}}")
        else:
            out.append(c)
    return "".join(out)


def short_hash(*parts: str | bytes) -> bytes:
    """8-byte BLAKE2b of the parts, each prefixed by its length (so no two part lists collide by
    concatenation): the one-way hash of values, anchors and slot ids."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        data = p.encode("utf-8") if isinstance(p, str) else p
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def value_class(candidate: SlotCandidate, max_span: int) -> str:
    """The RE2 value class of a candidate: the classes its values used, lengths from half the shortest to
    twice the longest (within 1..``max_span``), matched lazily so the nearest right anchor ends it."""
    members = []
    order = (
        ("digit", "0-9"),
        ("lower", "a-z"),
        ("upper", "A-Z"),
        ("space", " "),
        ("letter", r"\p{L}"),
        ("number", r"\p{N}"),
    )
    for name, piece in order:
        if name in candidate.classes:
            members.append(piece)
    for c in sorted(candidate.punct):
        members.append(escape_re2(c) if c in _ASCII_PUNCT or ord(c) < 32 else c)
    lo = max(1, candidate.min_len // 2)
    hi = max(lo, min(max_span, candidate.max_len * 2))
    return f"[{''.join(members)}]{{{lo},{hi}}}?"


def describe(candidate: SlotCandidate) -> str:
    """The rule description of a slot: distinct values, their lengths and observations (no value)."""
    return (
        f"learned slot: {len(candidate.value_hashes)} distinct values of {candidate.min_len}-"
        f"{candidate.max_len} characters, seen {candidate.observations} times"
    )
