"""Command-line functions for rule files (the ``prefixgate rules ...`` subcommands call these).

``check(paths)`` validates rule files and packs; ``apply(rule_paths, request_path)`` prints the canonical
form of a request body. Runnable alone as ``python -m rules.cli check FILE...`` /
``python -m rules.cli apply [--rules FILE...] REQUEST.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from rules.errors import RequestShapeError, RuleError
from rules.loader import DEFAULT_PACKS, load_ruleset


def check(paths: list[str]) -> int:
    """Validate each rule file or pack name, then all of them together (rule ids must be unique across
    files).

    Prints ``OK PATH: N rules`` per valid file on stdout and ``FILE:LINE: rule 'ID': reason`` per error
    on stderr.

    Returns:
        the exit code: 0 when everything is valid, 1 otherwise (2 when no path is given).
    """
    if not paths:
        print("rules check: give at least one rule file or pack name", file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        try:
            ruleset = load_ruleset([path])
        except RuleError as e:
            print(str(e), file=sys.stderr)
            failed = True
            continue
        print(f"OK {path}: {len(ruleset)} rules")
    if not failed and len(paths) > 1:
        try:
            ruleset = load_ruleset(paths)
        except RuleError as e:
            print(str(e), file=sys.stderr)
            return 1
        print(f"OK together: {len(ruleset)} rules")
    return 1 if failed else 0


def read_request(request_path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) of a request body file (``-`` reads stdin).

    Accepts an OpenAI chat body (``messages``, optional ``tools``) or an Anthropic Messages body (its
    top-level ``system``, a string or text blocks, becomes a leading system message).

    Raises:
        OSError: the file cannot be read.
        ValueError: not JSON, or not a chat body.
    """
    text = sys.stdin.read() if request_path == "-" else Path(request_path).read_text(encoding="utf-8")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise ValueError("expected a JSON object with a 'messages' list (an OpenAI or Anthropic chat body)")
    messages = list(body["messages"])
    system = body.get("system")
    if isinstance(system, str | list) and system:
        messages.insert(0, {"role": "system", "content": system})
    return messages, body.get("tools")


def apply(rule_paths: list[str] | None, request_path: str, placement: str | None = None) -> int:
    """Print the canonical form of the request in ``request_path`` as JSON.

    The output holds ``messages``, ``tools``, ``stable_prefix_end`` ({message, part, char}: where the
    volatile tail begins), ``segments``, ``turn_stable_end`` / ``turn_segments`` (the same, with a block an
    earlier turn holds counted as history: ``Canonical.turn_stable_end``), ``applied``, ``hoisted`` and
    ``stable_prefix_sha256`` (SHA-256
    of ``Canonical.stable_prefix_material()``: two requests with the same value share their stable prefix).

    Args:
        rule_paths: rule files or pack names; None loads the default pack.
        request_path: a JSON request body (``-`` for stdin).
        placement: overrides every hoist rule's placement.

    Returns:
        the exit code: 0 on success, 1 for a rule error, 2 for an unreadable or invalid request.
    """
    try:
        ruleset = load_ruleset(list(DEFAULT_PACKS) if rule_paths is None else rule_paths, placement=placement)
    except RuleError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        messages, tools = read_request(request_path)
        canonical = ruleset.apply(messages, tools)
    except (OSError, ValueError) as e:
        kind = "invalid request" if isinstance(e, ValueError | RequestShapeError) else "cannot read request"
        print(f"{request_path}: {kind}: {e}", file=sys.stderr)
        return 2
    out = canonical.to_dict()
    # where the newest turn's tail starts, a block an earlier turn holds being history (the cache explanation's
    # and the tiers' view; the same as stable_prefix_end when no earlier turn holds a block)
    turn_end = canonical.turn_stable_end
    turns = canonical.turn_segments if canonical.turn_segments is not None else canonical.segments
    out["turn_stable_end"] = {"message": turn_end.message, "part": turn_end.part, "char": turn_end.char}
    out["turn_segments"] = [s.to_dict() for s in turns]
    out["stable_prefix_sha256"] = hashlib.sha256(canonical.stable_prefix_material()).hexdigest()
    # the tools + system segment's digest: what a config's ``shared_prefixes: [{content_hash: ...}]`` names
    out["content_hash"] = hashlib.sha256(canonical.stable_prefix_material(1)).hexdigest()
    print(json.dumps(out, ensure_ascii=False, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rules.cli {check,apply} ...``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m rules.cli", description="Validate and try prompt rules.")
    sub = parser.add_subparsers(dest="command", required=True)
    check_parser = sub.add_parser("check", help="validate rule files or pack names")
    check_parser.add_argument("paths", nargs="+", metavar="FILE")
    apply_parser = sub.add_parser("apply", help="print the canonical form of a request body")
    apply_parser.add_argument(
        "--rules",
        nargs="+",
        metavar="FILE",
        default=None,
        help="rule files or pack names (default: the default pack)",
    )
    apply_parser.add_argument("--placement", default=None, help="override every hoist rule's placement")
    apply_parser.add_argument("request", metavar="REQUEST.json")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.paths)
    return apply(args.rules, args.request, args.placement)


if __name__ == "__main__":
    raise SystemExit(main())
