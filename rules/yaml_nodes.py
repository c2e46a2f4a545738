"""Reading a rule file's YAML as composed nodes, so every error names its line: the file's node tree, a node's
value (safe types only), mappings with their key nodes (duplicate keys refused, YAML merge keys applied), and an
error located in its file. ``rules.loader`` builds the rules from these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rules.errors import RuleError


def node_line(node: yaml.Node) -> int:
    """The 1-based line a composed node starts on."""
    return node.start_mark.line + 1


def compose_file(path: Path, display: str) -> yaml.Node:
    """The composed YAML node tree of the file at ``path`` (``display``: how errors name it).

    Raises:
        RuleError: a file that cannot be read, bad YAML (with its line), an empty file.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RuleError("file not found", display) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RuleError(f"cannot read file: {e}", display) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        reason = f"bad YAML: {problem}" + (f" ({context})" if context else "")
        raise RuleError(reason, display, mark.line + 1 if mark is not None else None) from None
    if node is None:
        raise RuleError("empty file (expected a mapping with a 'rules' list)", display, 1)
    return node


def node_value(node: yaml.Node) -> Any:
    """The Python value of a composed node (safe types only).

    Raises:
        RuleError: the node cannot be constructed (an unknown tag such as ``!re``, an impossible date such as
            ``2024-02-30``), with its line; the caller's file is filled in by ``located``.
    """
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
        problem = getattr(e, "problem", None) or str(e)
        raise RuleError(f"bad value: {problem}", None, node_line(node)) from None


def located(error: RuleError, file: str, rule_id: str | None = None) -> RuleError:
    """``error`` located in ``file`` (and rule ``rule_id``) when it was raised without a file (by ``node_value`` or
    ``flatten_merges``, which only know the node); errors raised with their location are kept as they are."""
    if error.file is not None:
        return error
    return RuleError(error.reason, file, error.line, error.rule_id or rule_id)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def flatten_merges(node: yaml.MappingNode, rule_id: str | None, _active: tuple[int, ...] = ()) -> None:
    """Apply YAML merge keys in place (https://yaml.org/type/merge.html): ``<<: *defaults`` or ``<<: [*a, *b]``
    adds the merged mappings' pairs; the mapping's own keys win over merged ones and, in a list, an earlier
    mapping wins over a later one. A merged mapping has its own merge keys applied first.

    Raises:
        RuleError (without a file; ``located`` adds it): a merge value that is not a mapping or a list of
            mappings, a merged key that is not a plain scalar, or a mapping that merges itself.
    """
    if not any(key.tag == _MERGE_TAG for key, _ in node.value):
        return
    if id(node) in _active:
        raise RuleError("bad merge key: a mapping merges itself", None, node_line(node), rule_id)
    own: list[tuple[yaml.Node, yaml.Node]] = []
    sources: list[yaml.MappingNode] = []
    for key, value in node.value:
        if key.tag != _MERGE_TAG:
            own.append((key, value))
        elif isinstance(value, yaml.MappingNode):
            sources.append(value)
        elif isinstance(value, yaml.SequenceNode) and all(
            isinstance(v, yaml.MappingNode) for v in value.value
        ):
            sources.extend(value.value)
        else:
            raise RuleError(
                "bad merge key: expected a mapping or a list of mappings", None, node_line(value), rule_id
            )
    seen = {key.value for key, _ in own if isinstance(key, yaml.ScalarNode)}
    merged: list[tuple[yaml.Node, yaml.Node]] = []
    for source in sources:
        flatten_merges(source, rule_id, (*_active, id(node)))
        for key, value in source.value:
            if not isinstance(key, yaml.ScalarNode):
                raise RuleError("bad merge key: merged keys must be strings", None, node_line(key), rule_id)
            if key.value not in seen:
                seen.add(key.value)
                merged.append((key, value))
    node.value = merged + own


def mapping_of(
    node: yaml.Node, file: str, rule_id: str | None, what: str
) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """Key -> (key node, value node) of a mapping node (YAML merge keys applied); duplicate or non-string keys
    are errors."""
    if not isinstance(node, yaml.MappingNode):
        raise RuleError(f"{what} must be a mapping", file, node_line(node), rule_id)
    flatten_merges(node, rule_id)
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = node_value(key_node) if isinstance(key_node, yaml.ScalarNode) else None
        if not isinstance(key, str):
            raise RuleError(f"keys of {what} must be strings", file, node_line(key_node), rule_id)
        if key in out:
            raise RuleError(f"duplicate key '{key}' in {what}", file, node_line(key_node), rule_id)
        out[key] = (key_node, value_node)
    return out
