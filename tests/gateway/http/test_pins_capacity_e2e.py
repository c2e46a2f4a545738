"""Over HTTP: a pinned warm makes a prompt too big for what it leaves of the pool a 400 naming the pin, on the
chat and legacy completions faces (the latter calling it the prompt), and never a request waiting for good
with the queue behind it. Before (a burst trial): no answer, and every later request hung too."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.http.test_protocol_exact_e2e import assert_no_block_in_use
from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config

NUM_BLOCKS = 36  # 576 tokens (the context is 512); pins may hold 9 blocks


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    data = tiny_config_data(tiny_checkpoint, num_blocks=NUM_BLOCKS)
    running = RunningServer(write_config(tmp_path_factory.mktemp("cfg") / "prefixgate.yaml", data)).start()
    yield running
    running.stop()


def test_a_prompt_past_what_a_pin_leaves_is_a_400_and_the_queue_goes_on(server):
    warm = httpx.post(
        f"{server.base_url}/admin/cache/warm",
        json={"system": "You are the pin test. " * 8, "pin": True},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=60,
    )
    assert warm.status_code == 200, warm.text
    pinned = warm.json()["pinned_blocks"]
    assert pinned >= 5
    big = "alpha beta gamma delta " * 24  # fits the context (512) and the pool, not beside the pin
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": TINY_MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 1},
        timeout=60,
    )
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"{pinned} blocks pinned by warmed prefixes" in error["message"]
    legacy = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": TINY_MODEL, "prompt": big, "max_tokens": 1},
        timeout=60,
    )
    assert legacy.status_code == 400, legacy.text
    error = legacy.json()["error"]
    assert error["param"] == "prompt" and "messages" not in error["message"]
    small = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": TINY_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert small.status_code == 200, small.text
    dropped = httpx.delete(
        f"{server.base_url}/admin/cache",
        params={"prefix_key": warm.json()["prefix_key"]},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=60,
    )
    assert dropped.status_code == 200
    again = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": TINY_MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 1},
        timeout=60,
    )
    assert again.status_code == 200, again.text  # the pin dropped, the whole pool serves it
    assert_no_block_in_use(server)
