"""SSE encoding and parsing, against the recorded OpenAI streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.sse import DONE, SSEParser, encode_event, parse_sse

FIXTURES = Path("/work/shared/fixtures/protocol/openai")
if not FIXTURES.is_dir():  # a checkout without the shared folder next to it
    FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "protocol" / "openai"


def test_encode_event_is_compact_json_and_blank_line():
    assert encode_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert encode_event({"x": None}, event="ping") == b'event: ping\ndata: {"x":null}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_parser_handles_split_chunks_crlf_comments_and_multiline_data():
    payload = b': comment\r\nevent: message_start\r\ndata: {"a":\r\ndata: 1}\r\n\r\ndata: [DONE]\n\n'
    whole = parse_sse(payload)
    assert [(e.event, e.data) for e in whole] == [("message_start", '{"a":\n1}'), ("message", "[DONE]")]
    parser = SSEParser()
    split = []
    for i in range(len(payload)):
        split.extend(parser.feed(payload[i : i + 1]))
    assert split == whole


def test_parser_keeps_multibyte_characters_split_across_chunks():
    payload = encode_event({"t": "안녕"})
    parser = SSEParser()
    events = parser.feed(payload[:12]) + parser.feed(payload[12:])
    assert json.loads(events[0].data) == {"t": "안녕"}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.sse")))
def test_recorded_openai_streams_parse_and_reencode_identically(name):
    raw = (FIXTURES / name).read_bytes()
    events = parse_sse(raw)
    assert events[-1].data == "[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    reencoded = b"".join(encode_event(c) for c in chunks) + DONE
    assert parse_sse(reencoded) == events
