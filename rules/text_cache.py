"""A bounded memo of what one rule does to one text: ``(scope, rule index, text) -> (new text, applications,
hoisted values)``, least recently used first out.

The span and normalize actions are pure functions of the rule and the text (``rules.actions``), so a text seen
before (the same system prompt, tool preamble or document in request after request) gets the stored result
instead of one RE2 scan per rule. One cache per ``RuleSet`` (the index is the rule's place in it).

Entries are separated by ``scope`` (the gateway passes model and tenant, the cache salt): a stored result is
faster than a computed one, so a memo shared across tenants would let one tenant learn from its latency whether
another sent a text, the prompt-cache timing side channel (docs/tenants.md) one layer up.

Invariants: a stored result is exactly what the action returned for that rule and text; the characters held
(texts and rewritten texts) never exceed ``max_chars`` nor the entries ``max_entries``; a text longer than
``max_text_chars`` is never stored; safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rules.bounded_lru import BoundedLRU, MemoCounters

Result = tuple[str, int, tuple[Any, ...]]
"""(new text, number of applications, hoisted values in order; for a whole pass of rules, the steps of the
rules that applied)."""


class TextActionCache(MemoCounters):
    """``(scope, rule index, text) -> Result``, bounded by characters and entries held.

    Args:
        max_chars: most characters held over all entries (a key's text plus a rewritten text).
        max_entries: most entries (each costs ~300 bytes besides its characters; a rule set of ~40 rules adds
            one per rule for every new text, e.g. each new user question).
        max_text_chars: texts longer than this are computed every time, never stored.
    """

    def __init__(
        self, max_chars: int = 2_000_000, max_entries: int = 16_384, max_text_chars: int = 200_000
    ) -> None:
        self.max_chars = max_chars
        self.max_entries = max_entries
        self.max_text_chars = max_text_chars
        self._memo: BoundedLRU[tuple[str, int, str], Result] = BoundedLRU(max_entries, (max_chars,), _size)

    @property
    def chars(self) -> int:
        """Characters held now."""
        return self._memo.totals[0]

    def get(self, index: int, text: str, compute: Callable[[str], Result], scope: str = "") -> Result:
        """The result of rule ``index`` on ``text`` within ``scope``: stored, or ``compute(text)`` (then stored
        if it fits). A result stored under one scope is never returned under another.

        Raises:
            whatever ``compute`` raises (nothing is stored then).
        """
        return self._memo.get_or_compute(
            (scope, index, text), lambda: compute(text), store=len(text) <= self.max_text_chars
        )

    def check(self) -> None:
        """Assert the invariants (tests)."""
        self._memo.check()
        assert all(len(text) <= self.max_text_chars for _, _, text in self._memo.keys())


def _size(key: tuple[str, int, str], result: Result) -> tuple[int]:
    text, new_text = key[2], result[0]
    return (len(text) + (0 if new_text is text else len(new_text)),)
