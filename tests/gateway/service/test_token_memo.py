"""PieceTokenMemo: per-message cl100k encoding equals encoding the whole prompt; scoped, bounded."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer, SmolLM2Tokenizer
from gateway.service.canonicalize.token_memo import PieceTokenMemo

_TOKENIZER = Cl100kTokenizer()

# characters that stress tiktoken's pattern at a message boundary: whitespace runs, newlines, punctuation,
# letters, digits, contraction quotes, the layout's own "<|" and "|>", multi-byte characters
_ALPHABET = st.sampled_from(
    list(" \t\r\n\n\n<|>'sdtmlvre.,!?:;-_/\\\"{}[]()0123456789aZéß東😀\u00a0\u2028\x0b\x0c")
    + ["<|user|>", "<|endoftext|>", "\n\n", "'s", "'ll", "  \n", "\r\n", "12345"]
)
_TEXT = st.lists(_ALPHABET, max_size=40).map("".join)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _TEXT})}),
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
        "content": st.one_of(st.none(), _TEXT, st.lists(_PART, max_size=3)),
    },
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"id": _TEXT, "type": st.just("function"), "function": st.just({"name": "f"})}
            ),
            max_size=2,
        )
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(_MESSAGE, min_size=1, max_size=6),
    generation=st.booleans(),
    preamble=st.sampled_from(["", '<|tools|>\n[{"name":"f"}]\n\n']),
)
def test_memo_encode_equals_whole_prompt(messages, generation, preamble):
    """For the Cl100k layout (with the tools preamble rendered_prompt adds), twice through one memo (the
    second time from stored pieces), the ids and offsets are exactly tiktoken's on the whole text."""
    text = preamble + _TOKENIZER.render(messages, None, generation)
    memo = PieceTokenMemo()
    expected = _TOKENIZER.encode(text)
    assert memo.encode(_TOKENIZER, text, "m\0t") == expected
    assert memo.encode(_TOKENIZER, text, "m\0t") == expected
    memo.check()


@settings(max_examples=300, deadline=None)
@given(text=st.lists(_ALPHABET, max_size=80).map("".join))
def test_memo_encode_equals_any_text(text):
    """The cut (a newline before "<|") is exact for any text, not only the layout's."""
    assert PieceTokenMemo().encode(_TOKENIZER, text) == _TOKENIZER.encode(text)


def test_pieces_are_reused_within_a_scope_only():
    memo = PieceTokenMemo()
    system = "<|system|>\nYou are a helpful assistant for a railway company.\n\n"
    first = system + "<|user|>\nWhen does the train leave?\n\n<|assistant|>\n"
    second = system + "<|user|>\nCan I get a refund?\n\n<|assistant|>\n"
    assert memo.encode(_TOKENIZER, first, "m\0a") == _TOKENIZER.encode(first)
    assert (memo.hits, memo.misses) == (0, 3)
    assert memo.encode(_TOKENIZER, second, "m\0a") == _TOKENIZER.encode(second)
    assert (memo.hits, memo.misses) == (2, 4)  # the system prompt and the generation prompt
    assert memo.encode(_TOKENIZER, second, "m\0b") == _TOKENIZER.encode(second)
    assert (memo.hits, memo.misses) == (2, 7)  # another tenant: nothing shared
    assert len(memo) == 7


def test_bounded_by_entries_and_characters():
    memo = PieceTokenMemo(max_chars=100, max_entries=3, max_piece_chars=40)
    for k in range(10):
        memo.encode(_TOKENIZER, f"<|user|>\nquestion {k}\n\n<|assistant|>\n", "s")
        memo.check()
    assert len(memo) == 3
    long = "<|user|>\n" + "x" * 60 + "\n\n"
    memo.encode(_TOKENIZER, long, "s")
    memo.check()
    assert ("s", long) not in memo._memo.keys()
    small = PieceTokenMemo(max_chars=30, max_entries=100)
    for k in range(5):
        small.encode(_TOKENIZER, f"<|user|>\nquestion {k}\n\n", "s")
        small.check()
    assert small.chars <= 30
    few = PieceTokenMemo(max_tokens=12)
    for k in range(5):
        few.encode(_TOKENIZER, f"<|user|>\nquestion number {k}\n\n", "s")
        few.check()
    assert 0 < few.tokens <= 12 and len(few) < 5


def test_refuses_a_tokenizer_it_is_not_exact_for():
    with pytest.raises(TypeError, match="only for cl100k_base, not SmolLM2Tokenizer"):
        PieceTokenMemo().encode(object.__new__(SmolLM2Tokenizer), "<|user|>\nhi\n\n")
