"""Shared fixtures: one tiny random checkpoint and one real gateway serving it, for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.checkpoints import make_tiny_hf_llama
from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.upstream_helpers import httpcore_client

TINY_MODEL = "tiny"
BLOCK_SIZE = 16
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama as a Hugging Face folder (context 512 tokens, vocabulary 384)."""
    return make_tiny_hf_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=0)


def tiny_config_data(checkpoint: Path, **engine) -> dict:
    """A config serving ``checkpoint`` as ``tiny`` (blocks of 16, 128 of them, 8 sequences) with ``engine``'s
    settings over these. ``idle_reply_prefill`` is off unless ``engine`` turns it on: with it, a reply's next
    turn is prefilled in the background as soon as the reply is out, so a test sending that turn at once would
    find more or less of it cached depending on timing; the tests asserting exact counts of other features
    keep the next turn computing the reply itself, and tests/gateway/http/test_idle_reply_prefill_e2e.py
    runs it on, waiting for the engine to be idle before each next turn."""
    engine = {"idle_reply_prefill": False, **engine}
    return {
        "server": {"max_body_bytes": MAX_BODY_BYTES},
        "admin": {"token": ADMIN_TOKEN},
        "rules": ["default"],
        "models": [
            {
                "name": TINY_MODEL,
                "backend": "embedded",
                "path": str(checkpoint),
                "engine": {
                    "block_size": BLOCK_SIZE,
                    "num_blocks": 128,
                    "max_batch": 8,
                    "device": "cpu",
                    **engine,
                },
            }
        ],
    }


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory) -> Iterator[RunningServer]:
    """The real gateway (uvicorn, default rules, admin token) over the tiny checkpoint."""
    config = write_config(
        tmp_path_factory.mktemp("config") / "prefixgate.yaml", tiny_config_data(tiny_checkpoint)
    )
    running = RunningServer(config).start()
    yield running
    running.stop()


@pytest.fixture
def client(server):
    """The official OpenAI SDK pointed at the gateway."""
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def generated_kv_server(tiny_checkpoint, tmp_path_factory) -> Iterator[RunningServer]:
    """``server`` with ``engine.cache_generated_kv: true``: replies' KV cached too (the opt-in whose next turns
    reuse the previous reply: served turns, reply edits explained as ``history_rewritten``)."""
    config = write_config(
        tmp_path_factory.mktemp("config") / "prefixgate.yaml",
        tiny_config_data(tiny_checkpoint, cache_generated_kv=True),
    )
    running = RunningServer(config).start()
    yield running
    running.stop()


@pytest.fixture
def generated_kv_client(generated_kv_server):
    """The official OpenAI SDK pointed at ``generated_kv_server``."""
    import openai

    with openai.OpenAI(
        base_url=f"{generated_kv_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as sdk:
        yield sdk


@pytest.fixture
def respx_upstreams(monkeypatch):
    """Gateways and backends made in the test share an httpcore client for their upstream calls, so that
    ``respx`` (which intercepts httpcore) can mock the upstreams."""
    monkeypatch.setattr("gateway.transport.upstream_http.make_client", httpcore_client)
