"""The token ids the engine served for each generated turn, per tenant, so a resent conversation reuses their KV.

The engine caches the KV of the tokens a model *generated*. When the client resends the conversation, the
reply comes back as text and is rendered and tokenized again; a tokenizer's canonical encoding of that text is
not always the ids the model wrote. Constrained decoding makes this common (the grammar allows every spelling of
the same bytes, and a small model picks ``"}`` + ``}`` where the text tokenizes as ``"`` + ``}}``), and sampling
does it too. The prompt then differs from the cached tokens a few tokens before the end of the reply, and the
KV of everything after that point, up to a whole block before it, is computed again on every turn: an agent
loop of tool calls lost 8 tokens per turn that way with SmolLM2 (docs/prefix-cache.md, "Served turns").

``ServedTurns`` remembers, for a finished request whose output does not re-tokenize to itself, the text of its
*turn piece* (the text between the last special token of its prompt and the end of its output: with ChatML
``"assistant\\n" + reply``) and the ids the engine holds for it (the prompt's ids after that special token, then
the generated ids). ``engine.piece_memo.PieceMemo`` cuts every prompt at special tokens and encodes each piece
alone; a piece that equals a remembered turn piece of the same scope takes the served ids instead of its
canonical encoding. That is the whole mechanism, and it is general:

- any tokenizer the piece memo can cut exactly (``piece_split_is_exact``) with a byte-level decoder (the ids'
  bytes are then exactly the text's UTF-8): the remembered ids decode to exactly the piece's text, so the prompt
  still spells the same text, and the pieces around it are encoded as before (no merge crosses a special
  token); for any other tokenizer ``enabled`` is False and nothing changes;
- any reply: tool-call JSON, plain text, any split, cut by ``max_tokens`` or ended by EOS (a reply cut by a stop
  string is not remembered: the client never got its tail);
- the ids are what the model wrote, so the next turn's model sees its own tokens, and the prefix cache (which
  holds the KV of exactly those ids) serves the reply whole.

Alternatives not taken: forbidding non-canonical splits in the tool-call grammar covers only constrained JSON
(not sampled text), needs a vocabulary-wide canonicality check per step, and changes what the model may write;
re-prefilling the canonical tail after the fact only moves the same computation to another time.

Entries are kept per ``scope`` (the cache salt, i.e. the tenant), as ``engine.piece_memo`` keeps its own: a
remembered turn changes the prompt's ids (and makes its encode faster), so one tenant must never see another's.

One text has one spelling in a conversation: a reply whose text an earlier turn of its own prompt already holds
(an agent making the same tool call again) is not stored, and a canonical one does not forget an older split,
since that earlier turn was prefilled and cached as it is spelled now; a new spelling would part every later
prompt from the cache at it.

Invariants: an entry's ids decode (byte-level) to exactly its text, contain no added token, and differ from the
canonical encoding of that text (turns that re-tokenize to themselves are not stored); the characters held
never exceed ``max_chars`` nor the entries ``max_entries`` (least recently used out first:
``engine.bounded_memo``); the turns counted per scope are the turns held in it; thread-safe (one lock around
the memo and its counts). The ids a prompt gets depend only on the entries, never on the prefix cache's state, so
a request's tokens are the same with the cache on or off.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from engine.bounded_memo import BoundedMemo
from engine.piece_memo import piece_split_is_exact


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character -> byte table of byte-level BPE, inverted (``engine.tokenizer``'s table)."""
    from engine.tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def decoder_is_byte_level(backend: BackendTokenizer) -> bool:
    """True when the tokenizer's decoder is ``ByteLevel`` (a token's text is its vocabulary string's bytes)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


class ServedTurns:
    """``(scope, turn piece text) -> (served token ids, start character of each)`` for one tokenizer.

    Args:
        backend: the checkpoint's ``tokenizers.Tokenizer``.
        max_chars: most characters of turn pieces held over all entries.
        max_entries: most entries.
        max_turn_chars: longer turn pieces are never stored.

    Attributes:
        enabled: the tokenizer meets the module docstring's conditions; when False ``record`` stores nothing.
        recorded: turns stored (their ids were not the canonical encoding of their text).
        canonical: turns not stored because their ids were already the canonical encoding.
        repeated: turns not stored because an earlier turn of their prompt has the same text (its spelling,
            prefilled and cached, is kept: one text has one spelling in a conversation).
        hits: prompt pieces that took served ids.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        max_chars: int = 2_000_000,
        max_entries: int = 4_096,
        max_turn_chars: int = 200_000,
    ) -> None:
        self.backend = backend
        self.max_turn_chars = max_turn_chars
        self.enabled = piece_split_is_exact(backend) and decoder_is_byte_level(backend)
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        contents = sorted((t.content for t in added.values() if t.content), key=len, reverse=True)
        self._added_text = re.compile("|".join(re.escape(c) for c in contents)) if contents else None
        self._byte_of = _byte_level_alphabet()
        self._memo: BoundedMemo[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = BoundedMemo(
            max_entries, max_chars, _turn_chars
        )
        self._per_scope: Counter[str] = Counter()  # scope -> turns held (> 0; a scope with none is not a key)
        self._lock = threading.Lock()
        self.recorded = 0
        self.canonical = 0
        self.repeated = 0
        self.hits = 0

    @property
    def max_chars(self) -> int:
        """Most characters of turn pieces held over all entries."""
        return self._memo.max_size

    @property
    def max_entries(self) -> int:
        """Most entries."""
        return self._memo.max_entries

    @property
    def entries(self) -> int:
        """Turns held now."""
        return len(self._memo)

    @property
    def chars(self) -> int:
        """Characters of the turn pieces held now."""
        return self._memo.size

    def clear(self) -> None:
        """Forget every turn."""
        with self._lock:
            self._memo.clear()
            self._per_scope.clear()

    def holds(self, scope: str) -> bool:
        """True when ``scope`` has at least one turn (its prompts must be cut into pieces to find them)."""
        return scope in self._per_scope

    def record(
        self,
        scope: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        returned: str | None = None,
    ) -> bool:
        """Remember a finished request's turn when its ids are not the canonical encoding of its text.

        Args:
            scope: the request's cache salt (tenant).
            prompt_token_ids: its prompt (the turn piece starts after the prompt's last added token).
            output_token_ids: the ids it generated, less the stop token that ended them (EOS is never part of
                the reply's text); the caller leaves out replies a stop string cut.
            returned: the reply's text as the client got it, when the engine ended it short of its ids (a
                repeat of an earlier tool call, dropped: ``engine.detokenizer.RepeatedCallGuard``); the ids are
                then cut to the tokens that spell it (nothing is stored when no token ends where it ends).

        Returns:
            True when the turn was stored. Never raises for any ids: a turn that holds an added token or the
            text of one, bytes that are not whole UTF-8, or more than ``max_turn_chars`` characters is skipped.
        """
        if not self.enabled or not output_token_ids:
            return False
        if any(t in self._added_ids for t in output_token_ids):
            return False
        start = len(prompt_token_ids)
        while start > 0 and prompt_token_ids[start - 1] not in self._added_ids:
            start -= 1
        lead = tuple(prompt_token_ids[start:])
        if returned is not None:
            output_token_ids = self._spelling(lead, output_token_ids, returned)
            if not output_token_ids:
                return False
        ids = lead + tuple(output_token_ids)
        text = self._text(ids)
        if text is None or len(text) > self.max_turn_chars:
            return False
        if self._added_text is not None and self._added_text.search(text):
            return False  # the prompt would cut this text at that special token: it never comes back whole
        if tuple(self.backend.encode(text, add_special_tokens=False).ids) == ids:
            # an older reply of the same text, split otherwise, is not the latest (unless this prompt holds it)
            if self._holds(scope, text) and not self._spelled_in(prompt_token_ids, text):
                self._forget((scope, text))
            with self._lock:
                self.canonical += 1
            return False
        if self._spelled_in(prompt_token_ids, text):
            # the conversation already holds this text (the model made the same call again): a new spelling
            # would change that earlier turn, prefilled as it is spelled now, in every later prompt
            with self._lock:
                self.repeated += 1
            return False
        self._put((scope, text), (ids, self._starts(text, ids)))
        return True

    def _spelling(
        self, lead: Sequence[int], output_token_ids: Sequence[int], returned: str
    ) -> tuple[int, ...]:
        """The first ids of ``output_token_ids`` that spell ``returned`` after ``lead`` (``()`` when none do: no
        token ends where the returned text ends)."""
        lead_text = self._text(lead)
        if lead_text is None:
            return ()
        size = len(returned.encode("utf-8"))
        at = 0
        for k, token_id in enumerate(output_token_ids):
            at += len(self.backend.id_to_token(token_id) or "")
            if at == size:
                cut = tuple(output_token_ids[: k + 1])
                return cut if self._text(tuple(lead) + cut) == lead_text + returned else ()
            if at > size:
                break
        return ()

    def _holds(self, scope: str, text: str) -> bool:
        with self._lock:
            return (scope, text) in self._memo

    def _spelled_in(self, prompt_token_ids: Sequence[int], text: str) -> bool:
        """Whether a whole piece of the prompt (ids between two added tokens) spells ``text``: an earlier turn of
        the conversation with the same text. Only pieces of the right byte length are decoded."""
        size = len(text.encode("utf-8"))
        piece: list[int] = []
        for token_id in prompt_token_ids:
            if token_id not in self._added_ids:
                piece.append(token_id)
                continue
            if piece and sum(len(self.backend.id_to_token(t) or "") for t in piece) == size:
                if self._text(piece) == text:
                    return True
            piece = []
        return False  # the last piece is this turn's own start

    def lookup(self, scope: str, piece: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The served ids of ``piece`` in ``scope`` and the start character of each token in it, or None."""
        if scope not in self._per_scope:  # ``holds`` written out: every piece of every prompt asks
            return None
        with self._lock:
            hit = self._memo.get((scope, piece))
            if hit is not None:
                self.hits += 1
        return hit

    def _text(self, ids: Sequence[int]) -> str | None:
        """The exact text of byte-level ids (strict UTF-8), or None when their bytes do not form one."""
        out = bytearray()
        for token_id in ids:
            spelling = self.backend.id_to_token(token_id)
            if spelling is None:
                return None
            for ch in spelling:
                b = self._byte_of.get(ch)
                if b is None:
                    return None
                out.append(b)
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def _starts(self, text: str, ids: Sequence[int]) -> tuple[int, ...]:
        """Start character of each token: the character that holds its first byte."""
        char_bytes = []
        at = 0
        for ch in text:
            char_bytes.append(at)
            at += len(ch.encode("utf-8"))
        starts = []
        at = 0
        for token_id in ids:
            starts.append(bisect.bisect_right(char_bytes, at) - 1)
            at += len(self.backend.id_to_token(token_id))  # one character per byte (byte-level alphabet)
        return tuple(max(0, s) for s in starts)

    def _forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            if self._memo.pop(key) is not None:
                self._drop_scopes((key,))

    def _drop_scopes(self, keys: Iterable[tuple[str, str]]) -> None:
        """Count the turns of ``keys`` out of their scopes (under the lock)."""
        per_scope = self._per_scope
        for scope, _ in keys:
            per_scope[scope] -= 1
            if per_scope[scope] <= 0:
                del per_scope[scope]

    def _put(self, key: tuple[str, str], value: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        with self._lock:
            evicted = self._memo.put(key, value, replace=True)
            if evicted is None:  # the same text served again: the latest ids replace the held ones
                return
            self.recorded += 1
            self._per_scope[key[0]] += 1
            self._drop_scopes(evicted)


def _turn_chars(key: tuple[str, str]) -> int:
    """The size of a memo entry: the characters of its turn piece."""
    return len(key[1])
