"""Cl100kTokenizer.offsets: tiktoken's decode_with_offsets rule, vectorized."""

from __future__ import annotations

import pytest

from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer

TEXTS = [
    "",
    "hello world",
    "Grüße aus Köln — 東京は晴れ 😀🎉 مرحبا, 안녕하세요",
    "<|system|>\nYou are a bot.\n\n<|user|>\nHi\n\n<|assistant|>\n",
    "é" * 50 + "🎉" * 30 + "\x00\t\n" + "a" * 500,
]


@pytest.fixture(scope="module")
def tokenizer() -> Cl100kTokenizer:
    return Cl100kTokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_offsets_equal_tiktokens(tokenizer, text):
    ids, starts = tokenizer.encode(text)
    assert starts == tokenizer._encoding.decode_with_offsets(ids)[1]
    assert all(isinstance(start, int) for start in starts) and starts == sorted(starts)


@pytest.mark.parametrize("text", TEXTS)
def test_piece_offsets_loop_and_numpy_agree(tokenizer, text, monkeypatch):
    # short pieces take a Python loop, long ones numpy: the same starts and character count either way
    from gateway.service.canonicalize import prompt_tokenizers

    ids = tokenizer.encode_ids(text)
    for cut in (0, 1, 3, len(ids) // 2):  # pieces that start inside a character too
        piece = ids[cut:]
        monkeypatch.setattr(prompt_tokenizers, "SHORT_PIECE_IDS", 10**9)
        looped = tokenizer.piece_offsets(piece)
        monkeypatch.setattr(prompt_tokenizers, "SHORT_PIECE_IDS", -1)
        assert looped == tokenizer.piece_offsets(piece)
        assert all(type(start) is int for start in looped[0]) and type(looped[1]) is int
