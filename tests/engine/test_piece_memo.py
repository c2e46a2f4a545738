"""The tokenizer's piece memo (``engine.piece_memo``): ids and offsets equal to the whole-text encode on generated
prompts, memo hits, bounds, scopes, and the tokenizers it must refuse to cut."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, normalizers, pre_tokenizers

from engine.gguf_loader import open_gguf, read_metadata
from engine.piece_memo import PieceMemo, piece_split_is_exact
from engine.tokenizer import Tokenizer
from tests.engine.checkpoints import BOS, EOS, IM_START, make_tiny_gguf_llama, train_tokenizer

# Fragments chosen so that cut points fall where BPE or the pre-tokenizer would join them if they were not cut:
# a word split by a special token, digits on both sides, spaces and newlines before and after, half a special.
FRAGMENTS = [
    "hello",
    " world",
    "wor",
    "ld",
    "12",
    "345",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "café",
    "déjà vu",
    "日本語",
    "🙂",
    "x = f(y) + 42;",
    "'s",
    "<|",
    "|>",
    "<|im_start",
    "im_end|>",
    "<",
    "!!",
    "items at 12:30!",
]


def generated_texts(specials: list[str], count: int, seed: int = 0) -> list[str]:
    """Random concatenations of ``FRAGMENTS`` and ``specials`` (adjacent specials, specials first and last)."""
    rng = random.Random(seed)
    pool = FRAGMENTS + specials * 3
    texts = []
    for _ in range(count):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 40))))
    return texts


def chat_texts(specials: list[str], seed: int = 0) -> list[str]:
    """ChatML-like prompts: a long system piece repeated under different questions, and variations of it."""
    rng = random.Random(seed)
    start, end = specials[0], specials[-1]
    system = " ".join(rng.choice(FRAGMENTS) for _ in range(200))
    out = []
    for i in range(12):
        question = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        sys_text = system if i % 3 else system + rng.choice(FRAGMENTS)
        out.append(f"{start}system\n{sys_text}{end}\n{start}user\n{question}{end}\n{start}assistant\n")
    return out


def whole(backend, text: str) -> tuple[list[int], list[int]]:
    encoding = backend.encode(text, add_special_tokens=False)
    return list(encoding.ids), [start for start, _ in encoding.offsets]


def check_equal(memo: PieceMemo, texts: list[str], scope: str = "") -> None:
    for text in texts:
        expected = whole(memo.backend, text)
        assert memo.encode(text, scope) == expected, text
        assert memo.encode_ids(text, scope) == expected[0], text


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer()


def test_trained_byte_level_bpe_is_cut_and_equal_to_whole_encodes(trained):
    memo = PieceMemo(trained, min_piece_chars=1)
    assert memo.exact
    texts = generated_texts([BOS, IM_START, EOS], 400) + chat_texts([IM_START, EOS])
    check_equal(memo, texts)
    assert memo.misses > 0
    before = memo.hits
    check_equal(memo, texts)  # second pass: every stored piece comes from the memo, still equal
    assert memo.hits > before


def test_default_thresholds_store_only_long_pieces(trained):
    memo = PieceMemo(trained)
    texts = chat_texts([IM_START, EOS], seed=3)
    check_equal(memo, texts)
    # one entry per distinct long system text; the short questions and role lines are never stored
    assert memo.entries == len({t.split("\n", 1)[1].split(EOS)[0] for t in texts})
    assert memo.hits == 2 * len(texts) - memo.entries  # check_equal encodes each text twice


def test_gguf_tokenizer_with_llama_cpp_splits_is_exact(tmp_path):
    for pre in ("smollm", "llama3", "qwen2"):
        tok = Tokenizer.from_gguf_metadata(
            read_metadata(open_gguf(make_tiny_gguf_llama(tmp_path / f"{pre}.gguf", pre=pre)))
        )
        assert tok.pieces.exact
        tok.pieces.min_piece_chars = 1
        check_equal(tok.pieces, generated_texts([BOS, IM_START, EOS], 150, seed=1))


def test_scopes_do_not_share_entries(trained):
    memo = PieceMemo(trained, min_piece_chars=4)
    text = f"{IM_START}system\nhello world 12345{EOS}"
    memo.encode(text, "tenant-a")
    hits = memo.hits
    memo.encode(text, "tenant-b")
    assert memo.hits == hits  # another tenant's piece is not a hit
    memo.encode(text, "tenant-a")
    assert memo.hits == hits + 1


def test_bounds_evict_least_recently_used(trained):
    memo = PieceMemo(trained, min_piece_chars=1, max_entries=2, max_chars=1_000)
    a, b, c = "aaaa hello", "bbbb world", "cccc 12345"
    for piece in (a, b):
        memo.encode(f"{piece}{EOS}")
    memo.encode(f"{a}{EOS}")  # a is now the most recently used
    memo.encode(f"{c}{EOS}")  # b goes
    assert memo.entries == 2
    hits = memo.hits
    memo.encode(f"{a}{EOS}{c}")
    assert memo.hits == hits + 2
    memo.encode(f"{b}{EOS}")
    assert memo.hits == hits + 2  # b was evicted: a miss, stored again
    small = PieceMemo(trained, min_piece_chars=1, max_chars=25)
    for piece in (a, b, c):
        small.encode(f"{piece}{EOS}")
    assert small.chars <= 25 and small.entries == 2
    long_piece = "hello " * 10
    small.max_piece_chars = 20
    check_equal(small, [long_piece + EOS])
    assert all(key[1] != long_piece for key in small._memo)
    small.clear()
    assert small.entries == 0 and small.chars == 0


def test_tokenizers_that_cannot_be_cut_are_encoded_whole(trained):
    cases = []
    tok = train_tokenizer()
    tok.normalizer = normalizers.NFKC()
    cases.append(tok)
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken("<tool>", lstrip=True, rstrip=True)])
    cases.append(tok)
    tok = train_tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    cases.append(tok)
    tok = train_tokenizer()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    cases.append(tok)
    for tok in cases:
        assert not piece_split_is_exact(tok)
        memo = PieceMemo(tok, min_piece_chars=1)
        check_equal(memo, generated_texts([BOS, IM_START, EOS, " <tool> "], 50, seed=2))
        assert memo.entries == 0 and memo.hits == 0
    assert piece_split_is_exact(trained)


def test_render_chat_and_offsets_use_the_memo_and_equal_the_whole_encode(tiny_hf_dir):
    tok = Tokenizer.from_hf_folder(tiny_hf_dir)
    system = "You are a helpful assistant who answers in detail. " * 20
    for i, question in enumerate(["What is 2+2?", "And 3+3?", "café 日本語 🙂 12:30"]):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tok.apply_chat_template(messages)
        expected = tok.encode(text)
        assert tok.render_chat(messages, scope="t") == expected
        assert tok.encode_with_offsets(text, "t") == whole(tok.backend, text)
        assert tok.pieces.hits >= 2 * i + (1 if i else 0)


@pytest.mark.slow
def test_smollm2_prompts_equal_whole_encodes(smollm2_path):
    from bench.engine import QUESTIONS, SYSTEM_SENTENCES

    tok = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(smollm2_path)))
    assert tok.pieces.exact
    rng = random.Random(0)
    texts = []
    for i in range(40):
        system = " ".join(rng.choice(SYSTEM_SENTENCES) for _ in range(rng.randint(5, 40)))
        messages = [{"role": "system", "content": f"Session {i % 4}. {system}"}]
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": rng.choice(QUESTIONS) + f" ({turn})"})
            messages.append({"role": "assistant", "content": rng.choice(FRAGMENTS) * 3})
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        texts.append(tok.apply_chat_template(messages))
    tok.pieces.min_piece_chars = 1
    check_equal(tok.pieces, texts + generated_texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], 200))
    check_equal(tok.pieces, texts)
