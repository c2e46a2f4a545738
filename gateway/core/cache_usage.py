"""Value types of provider prompt caching shared by every layer: one request's cache token counts
(``CacheUsage``) and the retention name that means "no cache marker" (``NO_CACHE``).

``CacheUsage.check`` prices nothing; it only refuses counts no price can apply to. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NO_CACHE = "none"
"""The retention choice that places no cache marker at all."""


class CacheUsageError(ValueError):
    """Token counts that cannot be priced: negative, or reads plus writes above the prompt tokens, or a
    retention the model does not have. The message names the field."""


@dataclass(frozen=True)
class CacheUsage:
    """One request's input tokens as the provider reported them.

    Attributes:
        prompt_tokens: all input tokens, cached and written ones included.
        cache_read_tokens: tokens read from the cache.
        cache_write_tokens: retention name -> tokens written with it (None key = the default retention).
    """

    prompt_tokens: int
    cache_read_tokens: int = 0
    cache_write_tokens: Mapping[str | None, int] = field(default_factory=dict)

    @property
    def written(self) -> int:
        """All tokens written, every retention together."""
        return sum(self.cache_write_tokens.values())

    def check(self, prices: Any) -> None:
        """Raise ``CacheUsageError`` when these counts cannot be priced with ``prices``
        (a ``gateway.config.price_table.ModelPrices``)."""
        if (
            self.prompt_tokens < 0
            or self.cache_read_tokens < 0
            or any(v < 0 for v in self.cache_write_tokens.values())
        ):
            raise CacheUsageError("usage: token counts must be >= 0")
        if self.cache_read_tokens + self.written > self.prompt_tokens:
            raise CacheUsageError(
                f"usage: cache reads ({self.cache_read_tokens}) plus writes ({self.written}) exceed the prompt "
                f"tokens ({self.prompt_tokens})"
            )
        for retention in self.cache_write_tokens:
            if (retention or prices.default_retention) not in prices.cache_write:
                raise CacheUsageError(
                    f"usage: cache writes with retention {retention!r}, which {prices.model} does not have "
                    f"({sorted(prices.cache_write)})"
                )
