"""Canonicalization of chat requests by the configured rules (the opt-out header is read in
``gateway.core.headers``).

Every chat request to every backend passes through ``Canonicalizer.apply`` before routing. With rules on
(the default), the request's messages and tools are replaced by the rules' canonical ones. With
``x-prefixgate-rules: off`` (or ``rules: []`` in the config) the request is sent exactly as it came, and an
empty rule set is still applied to a copy only to find the segments whose stable part names the prefix group.
Completion requests (a raw ``prompt``) are not chat-shaped and are never rewritten.

This module is the gateway's only door to the ``rules`` package (``tests/test_layers.py`` holds it to that):
``RuleError`` (a bad rule file, raised while building a ``Canonicalizer``) and the ``prefixgate rules``
subcommands (``run_rules_command``) are reached through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.errors import InvalidRequestError
from gateway.core.request import ChatRequest
from rules import RequestShapeError, RuleError, RuleSet, load_ruleset
from rules import cli as rules_cli

__all__ = ["PREFIX_KEY_LEVEL", "Canonicalizer", "RuleError", "run_rules_command"]

PREFIX_KEY_LEVEL = 2
"""Segments named by the prefix key: 1 = tools + system, 2 = + documents (3 would add the history, which
changes every turn, so a conversation's turns would land in different prefix groups and, behind several
replicas, on different machines; level 2 keeps every turn of every conversation on one system prompt and
document together)."""


class Canonicalizer:
    """Applies the configured rule set to chat requests.

    Args:
        rules: pack names or YAML paths, as in the config's ``rules:`` (empty = rewriting off).

    Raises:
        rules.RuleError: a bad rule file or unknown pack (file, line and rule id in its message).
    """

    def __init__(self, rules: Sequence[str]) -> None:
        self.rule_names = tuple(rules)
        self._ruleset = load_ruleset(list(rules)) if rules else None
        self._plain = RuleSet()

    def apply(self, request: ChatRequest) -> None:
        """Canonicalize ``request`` in place: sets ``request.canonical`` and, when rules are on, replaces
        ``request.messages`` / ``request.tools`` by the canonical ones. No-op for completion requests."""
        if request.kind != "chat":
            return
        rewrite = request.rules_enabled and self._ruleset is not None
        try:
            canonical = (self._ruleset if rewrite else self._plain).apply(request.messages, request.tools)
        except RequestShapeError as exc:
            raise InvalidRequestError(
                f"Invalid request shape: {exc}", param="messages", code="invalid_value"
            ) from exc
        if rewrite:
            request.messages = canonical.messages
            request.tools = canonical.tools
        request.canonical = canonical

    def stable_material(self, request: ChatRequest) -> bytes | None:
        """The bytes that name the request's prefix group: its stable segments up to ``PREFIX_KEY_LEVEL``
        (None for completion requests)."""
        if request.canonical is None:
            return None
        return request.canonical.stable_prefix_material(PREFIX_KEY_LEVEL)

    @staticmethod
    def applied(request: ChatRequest) -> dict[str, int]:
        """Rule id -> times applied to this request (empty when rules were off)."""
        if request.canonical is None or not request.rules_enabled:
            return {}
        return dict(request.canonical.applied)


def run_rules_command(
    command: str, files: list[str], request: str | None = None, placement: str | None = None
) -> int:
    """``prefixgate rules check FILE...`` (``command="check"``) or ``prefixgate rules apply [--rules FILE...]
    REQUEST.json`` (``command="apply"``): the ``rules`` package's own commands; returns the exit status."""
    if command == "check":
        return rules_cli.check(files)
    if request is None:
        raise ValueError("rules apply needs a REQUEST.json path")
    return rules_cli.apply(files, request, placement)
