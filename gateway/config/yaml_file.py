"""Reading a YAML file of the config (the config itself, a key file): its text, refused with a ``ConfigError``
when it cannot be read or is not UTF-8, and its mappings checked for a key given twice (PyYAML keeps the last
one without a word: a second ``server:`` block would silently replace the first)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from gateway.config.schema import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


def read_text(path: str | os.PathLike[str], source: str, what: str = "the file") -> str:
    """The UTF-8 text of ``path``.

    Raises:
        ConfigError: ``<source>: cannot read <what> (why)``: a missing or unreadable file, or bytes that are not
            UTF-8 (with the line of the first bad byte).
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read {what} ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1
        byte = exc.object[exc.start]
        raise ConfigError(
            source, "", f"cannot read {what} (not UTF-8 text: byte 0x{byte:02x} on line {line})"
        ) from None


def check_unique_keys(text: str, source: str, root: str = "") -> None:
    """Refuse a mapping of ``text`` (a YAML document) that names one key twice. Text that does not parse is
    left to the caller's parser, which reports it; merge keys (``<<: *base``) may be overridden, as YAML says.

    Args:
        text: the document.
        source: the file, named in the error.
        root: key path of the document itself (``keys`` for a key file holding a bare list).

    Raises:
        ConfigError: ``<source>: <key path>: duplicate key (lines A and B) ...``.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return
    found = _first_duplicate(node, root, set())
    if found is not None:
        path, first, second = found
        raise ConfigError(
            source,
            path,
            f"duplicate key (lines {first} and {second}): YAML would keep only the second; give it once",
        )


def _first_duplicate(node: yaml.Node | None, path: str, seen: set[int]) -> tuple[str, int, int] | None:
    """(key path, first line, second line) of the first key named twice in one mapping under ``node``."""
    if node is None or id(node) in seen:  # an alias is checked where its anchor is
        return None
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            if isinstance(key_node, yaml.ScalarNode):
                name = key_node.value
                here = f"{path}.{name}" if path else name
                line = key_node.start_mark.line + 1
                key = (key_node.tag, name)
                if key in lines:
                    return here, lines[key], line
                lines[key] = line
            else:
                here = path
            found = _first_duplicate(value_node, here, seen)
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = _first_duplicate(item, f"{path}[{index}]", seen)
            if found is not None:
                return found
    return None
