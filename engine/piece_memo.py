"""A bounded memo of a checkpoint tokenizer's encodings per piece of text between special tokens.

Every chat request's prompt is rendered and tokenized whole (``Tokenizer.render_chat``), and again by the cache
explanation (``gateway.backends.embedded.EnginePromptTokenizer.encode``), although most of it (the system
prompt, earlier turns) repeats from the previous request. The ``tokenizers`` library encodes a text in two
stages: it first cuts the text at every added token it finds (leftmost-longest match among the added tokens'
contents), then normalizes, pre-tokenizes and runs the model (BPE) on each remaining piece on its own. So with
no normalizer and added tokens that strip nothing, and pre-tokenizers that treat every piece alike, the ids of
a text are the ids of its pieces, each encoded alone, with each added token's id between them: no BPE merge or
pre-tokenizer split crosses an added token. ``PieceMemo.encode`` cuts the text the same way (a regex
alternation of the added tokens' contents, longest first at each position: leftmost-longest), takes each long
piece's ids and start offsets from the memo or encodes it alone, and joins them; offsets of a piece are shifted
by its start in the text.

When the tokenizer does not meet those conditions (``piece_split_is_exact``: a normalizer, an added token with
``lstrip`` / ``rstrip`` / ``single_word``, a pre-tokenizer outside ``ByteLevel`` without prefix space,
``Split``, ``Digits``, ``Sequence`` of them, a model other than BPE, ``encode_special_tokens`` on), ``encode``
is the backend's own whole-text encode, every time. ``tests/engine/test_piece_memo.py`` checks equality on
generated prompts, cut points between pieces that BPE would merge if they were not cut included.

A piece equal to a turn the engine served in the same scope (``engine.served_turns``: a reply whose generated
ids are not the canonical encoding of its text) takes the ids that were served instead of its encoding, so the
prompt holds the tokens whose KV the prefix cache has; such a piece's ids decode to exactly its text.

Entries are kept per ``scope`` (the caller passes the request's cache salt, i.e. its tenant): a memo hit is
faster than an encode, so a memo shared across tenants would let one tenant time whether another sent a text
(the same reason as the prefix cache's salt and ``gateway.service.canonicalize.token_memo``).

Invariants: ``encode(text, scope)`` equals ``(backend.encode(text, add_special_tokens=False).ids, [start of
each offset])`` except for the pieces that are served turns of ``scope``, whose ids are the served ones; pieces shorter than ``min_piece_chars`` or longer than ``max_piece_chars`` are never stored;
the characters held never exceed ``max_chars`` nor the entries ``max_entries`` (least recently used out first:
``engine.bounded_memo``);
safe to share between threads (a lock around every read and write of the memo; encodes run outside it).
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BackendTokenizer

from engine import backend_encode
from engine.bounded_memo import BoundedMemo

if TYPE_CHECKING:
    from engine.served_turns import ServedTurns

_PIECEWISE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Sequence"})


def piece_split_is_exact(backend: BackendTokenizer) -> bool:
    """True when encoding the pieces between added tokens one by one gives the whole text's ids and offsets
    (the conditions of the module docstring), read from the tokenizer's own serialized configuration."""
    if getattr(backend, "encode_special_tokens", False):
        return False
    config = json.loads(backend.to_str())
    if config.get("normalizer") is not None:
        return False
    if (config.get("model") or {}).get("type") != "BPE":
        return False
    for token in config.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word") or not token.get("content"):
            return False
    return _pre_tokenizer_is_piecewise(config.get("pre_tokenizer"))


def _pre_tokenizer_is_piecewise(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind not in _PIECEWISE_PRE_TOKENIZERS:
        return False
    if kind == "ByteLevel" and pre.get("add_prefix_space"):
        return False
    if kind == "Sequence":
        return all(_pre_tokenizer_is_piecewise(p) for p in pre.get("pretokenizers") or [])
    return True


class PieceMemo:
    """``(scope, piece) -> (token ids, start offsets in the piece)`` for one ``tokenizers.Tokenizer``, least
    recently used first out.

    Args:
        backend: the checkpoint's ``tokenizers.Tokenizer``.
        max_chars: most characters of pieces held over all entries.
        max_entries: most entries.
        min_piece_chars: pieces shorter than this are encoded every time (a question, a role name): storing
            them would only push out the long pieces that repeat.
        max_piece_chars: pieces longer than this are encoded every time, never stored.
        served: the tokenizer's served turns (``engine.served_turns``), or None: pieces are always encoded.

    Attributes:
        exact: ``piece_split_is_exact(backend)``; when False every ``encode`` is the backend's whole-text one.
        hits, misses: pieces served from / added to the memo (stored pieces only).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        max_chars: int = 4_000_000,
        max_entries: int = 4_096,
        min_piece_chars: int = 256,
        max_piece_chars: int = 400_000,
        served: ServedTurns | None = None,
    ) -> None:
        self.served = served
        self.backend = backend
        self.min_piece_chars = min_piece_chars
        self.max_piece_chars = max_piece_chars
        self.exact = piece_split_is_exact(backend)
        added = {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()}
        self._added_ids = added
        alternation = "|".join(re.escape(c) for c in sorted(added, key=len, reverse=True))
        self._cut = re.compile(alternation) if alternation else None
        self._memo: BoundedMemo[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = BoundedMemo(
            max_entries, max_chars, _piece_chars
        )
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def max_chars(self) -> int:
        """Most characters of pieces held over all entries."""
        return self._memo.max_size

    @property
    def max_entries(self) -> int:
        """Most entries."""
        return self._memo.max_entries

    @property
    def entries(self) -> int:
        """Pieces held now."""
        return len(self._memo)

    @property
    def chars(self) -> int:
        """Characters of the pieces held now."""
        return self._memo.size

    def clear(self) -> None:
        """Forget every piece."""
        with self._lock:
            self._memo.clear()

    def encode(self, text: str, scope: str = "") -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added) and the start character of each token (as the
        backend's ``Encoding.offsets`` give them).

        Args:
            text: any text.
            scope: the memo's partition (the caller's tenant, module docstring).
        """
        if not self._cuts(text, scope):
            return self._whole(text)
        ids: list[int] = []
        starts: list[int] = []
        self._join(text, scope, ids, starts)
        return ids, starts

    def encode_ids(self, text: str, scope: str = "") -> list[int]:
        """The token ids of ``encode(text, scope)`` (the offsets are not computed)."""
        if not self._cuts(text, scope):
            return backend_encode.encode(self.backend, text).ids
        ids: list[int] = []
        self._join(text, scope, ids, None)
        return ids

    def _cuts(self, text: str, scope: str) -> bool:
        """True when ``text`` is encoded piece by piece: the cut is exact, and the text is long enough to have
        pieces worth remembering or ``scope`` has served turns to find in it."""
        if not self.exact or self._cut is None:
            return False
        return len(text) >= self.min_piece_chars or (self.served is not None and self.served.holds(scope))

    def _join(self, text: str, scope: str, ids: list[int], starts: list[int] | None) -> None:
        at = 0
        for match in self._cut.finditer(text):
            if match.start() > at:
                self._piece(text[at : match.start()], at, scope, ids, starts)
            ids.append(self._added_ids[match.group()])
            if starts is not None:
                starts.append(match.start())
            at = match.end()
        if at < len(text):
            self._piece(text[at:], at, scope, ids, starts)

    def _whole(self, text: str) -> tuple[list[int], list[int]]:
        encoding = backend_encode.encode(self.backend, text)
        return list(encoding.ids), [start for start, _ in encoding.offsets]

    def _piece(self, piece: str, at: int, scope: str, ids: list[int], starts: list[int] | None) -> None:
        """Append the ids of ``piece`` to ``ids`` and, unless ``starts`` is None, their offsets shifted by
        ``at`` to ``starts``."""
        served = self.served.lookup(scope, piece) if self.served is not None else None
        if served is not None:
            ids.extend(served[0])
            if starts is not None:
                starts.extend([s + at for s in served[1]] if at else served[1])
            return
        store = self.min_piece_chars <= len(piece) <= self.max_piece_chars
        key = (scope, piece)
        hit = None
        if store:
            with self._lock:
                hit = self._memo.get(key)
                if hit is not None:
                    self.hits += 1
        if hit is None:
            piece_ids, piece_starts = self._whole(piece)
            hit = (tuple(piece_ids), tuple(piece_starts))
            if store:
                self._put(key, hit)
        ids.extend(hit[0])
        if starts is not None:
            starts.extend([s + at for s in hit[1]] if at else hit[1])

    def _put(self, key: tuple[str, str], value: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        with self._lock:
            if self._memo.put(key, value) is not None:  # None: another thread stored it meanwhile
                self.misses += 1


def _piece_chars(key: tuple[str, str]) -> int:
    """The size of a memo entry: the characters of its piece."""
    return len(key[1])
