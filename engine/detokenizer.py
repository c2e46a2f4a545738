"""Incremental detokenization and stop strings, one request at a time.

``IncrementalDetokenizer`` turns generated token ids into text deltas without ever emitting a broken UTF-8
sequence: byte-level BPE (GPT-2 style, as in SmolLM2) can split one character over several tokens, and a
decode of a partial sequence ends in U+FFFD; such text is held back until the next tokens complete it. It
decodes a sliding window (the tokens of the previous delta as context, then the unread tokens), the scheme of
vLLM's ``detokenize_incrementally``, so each token costs O(window), not O(output).

``StopStringMatcher`` ends generation *before* the first occurrence of any stop string (OpenAI semantics: the
stop string is not returned) and holds back the longest tail of the text that could still grow into a stop
string, so a stop string is never partially emitted. Stop strings apply to the text of the answer only: given
``markup`` (the tool-call markers, ``engine.tool_calls.CALL_MARKERS``), the answer's text ends where the first
marker begins, and no stop string matches from there on (a forced call, whose output is all markup, is never cut
by a stop string that occurs in its arguments; OpenAI applies stop sequences to generated text, not to tool-call
arguments).

``RepeatedCallGuard`` ends a tool-call response at a call identical, byte for byte, to one the same response has
already made (a small model repeating its call; SmolLM2 greedy under ``tool_choice: required`` wrote the same
call until ``max_tokens``): the repeat and the separator before it are not returned, and text that may still
become such a repeat is held back until it differs, so no part of a dropped repeat is ever emitted; an answer
that reaches ``max_tokens`` inside such a repeat after its arguments closed (nothing but ``}`` and the closing tag
could follow) ends at the call before it, complete. Cut earlier, the text could still have become a new call (the
same name with other arguments), so the finish stays ``length`` and the held text is flushed.
"""

from __future__ import annotations

from typing import Protocol

from engine.tool_calls import CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, CALL_TAIL

REPEAT_FIXED_TAIL = len(CALL_TAIL + CALL_CLOSE)
"""Characters of a call after its arguments' last one: fixed by the grammar, so a pending repeat that reached its
arguments' end can only complete."""

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of ``engine.tokenizer.Tokenizer``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # pragma: no cover - protocol
        ...


class IncrementalDetokenizer:
    """Text of a growing list of generated token ids, delta by delta.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.

    The concatenation of every ``add`` result and the final ``flush`` equals the text of decoding the emitted
    ids in windows, which is ``tokenizer.decode(all ids)`` for byte-level BPE and SentencePiece tokenizers.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _delta(self, allow_incomplete: bool) -> str:
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def add(self, token_id: int) -> str:
        """Append one generated token id; return the new text it completes ("" while a character is pending)."""
        self.token_ids.append(token_id)
        return self._delta(allow_incomplete=False)

    def flush(self) -> str:
        """Text of tokens still held back (an unfinished UTF-8 sequence is emitted as U+FFFD at the end)."""
        if self._read_offset == len(self.token_ids):
            return ""
        return self._delta(allow_incomplete=True)


class HeldBackText:
    """A growing ``text`` of which ``text[:emitted]`` has been returned; the rest is held back until decided."""

    text: str
    emitted: int

    def flush(self) -> str:
        """Emit what is held back (generation ended for another reason)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class StopStringMatcher(HeldBackText):
    """Stop-string detection with hold-back over a growing text.

    Args:
        stops: the stop strings (each non-empty).
        markup: markers (each non-empty) where the text stop strings apply to ends: from the earliest
            occurrence of any of them on, no stop string matches (a stop string must end before it); text that
            may be the start of a marker is held back until decided. Empty: stop strings apply to all text.

    Raises:
        ValueError: an empty stop string or marker.
    """

    def __init__(self, stops: tuple[str, ...] | list[str], markup: tuple[str, ...] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(not m for m in markup):
            raise ValueError("markup markers must be non-empty")
        self.stops = tuple(stops)
        self.markup = tuple(markup)
        self._max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text (the earliest occurrence; first in ``stops`` on a tie)."""
        self._searched = 0  # text before this held no whole stop string
        self.markup_at: int | None = None
        """Where the first markup marker begins in ``text`` (None until one is seen): stop strings end before."""

    def _held_tail(self, end: int) -> int:
        """Length of the longest tail of the unemitted ``text[:end]`` that is a proper prefix of a stop string."""
        pending = end - self.emitted
        for k in range(min(self._max_len - 1, pending), 0, -1):
            tail = self.text[end - k : end]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _text_end(self, search_from: int) -> int:
        """End of the text stop strings apply to: the first marker's start once one is seen, else before the
        longest tail that may begin a marker (undecided yet)."""
        if self.markup_at is None:
            hits = [i for m in self.markup if (i := self.text.find(m, max(0, search_from))) >= 0]
            if hits:
                self.markup_at = min(hits)
        if self.markup_at is not None:
            return self.markup_at
        longest = max((len(m) for m in self.markup), default=0)
        for k in range(min(longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(m.startswith(tail) for m in self.markup):
                return len(self.text) - k
        return len(self.text)

    def push(self, delta: str) -> str:
        """Add new text; return what can be emitted now. Sets ``stopped`` when a stop string completes."""
        if self.stopped:
            return ""
        if not self.stops or self.markup_at is not None:
            self.text += delta
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        longest = max((len(m) for m in self.markup), default=0)
        search_from = max(self.emitted, self._searched - self._max_len + 1)
        markup_from = len(self.text) - longest + 1
        self.text += delta
        end = self._text_end(markup_from)
        self._searched = end
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from, end)) >= 0]
        if hits:
            end = min(i for i, _ in hits)
            self.matched = next(s for i, s in hits if i == end)
            out = self.text[self.emitted : end]
            self.text = self.text[:end]
            self.emitted = end
            self.stopped = True
            return out
        if self.markup_at is not None:  # the answer's text ended without a stop: everything goes
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        end -= self._held_tail(end)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


class RepeatedCallGuard(HeldBackText):
    """Ends a tool-call response at the first call identical to an earlier call of the same response (module
    docstring). A call is the text from ``CALL_OPEN`` through the next ``CALL_CLOSE``; a repeat is
    ``CALL_SEPARATOR`` followed by an earlier call's exact text, right after a call closes.

    Invariant: ``text[:emitted]`` has been returned; what is held back (``text[emitted:]``) starts where the
    last complete call ends and is a proper prefix of ``CALL_SEPARATOR`` + an earlier call.
    """

    def __init__(self) -> None:
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.repeats: set[str] = set()  # CALL_SEPARATOR + each complete call: what a repeat would be
        self._after_call = 0  # where the last complete call ends (a repeat can only start there)
        self._scan = 0  # text before this holds no call opening that is not yet complete or recorded

    def push(self, delta: str) -> str:
        """Add new text; return what can be emitted now. Sets ``stopped`` when a repeat completes (its text and
        the separator before it are dropped from ``text``)."""
        if self.stopped:
            return ""
        self.text += delta
        while (start := self.text.find(CALL_OPEN, self._scan)) >= 0:
            close = self.text.find(CALL_CLOSE, start + len(CALL_OPEN))
            if close < 0:
                break
            end = close + len(CALL_CLOSE)
            call = self.text[start:end]
            repeat_at = start - len(CALL_SEPARATOR)
            if (
                CALL_SEPARATOR + call in self.repeats
                and repeat_at == self._after_call
                and self.text.startswith(CALL_SEPARATOR, repeat_at)
            ):
                out = self.text[self.emitted : repeat_at]
                self.text = self.text[:repeat_at]
                self.emitted = repeat_at
                self.stopped = True
                return out
            self.repeats.add(CALL_SEPARATOR + call)
            self._after_call = self._scan = end
        if start < 0:  # no opening from _scan on: the next one ends after what could not hold one
            self._scan = max(self._scan, len(self.text) - len(CALL_OPEN) + 1)
        else:  # an opening without its close yet: searched from there again
            self._scan = start
        pending = self.text[self._after_call :]
        may_repeat = bool(pending) and any(r.startswith(pending) for r in self.repeats)
        end = max(self._after_call if may_repeat else len(self.text), self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def end_at_repeat(self) -> bool:
        """Where the text after the last complete call is an earlier call's text up to its arguments' end at
        least (held back; only ``}`` and the closing tag could follow, so it could only become that repeat): drop
        it, set ``stopped`` and return True (the answer ends at that call, as if the repeat had completed); else
        False. For an answer cut at ``max_tokens``. A shorter pending text is no certain repeat (a tools trial:
        ``{"name": "get_weather", "arguments": {"city": "`` was the start of a call for another city, dropped
        with a ``tool_calls`` finish), so the answer is cut there (``length``)."""
        if (
            self.stopped
            or not self.repeats
            or self.emitted != self._after_call
            or len(self.text) == self.emitted
        ):
            return False
        pending = self.text[self._after_call :]
        if not any(
            r.startswith(pending) and len(pending) >= len(r) - REPEAT_FIXED_TAIL for r in self.repeats
        ):
            return False
        self.text = self.text[: self._after_call]
        self.stopped = True
        return True


class OutputText:
    """Detokenizer and stop matcher of one request: token ids in, emit-ready text out.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.
        stops: stop strings of the request.
        markup: where the answer's text ends for stop strings (``StopStringMatcher``).
        tool_calls: the output may hold tool calls: a repeated call ends it (``RepeatedCallGuard``).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stops: tuple[str, ...],
        markup: tuple[str, ...] = (),
        tool_calls: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stops, markup)
        self.guard = RepeatedCallGuard() if tool_calls else None

    @property
    def stopped(self) -> bool:
        """True once a stop string (or a repeated tool call) has been seen; nothing more is emitted."""
        return self.matcher.stopped or (self.guard is not None and self.guard.stopped)

    @property
    def repeated_call(self) -> bool:
        """True when a call identical to an earlier one ended the output (``RepeatedCallGuard``)."""
        return self.guard is not None and self.guard.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self.matcher.matched

    @property
    def text(self) -> str:
        """All text emitted so far plus any held-back tail (after stop-string and repeated-call trimming)."""
        if self.guard is None:
            return self.matcher.text
        return self.guard.text + ("" if self.guard.stopped else self.matcher.text[self.matcher.emitted :])

    def add(self, token_id: int) -> str:
        """Feed one generated token id (not a stopping EOS / stop token); return the text to emit now."""
        out = self.matcher.push(self.detok.add(token_id))
        return out if self.guard is None else self.guard.push(out)

    def end_at_repeat(self) -> bool:
        """At ``max_tokens``: True (and ``stopped``, ``repeated_call``) when the output was inside a repeat of an
        earlier call past its arguments, which is dropped (``RepeatedCallGuard.end_at_repeat``); else False."""
        return self.guard is not None and not self.matcher.stopped and self.guard.end_at_repeat()

    def finish(self) -> str:
        """Flush held-back text at the end of generation (nothing after a stop string or a repeated call)."""
        if self.stopped:
            return ""
        out = self.matcher.push(self.detok.flush())
        if not self.matcher.stopped:
            out += self.matcher.flush()
        if self.guard is None:
            return out
        out = self.guard.push(out)
        return out if self.guard.stopped else out + self.guard.flush()
