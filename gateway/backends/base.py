"""What every backend (embedded engine, OpenAI-compatible upstream, Anthropic upstream) yields.

A backend turns a ``ChatRequest`` (already canonicalized by the rules, with its prefix key) into an async
stream of ``Delta`` events and exactly one final ``Finish``. The protocol faces format these as OpenAI or
Anthropic JSON/SSE. Closing the stream early (client disconnect) must cancel the work behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from gateway.core.events import BackendEvent
from gateway.core.request import ChatRequest


class Backend(Protocol):
    """A model backend. ``name`` is the client-facing model name it serves."""

    name: str

    async def start(self) -> None:
        """Acquire resources (load weights, open HTTP clients)."""

    async def close(self) -> None:
        """Release resources; cancel work in flight."""

    def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` events then one ``Finish``. Raises ``gateway.core.errors`` API errors on bad input."""
        ...
