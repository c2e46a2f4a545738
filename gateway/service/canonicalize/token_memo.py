"""A bounded memo of cl100k token ids per rendered message: ``(scope, piece) -> ids`` (and their offsets).

The cache explanation tokenizes the whole rendered prompt of every request, although most of it (the system
prompt, tools, earlier turns) repeats from the previous request. ``PieceTokenMemo.encode`` cuts the text at
every ``"\\n"`` that is followed by ``"<|"`` (where ``Cl100kTokenizer``'s layout starts a message), encodes
each piece on its own (or takes it from the memo), and joins the ids. The start offsets are kept per piece too
(``Cl100kTokenizer.piece_offsets``: each token's start within its piece and the characters the piece holds):
an offset is a running count of characters over the ids (``Cl100kTokenizer.offsets``, a function of the ids
alone), so a piece's offsets in the whole text are its own plus the characters of the pieces before it, then
clamped at 0 as ``offsets`` does (session 7 of docs/overhead.md: a shift of the stored offsets costs less than
the vectorized pass over the whole prompt did).

Why that is exact for ``cl100k_base``: tiktoken splits text into pieces with its pattern (``'s|'t|...|
[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``) and runs BPE
inside each piece only. No alternative matches a newline followed by a non-whitespace character, so no piece
crosses such a point; and a match that ends there ends on a newline, which ``\\s*[\\r\\n]+`` (tried before the
only lookahead, ``\\s+(?!\\S)``) takes whatever follows, so the split before it is the same whether the text
goes on or ends. Special tokens are encoded as plain text (``disallowed_special=()``), so nothing else crosses
the cut. ``tests/gateway/test_token_memo.py`` checks the equality on generated prompts.

Entries are separated by ``scope`` (model and tenant): a memo hit is faster than an encode, so a memo shared
across tenants would let one tenant time whether another sent a text (the same reason as
``rules.text_cache``).

Invariants: ``encode(tokenizer, text, scope)`` equals ``tokenizer.encode(text)``; the characters held never
exceed ``max_chars``, the token ids ``max_tokens`` (~36 bytes each as a tuple of ints) nor the entries
``max_entries`` (each stored id also holds its offset, another ~36 bytes); a piece longer than
``max_piece_chars`` is never stored;
safe to share between threads (the explanation of a long prompt runs in a worker thread).
"""

from __future__ import annotations

import re

from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer
from rules.bounded_lru import BoundedLRU, MemoCounters

_CUT = re.compile(r"\n(?=<\|)")


class PieceTokenMemo(MemoCounters):
    """``(scope, piece) -> (token ids, their offsets in the piece, characters)`` for ``Cl100kTokenizer``, least
    recently used first out.

    Args:
        max_chars: most characters of pieces held over all entries.
        max_tokens: most token ids held over all entries.
        max_entries: most entries (each new user turn adds one).
        max_piece_chars: pieces longer than this are encoded every time, never stored.
    """

    def __init__(
        self,
        max_chars: int = 2_000_000,
        max_tokens: int = 250_000,
        max_entries: int = 8_192,
        max_piece_chars: int = 200_000,
    ) -> None:
        self.max_chars = max_chars
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.max_piece_chars = max_piece_chars
        self._memo: BoundedLRU[tuple[str, str], _Piece] = BoundedLRU(
            max_entries, (max_chars, max_tokens), _cost
        )

    @property
    def chars(self) -> int:
        """Characters of pieces held now."""
        return self._memo.totals[0]

    @property
    def tokens(self) -> int:
        """Token ids held now."""
        return self._memo.totals[1]

    def encode(self, tokenizer: Cl100kTokenizer, text: str, scope: str = "") -> tuple[list[int], list[int]]:
        """``tokenizer.encode(text)`` (ids, start character offsets), the pieces seen before within ``scope``
        taken from the memo. A piece stored under one scope is never used under another.

        Raises:
            TypeError: ``tokenizer`` is not a ``Cl100kTokenizer`` (the cut is exact only for its encoding).
        """
        if not isinstance(tokenizer, Cl100kTokenizer):
            raise TypeError(
                f"the per-message memo is exact only for cl100k_base, not {type(tokenizer).__name__}"
            )
        ids: list[int] = []
        offsets: list[int] = []
        chars = 0
        at = 0
        for cut in _CUT.finditer(text):
            chars = self._add(tokenizer, text[at : cut.end()], scope, ids, offsets, chars)
            at = cut.end()
        self._add(tokenizer, text[at:], scope, ids, offsets, chars)
        return ids, offsets

    def _add(
        self,
        tokenizer: Cl100kTokenizer,
        piece: str,
        scope: str,
        ids: list[int],
        offsets: list[int],
        chars: int,
    ) -> int:
        """Append the piece's ids and offsets (``chars``: characters before it); the characters after it."""
        if not piece:
            return chars
        piece_ids, starts, count = self._memo.get_or_compute(
            (scope, piece),
            lambda: _piece(tokenizer, piece),
            store=len(piece) <= self.max_piece_chars,
        )
        ids.extend(piece_ids)
        if starts and starts[0] + chars < 0:  # only where the text starts inside a character: clamp
            offsets.extend(max(start + chars, 0) for start in starts)
        elif chars:
            offsets.extend([start + chars for start in starts])
        else:
            offsets.extend(starts)
        return chars + count

    def check(self) -> None:
        """Assert the invariants (tests)."""
        self._memo.check()
        assert all(len(piece) <= self.max_piece_chars for _, piece in self._memo.keys())


_Piece = tuple[tuple[int, ...], tuple[int, ...], int]
"""(token ids, their start offsets in the piece before the clamp at 0, characters of the piece)."""


def _piece(tokenizer: Cl100kTokenizer, piece: str) -> _Piece:
    ids = tuple(tokenizer.encode_ids(piece))
    starts, count = tokenizer.piece_offsets(ids)
    return ids, starts, count


def _cost(key: tuple[str, str], value: _Piece) -> tuple[int, int]:
    return len(key[1]), len(value[0])
