"""Cost saved by provider prompt caching, from a per-model price table.

Prices are US dollars per million tokens, as providers publish them:

- ``input``: an uncached input token.
- ``cached_input``: an input token read from the provider's prompt cache (OpenAI "cached input",
  Anthropic "cache hits & refreshes", 0.1 x input on Anthropic).
- ``cache_write``: an input token written to the cache (Anthropic "5m cache writes", 1.25 x input; OpenAI
  charges no premium, so ``cache_write`` defaults to ``input``).
- ``cache_write_1h``: Anthropic's 1-hour cache write (2 x input); defaults to ``cache_write``.

Formula (what caching saved against sending the same prompt with no cache at all)::

    saved = cached * (input - cached_input) - cache_creation * (cache_write - input)

in dollars after dividing by 1e6. The first term is the discount on tokens read from the cache, the second
the premium paid on tokens written to it (negative savings when writes are never read back). Sources:
https://platform.openai.com/docs/guides/prompt-caching and
https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching#pricing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOKENS_PER_PRICE_UNIT = 1_000_000


class PriceTableError(ValueError):
    """A price entry that is missing, negative or not a number. The message names the field."""


@dataclass(frozen=True)
class Prices:
    """Per-model prices in USD per million tokens (see module docstring)."""

    input: float
    cached_input: float
    cache_write: float
    cache_write_1h: float

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "prices") -> Prices:
        """Build from a config mapping ``{input, cached_input?, cache_write?, cache_write_1h?}``.

        ``cached_input`` defaults to ``input`` (no discount), ``cache_write`` to ``input`` (no premium),
        ``cache_write_1h`` to ``cache_write``.

        Raises:
            PriceTableError: ``input`` missing, an unknown key, or a value that is not a number >= 0.
        """
        if not isinstance(raw, Mapping):
            raise PriceTableError(f"{where}: expected a mapping of prices per million tokens")
        unknown = set(raw) - {"input", "cached_input", "cache_write", "cache_write_1h"}
        if unknown:
            raise PriceTableError(f"{where}: unknown key(s) {sorted(unknown)}")
        if "input" not in raw:
            raise PriceTableError(f"{where}.input: required (USD per million input tokens)")
        values = {key: _price(raw[key], f"{where}.{key}") for key in raw}
        cache_write = values.get("cache_write", values["input"])
        return cls(
            input=values["input"],
            cached_input=values.get("cached_input", values["input"]),
            cache_write=cache_write,
            cache_write_1h=values.get("cache_write_1h", cache_write),
        )


def _price(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PriceTableError(f"{where}: expected a number >= 0 (USD per million tokens), got {value!r}")
    return float(value)


def cost_saved_usd(
    prices: Prices, cached_tokens: int, cache_creation_tokens: int = 0, cache_creation_1h_tokens: int = 0
) -> float:
    """Dollars saved by the provider cache on one request (negative when cache writes cost more).

    Args:
        prices: the model's prices.
        cached_tokens: input tokens read from the cache.
        cache_creation_tokens: input tokens written to the cache, all TTLs together.
        cache_creation_1h_tokens: of those, tokens written with the 1-hour TTL (priced ``cache_write_1h``).

    Raises:
        ValueError: a negative count, or more 1-hour writes than writes.
    """
    if min(cached_tokens, cache_creation_tokens, cache_creation_1h_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    if cache_creation_1h_tokens > cache_creation_tokens:
        raise ValueError("cache_creation_1h_tokens exceeds cache_creation_tokens")
    writes_5m = cache_creation_tokens - cache_creation_1h_tokens
    saved = (
        cached_tokens * (prices.input - prices.cached_input)
        - writes_5m * (prices.cache_write - prices.input)
        - cache_creation_1h_tokens * (prices.cache_write_1h - prices.input)
    )
    return saved / TOKENS_PER_PRICE_UNIT


def input_cost_usd(
    prices: Prices,
    prompt_tokens: int,
    cached_tokens: int = 0,
    cache_creation_tokens: int = 0,
) -> float:
    """Dollars one request's input tokens cost with caching (output tokens are not priced here).

    ``prompt_tokens`` counts all input tokens (cached and written ones included), as ``BackendUsage`` does.

    Raises:
        ValueError: negative counts, or cached + written tokens above ``prompt_tokens``.
    """
    if min(prompt_tokens, cached_tokens, cache_creation_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    if cached_tokens + cache_creation_tokens > prompt_tokens:
        raise ValueError("cached_tokens + cache_creation_tokens exceeds prompt_tokens")
    plain = prompt_tokens - cached_tokens - cache_creation_tokens
    dollars = (
        plain * prices.input
        + cached_tokens * prices.cached_input
        + cache_creation_tokens * prices.cache_write
    )
    return dollars / TOKENS_PER_PRICE_UNIT
