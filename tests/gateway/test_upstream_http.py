"""Shared upstream plumbing: redaction, backoff, Retry-After, SSE line splitting and parsing (gateway.upstream_http)."""

from __future__ import annotations

import email.utils
import json
from pathlib import Path

import pytest

from gateway.upstream_http import (
    REDACTED,
    LineSplitter,
    RetryPolicy,
    iter_sse,
    parse_retry_after,
    redact,
    redact_url,
)

FIXTURES = Path(__file__).parent / "fixtures" / "protocol"


async def _lines(chunks: list[bytes]):
    splitter = LineSplitter()
    for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.flush():
        yield line


async def parse(chunks: list[bytes]):
    return [event async for event in iter_sse(_lines(chunks))]


def test_redact_removes_known_secrets_and_key_shapes():
    secret = "my-very-secret-upstream-key"
    text = (
        f"failed with key {secret}; Incorrect API key provided: sk-proj-abcdefghijklmnop1234; "
        "anthropic sk-ant-api03-AbCdEf123456; Authorization: Bearer abc.def-ghi_jkl; "
        'url https://x/v1?api_key=zzzzzzzz123 {"x-api-key": "qwertyuiop"}'
    )
    out = redact(text, [secret])
    for leaked in (
        secret,
        "sk-proj-abcdefghijklmnop1234",
        "sk-ant-api03",
        "abc.def-ghi_jkl",
        "zzzzzzzz123",
        "qwertyuiop",
    ):
        assert leaked not in out
    assert out.count(REDACTED) == 6
    assert "Bearer [REDACTED]" in out and "api_key=[REDACTED]" in out


def test_redact_keeps_ordinary_text():
    text = "upstream http://vllm-0:8000/v1 answered 503: model is loading (tokens: 1024, sk=3)"
    assert redact(text, ["", "abc"]) == text  # short or empty secrets are not redacted (would eat words)


def test_redact_url_drops_credentials_and_query():
    assert redact_url("https://user:pw@host:8443/v1?key=123#x") == "https://host:8443/v1"


def test_backoff_is_full_jitter_capped_and_respects_retry_after():
    policy = RetryPolicy(retries=5, backoff_base_s=0.5, backoff_max_s=4.0)
    assert [policy.delay(a, rng=lambda: 1.0) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.delay(3, rng=lambda: 0.0) == 0.0
    assert policy.delay(0, retry_after_s=7.0, rng=lambda: 1.0) == 7.0


def test_parse_retry_after_seconds_and_http_date():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    now = 1_700_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 20, usegmt=True), now=now) == pytest.approx(20.0)
    assert parse_retry_after(email.utils.formatdate(now - 20, usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_line_splitter_handles_every_line_end_and_split_characters():
    splitter = LineSplitter()
    lines = splitter.feed(b"a\r")  # CR at a chunk end may be the first half of CRLF
    lines += splitter.feed(b"\nb\rc\nd\xc3")  # ... it was; then CR alone, LF; a split UTF-8 character
    lines += splitter.feed(b"\xa9\n")
    lines += splitter.feed("e\u2028f".encode())  # U+2028 is not an SSE line end
    lines += splitter.flush()
    assert lines == ["a", "b", "c", "d\u00e9", "e\u2028f"]


async def test_sse_parses_comments_multiline_data_ids_and_unterminated_tail():
    events = await parse(
        [b": keep-alive\n\nevent: ping\ndata: {}\n\ndata: a\ndata:b\nid: 7\n\n", b"data: tail"]
    )
    assert [(e.event, e.data, e.id) for e in events] == [
        ("ping", "{}", None),
        ("message", "a\nb", "7"),
        ("message", "tail", "7"),
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "openai").glob("*.sse")))
async def test_recorded_openai_streams_parse_chunk_by_chunk(name):
    raw = (FIXTURES / "openai" / name).read_bytes()
    whole = await parse([raw])
    by_byte = await parse([raw[i : i + 7] for i in range(0, len(raw), 7)])
    assert [e.data for e in whole] == [e.data for e in by_byte]
    assert whole[-1].data == "[DONE]"
    chunks = [json.loads(e.data) for e in whole[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "anthropic").iterdir()))
async def test_recorded_anthropic_streams_parse(name):
    events = await parse([(FIXTURES / "anthropic" / name).read_bytes()])
    types = [json.loads(e.data)["type"] for e in events]
    assert [e.event for e in events] == types  # the event name repeats the data's type
    assert types[0] == "message_start" and types[-1] == "message_stop"
