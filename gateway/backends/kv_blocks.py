"""The engine's block hashes of an upstream request, for the exact (KV event) path of cache-aware routing.

``KVBlockHasher`` renders the prompt of a request body the way ``kv_events.message_format`` says the engine
does (a leading ``system`` field first, as a ``system`` message; then each message of ``messages``), tokenizes
it with ``kv_events.tokenizer`` and chains the hashes of its full blocks
(``gateway.transport.routing_policy.block_hashes``, unsalted, as the publishing engine hashes). Content that is
not a string (parts, tool calls) is rendered as compact sorted JSON, so such prompts may not match the
engine's own rendering: they are then only routed on the approximate view's terms (a shorter match).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import tiktoken

from gateway.config.schema import KVEventsConfig
from gateway.transport.routing_policy import block_hashes


@lru_cache(maxsize=4)
def _encoding(name: str) -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(f"{name}_offline")
    except ValueError:
        return tiktoken.get_encoding(name)


def _text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    )


class KVBlockHasher:
    """Block hashes of a request body as the replicas' engine computes them (see the module docstring).

    Args:
        config: the upstream's ``kv_events`` settings.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._encoding = _encoding(config.tokenizer)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text of ``body`` in the engine's message format ("" when it has no messages)."""
        fmt = self.config.message_format
        parts = []
        if body.get("system") is not None:
            parts.append(fmt.format(role="system", content=_text(body["system"])))
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else ():
            if isinstance(m, Mapping):
                parts.append(fmt.format(role=_text(m.get("role", "")), content=_text(m.get("content") or "")))
        return "".join(parts)

    def __call__(self, body: Any) -> tuple[int, ...]:
        """Chained hashes of the full blocks of ``body``'s tokenized prompt; ``()`` for a body without one."""
        if not isinstance(body, Mapping):
            return ()
        ids = self._encoding.encode(self.render(body), disallowed_special=())
        return tuple(block_hashes(ids, self.config.block_size))
