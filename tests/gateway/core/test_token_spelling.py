"""Where generated tokens start in the text they spell, and legacy completions' ``text_offset`` from it."""

from __future__ import annotations

from gateway.core.events import TokenLogprob
from gateway.core.token_spelling import TokenSpelling
from gateway.protocols.openai.render import completion_logprobs

# "アネ" is e3 82 a2 e3 83 8d: a byte-level tokenizer may split each character over two tokens
TOKENS = [b"\xe3\x82", b"\xa2", b"\xe3", b"\x83\x8d", b"!", b"\xe3\x81", b"?"]
TEXT = "アネ!\ufffd?"  # the last character is broken off by "?": one U+FFFD, then "?"


def test_a_token_finishing_a_character_starts_in_it_and_one_breaking_it_off_after_its_replacement():
    assert TokenSpelling().offsets(TOKENS) == [0, 0, 1, 1, 2, 3, 4]
    spelling = TokenSpelling()
    for data in TOKENS:
        spelling.feed(data)
    assert spelling.chars == len(TEXT) == b"".join(TOKENS).decode("utf-8", errors="replace").__len__()


def test_legacy_text_offsets_stay_inside_the_text_across_chunks():
    """A re-trial: the 5-character answer 'アネルエッ' got offsets 0-9 (each byte token counted as a character)."""
    entries = [TokenLogprob(t.decode("utf-8", "replace"), tuple(t), -1.0) for t in TOKENS]
    whole = completion_logprobs(entries, TokenSpelling())["text_offset"]
    streamed_spelling = TokenSpelling()
    streamed = [o for chunk in (entries[:3], entries[3:5], entries[5:]) for o in
                completion_logprobs(chunk, streamed_spelling)["text_offset"]]  # fmt: skip
    assert whole == streamed == [0, 0, 1, 1, 2, 3, 4]
    assert all(offset < len(TEXT) for offset in whole)
