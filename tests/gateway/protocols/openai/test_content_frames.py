"""``ContentChunkFrames``: a text-only chat chunk put together from its cached frame is the chunk
``encode_event(chat_chunk(...))`` writes, byte for byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import SamplingParams
from gateway.core.event_stream import encode_event
from gateway.core.request import ChatRequest
from gateway.protocols.openai.render import ContentChunkFrames, ResponseMeta, chat_chunk

TRICKY = [
    "",
    "Hello",
    ' "quoted" \\ back\\slash /',
    "line\nbreak\r\ttab\x00\x1f",
    "caf\u00e9 \u4e2d\u6587 \U0001f680",
    "\x85 \u2028 \u2029",
    "\ufdd0prefixgate-content-slot\ufdd0",
    "</script>&<>",
]


def meta(
    model: str = "smollm2", fingerprint: str | None = "fp_0123456789", request_id: str = "abc"
) -> ResponseMeta:
    request = ChatRequest(model=model, messages=[], params=SamplingParams(), request_id=request_id)
    return ResponseMeta(request, fingerprint)


def generic(m: ResponseMeta, text: str, index: int) -> bytes:
    return encode_event(chat_chunk(m, {"content": text}, index=index))


def test_tricky_texts_are_the_generic_chunk_byte_for_byte():
    for m in (meta(), meta(fingerprint=None), meta(model='we"ird/\u00e9\u2028', request_id="x\\y")):
        frames = ContentChunkFrames(m)
        for index in (0, 1, 7):
            for text in TRICKY:
                assert frames.content(text, index) == generic(m, text, index)


@settings(max_examples=300, deadline=None)
@given(text=st.text(), model=st.text(min_size=1), index=st.integers(0, 127))
def test_any_text_model_and_index_give_the_generic_chunk(text, model, index):
    m = meta(model=model)
    assert ContentChunkFrames(m).content(text, index) == generic(m, text, index)


def test_a_model_named_like_the_slot_takes_the_generic_path():
    m = meta(model="\ufdd0prefixgate-content-slot\ufdd0")
    frames = ContentChunkFrames(m)
    assert frames.content("hi") == generic(m, "hi", 0)
    assert frames._frames == {0: None}  # the slot's JSON string occurs twice in that chunk: no frame was cut
    inside = meta(model="a\ufdd0prefixgate-content-slot\ufdd0b")  # inside a name: not a whole JSON string
    assert ContentChunkFrames(inside).content("hi") == generic(inside, "hi", 0)


def test_a_frame_is_cut_once_per_choice_index():
    frames = ContentChunkFrames(meta())
    for text in ("a", "b", "c"):
        frames.content(text, 0)
        frames.content(text, 2)
    assert sorted(frames._frames) == [0, 2]
    head, tail = frames._frames[0]
    assert head.startswith(b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":')
    assert tail == b'},"logprobs":null,"finish_reason":null}]}\n\n'
