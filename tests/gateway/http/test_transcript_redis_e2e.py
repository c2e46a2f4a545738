"""The transcript memory in Redis, through the real server and the OpenAI SDK: two gateways sharing a Redis
agree on a conversation's history; a Redis that refuses connections or never answers costs no request (the
gateway goes on with its in-process store and counts the errors)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.gateway.conftest import BLOCK_SIZE, TINY_MODEL, tiny_config_data
from tests.gateway.http.test_history_e2e import SYSTEM, cached, conversation
from tests.gateway.server import RunningServer, write_config


@contextmanager
def gateway(tiny_checkpoint, tmp_path, redis_url: str, name: str) -> Iterator[RunningServer]:
    data = tiny_config_data(tiny_checkpoint)
    data["transcript"] = {"redis_url": redis_url, "redis_prefix": f"test:{uuid.uuid4().hex}:"}
    running = RunningServer(write_config(tmp_path / f"{name}.yaml", data)).start()
    try:
        yield running
    finally:
        running.stop()


def sdk(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def send(client: openai.OpenAI, messages, who: str, system: str = SYSTEM):
    messages = [{"role": "system", "content": system}, *messages[1:]]
    return client.chat.completions.create(
        model=TINY_MODEL,
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_headers={"x-prefixgate-tenant": who},
    ).usage


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A TCP server that accepts connections (the kernel's backlog) and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        listener.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_an_unreachable_or_silent_redis_costs_no_request(tiny_checkpoint, tmp_path, silent_redis, kind):
    url = f"redis://127.0.0.1:{closed_port()}/0" if kind == "refused" else silent_redis
    who = f"t-{uuid.uuid4().hex[:8]}"
    with gateway(tiny_checkpoint, tmp_path, url, kind) as server, sdk(server) as client:
        usages = [send(client, conversation(turn), who) for turn in range(1, 4)]
        doc = server.stats()
    assert all(u.completion_tokens >= 1 for u in usages)
    redis_stats = doc["transcript"]["redis"]
    assert redis_stats["errors"] >= 1 and redis_stats["writes"] == 0
    assert doc["errors"] == {}
    # the in-process store still keeps the history: turn 3 reused turn 2's transcript
    assert doc["transcript"]["memory"]["hits"] >= 1


def test_two_gateways_sharing_redis_agree_on_a_conversation(tiny_checkpoint, tmp_path):
    url = "redis://127.0.0.1:6379/0"
    who = f"t-{uuid.uuid4().hex[:8]}"
    data = tiny_config_data(tiny_checkpoint)
    prefix = f"test:{uuid.uuid4().hex}:"
    data["transcript"] = {"redis_url": url, "redis_prefix": prefix}
    first = RunningServer(write_config(tmp_path / "a.yaml", data)).start()
    second = RunningServer(write_config(tmp_path / "b.yaml", data)).start()
    try:
        timed = SYSTEM.replace("Current date: 2026-12-01", "Current time: 09:45:{second}")
        with sdk(first) as a, sdk(second) as b:
            send(a, conversation(1), who, timed.format(second="01"))
            usage_a = send(a, conversation(2), who, timed.format(second="02"))
            # the next turn arrives at the other gateway, with a new time: its memory comes from Redis
            send(b, conversation(2), who, timed.format(second="02"))  # warms b's own prefix cache
            usage_b = send(b, conversation(3), who, timed.format(second="03"))
        doc = second.stats()
    finally:
        first.stop()
        second.stop()
    assert doc["transcript"]["redis"]["redis_hits"] >= 1
    assert doc["transcript"]["memory"]["hits"] >= 1
    previous = usage_a.prompt_tokens
    assert cached(usage_b) >= previous - previous % BLOCK_SIZE - BLOCK_SIZE
