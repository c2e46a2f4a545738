"""Loading and validating YAML rule files (and the shipped packs in ``rules/packs``).

A rule file is a YAML mapping::

    description: free text                       # optional
    include: [dates, ./more_rules.yaml]          # optional: packs or files loaded first (each file once)
    patterns:                                    # optional: regex fragments for this file, used as %{NAME}
      TICKET: 'T-\\d{6}'
    rules:
      - id: ticket-line                          # unique across everything loaded
        description: free text                   # optional
        match:
          role: [system, developer]              # a role, a list of roles, or any (default)
          position: any                          # first | last | any (default), among those roles
          index: 0                               # or an absolute message index (negative from the end)
          pattern: '(?m)^Ticket: %{TICKET}$'     # RE2 syntax (linear time)
          skip_code: true                        # ignore matches inside code blocks (default false)
        action: hoist                            # hoist | replace | round | drop | normalize | sort_tools | reorder | keep
        placement: tail_end                      # hoist: tail_end | last_user_prefix | before_last_user | system_end
        group: 0                                 # hoist/drop/replace: the group acted on (number or name)

Action keys: ``replace`` takes ``with`` (a ``{group}`` template), ``reorder`` takes ``template``, ``round``
takes ``unit`` (minute/hour/day), ``normalize`` takes ``line_endings``, ``trailing_spaces`` (bools),
``blank_lines`` (int or null), ``unicode`` (NFC/NFD/NFKC/NFKD or false) and ``hard_breaks`` (bool; its
``match.skip_code`` leaves code blocks alone). ``sort_tools`` takes no match. ``keep`` takes ``group``: the
text it matches is left alone by every other span rule of the loaded set. A ``hoist`` pattern may name a group
``hoisted``: its text is what moves, while ``group`` is what is removed (a JSON member moves, its comma goes).
``hoist`` also takes ``per_request``: ``true`` when its values may change from one request of a conversation to
the next (a time, a request id), ``false`` (the default) when they hold for the conversation and tell whose it
is (a user's name), or a pattern that the per-request values contain (``Rule.per_request``); and ``private``:
``true`` when those per-request values are the user's own data (a git status), which may change within a
conversation only where the client names the end user (``Rule.private``). ``keep`` also
takes ``except``: ids of rules it leaves free to act on the text it protects.

Everything is checked at load time; the first problem raises ``RuleError`` naming the file, the line of
the offending YAML node and the rule id. Line numbers come from PyYAML's composed node tree
(``yaml.compose``), whose nodes carry their start marks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rules.canonicalize import RuleSet
from rules.errors import RuleError, RuleErrors
from rules.model import (
    ACTIONS,
    DEFAULT_PLACEMENT,
    PLACEMENTS,
    POSITIONS,
    ROLES,
    ROUND_GROUPS,
    ROUND_UNITS,
    SPAN_ACTIONS,
    MessageSelector,
    NormalizeOptions,
    Rule,
)
from rules.patterns import (
    FRAGMENT_NAME,
    PatternError,
    base_group_name,
    check_group,
    compile_pattern,
    parse_template,
)
from rules.yaml_nodes import compose_file as _compose
from rules.yaml_nodes import located as _located
from rules.yaml_nodes import mapping_of as _mapping
from rules.yaml_nodes import node_line as _line
from rules.yaml_nodes import node_value as _value

PACK_DIR = Path(__file__).resolve().parent / "packs"
"""Directory of the shipped packs (``NAME.yaml``; files starting with ``_`` are not packs)."""

FRAGMENTS_FILE = PACK_DIR / "_fragments.yaml"
"""Shipped regex fragments, visible to every rule file."""

DEFAULT_PACKS: tuple[str, ...] = ("default",)
"""What the gateway loads when its config names no rules."""

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*\Z")
_TOP_KEYS = ("description", "include", "patterns", "rules")
_COMMON_KEYS = ("id", "description", "match", "action")
_ACTION_KEYS: dict[str, tuple[str, ...]] = {
    "hoist": ("group", "placement", "per_request", "private"),
    "drop": ("group",),
    "replace": ("group", "with"),
    "round": ("unit",),
    "reorder": ("template",),
    "normalize": ("line_endings", "trailing_spaces", "blank_lines", "unicode", "hard_breaks"),
    "sort_tools": (),
    "keep": ("group", "except"),
}
_MATCH_KEYS = ("role", "position", "index", "pattern", "skip_code")
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def list_packs() -> list[str]:
    """Names of the shipped packs, sorted."""
    return sorted(p.stem for p in PACK_DIR.glob("*.yaml") if not p.name.startswith("_"))


def load_ruleset(sources: list[str] | tuple[str, ...], placement: str | None = None) -> RuleSet:
    """Load rule files and shipped packs into one ``RuleSet``.

    Args:
        sources: shipped pack names (``default``, ``dates``, ... see ``list_packs``) or paths of YAML
            files, in application order. ``[]`` gives a RuleSet that changes nothing. A name containing a
            path separator or ending in ``.yaml``/``.yml`` is a path; anything else is a pack name. A file
            reached twice (directly or by ``include``) is loaded once, at its first place.
        placement: when given, overrides every hoist rule's placement (one of ``PLACEMENTS``).

    Raises:
        RuleError: unknown pack, unreadable file, bad YAML, or an invalid rule; with file, line and
            rule id where they apply.
    """
    if placement is not None and placement not in PLACEMENTS:
        raise RuleError(f"unknown hoist placement '{placement}' (one of: {', '.join(PLACEMENTS)})")
    state = _LoadState(placement=placement, fragments=builtin_fragments())
    for source in sources:
        path, display = _resolve(source, None, None)
        _load_file(path, display, state, ())
    return RuleSet(state.rules, state.files)


@functools.lru_cache(maxsize=1)
def builtin_fragments() -> dict[str, str]:
    """The shipped fragments of ``_fragments.yaml`` (name -> regex source), each checked to compile."""
    display = str(FRAGMENTS_FILE)
    root = _compose(FRAGMENTS_FILE, display)
    keys = _mapping(root, display, None, "the fragments file")
    if set(keys) - {"description", "patterns"}:
        raise RuleError("the fragments file holds only 'description' and 'patterns'", display, _line(root))
    fragments: dict[str, str] = {}
    if "patterns" in keys:
        _read_patterns(keys["patterns"][1], display, fragments, builtin={})
    return fragments


@dataclass
class _LoadState:
    placement: str | None
    fragments: dict[str, str]
    rules: list[Rule] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    seen_files: set[Path] = field(default_factory=set)
    rule_sites: dict[str, tuple[str, int]] = field(default_factory=dict)


def _resolve(source: Any, base: Path | None, where: tuple[str, int] | None) -> tuple[Path, str]:
    """(resolved path, name used in error messages) of a pack name or file path."""
    file, line = where if where else (None, None)
    if not isinstance(source, str) or not source:
        raise RuleError(f"a rule source must be a pack name or a path, not {source!r}", file, line)
    is_path = "/" in source or "\\" in source or source.endswith((".yaml", ".yml"))
    if not is_path:
        pack = PACK_DIR / f"{source}.yaml"
        if source.startswith("_") or not pack.is_file():
            raise RuleError(
                f"unknown rule pack '{source}' (shipped packs: {', '.join(list_packs())})",
                file or source,
                line,
            )
        return pack.resolve(), str(pack)
    path = Path(source).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    return path.resolve(), str(path)


def _load_file(path: Path, display: str, state: _LoadState, stack: tuple[Path, ...]) -> None:
    try:
        _load_file_checked(path, display, state, stack)
    except RuleError as e:
        raise _located(e, display) from None


def _rule_id_of(node: yaml.Node) -> str | None:
    """The ``id`` scalar of a rule mapping, if it has a plain one (to name the rule in an error)."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == "id" and isinstance(value, yaml.ScalarNode):
                return value.value
    return None


def _load_file_checked(path: Path, display: str, state: _LoadState, stack: tuple[Path, ...]) -> None:
    if path in stack:
        raise RuleError("include cycle: " + " -> ".join(str(p) for p in (*stack, path)), display)
    if path in state.seen_files:
        return
    state.seen_files.add(path)
    if path.resolve() == FRAGMENTS_FILE.resolve():
        builtin_fragments()  # the shipped fragments are always loaded (and checked) already
        state.files.append(display)
        return
    root = _compose(path, display)
    keys = _mapping(root, display, None, "a rule file")
    for key, (key_node, _) in keys.items():
        if key not in _TOP_KEYS:
            raise RuleError(
                f"unknown top-level key '{key}' (allowed: {', '.join(_TOP_KEYS)})", display, _line(key_node)
            )
    if "description" in keys and not isinstance(_value(keys["description"][1]), str):
        raise RuleError("description must be a string", display, _line(keys["description"][1]))
    if "include" in keys:
        include_node = keys["include"][1]
        if not isinstance(include_node, yaml.SequenceNode):
            raise RuleError("include must be a list of pack names or paths", display, _line(include_node))
        for item in include_node.value:
            target, target_display = _resolve(_value(item), path.parent, (display, _line(item)))
            if not target.is_file():
                raise RuleError(f"included file not found: {target_display}", display, _line(item))
            if target in (*stack, path):
                cycle = " -> ".join(str(p) for p in (*stack, path, target))
                raise RuleError(f"include cycle: {cycle}", display, _line(item))
            _load_file(target, target_display, state, (*stack, path))
    fragments = dict(state.fragments)
    if "patterns" in keys:
        _read_patterns(keys["patterns"][1], display, fragments, builtin=state.fragments)
    state.files.append(display)
    if "rules" not in keys:
        if "include" in keys:
            return
        raise RuleError("missing 'rules' (a list of rules)", display, _line(root))
    rules_node = keys["rules"][1]
    if isinstance(rules_node, yaml.ScalarNode) and _value(rules_node) is None:
        return
    if not isinstance(rules_node, yaml.SequenceNode):
        raise RuleError("'rules' must be a list", display, _line(rules_node))
    errors: list[RuleError] = []  # every invalid rule of the file is reported, not only the first
    for rule_node in rules_node.value:
        try:
            rule = _build_rule(rule_node, display, fragments, state.placement)
        except RuleError as e:
            errors.append(_located(e, display, _rule_id_of(rule_node)))
            continue
        if rule.id in state.rule_sites:
            first_file, first_line = state.rule_sites[rule.id]
            errors.append(
                RuleError(
                    f"duplicate rule id (first defined at {first_file}:{first_line})",
                    display,
                    rule.line,
                    rule.id,
                )
            )
            continue
        state.rule_sites[rule.id] = (display, rule.line)
        state.rules.append(rule)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RuleErrors(errors)


def _read_patterns(node: yaml.Node, file: str, fragments: dict[str, str], builtin: dict[str, str]) -> None:
    """Add a file's ``patterns`` mapping to ``fragments``, checking names and that each compiles."""
    entries = _mapping(node, file, None, "'patterns'")
    for name, (key_node, value_node) in entries.items():
        if not FRAGMENT_NAME.match(name):
            raise RuleError(f"fragment name '{name}' must be UPPER_CASE (A-Z, 0-9, _)", file, _line(key_node))
        if name in builtin:
            raise RuleError(
                f"fragment '{name}' is already defined by the shipped fragments", file, _line(key_node)
            )
        source = _value(value_node)
        if not isinstance(source, str) or not source:
            raise RuleError(f"fragment '{name}' must be a non-empty string", file, _line(value_node))
        fragments[name] = source
    for name, (_, value_node) in entries.items():
        try:
            compile_pattern(f"%{{{name}}}", fragments, allow_empty=True)
        except PatternError as e:
            raise RuleError(f"fragment '{name}': {e}", file, _line(value_node)) from None


def _build_rule(node: yaml.Node, file: str, fragments: dict[str, str], placement: str | None) -> Rule:
    """Validate one rule node and build the ``Rule``."""
    keys = _mapping(node, file, None, "a rule")
    rule_line = _line(node)
    rule_id = None
    if "id" not in keys:
        raise RuleError("rule has no 'id'", file, rule_line)
    id_node = keys["id"][1]
    raw_id = _value(id_node)
    if not isinstance(raw_id, str) or not _ID.match(raw_id):
        raise RuleError(
            f"bad rule id {raw_id!r} (letters, digits, '_', '.', ':', '-'; no spaces)", file, _line(id_node)
        )
    rule_id = raw_id

    def fail(reason: str, at: yaml.Node) -> RuleError:
        return RuleError(reason, file, _line(at), rule_id)

    if "action" not in keys:
        raise fail(f"missing 'action' (one of: {', '.join(ACTIONS)})", node)
    action_node = keys["action"][1]
    action = _value(action_node)
    if action not in ACTIONS:
        raise fail(f"unknown action {action!r} (one of: {', '.join(ACTIONS)})", action_node)
    allowed = _COMMON_KEYS + _ACTION_KEYS[action]
    for key, (key_node, _) in keys.items():
        if key in allowed:
            continue
        owners = [a for a, ks in _ACTION_KEYS.items() if key in ks]
        if owners:
            raise fail(
                f"key '{key}' does not apply to action '{action}' (it belongs to: {', '.join(owners)})",
                key_node,
            )
        raise fail(f"unknown key '{key}' (allowed for action '{action}': {', '.join(allowed)})", key_node)
    if "description" in keys and not isinstance(_value(keys["description"][1]), str):
        raise fail("description must be a string", keys["description"][1])

    fields: dict[str, Any] = {
        "id": rule_id,
        "action": action,
        "file": file,
        "line": rule_line,
        "description": _value(keys["description"][1]) if "description" in keys else "",
    }
    compiled = None
    if action == "sort_tools":
        if "match" in keys:
            raise fail("sort_tools takes no 'match' (it orders the request's tools)", keys["match"][0])
    else:
        if "match" not in keys and action in SPAN_ACTIONS:
            raise fail(f"action '{action}' needs a 'match' with a 'pattern'", node)
        if "match" in keys:
            selector, compiled, pattern_source, skip_code = _build_match(
                keys["match"][1],
                file,
                rule_id,
                fragments,
                needs_pattern=action in SPAN_ACTIONS,
                allow_skip_code=action == "normalize",
            )
            fields["selector"] = selector
            fields["skip_code"] = skip_code
            fields["pattern"] = compiled
            fields["pattern_source"] = pattern_source
    pattern_node = _pattern_node(keys)

    if "group" in keys:
        group = _value(keys["group"][1])
        try:
            check_group(compiled, group)
        except PatternError as e:
            raise fail(str(e), keys["group"][1]) from None
        fields["group"] = group
    if action == "keep" and "except" in keys:
        exempt = _value(keys["except"][1])
        if not isinstance(exempt, list) or not exempt or not all(isinstance(i, str) and i for i in exempt):
            raise fail("'except' must be a list of rule ids", keys["except"][1])
        fields["exempt"] = frozenset(exempt)
    if action == "hoist" and "per_request" in keys:
        fields["per_request"] = _per_request(
            _value(keys["per_request"][1]), fragments, fail, keys["per_request"][1]
        )
    if action == "hoist" and "private" in keys:
        private = _value(keys["private"][1])
        if not isinstance(private, bool):
            raise fail("'private' must be true or false", keys["private"][1])
        fields["private"] = private
    if action == "hoist":
        chosen = _value(keys["placement"][1]) if "placement" in keys else DEFAULT_PLACEMENT
        if chosen not in PLACEMENTS:
            raise fail(
                f"unknown placement {chosen!r} (one of: {', '.join(PLACEMENTS)})", keys["placement"][1]
            )
        fields["placement"] = placement or chosen
    if action in ("replace", "reorder"):
        key = "with" if action == "replace" else "template"
        if key not in keys:
            raise fail(f"action '{action}' needs '{key}' (a {{group}} template)", node)
        source = _value(keys[key][1])
        if not isinstance(source, str):
            raise fail(f"'{key}' must be a string", keys[key][1])
        try:
            fields["template"] = parse_template(source, compiled)
        except PatternError as e:
            raise fail(f"'{key}': {e}", keys[key][1]) from None
    if action == "round":
        if "unit" not in keys:
            raise fail(f"action 'round' needs 'unit' (one of: {', '.join(ROUND_UNITS)})", node)
        unit = _value(keys["unit"][1])
        if not isinstance(unit, str) or unit not in ROUND_UNITS:
            raise fail(f"unknown unit {unit!r} (one of: {', '.join(ROUND_UNITS)})", keys["unit"][1])
        fields["unit"] = unit
        if not any(base_group_name(n) in ROUND_GROUPS for n in compiled.groupindex):
            raise fail(
                "round needs a pattern with named groups among: " + ", ".join(ROUND_GROUPS), pattern_node
            )
    if action == "normalize":
        fields["normalize"] = _build_normalize(keys, fail, fields.get("skip_code", False))
    return Rule(**fields)


def _per_request(value: Any, fragments: dict[str, str], fail: Any, node: yaml.Node) -> Any:
    """A hoist rule's ``per_request``: a bool, or an RE2 pattern (fragments expanded) compiled."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str) or not value:
        raise fail("'per_request' must be true, false or a pattern a per-request value contains", node)
    try:
        return compile_pattern(value, fragments)
    except PatternError as e:
        raise fail(f"'per_request': {e}", node) from None


def _pattern_node(keys: dict[str, tuple[yaml.Node, yaml.Node]]) -> yaml.Node | None:
    if "match" not in keys or not isinstance(keys["match"][1], yaml.MappingNode):
        return None
    for key_node, value_node in keys["match"][1].value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == "pattern":
            return value_node
    return keys["match"][1]


def _build_match(
    node: yaml.Node,
    file: str,
    rule_id: str,
    fragments: dict[str, str],
    needs_pattern: bool,
    allow_skip_code: bool = False,
) -> tuple[MessageSelector, Any, str | None, bool]:
    keys = _mapping(node, file, rule_id, "'match'")

    def fail(reason: str, at: yaml.Node) -> RuleError:
        return RuleError(reason, file, _line(at), rule_id)

    for key, (key_node, _) in keys.items():
        if key not in _MATCH_KEYS:
            raise fail(f"unknown key '{key}' in match (allowed: {', '.join(_MATCH_KEYS)})", key_node)
    roles: frozenset[str] | None = None
    if "role" in keys:
        raw = _value(keys["role"][1])
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not names or not all(isinstance(r, str) for r in names):
            raise fail("role must be a role name or a non-empty list of role names", keys["role"][1])
        for name in names:
            if name != "any" and name not in ROLES:
                raise fail(f"unknown role '{name}' (one of: any, {', '.join(ROLES)})", keys["role"][1])
        roles = None if "any" in names else frozenset(names)
    position = "any"
    if "position" in keys:
        position = _value(keys["position"][1])
        if position not in POSITIONS:
            raise fail(f"unknown position {position!r} (one of: {', '.join(POSITIONS)})", keys["position"][1])
    index = None
    if "index" in keys:
        index = _value(keys["index"][1])
        if isinstance(index, bool) or not isinstance(index, int):
            raise fail("index must be an integer (negative counts from the end)", keys["index"][1])
        if position != "any":
            raise fail("give either 'position' or 'index', not both", keys["index"][0])
    compiled = None
    source = None
    if "pattern" in keys:
        if not needs_pattern:
            raise fail("this action takes no 'pattern' (it acts on whole texts)", keys["pattern"][0])
        source = _value(keys["pattern"][1])
        if not isinstance(source, str) or not source:
            raise fail("pattern must be a non-empty string", keys["pattern"][1])
        try:
            compiled = compile_pattern(source, fragments)
        except PatternError as e:
            raise fail(str(e), keys["pattern"][1]) from None
    elif needs_pattern:
        raise fail("match needs a 'pattern'", node)
    skip_code = False
    if "skip_code" in keys:
        skip_code = _value(keys["skip_code"][1])
        if not isinstance(skip_code, bool):
            raise fail("skip_code must be true or false", keys["skip_code"][1])
        if not needs_pattern and not allow_skip_code:
            raise fail(
                "skip_code applies only to actions with a pattern and to normalize", keys["skip_code"][0]
            )
    return MessageSelector(roles=roles, position=position, index=index), compiled, source, skip_code


def _build_normalize(
    keys: dict[str, tuple[yaml.Node, yaml.Node]], fail: Any, skip_code: bool
) -> NormalizeOptions:
    options: dict[str, Any] = {"skip_code": skip_code}
    for key in ("line_endings", "trailing_spaces", "hard_breaks"):
        if key in keys:
            value = _value(keys[key][1])
            if not isinstance(value, bool):
                raise fail(f"'{key}' must be true or false", keys[key][1])
            options[key] = value
    if "blank_lines" in keys:
        value = _value(keys["blank_lines"][1])
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise fail("'blank_lines' must be a non-negative integer or null", keys["blank_lines"][1])
        options["blank_lines"] = value
    if "unicode" in keys:
        value = _value(keys["unicode"][1])
        if value is False or value is None:
            options["unicode"] = None
        elif value in _UNICODE_FORMS:
            options["unicode"] = value
        else:
            raise fail(f"'unicode' must be one of {', '.join(_UNICODE_FORMS)} or false", keys["unicode"][1])
    return NormalizeOptions(**options)
