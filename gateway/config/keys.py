"""The ``keys:`` and ``shared_prefixes:`` sections of the config: client keys and declared public prefixes.

``keys:`` is a list of entries, or the path of a YAML file holding that list (relative to the config's
folder). Each entry::

    - name: alice              # optional label for stats (default key-<digest prefix>)
      key: env:ALICE_KEY       # the key (env:NAME recommended), or
      key_sha256: 9f86d0...    # its SHA-256 hex digest (printf %s KEY | sha256sum)
      tenant: acme             # cache salt (default: the name); no '/' (gateway.core.tenants)
      models: [gpt-4o-mini]    # optional; default every configured model
      rpm: 60                  # optional requests per minute
      tpm: 100000              # optional tokens per minute
      budget_usd: 5.0          # optional spend budget (priced upstream models)
      trusted: false           # honour x-prefixgate-tenant (platforms multiplexing their users)

The plain key is hashed at once and never kept (``gateway.core.keys``). Every problem (a duplicate key or
name, an unknown model, a malformed limit, an unknown field, a tenant with ``/``) raises ``ConfigError``
naming the file, the entry and its line, and never the key. An explicit empty list (or null) is an error too:
only a config without ``keys`` runs the gateway open.

``shared_prefixes:`` is a list of one-key mappings: ``{segment: tools_system}`` (or a level number 1/2),
``{rule: <rule id>}``, or ``{content_hash: <sha256 hex>}`` (see ``gateway.service.shared_prefix``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gateway.config.schema import ConfigError, SharedPrefix
from gateway.config.yaml_file import check_unique_keys, read_text
from gateway.core.json_types import yaml_kind
from gateway.core.keys import ClientKey, key_digest
from gateway.core.tenants import configured_tenant_problem

_KEY_FIELDS = {"name", "key", "key_sha256", "tenant", "models", "rpm", "tpm", "budget_usd", "trusted"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.:@/-]{1,64}")
EMPTY_KEYS_PROBLEM = (
    "an empty list of keys would start the gateway open (no authentication): list at least one key, or "
    "remove the keys key to run open on purpose"
)
"""The error of an explicit empty (or null) ``keys:``: only an absent ``keys`` runs the gateway open."""
SEGMENT_NAMES = {"tools_system": 1, "documents": 2}
"""Segment names ``shared_prefixes`` accepts, with their rules segment level."""


def entry_lines(text: str, top_key: str | None) -> list[int]:
    """1-based line of each item of a YAML sequence: the document itself (``top_key`` None) or the value of
    its top-level ``top_key``. Empty when the text is not such a sequence (the parser reports that)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return []
    if top_key is not None:
        if not isinstance(node, yaml.MappingNode):
            return []
        node = next((v for k, v in node.value if getattr(k, "value", None) == top_key), None)
    if not isinstance(node, yaml.SequenceNode):
        return []
    return [item.start_mark.line + 1 for item in node.value]


def parse_keys(
    value: Any,
    source: str,
    base_dir: Path | None,
    model_names: set[str],
    lines: list[int] | None = None,
    resolve_env=lambda value, where: value,
) -> tuple[ClientKey, ...]:
    """Validate ``keys:`` (a list, or a file path) against the configured model names.

    Args:
        value: the section as parsed from YAML.
        source: the config file (named in errors).
        base_dir: folder a relative key-file path is resolved against.
        model_names: the configured models (``models:`` of a key must name these).
        lines: 1-based line of each list entry in ``source`` (``entry_lines``), when known.
        resolve_env: ``(value, where) -> value`` turning ``env:NAME`` into the variable's value.

    Raises:
        ConfigError: ``<file>: keys[i] (line n).<field>: <problem>``; never quotes a key.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        path = Path(value)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        source = str(path)
        text = read_text(path, source, "the key file")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise ConfigError(source, "", f"{where}invalid YAML") from None
        check_unique_keys(text, source, "" if isinstance(value, dict) else "keys")
        top = None
        if isinstance(value, dict) and set(value) == {"keys"}:
            value, top = value["keys"], "keys"
        lines = entry_lines(text, top)
    if not isinstance(value, list):
        raise ConfigError(
            source, "keys", f"expected a list of key entries or a file path, got {yaml_kind(value)}"
        )
    if not value:
        raise ConfigError(source, "keys", EMPTY_KEYS_PROBLEM)
    keys: list[ClientKey] = []
    seen: dict[bytes, str] = {}
    for index, raw in enumerate(value):
        line = lines[index] if lines and index < len(lines) else None
        where = f"keys[{index}]" + (f" (line {line})" if line else "")
        key = _parse_entry(raw, source, where, model_names, resolve_env)
        if key.digest in seen:
            raise ConfigError(source, where, f"duplicate key: the same key as {seen[key.digest]}")
        if any(k.name == key.name for k in keys):
            raise ConfigError(source, f"{where}.name", f"duplicate name {key.name!r}")
        seen[key.digest] = where
        keys.append(key)
    return tuple(keys)


def _parse_entry(raw: Any, source: str, where: str, model_names: set[str], resolve_env) -> ClientKey:
    def fail(field: str, problem: str):
        raise ConfigError(source, f"{where}.{field}" if field else where, problem)

    if not isinstance(raw, dict):
        fail("", f"expected a mapping (name, key or key_sha256, tenant, ...), got {yaml_kind(raw)}")
    for field in raw:
        if field not in _KEY_FIELDS:
            fail(str(field), f"unknown field (valid: {', '.join(sorted(_KEY_FIELDS))})")
    if ("key" in raw) == ("key_sha256" in raw):
        fail("key", "expected exactly one of 'key' and 'key_sha256'")
    if "key" in raw:
        key = resolve_env(raw["key"], f"{where}.key")
        if not isinstance(key, str) or not key.strip():
            fail("key", "expected a non-empty string")
        key = key.strip()
        if any(ch.isspace() or not ch.isprintable() for ch in key):
            fail("key", "the key has whitespace or control characters inside")
        digest = key_digest(key)
    else:
        hex_digest = raw["key_sha256"]
        if not isinstance(hex_digest, str) or not _HEX64.fullmatch(hex_digest.strip().lower()):
            fail("key_sha256", "expected 64 hexadecimal digits (printf %s KEY | sha256sum)")
        digest = bytes.fromhex(hex_digest.strip().lower())
    name = raw.get("name", f"key-{digest.hex()[:12]}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        fail("name", "expected 1-64 characters of letters, digits and _.:@/-")
    tenant = raw.get("tenant", name)
    problem = configured_tenant_problem(tenant)
    if problem is not None:
        if "tenant" not in raw:
            problem = f"the tenant defaults to the name, and {problem} (or set tenant:)"
        fail("tenant", problem)
    models = raw.get("models")
    if models is not None:
        if isinstance(models, str):
            models = [models]
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            fail("models", f"expected a non-empty list of model names, got {yaml_kind(models)}")
        unknown = [m for m in models if m not in model_names]
        if unknown:
            fail("models", f"unknown model {unknown[0]!r} (configured: {', '.join(sorted(model_names))})")
        models = frozenset(models)
    trusted = raw.get("trusted", False)
    if not isinstance(trusted, bool):
        fail("trusted", f"expected a boolean, got {yaml_kind(trusted)}")
    return ClientKey(
        name=name,
        digest=digest,
        tenant=tenant,
        models=models,
        rpm=_limit(raw, "rpm", int, fail),
        tpm=_limit(raw, "tpm", int, fail),
        budget_usd=_limit(raw, "budget_usd", float, fail),
        trusted=trusted,
    )


def _limit(raw: dict, field: str, kind: type, fail) -> Any:
    value = raw.get(field)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok:
        what = "a positive integer" if kind is int else "a positive number"
        fail(field, f"expected {what}, got {yaml_kind(value)} {value!r}")
    return kind(value)


def parse_shared_prefixes(value: Any, source: str) -> tuple[SharedPrefix, ...]:
    """Validate ``shared_prefixes:``.

    Raises:
        ConfigError: not a list of one-key mappings ``segment`` / ``rule`` / ``content_hash``, or a bad value.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(source, "shared_prefixes", f"expected a list, got {yaml_kind(value)}")
    out = []
    for index, item in enumerate(value):
        where = f"shared_prefixes[{index}]"
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(
                source, where, "expected one of {segment: ...}, {rule: ...}, {content_hash: ...}"
            )
        ((kind, raw),) = item.items()
        if kind == "segment":
            level = SEGMENT_NAMES.get(raw, raw) if isinstance(raw, str) else raw
            if level not in (1, 2) or isinstance(level, bool):
                raise ConfigError(
                    source, f"{where}.segment", f"expected tools_system, documents, 1 or 2, got {raw!r}"
                )
            out.append(SharedPrefix("segment", str(level)))
        elif kind == "rule":
            if not isinstance(raw, str) or not raw:
                raise ConfigError(source, f"{where}.rule", "expected a rule id")
            out.append(SharedPrefix("rule", raw))
        elif kind == "content_hash":
            if not isinstance(raw, str) or not _HEX64.fullmatch(raw.strip().lower()):
                raise ConfigError(source, f"{where}.content_hash", "expected 64 hexadecimal digits (sha256)")
            out.append(SharedPrefix("content_hash", raw.strip().lower()))
        else:
            raise ConfigError(source, f"{where}.{kind}", "unknown kind (valid: segment, rule, content_hash)")
    return tuple(out)
