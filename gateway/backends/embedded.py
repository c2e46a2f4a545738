"""The embedded backend: a ``Backend`` over the in-process engine (``engine.async_engine.AsyncEngine``).

It turns a canonical ``ChatRequest`` into an ``engine.api.GenerationRequest`` (text-only messages, the
tenant as cache salt), streams ``TextDelta`` events as ``Delta`` and the final ``Finished`` as ``Finish``,
and maps the engine's named errors to API errors. Closing the stream (client disconnect) closes the engine's
iterator, which aborts the request and frees its blocks at once.

OpenAI parameters the engine cannot honour are refused with 400 rather than silently ignored (see
``UNSUPPORTED``); parameters that only carry bookkeeping (``metadata``, ``store``, ``user``...) are accepted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

from engine.api import EngineStats, Finished, GenerationRequest, TextDelta, WarmResult
from engine.errors import EngineError, PinCapError
from engine.kv_tiers.catalog import CachedPrefix
from gateway.backends.base import Backend, TokenCount
from gateway.config.schema import EmbeddedModel
from gateway.core.errors import InvalidRequestError, ServiceUnavailableError, from_engine_error
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish
from gateway.core.request import ChatRequest
from gateway.protocols.anthropic.parse import OPAQUE, THINKING_TYPES

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}
"""OpenAI body fields the embedded engine cannot honour -> the values it accepts (the neutral ones)."""

TOOL_CHOICES = (None, "none", "auto")
"""``ChatRequest.tool_choice`` values the engine honours: it cannot force a tool call."""

_ROLE_FOR_TEMPLATE = {"developer": "system"}


def create_embedded_backend(model: EmbeddedModel) -> EmbeddedBackend:
    """Factory for ``backend: embedded`` entries."""
    return EmbeddedBackend(model)


class EmbeddedBackend(Backend):
    """Serves one model from an in-process ``AsyncEngine``.

    Args:
        model: the model entry (``name``, ``path``, ``engine``).
        engine: an already-built engine (tests); None = build it from ``model`` in ``start``.
    """

    def __init__(self, model: EmbeddedModel, engine: Any = None) -> None:
        self.name = model.name
        self.model = model
        self.engine = engine
        digest = hashlib.blake2b(
            json.dumps([model.name, model.path, asdict(model.engine)], sort_keys=True).encode(), digest_size=5
        )
        self._fingerprint = f"fp_{digest.hexdigest()}"

    async def start(self) -> None:
        """Load the weights and tokenizer (in a worker thread: it takes seconds) and start the step loop."""
        if self.engine is None:
            from engine.async_engine import AsyncEngine

            self.engine = await asyncio.to_thread(
                AsyncEngine.from_config, None, self.model.path, self.model.engine
            )
        await self.engine.start()

    async def close(self) -> None:
        """Stop the engine; requests still running finish with ``abort``."""
        if self.engine is not None:
            await self.engine.shutdown()

    def engine_stats(self) -> EngineStats | None:
        """The engine's counters (None before ``start``)."""
        return self.engine.stats() if self.engine is not None else None

    def system_fingerprint(self) -> str | None:
        """``fp_`` + a hash of the model's name, path and engine config."""
        return self._fingerprint

    async def warm(
        self, request: ChatRequest, level_ends: list[tuple[int, str]] | None, pin: bool
    ) -> WarmResult | None:
        """Prefill ``request``'s prompt (``AsyncEngine.warm``) under its prefix key and tenant.

        Raises:
            ServiceUnavailableError: the engine is not started.
            InvalidRequestError / ContextLengthExceededError: engine errors mapped; a pin over the engine's
                cap is a 400 with param ``pin``.
        """
        engine = self.engine
        if engine is None:
            raise ServiceUnavailableError(f"The model `{self.name}` is not started.")
        request.level_ends = level_ends
        generation = generation_request(request)
        try:
            return await engine.warm(generation, pin=pin)
        except PinCapError as exc:
            raise InvalidRequestError(str(exc), param="pin", code="pin_cap_exceeded") from exc
        except EngineError as exc:
            raise from_engine_error(exc) from exc

    def wants_level_ends(self) -> bool:
        """True with KV tiers configured: the levels choose the blocks' TTL and budget share there."""
        return bool(self.model.engine.tiers)

    def cached_prefixes(self, *, prefix_key: str | None, tenant: str | None) -> list[CachedPrefix] | None:
        """``AsyncEngine.list_cached`` for this model (empty before ``start``)."""
        if self.engine is None:
            return []
        return self.engine.list_cached(prefix_key=prefix_key, tenant=tenant)

    def drop_cached(self, *, prefix_key: str | None, tenant: str | None) -> dict[str, int] | None:
        """``AsyncEngine.drop_cached`` (every prefix of this model when neither filter is given)."""
        if self.engine is None:
            return {"prefixes": 0, "ram": 0, "disk": 0, "redis": 0}
        if prefix_key is None and tenant is None:
            return self.engine.drop_cached(model_id=self.engine.model_id)
        return self.engine.drop_cached(prefix_key=prefix_key, tenant=tenant)

    def prompt_tokenizer(self) -> EnginePromptTokenizer | None:
        """The engine's chat template and tokenizer, rendering messages as ``generation_request`` does (None
        before ``start``)."""
        if self.engine is None:
            return None
        return EnginePromptTokenizer(self.engine.tokenizer, self.engine.model_id)

    async def count_tokens(self, request: ChatRequest) -> TokenCount:
        """The number of prompt token ids the engine would prefill for ``request``: the engine request a
        completion would get (``generation_request``) rendered by the checkpoint's chat template
        (``AsyncEngine.prompt_token_ids``), the generation prompt included, i.e. the ``prompt_tokens`` a
        completion reports. Nothing is scheduled: no block is taken, no prefix-cache entry is touched, no
        step runs; the count is returned even when the prompt would not fit the context window.

        Raises:
            ServiceUnavailableError: the engine is not started.
            InvalidRequestError: what ``generation_request`` refuses, or a template failure (engine error
                mapped).
        """
        engine = self.engine
        if engine is None:
            raise ServiceUnavailableError(f"The model `{self.name}` is not started.")
        generation = generation_request(request)
        try:
            token_ids = engine.prompt_token_ids(generation)
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        return TokenCount(len(token_ids), f"chat-template:{engine.model_id}")

    async def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` per non-empty text piece, then one ``Finish``.

        Raises:
            InvalidRequestError: a parameter the engine cannot honour, a non-text content part, a bad value.
            ContextLengthExceededError: the prompt does not fit (``PromptTooLongError``), before any block.
            ServiceUnavailableError: the engine was shut down under the request.
        """
        if self.engine is None:
            raise ServiceUnavailableError(f"The model `{self.name}` is not started.")
        generation = generation_request(request)
        try:
            first = True  # the first non-empty delta carries the cached count (headers of a stream)
            async with aclosing(self.engine.generate(generation)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        if event.text:
                            yield Delta(
                                text=event.text,
                                cached_tokens=event.cached_tokens if first else None,
                                prompt_tokens=event.prompt_tokens if first else None,
                            )
                            first = False
                    elif isinstance(event, Finished):
                        if event.finish_reason == "abort":
                            raise ServiceUnavailableError("The engine stopped before the request finished.")
                        yield Finish(
                            finish_reason=event.finish_reason,
                            usage=BackendUsage(
                                prompt_tokens=event.usage.prompt_tokens,
                                completion_tokens=event.usage.completion_tokens,
                                cached_tokens=event.usage.cached_tokens,
                                counted_by="engine",
                            ),
                            ttft_s=event.ttft_s,
                            stop_sequence=event.stop_string,
                        )
                        return
        except EngineError as exc:
            error = from_engine_error(exc)
            if request.kind == "completion" and error.param == "messages":
                error.param = "prompt"
            raise error from exc


class EnginePromptTokenizer:
    """The checkpoint's chat template and tokenizer as the miss explanation's ``PromptTokenizer``: the text
    the engine prefills for canonical messages (``template_message`` / ``template_tools`` applied, generation
    prompt added) and its token ids with start offsets, equal to ``AsyncEngine.prompt_token_ids``.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer``.
        model_id: the engine's model id (the name).
    """

    def __init__(self, tokenizer: Any, model_id: str) -> None:
        self._tokenizer = tokenizer
        self.name = f"chat-template:{model_id}"

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        """The prompt text of ``messages`` (+ ``tools``).

        Raises:
            InvalidRequestError: a content part the engine cannot take; engine errors of the template.
        """
        shaped = [template_message(message, index) for index, message in enumerate(messages)]
        return self._tokenizer.apply_chat_template(shaped, template_tools(tools), add_generation_prompt)

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, start character of each token), without special tokens added."""
        encoding = self._tokenizer.backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [start for start, _ in encoding.offsets]


def generation_request(request: ChatRequest) -> GenerationRequest:
    """The engine request for a canonical ``ChatRequest``.

    Raises:
        InvalidRequestError: unsupported parameters (``UNSUPPORTED`` for OpenAI bodies, ``TOOL_CHOICES``),
            non-text content parts, or server tools.
    """
    if request.openai_body is not None:
        check_supported(request.openai_body)
    if request.anthropic_body is not None:
        check_supported_anthropic(request.anthropic_body)
    if request.tool_choice not in TOOL_CHOICES:
        raise InvalidRequestError(
            "The embedded engine cannot force a tool call: tool_choice must be 'auto' or 'none'.",
            param="tool_choice",
            code="unsupported_value",
        )
    common = {
        "params": request.params,
        "cache_salt": request.tenant,
        "request_id": request.request_id,
        "prefix_key": request.prefix_key or None,
        "level_ends": request.level_ends,
    }
    if request.kind == "completion":
        return GenerationRequest(prompt=request.prompt or "", **common)
    messages = [template_message(message, index) for index, message in enumerate(request.messages)]
    return GenerationRequest(
        messages=messages,
        tools=template_tools(request.tools),
        continue_final_message=request.continue_final_message and messages[-1]["role"] == "assistant",
        **common,
    )


def check_supported(body: dict[str, Any]) -> None:
    """Refuse body fields with values the engine cannot honour (400 naming the field)."""
    for name, accepted in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], value) for value in accepted):
            raise InvalidRequestError(
                f"Unsupported value for '{name}' with the embedded engine: only {_accepted(accepted)} is "
                "supported.",
                param=name,
                code="unsupported_value",
            )


def check_supported_anthropic(body: dict[str, Any]) -> None:
    """Refuse Anthropic fields the engine cannot honour rather than ignore them: ``thinking`` other than
    ``{"type": "disabled"}`` (the checkpoint has no extended thinking) and ``output_config`` (effort and
    structured output formats), each a 400 naming the field."""
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise InvalidRequestError(
            "thinking: the embedded engine has no extended thinking; omit 'thinking' or send "
            '{"type": "disabled"}.',
            param="thinking",
            code="unsupported_value",
        )
    if body.get("output_config") is not None:
        raise InvalidRequestError(
            "output_config: not supported by the embedded engine (no effort levels, no output formats); "
            "omit it.",
            param="output_config",
            code="unsupported_value",
        )


def template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as the chat template expects it: ``content`` a string (text parts joined by newlines),
    ``developer`` rendered as ``system``; tool-call fields kept.

    Raises:
        InvalidRequestError: a content part that is not text (images, audio, files).
    """
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.get("type") == OPAQUE and (part.get("block") or {}).get("type") in THINKING_TYPES:
                continue  # an Anthropic thinking block from an earlier turn: not prompt text for this model
            if part.get("type") not in ("text", "input_text", "refusal"):
                kind = part.get("type")
                if kind == OPAQUE:  # an Anthropic block riding through: name it by its own type
                    kind = (part.get("block") or {}).get("type")
                raise InvalidRequestError(
                    f"Content part type '{kind}' is not supported by the embedded engine (text only).",
                    param=f"messages[{index}].content[{part_index}].type",
                    code="unsupported_value",
                )
            texts.append(part.get("text", part.get("refusal", "")))
        content = "\n".join(texts)
    out = {key: value for key, value in message.items() if key != "content"}
    out["role"] = _ROLE_FOR_TEMPLATE.get(message["role"], message["role"])
    out["content"] = "" if content is None else content
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools for the chat template, without the Anthropic-only extras riding under ``x-anthropic``.

    Raises:
        InvalidRequestError: an Anthropic server tool (``type: x-anthropic``), which only Anthropic can run.
    """
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"Tool type '{tool.get('type')}' is not supported by the embedded engine (function tools "
                "only).",
                param=f"tools[{index}]",
                code="unsupported_value",
            )
        out.append({key: value for key, value in tool.items() if key != OPAQUE})
    return out


def _same(value: Any, accepted: Any) -> bool:
    """Equal and of the same JSON type (so ``false`` is not ``0``)."""
    return type(value) is type(accepted) and value == accepted


def _accepted(values: tuple[Any, ...]) -> str:
    shown = [json.dumps(v) for v in values if v is not None]
    return " or ".join(shown) if shown else "omitting it"
