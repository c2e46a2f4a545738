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
