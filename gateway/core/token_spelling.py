"""Where generated tokens start in the text they spell: token bytes decoded as UTF-8 the way the engine's
detokenizer decodes them (``engine.detokenizer``: U+FFFD for each invalid sequence and for an unfinished one at
the end), so a token's start can be told in characters of the text a client receives.

Owns ``TokenSpelling``. Used for the logprobs a stream attaches to each chunk (``gateway.backends.embedded``) and
for legacy completions' ``text_offset`` (``gateway.protocols.openai.render``). Invariant: ``chars`` only grows,
by the characters ended so far; bytes of an unfinished character are held until a byte ends or breaks it.
"""

from __future__ import annotations

import codecs


class TokenSpelling:
    """Generated tokens' bytes decoded as UTF-8 with U+FFFD for each invalid or (at the end) unfinished
    sequence; ``chars`` counts the characters ended so far and ``start_of`` where the next token starts."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def feed(self, data: bytes) -> None:
        """Decode ``data`` (a token's bytes) after what came before."""
        self.chars += len(self._decoder.decode(data))

    def start_of(self, data: bytes) -> int:
        """The character a token of bytes ``data`` starts in, were it fed next: the unfinished character the
        bytes before it began, when its first byte goes on with it; else the character after the U+FFFD that
        unfinished bytes become when a byte breaks them off (Python's decoder writes one U+FFFD per maximal
        invalid subpart, as the engine's detokenizer does)."""
        held, _ = self._decoder.getstate()
        if not held:
            return self.chars
        try:
            (held + data[:1]).decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data" or not data:
                return self.chars + len(held.decode("utf-8", errors="replace"))
        return self.chars

    def offsets(self, tokens: list[bytes]) -> list[int]:
        """The start of each of ``tokens`` (fed in order), in characters of the whole text."""
        out = []
        for data in tokens:
            out.append(self.start_of(data))
            self.feed(data)
        return out
