"""A client that closes its streams before the end is charged what was generated, through the real server
(the fresh-user trial bypassed a key's ``tpm: 300`` and its budget this way: 4 streams closed after 120 chunks,
counters unchanged, ``spend_usd: 0.0``): a key with ``tpm: 200`` that streamed 2 x (40 + 120) tokens and closed
each stream has its usage, spend and tpm bucket charged, so its next request is refused with 429 and
Retry-After (the bucket, 120 tokens in debt, refills at 3.3 a second: over 30 s of margin); each 499 line
carries the token counts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.backends.base import Backend
from gateway.config.loader import parse_config
from gateway.core.events import BackendEvent, Delta
from tests.gateway.server import ADMIN_TOKEN, RunningServer

KEY = "sk-streamer-0123456789"
PRICES = {"input": 1.0, "cached_input": 0.5, "output": 1000.0}
GENERATED = 120


class Endless(Backend):
    """Yields ``GENERATED`` one-word deltas (the first with the prompt's counts, as the embedded engine's), then
    generates on until the stream is closed. Counts words as tokens (``prompt_tokenizer``)."""

    name = "endless"

    class Words:
        name = "words"

        def encode(self, text: str) -> tuple[list[str], list[int]]:
            words = text.split()
            return words, list(range(len(words)))

    async def stream(self, request) -> AsyncIterator[BackendEvent]:
        yield Delta(" w", prompt_tokens=40, cached_tokens=0)
        for _ in range(GENERATED - 1):
            yield Delta(" w")
        await asyncio.Event().wait()

    def prompt_tokenizer(self) -> Words:
        return self.Words()


@pytest.fixture
def server():
    config = parse_config(
        {
            "rules": [],
            "models": [
                {"name": "endless", "backend": "openai", "base_url": "http://unused", "prices": PRICES}
            ],
            "keys": [{"name": "streamer", "key": KEY, "tenant": "acme", "tpm": 200, "budget_usd": 5.0}],
            "admin": {"token": ADMIN_TOKEN},
        }
    )
    running = RunningServer(config, backends={"endless": Endless()}).start()
    yield running
    running.stop()


def stream_and_leave(server: RunningServer) -> int:
    """Stream one answer, read every generated chunk, then close the connection; the chunks read."""
    body = {
        "model": "endless",
        "messages": [{"role": "user", "content": "go on"}],
        "stream": True,
        "max_tokens": 500,
    }
    chunks = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"content":" w"' in line.replace(": ", ":"):
                chunks += 1
                if chunks == GENERATED:
                    break
    return chunks


def wait_aborted(server: RunningServer, count: int) -> dict:
    """Poll ``/admin/stats`` until ``count`` requests were recorded aborted (the server notices a closed
    connection on its own schedule); the last document."""
    for _ in range(400):
        doc = server.stats()
        if doc["models"]["endless"]["aborted"] >= count:
            return doc
        time.sleep(0.025)
    raise AssertionError(f"{count} aborted requests were never recorded: {doc['models']['endless']}")


def test_streams_closed_by_the_client_are_charged_and_the_tpm_limit_holds(server, caplog):
    with caplog.at_level(logging.INFO, logger="prefixgate.request"):
        for stream in range(2):
            assert stream_and_leave(server) == GENERATED
            doc = wait_aborted(server, stream + 1)
    key = doc["keys"]["streamer"]
    assert (key["requests"], key["prompt_tokens"], key["completion_tokens"]) == (0, 80, 2 * GENERATED)
    assert key["spend_usd"] == pytest.approx(2 * (40 * 1.0 + GENERATED * 1000.0) / 1e6)
    assert key["reserved_usd"] == 0.0
    assert doc["tenants"]["acme"]["completion_tokens"] == 2 * GENERATED
    lines = [r.getMessage() for r in caplog.records if "status=499" in r.getMessage()]
    assert len(lines) == 2
    assert all(f"prompt_tokens=40 cached_tokens=0 completion_tokens={GENERATED}" in line for line in lines)
    # 2 x 160 tokens charged to a 200-token-per-minute bucket: the next request waits
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "endless", "messages": [{"role": "user", "content": "more"}], "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
