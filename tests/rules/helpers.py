"""Helpers for the rules tests: rule files written to a temp dir, and message text flattening."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rules import RuleSet, load_ruleset


def write_rules(tmp_path: Path, body: str, name: str = "rules.yaml") -> Path:
    """Write a (dedented) YAML rule file and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip("\n"), encoding="utf-8")
    return path


def ruleset_from(tmp_path: Path, body: str, placement: str | None = None) -> RuleSet:
    """Load a RuleSet from one YAML rule-file body."""
    return load_ruleset([str(write_rules(tmp_path, body))], placement=placement)


def all_text(messages: list[dict[str, Any]]) -> str:
    """Every text slot of every message, joined by newlines (what a template would render, roughly)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if p.get("type") == "text")
    return "\n".join(out)


def chat(system: str, user: str = "What should I do next?") -> list[dict[str, Any]]:
    """A two-message chat request."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
