"""Fixtures of the tier tests: a tiny KV layout, real diskcache dirs, the machine's Redis with a unique key
prefix per test (removed afterwards), a private ``redis-server`` that tests may stop, restart or cap, and a
fake clock."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.entry import KVLayout

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def counters() -> TierCounters:
    return TierCounters()


@pytest.fixture
def layout() -> KVLayout:
    """2 layers, 4-token blocks, 2 KV heads of dim 8, fp32: 512 bytes of KV per block."""
    return KVLayout("tiny-model@abc", "float32/DenseWeight", "float32", 4, 2, 2, 8)


@pytest.fixture
def redis_prefix():
    """A unique key prefix on the machine's Redis; every key under it is deleted after the test."""
    prefix = f"pgtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for k in client.scan_iter(match=f"{prefix}:*", count=500):
        client.delete(k)
    client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A ``redis-server`` of our own on a free port (stoppable, restartable, cappable)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        for _ in range(100):
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()
