"""``engine.backend_encode.encode``: the backend's own encoding, through ``encode_batch`` (GIL released) for a long
text."""

from __future__ import annotations

import random

import pytest

from engine import backend_encode
from tests.engine.checkpoints import BOS, EOS, IM_START, train_tokenizer


class _Spy:
    """A backend recording which of its encode methods ran."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.calls: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append("encode")
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append("encode_batch")
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer()


def _text(rng: random.Random, chars: int) -> str:
    words = ["hello", "world", " ", "\n", "ünïcode", "데이터", "12345", BOS, IM_START, EOS, "  ", "\t", "!?"]
    out: list[str] = []
    while sum(map(len, out)) < chars:
        out.append(rng.choice(words))
    return "".join(out)


@pytest.mark.parametrize(
    "chars", [0, 100, backend_encode.GIL_FREE_CHARS - 1, backend_encode.GIL_FREE_CHARS, 70_000]
)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_the_encoding_is_the_backends_own_and_long_texts_take_the_batch_path(
    trained, chars: int, add_special_tokens: bool
) -> None:
    text = _text(random.Random(chars), chars)[:chars]
    spy = _Spy(trained)
    got = backend_encode.encode(spy, text, add_special_tokens)
    expected = trained.encode(text, add_special_tokens=add_special_tokens)
    assert got.ids == expected.ids
    assert got.offsets == expected.offsets
    assert got.tokens == expected.tokens
    assert spy.calls == ["encode_batch" if chars >= backend_encode.GIL_FREE_CHARS else "encode"]
