"""Errors raised by the rules package.

``RuleError`` is raised while loading rule files (start-up); ``RequestShapeError`` while canonicalizing a
request whose messages or tools are not in the OpenAI chat shape.
"""

from __future__ import annotations


class RuleError(Exception):
    """A rule file is unreadable, not valid YAML, or holds an invalid rule.

    Attributes:
        file: path of the offending file (or the pack name as given), or None.
        line: 1-based line of the offending YAML node, or None when the file itself is the problem.
        rule_id: id of the offending rule, or None when the problem is outside a rule or the id is missing.
        reason: what is wrong, without the location prefix.

    ``str(error)`` is ``"FILE:LINE: rule 'ID': REASON"``; parts that are None are left out.
    """

    def __init__(
        self, reason: str, file: str | None = None, line: int | None = None, rule_id: str | None = None
    ) -> None:
        self.reason = reason
        self.file = file
        self.line = line
        self.rule_id = rule_id
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
            where += ": "
        rule = f"rule '{self.rule_id}': " if self.rule_id is not None else ""
        return f"{where}{rule}{self.reason}"


class RuleErrors(RuleError):
    """Several invalid rules in one file, each a ``RuleError`` (``errors``, in file order).

    Reads like its first error (``file``, ``line``, ``rule_id``, ``reason``); ``str(error)`` is every error's
    line, one per line, so ``prefixgate rules check`` and a refused start name all of them at once.
    """

    def __init__(self, errors: list[RuleError]) -> None:
        if not errors:
            raise ValueError("RuleErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.reason, first.file, first.line, first.rule_id)

    def _format(self) -> str:
        return "\n".join(str(error) for error in self.errors)


class RequestShapeError(ValueError):
    """The messages or tools given to ``RuleSet.apply`` are not in the OpenAI chat shape
    (e.g. a message that is not an object, a ``role`` that is not a string, a text part without a string
    ``text``). The message names the offending message index and field."""
