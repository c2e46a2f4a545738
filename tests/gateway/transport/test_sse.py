"""SSE encoding and the one parser (gateway.transport.sse), against the recorded OpenAI and Anthropic
streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.core.event_stream import DONE, encode_event
from gateway.transport.sse import LineSplitter, SSEEvent, SSEParser, iter_sse, parse_sse

FIXTURES = Path(__file__).parents[1] / "fixtures" / "protocol"


async def _chunks(chunks: list[bytes]):
    for chunk in chunks:
        yield chunk


async def parse_chunks(chunks: list[bytes]) -> list[SSEEvent]:
    return [event async for event in iter_sse(_chunks(chunks))]


def parse_bytewise(payload: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    events = []
    for i in range(len(payload)):
        events.extend(parser.feed(payload[i : i + 1]))
    return events + parser.close()


def test_encode_event_is_compact_json_and_blank_line():
    assert encode_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert encode_event({"x": None}, event="ping") == b'event: ping\ndata: {"x":null}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_encode_event_escapes_the_unicode_line_ends_of_splitlines_readers():
    """U+0085, U+2028 and U+2029 are line ends to ``str.splitlines`` (httpx's ``aiter_lines``): written as
    JSON escapes, the data line stays one line there and decodes to the same text; other non-ASCII stays
    UTF-8."""
    text = "a\x85b\u2028c\u2029d é"
    payload = encode_event({"t": text})
    assert payload == 'data: {"t":"a\\u0085b\\u2028c\\u2029d é"}\n\n'.encode()
    lines = payload.decode().splitlines()
    assert lines == [lines[0], ""] and json.loads(lines[0][len("data: ") :]) == {"t": text}
    assert parse_sse(payload)[0].json() == {"t": text}


def test_line_splitter_handles_every_line_end_and_split_characters():
    splitter = LineSplitter()
    lines = splitter.feed(b"a\r")  # CR at a chunk end may be the first half of CRLF
    lines += splitter.feed(b"\nb\rc\nd\xc3")  # ... it was; then CR alone, LF; a split UTF-8 character
    lines += splitter.feed(b"\xa9\n")
    lines += splitter.feed("e\u2028f".encode())  # U+2028 is not an SSE line end
    lines += splitter.flush()
    assert lines == ["a", "b", "c", "d\u00e9", "e\u2028f"]


def test_line_splitter_drops_one_byte_order_mark_and_replaces_bad_bytes():
    splitter = LineSplitter()
    lines = splitter.feed(b"\xef\xbb")  # a BOM split across chunks
    lines += splitter.feed(b"\xbfdata: \xff\n\xef\xbb\xbf\n")  # a later BOM is content
    assert lines == ["data: \ufffd", "\ufeff"]


def test_parser_handles_split_chunks_crlf_comments_and_multiline_data():
    payload = b': comment\r\nevent: message_start\r\ndata: {"a":\r\ndata: 1}\r\n\r\ndata: [DONE]\n\n'
    whole = parse_sse(payload)
    assert [(e.event, e.data) for e in whole] == [("message_start", '{"a":\n1}'), ("message", "[DONE]")]
    assert parse_bytewise(payload) == whole


def test_parser_keeps_multibyte_characters_split_across_chunks():
    payload = encode_event({"t": "안녕"})
    parser = SSEParser()
    events = parser.feed(payload[:12]) + parser.feed(payload[12:])
    assert events[0].json() == {"t": "안녕"}


def test_parser_dispatches_a_last_event_without_its_blank_line():
    for payload in (b"event: message_stop\ndata: {}", b"event: message_stop\ndata: {}\n", b"data: {}\r"):
        events = parse_sse(payload)
        assert [e.data for e in events] == ["{}"] and parse_bytewise(payload) == events
    assert parse_sse(b"event: ping\n\n") == []  # no data: nothing to dispatch
    assert parse_sse(b"event: orphan\n\ndata: x\n\n")[0].event == "message"  # the blank line reset the name


async def test_parser_ids_empty_data_and_unknown_fields():
    events = await parse_chunks(
        [b": keep-alive\n\nevent: ping\ndata: {}\n\ndata: a\ndata:b\nid: 7\nretry: 10\nfoo\n\n", b"data\n\n",
         b"id: bad\0id\ndata: tail"]
    )  # fmt: skip
    assert [(e.event, e.data, e.id) for e in events] == [
        ("ping", "{}", None),
        ("message", "a\nb", "7"),
        ("message", "", "7"),  # a bare "data" line is an empty data field
        ("message", "tail", "7"),  # an id with NUL is ignored
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "openai").glob("*.sse")))
async def test_recorded_openai_streams_parse_in_any_chunking_and_reencode_identically(name):
    raw = (FIXTURES / "openai" / name).read_bytes()
    whole = parse_sse(raw)
    assert await parse_chunks([raw[i : i + 7] for i in range(0, len(raw), 7)]) == whole
    assert whole[-1].data == "[DONE]"
    chunks = [e.json() for e in whole[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    reencoded = b"".join(encode_event(c) for c in chunks) + DONE
    assert parse_sse(reencoded) == whole


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "anthropic").iterdir()))
def test_recorded_anthropic_streams_parse(name):  # the .txt recordings end without a final newline
    raw = (FIXTURES / "anthropic" / name).read_bytes()
    events = parse_sse(raw)
    types = [json.loads(e.data)["type"] for e in events]
    assert [e.event for e in events] == types  # the event name repeats the data's type
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert parse_sse(raw.rstrip(b"\n")) == events  # the same without the final blank line
