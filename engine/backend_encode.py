"""Encoding a text with a ``tokenizers.Tokenizer`` without holding the GIL for long.

``Tokenizer.encode`` runs with the GIL held: a 3 MB prompt held it for ~4 s, and every other request and
``/healthz`` with it, even from a worker thread (a fresh-user trial). ``Tokenizer.encode_batch`` releases the GIL
while it encodes (the library runs its batch in native code outside the interpreter) and gives, for one text, the
same ``Encoding``. ``encode`` takes that path for a text of ``GIL_FREE_CHARS`` characters or more, where the
hand-over costs nothing next to the encode itself.

Invariant: ``encode(backend, text, ...)`` equals ``backend.encode(text, ...)`` (ids, offsets, everything).
"""

from __future__ import annotations

from tokenizers import Encoding
from tokenizers import Tokenizer as BackendTokenizer

GIL_FREE_CHARS = 16_384
"""Texts of this many characters or more are encoded with the GIL released (``encode_batch`` of one text);
shorter ones by ``encode`` (a few hundred microseconds at most)."""


def encode(backend: BackendTokenizer, text: str, add_special_tokens: bool = False) -> Encoding:
    """``backend.encode(text, add_special_tokens=add_special_tokens)``, the GIL released for a long ``text``.

    Args:
        backend: the ``tokenizers`` tokenizer.
        text: the text to encode.
        add_special_tokens: apply the tokenizer's post-processor (BOS/EOS rule).

    Returns:
        the ``tokenizers.Encoding`` of ``text`` (``.ids``: token ids, ``.offsets``: (start, end) characters).
    """
    if len(text) < GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
