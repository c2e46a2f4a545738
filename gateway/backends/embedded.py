"""The embedded backend: a ``Backend`` over the in-process engine (``engine.async_engine.AsyncEngine``).

It turns a canonical ``ChatRequest`` into an ``engine.api.GenerationRequest`` (text-only messages, the
tenant as cache salt, a declared public prefix under its shared salt), streams ``TextDelta`` events as
``Delta`` and the final ``Finished`` as ``Finish``, and maps the engine's named errors to API errors.
Closing the stream (client disconnect) closes the engine's iterator, which aborts the request and frees its
blocks at once.

Tools: the engine renders them for every checkpoint (docs/tools.md). When its ``tool_format`` is
``"generic"``, the request's ``tool_choice`` becomes a ``"tool_calls"`` ``Constraint`` (``none``: no constraint)
and each choice's output is parsed by ``engine.tool_calls.ToolCallParser`` into OpenAI tool-call deltas
(``Delta.tool_calls``, one per call once complete, or at the end of an output ``max_tokens`` cut inside a call's
arguments, that call with its arguments text so far; streamed or not; the Anthropic face turns them into
``tool_use`` blocks); a choice that called a tool and stopped finishes with ``tool_calls``. With a response
format as well (``tool_choice`` ``auto``), the output is calls or a JSON answer in that format, which is content
(finish reason ``stop``). ``n`` > 1 choices stream with their ``index``; one ``Finish`` ends the stream
(usage of all choices, each choice's reason in ``finish_reasons``). Logprobs carry each token's text and bytes
from the engine's tokenizer.

OpenAI parameters the engine cannot honour are refused with 400 rather than silently ignored (see
``UNSUPPORTED``; ``store: true`` among them, as the Responses face refuses it: no completion is stored);
parameters that only carry bookkeeping (``metadata``, ``user``, ``service_tier``...) are accepted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.api import EngineStats, Finished, GenerationRequest, TextDelta, WarmResult
from engine.api import TokenLogprob as EngineTokenLogprob
from engine.errors import EngineError, PinCapError
from engine.kv_tiers.catalog import CachedPrefix
from engine.tool_calls import ContentDelta as ToolContentDelta
from engine.tool_calls import ToolCallEnd, ToolCallParser
from gateway.backends.base import Backend, TokenCount
from gateway.backends.embedded_request import generation_request, template_message, template_tools
from gateway.backends.reply_prefill import IdlePrefills, ReplyRecorder
from gateway.config.schema import EmbeddedModel
from gateway.core.errors import InvalidRequestError, ServiceUnavailableError, from_engine_error
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish, TokenLogprob, TopLogprob
from gateway.core.prompt_size import INLINE_TOKENIZE_CHARS, prompt_chars
from gateway.core.request import ChatRequest
from gateway.core.token_spelling import TokenSpelling

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


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
        self.idle_prefills: IdlePrefills | None = None
        """Idle reply prefills queued after each chat reply (``gateway.backends.reply_prefill``; None before
        ``start``)."""

    async def start(self) -> None:
        """Load the weights and tokenizer (in a worker thread: it takes seconds) and start the step loop."""
        if self.engine is None:
            from engine.async_engine import AsyncEngine

            self.engine = await asyncio.to_thread(
                AsyncEngine.from_config, None, self.model.path, self.model.engine
            )
        await self.engine.start()
        self.idle_prefills = IdlePrefills(self.engine)

    async def close(self) -> None:
        """Cancel the idle reply prefills and stop the engine; requests still running finish with ``abort``."""
        if self.idle_prefills is not None:
            await self.idle_prefills.close()
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
        """Prefill ``request``'s prompt (``AsyncEngine.warm``) under its prefix key and tenant. None (no cache
        of its own, as an upstream: a 400) when the model runs with ``enable_prefix_caching: false``, where a
        warm would prefill and keep nothing.

        Raises:
            ServiceUnavailableError: the engine is not started.
            InvalidRequestError / ContextLengthExceededError: engine errors mapped; a pin over the engine's
                cap is a 400 with param ``pin``.
        """
        if not self.model.engine.enable_prefix_caching:
            return None
        engine = self.engine
        if engine is None:
            raise ServiceUnavailableError(f"The model `{self.name}` is not started.")
        request.level_ends = level_ends
        generation = generation_request(request)
        try:
            prompt = await _prompt_off_loop(engine, generation, request)
            return await engine.warm(generation, pin=pin, prompt=prompt)
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

    def drop_cached(self, *, prefix_key: str | None, tenant: str | None) -> dict[str, Any] | None:
        """``AsyncEngine.drop_cached`` (every prefix of this model when neither filter is given); counts and,
        when a tier failed, ``skipped_tiers`` ({tier: reason})."""
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
        generation = generation_request(request, engine)
        try:
            token_ids = await _prompt_off_loop(engine, generation, request)
            if token_ids is None:
                token_ids = engine.prompt_token_ids(generation)
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        return TokenCount(len(token_ids), f"chat-template:{engine.model_id}")

    async def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` per non-empty text piece, then one ``Finish``. A chat reply that ended (``stop`` or
        ``length``) with one choice is queued, just before its ``Finish``, as an idle prefill of the conversation's
        next turn (``gateway.backends.reply_prefill``) where the engine runs them
        (``AsyncEngine.prefills_next_turns``); nothing of the reply is recorded otherwise.

        Raises:
            InvalidRequestError: a parameter the engine cannot honour, a non-text content part, a bad value.
            ContextLengthExceededError: the prompt does not fit (``PromptTooLongError``), before any block.
            ServiceUnavailableError: the engine was shut down under the request.
        """
        engine = self.engine
        if engine is None:
            raise ServiceUnavailableError(f"The model `{self.name}` is not started.")
        generation = generation_request(request, engine)
        n = generation.params.n
        constraint = generation.params.constraint
        parse = constraint is not None and constraint.kind == "tool_calls"
        json_answer = parse and constraint.tool_choice == "auto" and constraint.json_schema is not None
        choices = [_Choice(ToolCallParser(json_answer=json_answer) if parse else None) for _ in range(n)]
        spelled = _TokenSpeller(engine.tokenizer) if generation.params.logprobs is not None else None
        try:
            # the first delta carries the prompt's counts (the headers of a stream go out once it arrived),
            # whichever engine event it came from: a text piece, or the end of an output the tool-call parser
            # held back whole (an answer that is only a call cut by max_tokens)
            counts: tuple[int | None, int | None] | None = None
            first = True
            finished: dict[int, Finished] = {}
            # the reply as the client gets it, for the next turn's idle prefill (only where one can run)
            reply = (
                ReplyRecorder(anthropic=request.anthropic_body is not None)
                if request.kind == "chat"
                and n == 1
                and self.idle_prefills is not None
                and engine.prefills_next_turns
                else None
            )
            prompt = await _prompt_off_loop(engine, generation, request)
            async with aclosing(engine.generate(generation, prompt)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        if counts is None and event.cached_tokens is not None:
                            counts = (event.cached_tokens, event.prompt_tokens)
                        choice = choices[event.index]
                        choice.note_tokens(event)
                        logprobs = spelled.logprobs(event.logprobs) if spelled is not None else ()
                        deltas = choice.deltas(event.text, event.index, logprobs)
                    elif isinstance(event, Finished):
                        if event.finish_reason == "abort":
                            raise ServiceUnavailableError("The engine stopped before the request finished.")
                        if counts is None:
                            counts = (event.usage.cached_tokens, event.usage.prompt_tokens)
                        deltas = choices[event.index].close(
                            event.index,
                            cut=event.finish_reason == "length",
                            stopped=event.stop_string is not None,
                        )
                    else:
                        continue
                    for delta in deltas:
                        if first and counts is not None:
                            delta = replace(delta, cached_tokens=counts[0], prompt_tokens=counts[1])
                            first = False
                        if reply is not None:
                            reply.note(delta)
                        yield delta
                    if isinstance(event, Finished):
                        finished[event.index] = event
                        if len(finished) == n:
                            if reply is not None and self.idle_prefills is not None:
                                self.idle_prefills.queue(generation, reply)
                            yield _finish(finished, choices, engine.caches_generated_kv)
                            return
        except EngineError as exc:
            error = from_engine_error(exc, "prompt" if request.kind == "completion" else "messages")
            if request.kind == "completion" and error.param == "messages":
                error.param = "prompt"
            raise error from exc


async def _prompt_off_loop(
    engine: AsyncEngine, generation: GenerationRequest, request: ChatRequest
) -> list[int] | None:
    """``engine.prompt_token_ids(generation)`` computed in a worker thread when ``request``'s prompt is over
    ``INLINE_TOKENIZE_CHARS`` characters (the engine then takes it as computed), None for a shorter prompt (the
    engine tokenizes it on the event loop, where a thread's hand-over would cost more than the encode).

    Raises:
        EngineError: what ``prompt_token_ids`` raises (an empty prompt, a template failure).
    """
    if prompt_chars(request) <= INLINE_TOKENIZE_CHARS:
        return None
    return await asyncio.to_thread(engine.prompt_token_ids, generation)


@dataclass
class _Choice:
    """One choice's output state: its tool-call parser (None when the output is plain text), whether it
    called a tool, and logprobs waiting for the text the parser holds back.

    A call is delivered whole, once complete (``ToolCallEnd``: its arguments closed), or at the end of the
    output when ``max_tokens`` cut it after its name (its arguments text as far as it got, finish reason
    ``length``), in a stream as in a non-streamed answer, so both deliver the same calls (docs/tools.md,
    "Calls and max_tokens")."""

    parser: ToolCallParser | None
    called: bool = False
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last_was_silent: bool = False
    """The last token delta produced no text (a stop token's, when the choice then stops)."""
    text_chars: int = 0
    """Characters of the text the engine sent (before the tool-call parser)."""
    spelled: TokenSpelling = field(default_factory=TokenSpelling)
    """The tokens whose logprobs were released, decoded."""

    def note_tokens(self, event: TextDelta) -> None:
        """Keep the generated token ids of ``event`` (for ``answer_token_ids``)."""
        self.token_ids.extend(event.token_ids)
        self.last_was_silent = not event.text

    def answer_token_ids(self, finished: Finished) -> tuple[int, ...]:
        """The choice's generated ids as a client resending its answer unedited renders them (``Finish``'s
        ``answer_token_ids``): without the stop token that ended them (it produced no text; the chat
        template writes its own end of turn); none when a stop string cut the text (its ids are not the
        text the client got)."""
        if finished.stop_string is not None:
            return ()
        ids = self.token_ids
        if finished.finish_reason == "stop" and self.last_was_silent and ids:
            ids = ids[:-1]
        return tuple(ids)

    def answer_uncomputed(self, finished: Finished) -> int:
        """How many of ``answer_token_ids(finished)``' last ids have no KV in the engine (``Finish``'s
        ``answer_uncomputed``): the last sampled token is never fed to the model, so it is 1 unless the answer
        left that token out (a silent stop token) or is empty."""
        answer = self.answer_token_ids(finished)
        return 1 if answer and len(answer) == len(self.token_ids) else 0

    def deltas(self, text: str, index: int, logprobs: tuple[TokenLogprob, ...]) -> list[Delta]:
        """The ``Delta`` events of ``text`` (parsed into content and tool-call fragments when tools are on)."""
        self.pending_logprobs.extend(logprobs)
        self.text_chars += len(text)
        if self.parser is None:
            return self._flush([Delta(text=text, index=index)] if text else [], index)
        return self._flush(self._map(self.parser.feed(text), index) if text else [], index)

    def close(self, index: int, cut: bool = False, stopped: bool = False) -> list[Delta]:
        """The events of the held-back end of the output, and any logprobs not yet sent (``cut``: the output
        was cut by ``max_tokens``, see ``ToolCallParser.finish``; ``stopped``: a stop string cut the text, and
        the logprobs of the tokens past the text's end, the stop string's, are dropped, so the logprobs'
        tokens spell the text returned, as OpenAI's do; ``_flush`` held them back)."""
        out = self._map(self.parser.finish(cut=cut), index) if self.parser is not None else []
        out = self._flush(out, index)
        if stopped:
            self.pending_logprobs.clear()  # the stop string's tokens: past the text's end
        if self.pending_logprobs:  # a parser's held-back text (a stop token has no logprob)
            out.append(Delta(index=index, logprobs=tuple(self.pending_logprobs)))
            self.pending_logprobs.clear()
        return out

    def _flush(self, deltas: list[Delta], index: int) -> list[Delta]:
        """Attach to the first of ``deltas`` the pending logprobs of the tokens that start inside the text the
        engine sent; a token past its end (text the engine holds back: a stop string's start) waits. A token
        that continues a character begun by the one before starts inside that character
        (``TokenSpelling.start_of``)."""
        if deltas and self.pending_logprobs:
            ready = 0
            for entry in self.pending_logprobs:
                raw = bytes(entry.token_bytes)
                if self.spelled.start_of(raw) >= self.text_chars:
                    break
                self.spelled.feed(raw)
                ready += 1
            if ready:
                deltas[0] = replace(deltas[0], logprobs=tuple(self.pending_logprobs[:ready]))
                del self.pending_logprobs[:ready]
        return deltas

    def _map(self, events: list[Any], index: int) -> list[Delta]:
        out = []
        for event in events:
            if isinstance(event, ToolContentDelta):
                if event.text:
                    out.append(Delta(text=event.text, index=index))
            elif isinstance(event, ToolCallEnd):  # starts and argument fragments wait for the whole call
                self.called = True
                call = {
                    "index": event.index,
                    "id": event.call.id,
                    "type": "function",
                    "function": {"name": event.call.name, "arguments": event.call.arguments_json},
                }
                out.append(Delta(tool_calls=[call], index=index))
        return out


def _finish(finished: dict[int, Finished], choices: list[_Choice], answer_kv_kept: bool) -> Finish:
    """One ``Finish`` for all choices: the prompt counted once, every choice's completion tokens; a choice that
    called a tool and stopped finishes with ``tool_calls``. ``answer_kv_kept``: the engine caches generated
    tokens' KV (``EngineConfig.cache_generated_kv``); else none of the answer's ids is cached
    (``answer_uncomputed`` is all of them, so the cache explanation expects the prompt alone)."""
    reasons = []
    for index in range(len(finished)):
        reason = finished[index].finish_reason
        reasons.append("tool_calls" if reason == "stop" and choices[index].called else reason)
    first = finished[0]
    return Finish(
        finish_reason=reasons[0],
        usage=BackendUsage(
            prompt_tokens=first.usage.prompt_tokens,
            completion_tokens=sum(event.usage.completion_tokens for event in finished.values()),
            cached_tokens=first.usage.cached_tokens,
            counted_by="engine",
        ),
        ttft_s=min((e.ttft_s for e in finished.values() if e.ttft_s is not None), default=None),
        finish_reasons=tuple(reasons) if len(reasons) > 1 else (),
        stop_sequence=first.stop_string,
        answer_token_ids=choices[0].answer_token_ids(first),
        answer_uncomputed=(
            choices[0].answer_uncomputed(first) if answer_kv_kept else len(choices[0].answer_token_ids(first))
        ),
    )


class _TokenSpeller:
    """Token id -> (text, UTF-8 bytes) through the engine's tokenizer: byte-level BPE spellings are mapped back
    to their bytes (GPT-2's byte table, ``engine.tokenizer.bytes_to_unicode``); a part of a multi-byte
    character shows as U+FFFD in the text, whole in the bytes (OpenAI's ``bytes`` field)."""

    def __init__(self, tokenizer: Any) -> None:
        from engine.tokenizer import bytes_to_unicode

        self._tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def spell(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        spelling = self._tokenizer.id_to_token(token_id) or ""
        if spelling and all(char in self._byte_of for char in spelling):
            raw = bytes(self._byte_of[char] for char in spelling)
        else:
            raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        out = (raw.decode("utf-8", errors="replace"), tuple(raw))
        self._cache[token_id] = out
        return out

    def logprobs(self, entries: tuple[EngineTokenLogprob, ...]) -> tuple[TokenLogprob, ...]:
        """The engine's logprobs with each token spelled."""
        out = []
        for entry in entries:
            text, raw = self.spell(entry.token_id)
            top = tuple(TopLogprob(*self.spell(tid), logprob) for tid, logprob in entry.top_logprobs)
            out.append(TokenLogprob(text, raw, entry.logprob, top))
        return tuple(out)


class EnginePromptTokenizer:
    """The checkpoint's chat template and tokenizer as the miss explanation's ``PromptTokenizer``: the text
    the engine prefills for canonical messages (``template_message`` / ``template_tools`` applied, generation
    prompt added) and its token ids with start offsets, equal to ``AsyncEngine.prompt_token_ids``.

    A rendering whose message strings hold a special token's text (``engine.special_text``) is remembered with
    where those texts are (the last ``LITERAL_RENDERS``): ``encode`` of that text, or of a text that ends with it
    (the explanation puts a tools preamble first), encodes them as text, as the engine does.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer``.
        model_id: the engine's model id (the name).
    """

    LITERAL_RENDERS = 64

    def __init__(self, tokenizer: Any, model_id: str) -> None:
        self._tokenizer = tokenizer
        self.name = f"chat-template:{model_id}"
        self._literal: dict[str, tuple[tuple[int, int], ...]] = {}

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        """The prompt text of ``messages`` (+ ``tools``).

        Raises:
            InvalidRequestError: a content part the engine cannot take; engine errors of the template.
        """
        shaped = [template_message(message, index) for index, message in enumerate(messages)]
        text, literal = self._tokenizer.render_chat_text(
            shaped, template_tools(tools), add_generation_prompt=add_generation_prompt
        )
        if literal:
            self._literal.pop(text, None)
            self._literal[text] = literal
            while len(self._literal) > self.LITERAL_RENDERS:
                del self._literal[next(iter(self._literal))]
        return text

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, start character of each token), without special tokens added."""
        return self.encode_in_scope(text, "")

    def encode_in_scope(self, text: str, scope: str) -> tuple[list[int], list[int]]:
        """``encode(text)``, the pieces between special tokens memoized under ``scope``: the tenant, whose
        scope the engine renders the same request's prompt in (``engine.piece_memo``), so the explanation
        of a request finds its prompt's long pieces already encoded."""
        literal = self._literal_in(text)
        if not literal:
            return self._tokenizer.encode_with_offsets(text, scope)
        return self._tokenizer.encode_chat_with_offsets(text, literal, scope)

    def _literal_in(self, text: str) -> tuple[tuple[int, int], ...]:
        """Where the special tokens' texts from message strings are in ``text``: those of a remembered rendering
        that ``text`` is or ends with (shifted by what comes before it), else none."""
        if not self._literal:
            return ()
        if text in self._literal:
            return self._literal[text]
        for rendered, literal in reversed(self._literal.items()):
            if text.endswith(rendered):
                shift = len(text) - len(rendered)
                return tuple((start + shift, end + shift) for start, end in literal)
        return ()
