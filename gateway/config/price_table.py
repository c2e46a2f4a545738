"""The provider price table: prompt-cache prices per provider and model, shipped as data and overridable.

``gateway/config/data/prices.yaml`` (package data) holds, per provider, the cache *retentions* a request may ask for
(Anthropic ``5m`` / ``1h``, OpenAI ``in_memory`` / ``24h``, ...) with the lifetime used for planning, and per
model the prices in USD per million tokens: ``input`` (uncached), ``cache_read``, ``cache_write`` per retention,
``output`` (a generated token), and ``storage_per_hour`` (per million tokens per hour) where the provider bills storage (Gemini explicit caches).
The file says on which date it was checked (``checked``) and from which page (``source``).

Invariants: every price is a finite number >= 0, every model prices every retention its provider lists unless it
names the subset it supports (``cache_write`` keys), and each retention has a positive lifetime. A missing,
negative or ill-typed entry raises ``PriceTableError`` naming the file and the key path, so a bad table stops the
start. Model lookup is by the longest matching model-name prefix (``claude-opus-4-5-20251101`` finds
``claude-opus-4-5``). Pure: no HTTP, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

TOKENS_PER_PRICE_UNIT = 1_000_000
"""Prices are per million tokens."""

SHIPPED_TABLE = "data/prices.yaml"
"""The shipped table, inside the ``gateway.config`` package."""

LEGACY_PRICE_KEYS = frozenset({"input", "cached_input", "cache_write", "cache_write_1h", "output"})
"""The old per-model config keys (``gateway.pricing.Prices``), still accepted by ``apply_overrides``."""


class PriceTableError(ValueError):
    """A price table or override entry that is missing, negative, of the wrong type or unknown. The message
    starts with the file (or config place) and the key path, e.g.
    ``prices.yaml: providers.anthropic.models.claude-opus-4-5.cache_write.1h: expected a number >= 0``."""


@dataclass(frozen=True)
class ModelPrices:
    """One model's cache prices (USD per million tokens).

    Attributes:
        provider: provider name (``anthropic``, ``openai``, ...).
        model: the model-name prefix the entry is for.
        input: an uncached input token.
        cache_read: an input token read from the provider's cache.
        cache_write: retention name -> price of an input token written with that retention.
        retentions: retention name -> planning lifetime in seconds (only those this model supports).
        default_retention: what the provider uses when a request names none.
        output: a generated (output) token; None only for a model the table lacks whose config override
            names no ``output`` price (its output is then not priced).
        storage_per_hour: per million tokens per hour, where storage is billed; else None.
        min_cacheable_tokens: the provider's minimum cacheable prefix for this model, or None when unknown.
        source: page the prices were read from.
    """

    provider: str
    model: str
    input: float
    cache_read: float
    cache_write: Mapping[str, float]
    retentions: Mapping[str, float]
    default_retention: str
    output: float | None = None
    storage_per_hour: float | None = None
    min_cacheable_tokens: int | None = None
    source: str = ""

    def write_price(self, retention: str | None) -> float:
        """Price of a token written with ``retention`` (None = the default retention).

        Raises:
            KeyError: a retention this model does not support.
        """
        return self.cache_write[retention or self.default_retention]

    def dollars(self, tokens: int | float, price: float) -> float:
        """``tokens`` at ``price`` (per million) in dollars."""
        return tokens * price / TOKENS_PER_PRICE_UNIT

    def storage_dollars(self, tokens: int, hours: float) -> float:
        """Storage cost of ``tokens`` kept ``hours`` (0 where storage is not billed)."""
        return (
            0.0
            if self.storage_per_hour is None
            else tokens * hours * self.storage_per_hour / TOKENS_PER_PRICE_UNIT
        )


@dataclass(frozen=True)
class PriceTable:
    """All providers' model prices, and when and where they were checked.

    Attributes:
        checked: ISO date the table was checked against the providers' pages.
        models: provider -> model prefix -> ``ModelPrices``.
        path: where the table was read from (for messages).
    """

    checked: str
    models: Mapping[str, Mapping[str, ModelPrices]] = field(default_factory=dict)
    path: str = SHIPPED_TABLE

    def lookup(self, model: str, provider: str | None = None) -> ModelPrices | None:
        """The entry for ``model`` (longest matching name prefix; a provider prefix such as ``anthropic/`` is
        ignored), within ``provider`` when given, else across providers; None when no entry matches."""
        name = model.split("/", 1)[1] if "/" in model else model
        best: tuple[int, ModelPrices] | None = None
        providers = [provider] if provider is not None else list(self.models)
        for prov in providers:
            for prefix, prices in self.models.get(prov, {}).items():
                if name.startswith(prefix) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), prices)
        return None if best is None else best[1]

    def providers(self) -> list[str]:
        """Provider names, in file order."""
        return list(self.models)


def _names(items: Any) -> str:
    """``a, b, c``: names for a message, sorted (never a Python list's repr)."""
    return ", ".join(sorted(str(item) for item in items))


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PriceTableError(f"{where}: expected a number >= 0 (USD per million tokens), got {value!r}")
    return float(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PriceTableError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


_MODEL_KEYS = {"input", "cache_read", "cache_write", "output", "storage_per_hour", "min_cacheable_tokens"}
_PROVIDER_KEYS = {"source", "retentions", "default_retention", "min_cacheable_tokens", "models"}


def _min_tokens(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PriceTableError(f"{where}: expected a positive whole number of tokens, got {value!r}")
    return value


def _model_entry(
    raw: Any,
    where: str,
    provider: str,
    model: str,
    retentions: Mapping[str, float],
    default: str,
    provider_min: int | None,
    source: str,
) -> ModelPrices:
    raw = _mapping(raw, where)
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise PriceTableError(f"{where}: unknown key(s) {_names(unknown)}; expected {_names(_MODEL_KEYS)}")
    for key in ("input", "cache_read", "cache_write", "output"):
        if key not in raw:
            raise PriceTableError(f"{where}.{key}: missing (required)")
    writes_raw = _mapping(raw["cache_write"], f"{where}.cache_write")
    if not writes_raw:
        raise PriceTableError(f"{where}.cache_write: missing (one price per retention)")
    writes: dict[str, float] = {}
    for name, value in writes_raw.items():
        if name not in retentions:
            raise PriceTableError(
                f"{where}.cache_write.{name}: unknown retention; {provider} has {_names(retentions)}"
            )
        writes[str(name)] = _number(value, f"{where}.cache_write.{name}")
    if default not in writes:
        raise PriceTableError(f"{where}.cache_write.{default}: missing (the provider's default retention)")
    storage = raw.get("storage_per_hour")
    return ModelPrices(
        provider=provider,
        model=model,
        input=_number(raw["input"], f"{where}.input"),
        cache_read=_number(raw["cache_read"], f"{where}.cache_read"),
        cache_write=writes,
        retentions={name: retentions[name] for name in writes},
        default_retention=default,
        output=_number(raw["output"], f"{where}.output"),
        storage_per_hour=None if storage is None else _number(storage, f"{where}.storage_per_hour"),
        min_cacheable_tokens=(
            _min_tokens(raw["min_cacheable_tokens"], f"{where}.min_cacheable_tokens")
            if "min_cacheable_tokens" in raw
            else provider_min
        ),
        source=source,
    )


def parse_price_table(raw: Any, path: str = SHIPPED_TABLE) -> PriceTable:
    """Validate a loaded YAML document into a ``PriceTable``.

    Raises:
        PriceTableError: a missing ``checked`` date or ``providers``, a provider without retentions or models,
            a retention lifetime that is not a positive number, a model price missing, negative or not a number,
            an unknown key; the message starts with ``path`` and the key path.
    """
    raw = _mapping(raw, f"{path}: (top level)")
    checked = raw.get("checked")
    if not isinstance(checked, str) or not checked:
        raise PriceTableError(f"{path}: checked: missing (the ISO date the prices were checked)")
    providers = _mapping(raw.get("providers"), f"{path}: providers")
    if not providers:
        raise PriceTableError(f"{path}: providers: missing (at least one provider)")
    models: dict[str, dict[str, ModelPrices]] = {}
    for provider, entry in providers.items():
        where = f"{path}: providers.{provider}"
        entry = _mapping(entry, where)
        unknown = set(entry) - _PROVIDER_KEYS
        if unknown:
            raise PriceTableError(
                f"{where}: unknown key(s) {_names(unknown)}; expected {_names(_PROVIDER_KEYS)}"
            )
        retentions_raw = _mapping(entry.get("retentions"), f"{where}.retentions")
        if not retentions_raw:
            raise PriceTableError(f"{where}.retentions: missing (name: lifetime in seconds)")
        retentions: dict[str, float] = {}
        for name, seconds in retentions_raw.items():
            value = _number(seconds, f"{where}.retentions.{name}")
            if value <= 0:
                raise PriceTableError(
                    f"{where}.retentions.{name}: expected a lifetime > 0 seconds, got {seconds!r}"
                )
            retentions[str(name)] = value
        default = entry.get("default_retention")
        if default not in retentions:
            raise PriceTableError(
                f"{where}.default_retention: expected one of {_names(retentions)}, got {default!r}"
            )
        provider_min = (
            _min_tokens(entry["min_cacheable_tokens"], f"{where}.min_cacheable_tokens")
            if "min_cacheable_tokens" in entry
            else None
        )
        model_entries = _mapping(entry.get("models"), f"{where}.models")
        if not model_entries:
            raise PriceTableError(f"{where}.models: missing (at least one model)")
        models[str(provider)] = {
            str(model): _model_entry(
                value,
                f"{where}.models.{model}",
                str(provider),
                str(model),
                retentions,
                str(default),
                provider_min,
                str(entry.get("source", "")),
            )
            for model, value in model_entries.items()
        }
    return PriceTable(checked=checked, models=models, path=path)


@lru_cache(maxsize=1)
def shipped_price_table() -> PriceTable:
    """The shipped table, read and validated once per process.

    Raises:
        PriceTableError: the shipped file is broken (a packaging error).
    """
    return load_price_table()


def load_price_table(path: str | Path | None = None) -> PriceTable:
    """Read and validate a price table (default: the shipped ``gateway/config/data/prices.yaml``).

    Raises:
        PriceTableError: unreadable file, invalid YAML, or any entry ``parse_price_table`` refuses.
    """
    if path is None:
        where = f"gateway/config/{SHIPPED_TABLE}"
        text = resources.files("gateway.config").joinpath(SHIPPED_TABLE).read_text(encoding="utf-8")
    else:
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PriceTableError(f"{where}: cannot read the price table ({exc.strerror})") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PriceTableError(f"{where}: not valid YAML ({exc})") from exc
    return parse_price_table(raw, where)


def override_prices(
    base: ModelPrices | None, raw: Any, where: str, *, provider: str, model: str
) -> ModelPrices:
    """A model's prices with a config override applied.

    ``raw`` is either the table's own shape (``input``, ``cache_read``, ``cache_write: {retention: price}``,
    ``output``, ``storage_per_hour``, ``min_cacheable_tokens``; any subset when ``base`` exists) or the old config shape
    (``input``, ``cached_input``, ``cache_write``, ``cache_write_1h``: the 5-minute / default and the 1-hour
    write), which is converted. Without ``base`` (a model the table lacks) ``input`` is required, ``cache_read``
    defaults to ``input`` (no discount), write prices to ``input``, retentions to one ``default``, and ``output``
    to None (output not priced) unless given.

    Raises:
        PriceTableError: a negative, missing or ill-typed price, an unknown key or retention; the message
            starts with ``where``.
    """
    raw = _mapping(raw, where)
    legacy = (
        "cached_input" in raw
        or "cache_write_1h" in raw
        or not isinstance(raw.get("cache_write", {}), Mapping)
    )
    if legacy:
        unknown = set(raw) - LEGACY_PRICE_KEYS
        if unknown:
            raise PriceTableError(
                f"{where}: unknown key(s) {_names(unknown)}; expected {_names(LEGACY_PRICE_KEYS)}"
            )
        converted: dict[str, Any] = {}
        if "input" in raw:
            converted["input"] = raw["input"]
        if "output" in raw:
            converted["output"] = raw["output"]
        if "cached_input" in raw:
            converted["cache_read"] = raw["cached_input"]
        writes: dict[str, Any] = {}
        retention_names = list((base.retentions if base else {"default": 0}).keys())
        default_name = base.default_retention if base else "default"
        if "cache_write" in raw:
            writes[default_name] = raw["cache_write"]
        if "cache_write_1h" in raw:
            if "1h" not in retention_names:
                raise PriceTableError(
                    f"{where}.cache_write_1h: this model has no 1h retention (its retentions: {', '.join(retention_names)})"
                )
            writes["1h"] = raw["cache_write_1h"]
        if writes:
            converted["cache_write"] = writes
        raw = converted
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise PriceTableError(f"{where}: unknown key(s) {_names(unknown)}; expected {_names(_MODEL_KEYS)}")
    if base is None:
        if "input" not in raw:
            raise PriceTableError(f"{where}.input: missing (required for a model the price table lacks)")
        input_price = _number(raw["input"], f"{where}.input")
        raw = {"cache_read": input_price, **raw}  # the old default: no discount unless given
        writes_raw = _mapping(raw.get("cache_write", {"default": input_price}), f"{where}.cache_write")
        writes_out = {str(k): _number(v, f"{where}.cache_write.{k}") for k, v in writes_raw.items()}
        default = "default" if "default" in writes_out else next(iter(writes_out), "default")
        if not writes_out:
            writes_out = {"default": input_price}
        storage = raw.get("storage_per_hour")
        return ModelPrices(
            provider=provider,
            model=model,
            input=input_price,
            cache_read=_number(raw["cache_read"], f"{where}.cache_read"),
            cache_write=writes_out,
            retentions=dict.fromkeys(writes_out, 300.0),
            default_retention=default,
            output=_number(raw["output"], f"{where}.output") if "output" in raw else None,
            storage_per_hour=None if storage is None else _number(storage, f"{where}.storage_per_hour"),
            min_cacheable_tokens=(
                _min_tokens(raw["min_cacheable_tokens"], f"{where}.min_cacheable_tokens")
                if "min_cacheable_tokens" in raw
                else None
            ),
            source="config",
        )
    updates: dict[str, Any] = {"source": "config"}
    if "input" in raw:
        updates["input"] = _number(raw["input"], f"{where}.input")
    if "cache_read" in raw:
        updates["cache_read"] = _number(raw["cache_read"], f"{where}.cache_read")
    if "output" in raw:
        updates["output"] = _number(raw["output"], f"{where}.output")
    if "cache_write" in raw:
        writes_raw = _mapping(raw["cache_write"], f"{where}.cache_write")
        merged = dict(base.cache_write)
        for name, value in writes_raw.items():
            if name not in base.retentions:
                raise PriceTableError(
                    f"{where}.cache_write.{name}: unknown retention; {base.provider} has {_names(base.retentions)}"
                )
            merged[str(name)] = _number(value, f"{where}.cache_write.{name}")
        updates["cache_write"] = merged
    if "storage_per_hour" in raw:
        updates["storage_per_hour"] = _number(raw["storage_per_hour"], f"{where}.storage_per_hour")
    if "min_cacheable_tokens" in raw:
        updates["min_cacheable_tokens"] = _min_tokens(
            raw["min_cacheable_tokens"], f"{where}.min_cacheable_tokens"
        )
    return replace(base, **updates)
