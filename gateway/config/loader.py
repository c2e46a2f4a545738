"""The gateway's YAML config: loading, ``env:NAME`` values, and validation that names file, key and
expectation.

Every key is optional; the defaults are the embedded SmolLM2 with the shipped default rules. The keys are
listed in README.md ("Configuration") and ``examples/config.yaml``; each entry of ``models:`` becomes the
class of its ``backend:`` kind (``gateway.config.schema``). A string value ``env:NAME`` is replaced by the
environment variable ``NAME`` (an unset or empty variable is an error, so a forgotten admin token never
silently disables auth). Any bad key or value raises ``ConfigError`` naming the file, the key path
(``models[0].engine.block_size``) and what was expected; so does a key given twice in one mapping, a file that
is not UTF-8, and an embedded model's ``path`` that does not exist. Relative rule-file and model paths are
resolved against the config file's folder.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config.engine_section import parse_engine
from gateway.config.keys import EMPTY_KEYS_PROBLEM, entry_lines, parse_keys, parse_shared_prefixes
from gateway.config.price_table import PriceTableError, override_prices, shipped_price_table
from gateway.config.reader import Reader
from gateway.config.routing_section import parse_routing
from gateway.config.schema import (
    BACKEND_KINDS,
    DEFAULT_MODEL_NAME,
    LEARNING_MODES,
    WARM_CONTENT_KEYS,
    AdminConfig,
    AnthropicUpstream,
    ConfigError,
    EmbeddedModel,
    GatewayConfig,
    LearningConfig,
    ModelEntry,
    OpenAIUpstream,
    RingConfig,
    ServerConfig,
    TranscriptConfig,
    WarmEntry,
)
from gateway.config.yaml_file import check_unique_keys, read_text
from gateway.core.json_types import yaml_kind
from gateway.core.keys import ClientKey
from gateway.core.tenants import unreachable_tenant_problem

ADMIN_TOKEN_ENV = "PREFIXGATE_ADMIN_TOKEN"
"""The environment variable the admin token is read from when no config gives one: the embedded default (README:
``admin: {token: env:PREFIXGATE_ADMIN_TOKEN}``, optional there: unset or empty leaves the admin endpoints open, as
without a config) and a config file without ``admin.token`` (its own token wins when both are set)."""


def default_config() -> GatewayConfig:
    """The embedded default: SmolLM2-135M-Instruct (``path: default``) with the ``default`` rule pack, and the
    admin token from ``$PREFIXGATE_ADMIN_TOKEN`` when it is set (then ``/admin/*`` and ``/metrics`` need it)."""
    return GatewayConfig(admin=AdminConfig(token=os.environ.get(ADMIN_TOKEN_ENV) or None))


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate a YAML config file. Without ``admin.token`` (absent, null or empty) the admin token is
    ``$PREFIXGATE_ADMIN_TOKEN`` when that is set, as for the embedded default; the config's token wins when both
    are set.

    Raises:
        ConfigError: unreadable or non-UTF-8 file, bad YAML (with its line), a key given twice, unknown key,
            wrong type, bad value.
    """
    source, text, data = _read_document(path)
    config = parse_config(
        data, source=source, base_dir=Path(path).resolve().parent, key_lines=entry_lines(text, "keys")
    )
    if config.admin.token is None and os.environ.get(ADMIN_TOKEN_ENV):
        config = dataclasses.replace(config, admin=AdminConfig(token=os.environ[ADMIN_TOKEN_ENV]))
    return config


def load_canonicalizer_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read a YAML config file for its canonicalizer only: ``rules``, ``transcript`` (and the shared ``redis``
    URL) and ``rules_learning`` are validated as ``load_config`` does; of the other sections only their names
    are checked, so their ``env:NAME`` values (admin token, client keys, provider keys) need not be set and
    their model paths need not exist. The rest of the returned config is the defaults.

    Raises:
        ConfigError: as ``load_config``, for those sections.
    """
    source, _, data = _read_document(path)
    reader = Reader(source)
    top = reader.mapping(data, "", TOP_LEVEL_KEYS)
    return GatewayConfig(
        rules=_parse_rules(reader, top.get("rules", ["default"]), Path(path).resolve().parent),
        transcript=_parse_transcript(reader, top.get("transcript"), top.get("redis")),
        rules_learning=_parse_learning(reader, top.get("rules_learning")),
        source=source,
    )


def _read_document(path: str | os.PathLike[str]) -> tuple[str, str, Any]:
    """(source, text, parsed YAML; ``{}`` for an empty file) of a config file."""
    source = str(path)
    text = read_text(path, source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(
            source, "", f"{where}invalid YAML ({getattr(exc, 'problem', None) or exc})"
        ) from exc
    check_unique_keys(text, source)
    return source, text, {} if data is None else data


TOP_LEVEL_KEYS = frozenset(
    {
        "server",
        "admin",
        "rules",
        "models",
        "transcript",
        "redis",
        "rules_learning",
        "keys",
        "shared_prefixes",
        "warm",
        "warm_before_ready",
    }
)
"""The sections of a config file."""


def parse_config(
    data: Any, source: str = "<dict>", base_dir: Path | None = None, key_lines: list[int] | None = None
) -> GatewayConfig:
    """Validate an already-parsed mapping (see the module docstring for the keys).

    Args:
        data: the YAML document.
        source: named in errors.
        base_dir: folder that relative rule-file and model paths are resolved against; None = leave them.
        key_lines: 1-based line of each inline ``keys:`` entry, for errors.

    Raises:
        ConfigError: on the first problem found.
    """
    reader = Reader(source)
    top = reader.mapping(data, "", set(TOP_LEVEL_KEYS))
    server = _parse_server(reader, top.get("server"))
    admin = _parse_admin(reader, top.get("admin"))
    rules = _parse_rules(reader, top.get("rules", ["default"]), base_dir)
    models = _parse_models(reader, top.get("models"), base_dir)
    transcript = _parse_transcript(reader, top.get("transcript"), top.get("redis"))
    learning = _parse_learning(reader, top.get("rules_learning"))
    if "keys" in top and top["keys"] is None:
        reader.fail("keys", EMPTY_KEYS_PROBLEM)
    keys = parse_keys(
        reader.resolve_env(top.get("keys"), "keys"),
        source,
        base_dir,
        {m.name for m in models},
        key_lines,
        reader.resolve_env,
    )
    shared = parse_shared_prefixes(top.get("shared_prefixes"), source)
    warm = _parse_warm(reader, top.get("warm"), models, base_dir, keys)
    warm_before_ready = reader.typed(top, "", "warm_before_ready", bool, True)
    return GatewayConfig(
        server=server,
        admin=admin,
        rules=rules,
        models=models,
        transcript=transcript,
        rules_learning=learning,
        warm=warm,
        warm_before_ready=warm_before_ready,
        source=source,
        keys=keys,
        shared_prefixes=shared,
    )


def _parse_warm(
    reader: Reader,
    value: Any,
    models: tuple[ModelEntry, ...],
    base_dir: Path | None,
    keys: tuple[ClientKey, ...] = (),
) -> tuple[WarmEntry, ...]:
    """``warm:``: a list of ``WarmEntry`` mappings. Checked here: keys, types, that the model is embedded, that
    an entry has something to prefill, and that some request can have its tenant (``keys``: the configured
    client keys, ``gateway.core.tenants.reachable_tenant``); the prompt itself is checked when it is warmed."""
    if value is None:
        return ()
    if not isinstance(value, list):
        reader.fail("warm", f"expected a list of entries, got {yaml_kind(value)}")
    embedded = [m.name for m in models if isinstance(m, EmbeddedModel)]
    content_files = {f"{key}_file" for key in WARM_CONTENT_KEYS}
    out: list[WarmEntry] = []
    for index, raw in enumerate(value):
        where = f"warm[{index}]"
        entry = reader.mapping(raw, where, {"model", "tenant", "pin", *WARM_CONTENT_KEYS, *content_files})
        model = reader.typed(entry, where, "model", str | None, None)
        if model is None:
            if not embedded:
                reader.fail(where, "warming needs an embedded model (models: has none)")
            model = embedded[0]
        elif model not in embedded:
            reader.fail(
                f"{where}.model",
                f"expected an embedded model ({', '.join(embedded) or 'none'}), got {model!r}",
            )
        given = [key for key in WARM_CONTENT_KEYS if key in entry or f"{key}_file" in entry]
        if not given:
            reader.fail(where, f"expected one of {', '.join(WARM_CONTENT_KEYS)} (or a *_file of one)")
        for key in WARM_CONTENT_KEYS:
            if key in entry and f"{key}_file" in entry:
                reader.fail(f"{where}.{key}_file", f"give {key} or {key}_file, not both")
        if "messages" in given and len(given) > 1:
            reader.fail(where, "messages is a whole prompt: give it alone, or system and/or documents")
        files = []
        for key in WARM_CONTENT_KEYS:
            if f"{key}_file" in entry:
                path = reader.typed(entry, where, f"{key}_file", str, None)
                resolved = Path(path) if base_dir is None or Path(path).is_absolute() else base_dir / path
                files.append((key, str(resolved)))
        tenant = reader.typed(entry, where, "tenant", str, "")
        problem = unreachable_tenant_problem(tenant, keys)
        if problem is not None:
            reader.fail(f"{where}.tenant", problem)
        out.append(
            WarmEntry(
                model=model,
                tenant=tenant,
                pin=reader.typed(entry, where, "pin", bool, False),
                system=reader.typed(entry, where, "system", str | None, None),
                documents=reader.typed(entry, where, "documents", str | None, None),
                messages=entry.get("messages"),
                files=tuple(files),
            )
        )
    return tuple(out)


def _parse_transcript(reader: Reader, value: Any, redis_section: Any) -> TranscriptConfig:
    """``transcript:`` (bounds and an optional ``redis_url``); a shared ``redis: {url: ...}`` section gives the
    URL when ``transcript.redis_url`` is not set."""
    keys = {f.name for f in dataclasses.fields(TranscriptConfig)}
    section = reader.mapping({} if value is None else value, "transcript", keys)
    shared = reader.mapping({} if redis_section is None else redis_section, "redis", {"url"})
    default = TranscriptConfig()
    values: dict[str, Any] = {}
    for name, expected in (
        ("max_entries", int),
        ("max_bytes", int),
        ("ttl_s", float),
        ("socket_timeout_s", float),
        ("retry_after_s", float),
    ):
        values[name] = reader.typed(section, "transcript", name, expected, getattr(default, name))
        if not values[name] > 0:
            reader.fail(f"transcript.{name}", f"expected a positive number, got {values[name]}")
    url = reader.typed(section, "transcript", "redis_url", str | None, None)
    if url is None:
        url = reader.typed(shared, "redis", "url", str | None, None)
    if url is not None:
        reader.redis_url("transcript.redis_url", url)
    prefix = reader.typed(section, "transcript", "redis_prefix", str, default.redis_prefix)
    return TranscriptConfig(redis_url=url or None, redis_prefix=prefix, **values)


def _parse_learning(reader: Reader, value: Any) -> LearningConfig:
    """``rules_learning: off|suggest|apply`` or ``rules_learning: {mode: ..., min_distinct: N}``."""
    default = LearningConfig()
    if value is None:
        return default
    section = value if isinstance(value, dict) else {"mode": value}
    section = dict(reader.mapping(section, "rules_learning", {"mode", "min_distinct"}))
    if section.get("mode") is False:  # YAML 1.1 reads a bare ``off`` as false
        section["mode"] = "off"
    mode = reader.typed(section, "rules_learning", "mode", str, default.mode)
    if mode not in LEARNING_MODES:
        reader.fail("rules_learning.mode", f"expected one of {', '.join(LEARNING_MODES)}, got {mode!r}")
    min_distinct = reader.typed(section, "rules_learning", "min_distinct", int, default.min_distinct)
    if min_distinct < 2:
        reader.fail("rules_learning.min_distinct", f"expected an integer >= 2, got {min_distinct}")
    return LearningConfig(mode=mode, min_distinct=min_distinct)


UNKNOWN_FIELD_MODES = ("refuse", "ignore")


def _parse_server(reader: Reader, value: Any) -> ServerConfig:
    section = reader.mapping(
        {} if value is None else value,
        "server",
        {"host", "port", "max_body_bytes", "unknown_fields", "shutdown_grace_s"},
    )
    default = ServerConfig()
    host = reader.typed(section, "server", "host", str, default.host)
    port = reader.typed(section, "server", "port", int, default.port)
    max_body = reader.typed(section, "server", "max_body_bytes", int, default.max_body_bytes)
    if not 0 <= port <= 65535:
        reader.fail("server.port", f"expected a TCP port 0..65535, got {port}")
    if max_body < 1:
        reader.fail("server.max_body_bytes", f"expected a positive number of bytes, got {max_body}")
    unknown = reader.typed(section, "server", "unknown_fields", str, default.unknown_fields)
    if unknown not in UNKNOWN_FIELD_MODES:
        reader.fail("server.unknown_fields", f"expected 'refuse' or 'ignore', got {unknown!r}")
    grace = reader.typed(section, "server", "shutdown_grace_s", float, default.shutdown_grace_s)
    if not 0 <= grace <= 3600:
        reader.fail("server.shutdown_grace_s", f"expected seconds in [0, 3600], got {grace}")
    return ServerConfig(
        host=host, port=port, max_body_bytes=max_body, unknown_fields=unknown, shutdown_grace_s=grace
    )


def _parse_admin(reader: Reader, value: Any) -> AdminConfig:
    section = reader.mapping({} if value is None else value, "admin", {"token"})
    token = reader.typed(section, "admin", "token", str | None, None)
    return AdminConfig(token=token or None)


def _parse_rules(reader: Reader, value: Any, base_dir: Path | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        reader.fail("rules", f"expected a list of rule pack names or YAML file paths, got {yaml_kind(value)}")
    names = []
    for index, item in enumerate(value):
        item = reader.resolve_env(item, f"rules[{index}]")
        if not isinstance(item, str) or not item:
            reader.fail(
                f"rules[{index}]", f"expected a rule pack name or a YAML file path, got {yaml_kind(item)}"
            )
        names.append(_resolve_rule_path(item, base_dir))
    return tuple(names)


def _resolve_rule_path(item: str, base_dir: Path | None) -> str:
    """A pack name stays as is; a path (has a separator or a .yaml/.yml suffix) is made absolute."""
    is_path = "/" in item or os.sep in item or item.endswith((".yaml", ".yml"))
    if is_path and base_dir is not None and not os.path.isabs(item):
        return str((base_dir / item).resolve())
    return item


_MODEL_COMMON = {"name", "backend"}
_MODEL_EMBEDDED = {"path", "engine"}
_MODEL_UPSTREAM = {
    "base_url",
    "api_key",
    "upstream_model",
    "timeout_s",
    "retries",
    "prices",
    "ring",
    "routing",
    "routing_share",
    "kv_events",
    "cache_aware",
}
_MODEL_BACKEND_ONLY = {
    "openai": {"prompt_cache_key", "prompt_cache_retention", "cache_salt"},
    "anthropic": {"anthropic_version", "auto_breakpoints", "min_cacheable_tokens"},
}
"""Settings of one upstream kind only."""


def _parse_models(reader: Reader, value: Any, base_dir: Path | None) -> tuple[ModelEntry, ...]:
    if value is None:
        return (EmbeddedModel(name=DEFAULT_MODEL_NAME),)
    if not isinstance(value, list) or not value:
        reader.fail("models", f"expected a non-empty list of model entries, got {yaml_kind(value)}")
    models: list[ModelEntry] = []
    for index, entry in enumerate(value):
        model = _parse_model(reader, entry, f"models[{index}]", base_dir)
        if any(m.name == model.name for m in models):
            reader.fail(f"models[{index}].name", f"expected a unique model name, got a second {model.name!r}")
        models.append(model)
    return tuple(models)


def _parse_model(reader: Reader, entry: Any, where: str, base_dir: Path | None) -> ModelEntry:
    every_key = _MODEL_COMMON | _MODEL_EMBEDDED | _MODEL_UPSTREAM | set().union(*_MODEL_BACKEND_ONLY.values())
    raw = reader.mapping(entry, where, every_key)
    name = reader.typed(raw, where, "name", str, None, required=True)
    if not name:
        reader.fail(f"{where}.name", "expected a non-empty model name")
    backend = reader.typed(raw, where, "backend", str, "embedded")
    if backend not in BACKEND_KINDS:
        reader.fail(f"{where}.backend", f"expected one of {', '.join(BACKEND_KINDS)}, got {backend!r}")
    if backend == "embedded":
        allowed = _MODEL_COMMON | _MODEL_EMBEDDED
    else:
        allowed = _MODEL_COMMON | _MODEL_UPSTREAM | _MODEL_BACKEND_ONLY[backend]
    for key in raw:
        if key not in allowed:
            reader.fail(
                f"{where}.{key}",
                f"is not a setting of backend {backend!r} (valid: {', '.join(sorted(allowed))})",
            )
    if backend == "embedded":
        path = reader.typed(raw, where, "path", str, "default")
        if path != "default" and base_dir is not None and not os.path.isabs(path):
            path = str((base_dir / path).resolve())
        if path != "default" and not os.path.exists(path):
            reader.fail(f"{where}.path", f"no such model file or folder: {path}")
        engine = parse_engine(reader, raw.get("engine"), f"{where}.engine", base_dir)
        return EmbeddedModel(name=name, path=path, engine=engine)
    return _parse_upstream(reader, raw, where, name, backend)


def _parse_api_key(reader: Reader, raw: dict, where: str) -> str | None:
    """``api_key`` with surrounding whitespace removed (a secret file or ``echo`` leaves a newline); a key
    with whitespace, control or non-ASCII characters inside is refused, without echoing it (it goes out as an
    HTTP header, which the client library would reject at the first call, quoting the key)."""
    key = reader.typed(raw, where, "api_key", str | None, None)
    if key is None:
        return None
    key = key.strip()
    if not key or any(ch.isspace() or not ch.isprintable() or not ch.isascii() for ch in key):
        reader.fail(
            f"{where}.api_key", "the key is empty or has whitespace, control or non-ASCII characters inside"
        )
    return key


def _parse_upstream(
    reader: Reader, raw: dict, where: str, name: str, backend: str
) -> OpenAIUpstream | AnthropicUpstream:
    base_url = reader.resolve_env(raw.get("base_url"), f"{where}.base_url")
    single = isinstance(base_url, str)  # one URL: its errors name base_url itself, not base_url[0]
    if single:
        base_url = [base_url]
    if not isinstance(base_url, list) or not base_url:
        reader.fail(
            f"{where}.base_url", f"expected a URL or a non-empty list of URLs, got {yaml_kind(base_url)}"
        )
    urls = []
    for index, url in enumerate(base_url):
        key = f"{where}.base_url" if single else f"{where}.base_url[{index}]"
        url = reader.resolve_env(url, key)
        if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
            scheme, _, rest = url.partition("://")
            url = f"{scheme.lower()}://{rest}"  # a URL's scheme is case-insensitive (RFC 3986 section 3.1)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            reader.fail(key, f"expected an http:// or https:// URL, got {url!r}")
        try:
            parsed = httpx.URL(url)
            port = parsed.port
        except (httpx.InvalidURL, ValueError) as exc:
            reader.fail(key, f"not a valid URL ({exc}): {url!r}")
        if port is not None and not 0 < port < 65536:
            reader.fail(key, f"the port {port} is outside 1-65535")
        if parsed.userinfo:  # the message leaves the URL out: it holds a password
            reader.fail(
                key,
                "the URL holds credentials (user:password@), which the gateway cannot send (the transport "
                "refuses them beside its own headers): give the upstream's key as api_key (env:NAME)",
            )
        if not parsed.host:
            reader.fail(key, f"the URL has no host: {url!r}")
        if url.rstrip("/") in urls:
            first = urls.index(url.rstrip("/"))
            reader.fail(
                key,
                f"the same replica as base_url[{first}] ({url!r}): list each replica once (one "
                "server twice would hold two ring shares and two in-flight counts for one cache)",
            )
        urls.append(url.rstrip("/"))
    timeout = reader.typed(raw, where, "timeout_s", float, 60.0)
    retries = reader.typed(raw, where, "retries", int, 2)
    if timeout <= 0:
        reader.fail(f"{where}.timeout_s", f"expected a positive number of seconds, got {timeout}")
    if retries < 0:
        reader.fail(f"{where}.retries", f"expected a count >= 0, got {retries}")
    upstream_model = reader.typed(raw, where, "upstream_model", str | None, None)
    table = shipped_price_table()
    prices = table.lookup(upstream_model or name, backend) or table.lookup(upstream_model or name)
    if raw.get("prices") is not None:
        try:
            prices = override_prices(
                prices, raw["prices"], f"{where}.prices", provider=backend, model=upstream_model or name
            )
        except PriceTableError as exc:
            key, _, problem = str(exc).partition(": ")
            reader.fail(key, problem)
    common = {
        "name": name,
        "base_url": tuple(urls),
        "api_key": _parse_api_key(reader, raw, where),
        "upstream_model": upstream_model,
        "timeout_s": timeout,
        "retries": retries,
        "prices": prices,
        "ring": _parse_ring(reader, raw.get("ring"), f"{where}.ring"),
        **parse_routing(reader, raw, where),
    }
    if backend == "openai":
        retention = reader.typed(raw, where, "prompt_cache_retention", str, "auto")
        if retention not in ("auto", "off"):
            reader.fail(f"{where}.prompt_cache_retention", f"expected 'auto' or 'off', got {retention!r}")
        return OpenAIUpstream(
            **common,
            prompt_cache_key=reader.typed(raw, where, "prompt_cache_key", bool, True),
            prompt_cache_retention=retention,
            cache_salt=reader.typed(raw, where, "cache_salt", bool, False),
        )
    return AnthropicUpstream(
        **common,
        anthropic_version=_parse_anthropic_version(reader, raw, where),
        auto_breakpoints=reader.typed(raw, where, "auto_breakpoints", bool, True),
        min_cacheable_tokens=_parse_min_cacheable(
            reader, raw.get("min_cacheable_tokens"), f"{where}.min_cacheable_tokens"
        ),
    )


def _parse_ring(reader: Reader, value: Any, where: str) -> RingConfig:
    default = RingConfig()
    section = reader.mapping(
        {} if value is None else value, where, {f.name for f in dataclasses.fields(RingConfig)}
    )
    load_factor = reader.typed(section, where, "load_factor", float, default.load_factor)
    vnodes = reader.typed(section, where, "vnodes", int, default.vnodes)
    cooldown = reader.typed(section, where, "cooldown_s", float, default.cooldown_s)
    max_cooldown = reader.typed(
        section, where, "max_cooldown_s", float, max(default.max_cooldown_s, cooldown)
    )
    if not load_factor > 1.0:
        reader.fail(
            f"{where}.load_factor",
            f"expected a number > 1 (the bound on a replica's share), got {load_factor}",
        )
    if vnodes < 1:
        reader.fail(f"{where}.vnodes", f"expected an integer >= 1, got {vnodes}")
    if not cooldown > 0:
        reader.fail(f"{where}.cooldown_s", f"expected a positive number of seconds, got {cooldown}")
    if max_cooldown < cooldown:
        reader.fail(
            f"{where}.max_cooldown_s",
            f"expected a number of seconds >= cooldown_s ({cooldown}), got {max_cooldown}",
        )
    return RingConfig(
        load_factor=load_factor, vnodes=vnodes, cooldown_s=cooldown, max_cooldown_s=max_cooldown
    )


def _parse_anthropic_version(reader: Reader, raw: dict, where: str) -> str:
    version = reader.typed(raw, where, "anthropic_version", str, "2023-06-01")
    if not version or any(ch in version for ch in "\r\n"):
        reader.fail(
            f"{where}.anthropic_version", f"expected an API version such as '2023-06-01', got {version!r}"
        )
    return version


def _parse_min_cacheable(reader: Reader, value: Any, where: str) -> tuple[tuple[str, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        reader.fail(where, f"expected a mapping of model-name prefix -> tokens, got {yaml_kind(value)}")
    out = {}
    for prefix, tokens in value.items():
        if not isinstance(prefix, str) or not prefix:
            reader.fail(
                where, f"expected non-empty model-name prefixes as keys, got {yaml_kind(prefix)} {prefix!r}"
            )
        tokens = reader.typed(value, where, prefix, int, None, required=True)
        if tokens < 1:
            reader.fail(f"{where}.{prefix}", f"expected a number of tokens >= 1, got {tokens}")
        out[prefix] = tokens
    return tuple(out.items())
