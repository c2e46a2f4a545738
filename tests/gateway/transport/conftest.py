"""Fixtures of the transport tests: ``fleet``, three stub replicas on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.fleet.replica import StubReplica
from tests.gateway.transport.fleet_helpers import FAST


@pytest.fixture
async def fleet() -> AsyncIterator[list[StubReplica]]:
    """Three stub replicas (r0, r1, r2) on loopback with fast simulated engine timing."""
    replicas = [StubReplica(f"r{i}", 50_000, FAST) for i in range(3)]
    for r in replicas:
        await r.start()
    yield replicas
    for r in replicas:
        await r.kill()
