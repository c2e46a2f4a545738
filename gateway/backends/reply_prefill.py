"""The embedded backend's side of idle reply prefills (``EngineConfig.idle_reply_prefill``): the reply as the
client got it, turned into the assistant message it will resend, and the background tasks that hand the
conversation to ``AsyncEngine.prefill_next_turn``.

By default the engine caches no generated token's KV (cache on == cache off across turns), so a conversation's
next turn would compute the previous reply again, as prompt. Once a reply is out, the backend queues the
conversation followed by that reply as an idle prefill: the engine computes it on the prompt path while it has
nothing else to do, and the next turn finds it cached (docs/prefix-cache.md, "Idle reply prefill").

Invariants: only a chat request with one choice that ended with a reply (``stop`` or ``length``) is queued; the
assistant message holds exactly the text and tool calls the client received (``Delta.text`` and
``Delta.tool_calls`` of choice 0, in order); a task never raises into the event loop (an engine error ends it
with a log line) and every task still running is cancelled on ``close`` (the engine aborts its request and
frees its blocks).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import GenerationRequest
from engine.errors import EngineError
from gateway.core.events import Delta
from gateway.core.json_types import compact_json
from gateway.protocols.anthropic.render import tool_input

logger = logging.getLogger(__name__)


@dataclass
class ReplyRecorder:
    """Choice 0's reply as the client receives it, from the ``Delta`` events sent (text pieces in order, and
    each tool call once whole: ``{"id", "type", "function": {"name", "arguments"}}``).

    Attributes:
        anthropic: the request came through the Anthropic face, which returns a call's arguments as a parsed
            ``input`` object (``gateway.protocols.anthropic.render.tool_input``: a call cut by ``max_tokens``
            keeps only the members it completed), so that is what its client resends.
    """

    anthropic: bool = False
    texts: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def note(self, delta: Delta) -> None:
        """Keep ``delta``'s text and tool calls when it belongs to choice 0."""
        if delta.index != 0:
            return
        if delta.text:
            self.texts.append(delta.text)
        for call in delta.tool_calls or ():
            self.calls.append({key: value for key, value in call.items() if key != "index"})

    def message(self) -> dict[str, Any]:
        """The assistant message a client resends for this reply, in the chat template's form (``content`` a
        string, ``tool_calls`` only when it called a tool: ``gateway.backends.embedded_request.template_message``)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts)}
        if self.calls:
            message["tool_calls"] = [self._as_resent(call) for call in self.calls]
        return message

    def _as_resent(self, call: dict[str, Any]) -> dict[str, Any]:
        """``call`` as the client resends it: unchanged, or on the Anthropic face with the arguments of the
        ``input`` object it received (as ``gateway.protocols.anthropic.parse`` turns a ``tool_use`` back)."""
        if not self.anthropic:
            return call
        function = call.get("function") or {}
        arguments = compact_json(tool_input(function.get("arguments") or ""))
        return {**call, "function": {**function, "arguments": arguments}}


class IdlePrefills:
    """The background tasks of one backend's idle reply prefills.

    Args:
        engine: the ``AsyncEngine`` (its ``prefill_next_turn``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tasks: set[asyncio.Task] = set()

    def queue(self, generation: GenerationRequest, reply: ReplyRecorder) -> asyncio.Task | None:
        """Queue the prefill of ``generation``'s conversation followed by ``reply``'s assistant message (one
        choice, not a continued final message; None otherwise). Returns the task (tests await it)."""
        if generation.messages is None or generation.params.n != 1 or generation.continue_final_message:
            return None
        turn = replace(generation, messages=[*generation.messages, reply.message()])
        task = asyncio.get_running_loop().create_task(self._run(turn))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _run(self, turn: GenerationRequest) -> int | None:
        try:
            return await self.engine.prefill_next_turn(turn)
        except EngineError as exc:  # shut down, or a template the next turn cannot render either
            logger.debug("idle reply prefill of %s ended: %s", turn.request_id, exc)
            return None
        except Exception:  # noqa: BLE001 - a background task: logged, never raised into the event loop
            logger.warning("idle reply prefill of %s failed", turn.request_id, exc_info=True)
            return None

    async def close(self) -> None:
        """Cancel every task still running and wait for them (each aborts its engine request)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
