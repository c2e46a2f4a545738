"""Incremental detokenization (never broken UTF-8) and stop strings (never partially emitted)."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, OutputText, RepeatedCallGuard, StopStringMatcher
from engine.tool_calls import CALL_CLOSE, CALL_MARKERS
from tests.engine.engine_helpers import smollm2_checkpoint


class ByteTokenizer:
    """A byte-level tokenizer: ids 0-255 are single bytes, 256+ are multi-byte pieces; 300 is a special token."""

    SPECIAL = 300

    def __init__(self) -> None:
        self.pieces = {i: bytes([i]) for i in range(256)}
        for j, piece in enumerate(["hello", " world", "é", "日本", "STOP", "ST", "OP"]):
            self.pieces[256 + j] = piece.encode()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = b"".join(
            self.pieces.get(i, b"") if i != self.SPECIAL else b"<eos>" * (not skip_special_tokens)
            for i in ids
        )
        return data.decode("utf-8", errors="replace")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_multibyte_characters_are_held_until_complete():
    tok = ByteTokenizer()
    ids = tok.encode("a日本b😀")
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == "a日本b😀"
    assert all("\ufffd" not in d for d in deltas)
    # "日" is 3 bytes: the first two tokens emit nothing, the third emits the whole character
    assert deltas[1:4] == ["", "", "日"]


def test_random_text_round_trips_without_replacement_chars():
    tok = ByteTokenizer()
    rng = random.Random(0)
    alphabet = "abc é日本😀ß\n"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        deltas = stream(IncrementalDetokenizer(tok), tok.encode(text))
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped_and_truncated_utf8_flushes_as_replacement():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in [256, ByteTokenizer.SPECIAL, 257]] == ["hello", "", " world"]
    partial = "日".encode()[:2]
    assert [detok.add(b) for b in partial] == ["", ""]
    assert detok.flush() == "\ufffd"


def test_stop_string_is_never_partially_emitted():
    m = StopStringMatcher(("STOP",))
    emitted = [m.push(d) for d in ["ab", "S", "T", "O"]]
    assert emitted == ["ab", "", "", ""]  # "STO" could still become "STOP"
    assert m.push("Pxyz") == ""
    assert m.stopped and m.text == "ab"


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    m = StopStringMatcher(("STOP",))
    assert m.push("xST") == "x"
    assert m.push("AB") == "STAB"
    assert not m.stopped
    assert m.push("ST") == ""
    assert m.flush() == "ST"


def test_earliest_stop_string_wins_and_spans_deltas():
    m = StopStringMatcher(("world", "lo w"))
    out = m.push("hel") + m.push("lo wor") + m.push("ld")
    assert m.stopped and out == "hel" and m.text == "hel"


def test_output_text_stops_inside_a_token_and_drops_the_rest():
    tok = ByteTokenizer()
    out = OutputText(tok, ("o w",))
    emitted = out.add(256)  # "hello": "o" may start "o w"
    assert emitted == "hell"
    emitted += out.add(257)  # " world": completes "o w"
    assert out.stopped and emitted == "hell" and out.text == "hell"
    assert out.finish() == ""


def test_output_text_flushes_held_tail_at_finish():
    tok = ByteTokenizer()
    out = OutputText(tok, ("STOP",))
    emitted = out.add(256) + out.add(261)  # "hello" + "ST"
    assert emitted == "hello"
    assert out.finish() == "ST"
    assert out.text == "helloST"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(("",))
    with pytest.raises(ValueError):
        StopStringMatcher(("x",), markup=("",))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stop_strings_never_match_inside_tool_call_markup(step):
    """A forced call (all markup) is never cut, however the text arrives; its arguments hold the stop string."""
    m = StopStringMatcher(("Paris", "tool", "\n"), markup=CALL_MARKERS)
    out = "".join(m.push(CALL[i : i + step]) for i in range(0, len(CALL), step)) + m.flush()
    assert not m.stopped and out == CALL and m.matched is None


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stop_strings_apply_to_the_text_before_the_first_call(step):
    text = "Let me check Paris.\n" + CALL
    m = StopStringMatcher(("Paris",), markup=CALL_MARKERS)
    out = "".join(m.push(text[i : i + step]) for i in range(0, len(text), step))
    assert m.stopped and out == "Let me check " and m.matched == "Paris"
    text = "Let me check.\n" + CALL  # the stop string only in the call: the text and the call come whole
    m = StopStringMatcher(("Paris", "\n"), markup=CALL_MARKERS)
    out = "".join(m.push(text[i : i + step]) for i in range(0, len(text), step)) + m.flush()
    assert not m.stopped and out == text


def test_a_stop_string_that_overlaps_the_start_of_the_markup_does_not_match():
    m = StopStringMatcher((".\n<tool",), markup=CALL_MARKERS)
    out = m.push("Sure.\n<tool") + m.push("_call>\n{") + m.flush()
    assert not m.stopped and out == "Sure.\n<tool_call>\n{"
    m = StopStringMatcher((".\n<tool",), markup=CALL_MARKERS)  # not markup after all: the stop string matches
    assert m.push("Sure.\n<tool") + m.push("s") == "Sure"
    assert m.stopped and m.matched == ".\n<tool"


OTHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def guarded(text: str, step: int, finish: bool = True) -> tuple[RepeatedCallGuard, list[str]]:
    """``text`` pushed ``step`` characters at a time through a fresh guard (then flushed unless it stopped)."""
    g = RepeatedCallGuard()
    parts = [g.push(text[i : i + step]) for i in range(0, len(text), step)]
    if finish and not g.stopped:
        parts.append(g.flush())
    return g, parts


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_repeated_call_ends_the_output_and_no_part_of_it_is_emitted(step):
    g, parts = guarded(CALL + "\n" + CALL + "\n" + CALL[:20], step, finish=False)
    assert g.stopped and "".join(parts) == CALL and g.text == CALL
    assert g.push("more") == "" and g.flush() == ""
    # a repeat after another call: the calls before it stay, in order
    g, parts = guarded("Checking.\n" + CALL + "\n" + OTHER + "\n" + CALL, step, finish=False)
    assert g.stopped and "".join(parts) == "Checking.\n" + CALL + "\n" + OTHER


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_different_calls_and_unfinished_repeats_come_whole(step):
    text = CALL + "\n" + OTHER
    g, parts = guarded(text, step)
    assert not g.stopped and "".join(parts) == text
    # a repeat that differs only at its last argument character is not a repeat
    near = CALL.replace("Paris", "Parix")
    g, parts = guarded(CALL + "\n" + near, step)
    assert not g.stopped and "".join(parts) == CALL + "\n" + near
    # a repeat cut short (max_tokens) is not a repeat: flushed at the end, as the parser sees a cut call
    g, parts = guarded(CALL + "\n" + CALL[:-3], step)
    assert not g.stopped and "".join(parts) == CALL + "\n" + CALL[:-3]
    # the same call text inside an answer, not right after a call, is not a repeat
    g, parts = guarded(CALL + "\nok " + CALL, step)
    assert not g.stopped


def test_text_that_may_become_a_repeat_is_held_until_it_differs():
    g = RepeatedCallGuard()
    assert g.push(CALL) == CALL
    assert g.push("\n<tool_call>\n{") == ""  # may be the same call again
    assert (
        g.push('"name": "get_weather", "arguments": {"city": "R')
        == '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "R'
    )


def test_an_answer_cut_inside_a_repeat_past_its_arguments_ends_at_the_call_before_it():
    """At ``max_tokens`` inside a repeat whose arguments are written whole (only ``}`` and the closing tag could
    follow), the repeat is dropped and the answer ends, complete, at the call before it. Cut earlier, the text
    could still become another call (a tools trial: the start of a call for Rome, after one for Paris, was
    dropped with a ``tool_calls`` finish), so it is flushed and the finish stays ``length``."""
    args_end = len(CALL) - len("}" + CALL_CLOSE)
    for tail in ("\n" + CALL[:args_end], "\n" + CALL[: args_end + 1], "\n" + CALL[:-1]):
        g = RepeatedCallGuard()
        assert g.push(CALL + tail) == CALL
        assert g.end_at_repeat() and g.stopped and g.text == CALL and g.flush() == ""
    shared = '{"name": "get_weather", "arguments": {"city": "'
    assert CALL.index(shared) >= 0 and OTHER.index(shared) >= 0
    for tail in (
        "\n",
        "\n" + CALL[:30],
        "\n" + CALL[: CALL.index(shared) + len(shared)],
        "\n" + CALL[: args_end - 1],
    ):
        g = RepeatedCallGuard()
        out = g.push(CALL + tail)
        assert out == CALL  # held back while it may be a repeat
        assert not g.end_at_repeat() and not g.stopped and out + g.flush() == CALL + tail
    for text in (CALL + "\n" + OTHER[:-5], CALL, "Let me see", CALL + "\n" + OTHER):  # diverged or whole
        g = RepeatedCallGuard()
        out = g.push(text)
        assert not g.end_at_repeat() and not g.stopped and out + g.flush() == text
    tok = ByteTokenizer()
    out = OutputText(tok, (), CALL_MARKERS, tool_calls=True)
    emitted = "".join(out.add(i) for i in tok.encode(CALL + "\n" + CALL[:args_end]))
    assert emitted == CALL and out.end_at_repeat() and out.stopped and out.repeated_call
    assert out.text == CALL and out.finish() == ""
    out = OutputText(tok, (), CALL_MARKERS, tool_calls=True)
    emitted = "".join(out.add(i) for i in tok.encode(CALL + "\n<tool"))
    assert emitted == CALL and not out.end_at_repeat() and not out.stopped
    assert emitted + out.finish() == CALL + "\n<tool"
    assert not OutputText(tok, (), CALL_MARKERS).end_at_repeat()  # no guard without a tool-call constraint


def test_output_text_with_tool_calls_stops_at_a_repeated_call():
    tok = ByteTokenizer()
    out = OutputText(tok, ("Paris",), CALL_MARKERS, tool_calls=True)
    ids = tok.encode(CALL + "\n" + CALL + "\n")
    emitted = ""
    for i in ids:
        emitted += out.add(i)
        if out.stopped:
            break
    assert out.stopped and out.repeated_call and out.stop_string is None
    assert emitted == CALL and out.text == CALL and out.finish() == ""
    plain = OutputText(tok, (), CALL_MARKERS)  # no tool-call constraint: no guard
    assert "".join(plain.add(i) for i in ids) + plain.finish() == CALL + "\n" + CALL + "\n"
    assert not plain.stopped and not plain.repeated_call


@pytest.mark.slow
def test_smollm2_tokenizer_streams_exactly_its_full_decode():
    """Byte-level BPE of the real model: deltas concatenate to ``decode(all ids)`` and never hold U+FFFD."""
    tok = smollm2_checkpoint().tokenizer
    text = "Prefix caching: café, 日本語, emoji 😀🚆, math ∑x² and code `f(x) -> y`.\n" * 3
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    rng = random.Random(1)
    for _ in range(20):
        rand = [rng.randrange(0, tok.vocab_size) for _ in range(30)]
        deltas = stream(IncrementalDetokenizer(tok), rand)
        full = tok.decode(rand)
        if "\ufffd" not in full:
            assert "".join(deltas) == full
