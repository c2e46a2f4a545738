"""Declared public prefixes (``shared_prefixes:``): which leading messages of a request every tenant shares.

A request's public prefix is its tools + system segment (rules segment level 1; with ``segment: documents``
also a documents segment that ends on a message boundary right after it) when a declaration matches:
- ``segment``: every request (the operator declares the segment public for all clients);
- ``rule``: the rule with that id rewrote the request (a rule written for one product's common prompt);
- ``content_hash``: sha256 of the segment's stable material (``CanonicalPrompt.stable_prefix_material(1)``,
  canonical JSON of tools and system messages) equals the declared hex digest: only that exact prompt.

Only whole messages count, so a public prefix never takes a tenant's own text with it. The engine caches
those messages' full blocks once under the declaration's shared salt and everything after under the
tenant's salt (``engine.block_hash.LayeredKeys``).
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Sequence

from gateway.config.schema import ConfigError, SharedPrefix
from gateway.core.request import CanonicalPrompt, ChatRequest


def content_hash(canonical: CanonicalPrompt) -> str:
    """sha256 hex of the tools + system segment's stable material: what ``content_hash:`` declares."""
    return hashlib.sha256(canonical.stable_prefix_material(1)).hexdigest()


def _whole_messages(canonical: CanonicalPrompt, max_level: int) -> int:
    """Messages covered by the leading segments of level <= ``max_level`` that end on a message boundary."""
    count = 0
    for segment in canonical.segments:
        if segment.level > max_level:
            break
        if segment.end_part is None and segment.end_char is None:
            count = segment.end_message
    return count


def public_messages(request: ChatRequest, declarations: Sequence[SharedPrefix]) -> tuple[int, str]:
    """``(leading messages that are public, shared salt)`` of a canonicalized chat request; ``(0, "")`` when
    no declaration matches (or the request has no canonical form)."""
    canonical = request.canonical
    if canonical is None or request.kind != "chat" or not declarations:
        return 0, ""
    digest: str | None = None
    for declaration in declarations:
        if declaration.kind == "segment":
            matched, level = True, int(declaration.value)
        elif declaration.kind == "rule":
            matched, level = canonical.applied.get(declaration.value, 0) > 0, 1
        else:
            digest = digest or content_hash(canonical)
            matched, level = digest == declaration.value, 1
        if matched:
            count = _whole_messages(canonical, level)
            if count > 0:
                return count, f"{declaration.kind}:{declaration.value}"
    return 0, ""


def check_declared_rules(declarations: Sequence[SharedPrefix], rule_ids: Iterable[str], source: str) -> None:
    """Refuse a ``{rule: <id>}`` declaration whose rule is not among the loaded rules (``rule_ids``; none when
    rewriting is off): it could never match, so the prefix it means to share would silently stay private.

    Raises:
        ConfigError: ``<source>: shared_prefixes[i].rule: unknown rule id ...``.
    """
    known = set(rule_ids)
    for index, declaration in enumerate(declarations):
        if declaration.kind == "rule" and declaration.value not in known:
            close = difflib.get_close_matches(declaration.value, sorted(known), n=3)
            hint = (
                f"did you mean {', '.join(map(repr, close))}?" if close else f"{len(known)} rules are loaded"
            )
            raise ConfigError(
                source,
                f"shared_prefixes[{index}].rule",
                f"unknown rule id {declaration.value!r}: no rule of the config's rules: has it, so the "
                f"declaration could never match ({hint if known else 'no rules are loaded'})",
            )


def mark_public_prefix(request: ChatRequest, declarations: Sequence[SharedPrefix]) -> None:
    """Set ``request.shared_prefix_messages`` / ``shared_salt`` from the declarations."""
    request.shared_prefix_messages, request.shared_salt = public_messages(request, declarations)
