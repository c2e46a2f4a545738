"""The rule data model: what a validated rule is, independent of YAML.

A ``Rule`` is immutable once loaded. Its fields are filled by ``rules.loader`` after validation, so code
that applies rules never re-checks them: a span action always has a compiled pattern, ``round`` always a
unit, ``replace``/``reorder`` always a parsed template whose group references exist in the pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

ACTIONS: tuple[str, ...] = ("hoist", "replace", "round", "drop", "normalize", "sort_tools", "reorder", "keep")
"""Every action a rule may name."""

SPAN_ACTIONS: frozenset[str] = frozenset({"hoist", "replace", "round", "drop", "reorder", "keep"})
"""Actions that act on regex matches inside message text (they need ``match.pattern``). ``keep`` changes
nothing itself: the text it matches (its ``group``) is left alone by every other span rule of the set."""

PLACEMENTS: tuple[str, ...] = ("tail_end", "last_user_prefix", "before_last_user", "system_end")
"""Where hoisted values are re-inserted (see ``rules.placement``). The first is the default."""

DEFAULT_PLACEMENT = "tail_end"

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
"""Roles a ``match.role`` may name (``any`` selects every role)."""

POSITIONS: tuple[str, ...] = ("any", "first", "last")

ROUND_UNITS: dict[str, int] = {"minute": 60, "hour": 3600, "day": 86400}
"""``round`` units and their length in seconds (used for epoch values)."""

ROUND_GROUPS: tuple[str, ...] = ("hour", "minute", "second", "fraction", "ampm", "epoch_s", "epoch_ms")
"""Named groups ``round`` understands (a ``__N`` suffix, added by fragment expansion, is ignored)."""


PRIVATE = "private"
"""The per-request flag of a system value hoisted by a ``private`` rule (``Rule.private``), beside True and False
(``rules.transcript.conversation_scope``)."""


@dataclass(frozen=True)
class MessageSelector:
    """Which messages a rule looks at.

    Attributes:
        roles: the roles selected, or None for every role.
        position: ``any`` (every selected message), ``first`` or ``last`` (of the messages with those roles).
        index: an absolute message index (negative counts from the end) instead of a position, or None.
    """

    roles: frozenset[str] | None = None
    position: str = "any"
    index: int | None = None

    def select(self, messages: list[dict[str, Any]]) -> list[int]:
        """Indices of the selected messages, in ascending order."""
        if self.index is not None:
            i = self.index if self.index >= 0 else len(messages) + self.index
            if 0 <= i < len(messages) and self._role_ok(messages[i]):
                return [i]
            return []
        chosen = [i for i, m in enumerate(messages) if self._role_ok(m)]
        if self.position == "first":
            return chosen[:1]
        if self.position == "last":
            return chosen[-1:]
        return chosen

    def _role_ok(self, message: dict[str, Any]) -> bool:
        return self.roles is None or message.get("role") in self.roles


@dataclass(frozen=True)
class Template:
    """A parsed ``{group}`` template (``replace``'s ``with``, ``reorder``'s ``template``).

    ``pieces`` alternates literal strings and group references: a ``str`` is literal text, an ``int`` or a
    ``tuple[str]`` (one name) refers to a numbered or named group. ``{{`` and ``}}`` are literal braces.
    """

    source: str
    pieces: tuple[str | int | tuple[str], ...]

    def render(self, group_text: dict[int | str, str]) -> str:
        """Fill the template from ``group_text`` (group number or name -> matched text; a group that did
        not take part in the match renders as the empty string)."""
        out: list[str] = []
        for piece in self.pieces:
            if isinstance(piece, str):
                out.append(piece)
            elif isinstance(piece, tuple):
                out.append(group_text.get(piece[0], ""))
            else:
                out.append(group_text.get(piece, ""))
        return "".join(out)


@dataclass(frozen=True)
class NormalizeOptions:
    """What ``normalize`` does (all on by default).

    Attributes:
        line_endings: CRLF and lone CR become LF.
        trailing_spaces: spaces and tabs at the end of every line are removed.
        blank_lines: the longest run of blank lines kept (runs longer are cut to it); None keeps all.
        unicode: a ``unicodedata`` normal form (``NFC``, ``NFKC``, ...) or None.
        skip_code: lines of fenced and indented code blocks keep their trailing spaces and blank-line runs
            (``match.skip_code`` of a normalize rule).
        hard_breaks: a Markdown hard line break (two or more trailing spaces before a line of text) keeps
            two trailing spaces.
    """

    line_endings: bool = True
    trailing_spaces: bool = True
    blank_lines: int | None = 1
    unicode: str | None = "NFC"
    skip_code: bool = False
    hard_breaks: bool = False


@dataclass(frozen=True)
class Rule:
    """One validated rule.

    Attributes:
        id: unique across the loaded rule set.
        action: one of ``ACTIONS``.
        selector: which messages the rule looks at.
        pattern: the compiled re2 pattern (span actions), else None.
        pattern_source: the pattern as written (before ``%{FRAGMENT}`` expansion), or None.
        group: for hoist/drop/replace: the group whose span is acted on (0 = whole match).
        placement: for hoist: one of ``PLACEMENTS``.
        template: for replace (``with``) and reorder (``template``).
        unit: for round: a key of ``ROUND_UNITS``.
        normalize: for normalize.
        skip_code: span actions ignore matches that overlap a fenced or indented code block
            (``match.skip_code``).
        kept_by: the ``keep`` rules of the rule set this rule belongs to (set by ``with_keep_rules``): a
            match overlapping text one of them protects is ignored.
        exempt: for keep: ids of the rules it does not protect its text from (``except`` in the file): a
            line of dialogue is kept from the date rules, not from the rule that hoists a user's line.
        per_request: for hoist: whether a value it hoists may change from one request of a conversation to
            the next (a time, a request id, a usage counter): True, False (the default: the value holds for the
            conversation and tells whose it is, as a user's name does) or a compiled pattern that a per-request
            value contains (``value_per_request``). The transcript memory reuses a history only for a request
            with the same values of the second kind (``rules.canonicalize``).
        private: for hoist: its per-request values are the user's own data (a git status naming their files):
            they may change between the requests of a conversation only where the client names the end user
            (``rules.transcript.USER_MARK`` in the memory's scope); without that they tell whose conversation
            it is, so another conversation with the same stable form never gets a history holding them.
        description: free text from the file.
        file: the file the rule came from; line: its 1-based line.
    """

    id: str
    action: str
    selector: MessageSelector = field(default_factory=MessageSelector)
    pattern: Any = None
    pattern_source: str | None = None
    group: int | str = 0
    placement: str = DEFAULT_PLACEMENT
    template: Template | None = None
    unit: str | None = None
    normalize: NormalizeOptions | None = None
    skip_code: bool = False
    kept_by: tuple[Rule, ...] = ()
    per_request: Any = False
    private: bool = False
    exempt: frozenset[str] = frozenset()
    description: str = ""
    file: str = ""
    line: int = 0

    def value_per_request(self, value: str) -> bool:
        """Whether ``value``, hoisted by this rule, may change between the requests of one conversation
        (``per_request`` True, or its pattern found in ``value``); False for a value that tells whose
        conversation it is."""
        if isinstance(self.per_request, bool):
            return self.per_request
        return self.per_request.search(value) is not None


def with_keep_rules(rules: tuple[Rule, ...] | list[Rule]) -> tuple[Rule, ...]:
    """``rules`` with every span rule other than ``keep`` given, as ``kept_by``, the ``keep`` rules of the list
    (wherever they stand in it: protection does not depend on load order) whose roles cover all of the rule's
    roles: a keep rule for system text never blocks a rule that also acts on user text, nor a rule it names in
    ``except`` (``exempt``)."""
    keeps = tuple(r for r in rules if r.action == "keep")
    if not keeps:
        return tuple(rules)

    def covers(keep: Rule, rule: Rule) -> bool:
        if keep.selector.roles is None:
            return True
        return rule.selector.roles is not None and rule.selector.roles <= keep.selector.roles

    out: list[Rule] = []
    for rule in rules:
        if rule.action in SPAN_ACTIONS and rule.action != "keep":
            rule = replace(
                rule, kept_by=tuple(k for k in keeps if covers(k, rule) and rule.id not in k.exempt)
            )
        out.append(rule)
    return tuple(out)
