"""Rule patterns: ``%{FRAGMENT}`` expansion and compilation with google-re2 (linear-time matching).

Every user pattern runs on RE2 (https://github.com/google/re2/wiki/Syntax), whose matching time is
linear in the length of the text whatever the pattern, so no rule can hang the gateway. RE2 has no
look-around and no back-references; such patterns fail at load time.

Fragments: a rule file may define named regex pieces under ``patterns:`` (names in ``UPPER_CASE``) and
use them as ``%{NAME}``; the shipped ``_fragments.yaml`` pieces (dates, clocks, UUIDs...) are visible to
every file. Expansion wraps each fragment in ``(?:...)`` and renames the named groups inside it by
appending ``__N`` (N counts expansions within one pattern), so one fragment may be used twice in a
pattern; ``round`` strips that suffix when it looks for ``hour``, ``minute``...
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from typing import Any

import re2

from rules.model import Template

FRAGMENT_NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_FRAGMENT_REF = re.compile(r"%\{([^}]*)\}")
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?P?<([A-Za-z_][A-Za-z0-9_]*)>")
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


class PatternError(ValueError):
    """A pattern or template is invalid; the message says why (the loader adds file, line and rule id)."""


def expand_fragments(source: str, fragments: Mapping[str, str]) -> str:
    """``source`` with every ``%{NAME}`` replaced by its fragment (recursively), named groups inside
    fragments renamed ``NAME__N``.

    Raises:
        PatternError: unknown fragment, malformed reference, or a fragment that refers to itself.
    """
    counter = itertools.count(1)
    return _expand(source, fragments, counter, ())


def _expand(source: str, fragments: Mapping[str, str], counter: Iterator[int], stack: tuple[str, ...]) -> str:
    def substitute(m: re.Match[str]) -> str:
        name = m.group(1)
        if not FRAGMENT_NAME.match(name):
            raise PatternError(f"bad fragment reference %{{{name}}} (names are UPPER_CASE)")
        if name not in fragments:
            raise PatternError(f"unknown fragment %{{{name}}}")
        if name in stack:
            raise PatternError(f"fragment %{{{name}}} refers to itself ({' -> '.join(stack + (name,))})")
        body = _expand(fragments[name], fragments, counter, stack + (name,))
        suffix = f"__{next(counter)}"
        body = _NAMED_GROUP.sub(
            lambda g: g.group(0)[: -1 - len(g.group(1))] + g.group(1) + suffix + ">", body
        )
        return "(?:" + body + ")"

    return _FRAGMENT_REF.sub(substitute, source)


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    return options


def compile_pattern(source: str, fragments: Mapping[str, str], allow_empty: bool = False) -> Any:
    """Expand fragments and compile with RE2 (``allow_empty`` is for fragments, which may be optional).

    Returns:
        the compiled ``re2`` pattern (``finditer``, ``groupindex``, ``groups``).

    Raises:
        PatternError: bad fragment, a pattern RE2 rejects (its message included), or a pattern that
            matches the empty string (it would act on every position of every text).
    """
    expanded = expand_fragments(source, fragments)
    try:
        compiled = re2.compile(expanded, _options())
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternError(f"bad regex (RE2 syntax): {reason}") from None
    if not allow_empty and compiled.search("") is not None:
        raise PatternError("pattern matches the empty string")
    return compiled


def base_group_name(name: str) -> str:
    """A group name without the ``__N`` suffixes fragment expansion adds (``hour__3__7`` -> ``hour``)."""
    return name.split("__", 1)[0]


def check_group(compiled: Any, group: int | str) -> None:
    """Raise PatternError unless ``group`` (number or name) exists in ``compiled``."""
    if isinstance(group, bool) or not isinstance(group, int | str):
        raise PatternError(f"group must be a number or a group name, not {group!r}")
    if isinstance(group, int):
        if not 0 <= group <= compiled.groups:
            raise PatternError(f"group {group} does not exist (the pattern has {compiled.groups} groups)")
    elif group not in compiled.groupindex:
        names = ", ".join(sorted(compiled.groupindex)) or "none"
        raise PatternError(f"group '{group}' does not exist (named groups: {names})")


def parse_template(source: str, compiled: Any) -> Template:
    """Parse a ``{group}`` template and check each reference against ``compiled``'s groups.

    ``{name}`` refers to a named group, ``{3}`` to a numbered one, ``{{``/``}}`` are literal braces.

    Raises:
        PatternError: a lone brace, an empty reference, or a reference to a group that does not exist.
    """
    pieces: list[str | int | tuple[str]] = []
    pos = 0
    for m in _TEMPLATE_TOKEN.finditer(source):
        if m.start() > pos:
            pieces.append(source[pos : m.start()])
        token = m.group(0)
        if token in ("{{", "}}"):
            pieces.append(token[0])
        elif token in ("{", "}"):
            raise PatternError(f"lone '{token}' in template at character {m.start()} (write '{token * 2}')")
        else:
            ref = m.group(1).strip()
            if not ref:
                raise PatternError("empty {} in template")
            if ref.isdigit():
                check_group(compiled, int(ref))
                pieces.append(int(ref))
            else:
                check_group(compiled, ref)
                pieces.append((ref,))
        pos = m.end()
    if pos < len(source):
        pieces.append(source[pos:])
    return Template(source=source, pieces=tuple(pieces))


def group_texts(match: Any) -> dict[int | str, str]:
    """All groups of an re2 match by number and by name (groups that did not take part are left out)."""
    out: dict[int | str, str] = {}
    for i in range(match.re.groups + 1):
        text = match.group(i)
        if text is not None:
            out[i] = text
    for name, i in match.re.groupindex.items():
        if i in out:
            out[name] = out[i]
    return out


def group_span(match: Any, group: int | str) -> tuple[int, int]:
    """(start, end) character offsets of ``group`` in ``match``; (-1, -1) when it did not take part.
    (The re2 wrapper's ``span`` takes numbers only, so names are resolved through ``groupindex``.)"""
    index = group if isinstance(group, int) else match.re.groupindex[group]
    return match.span(index)
