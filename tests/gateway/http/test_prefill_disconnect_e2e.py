"""A client that hangs up while its prompt is being prefilled (before the first token: no byte of the answer has
been written yet) has its engine request aborted then, not once the prefill is done: on all three model
endpoints, streamed or not, over a real socket to the real gateway (uvicorn with ``prefixgate serve``'s
protocol) on the tiny checkpoint.

The engine's step thread is held inside the forward of the prompt's first chunk (``StepGate``) until the
request is gone from the engine, so the test knows the disconnect was acted on during the prefill without
timing anything: without the watch, the request would stay until its prefill finished, which the held step
never lets happen.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import pytest

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import RunningServer, write_config

BUDGET = 32  # max_num_batched_tokens: the prefill chunk


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    data = tiny_config_data(tiny_checkpoint, max_num_batched_tokens=BUDGET)
    running = RunningServer(write_config(tmp_path_factory.mktemp("cfg") / "prefixgate.yaml", data)).start()
    yield running
    running.stop()


def engine_of(server: RunningServer):
    return server.app.state.gateway.registry.get(TINY_MODEL).engine


class StepGate:
    """Wraps the engine's forward (``LLMEngine.run_step``, run by the step thread without the engine lock):
    records the tokens of each step and holds the first one until ``release``."""

    def __init__(self, core) -> None:
        self.core = core
        self.steps: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self._run = core.run_step
        core.run_step = self.run_step

    def run_step(self, plan):
        if plan.model_input is not None:
            self.steps.append(plan.sched.num_prefill_tokens)
            if len(self.steps) == 1:
                self.entered.set()
                self.release.wait(60)
        return self._run(plan)

    def remove(self) -> None:
        self.release.set()
        self.core.run_step = self._run


def body_of(path: str, text: str, stream: bool) -> dict:
    if path == "/v1/responses":
        return {"model": TINY_MODEL, "input": text, "max_output_tokens": 4, "stream": stream}
    return {
        "model": TINY_MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "stream": stream,
    }


def engine_requests(engine) -> int:
    with engine._cond:
        return len(engine.core.requests)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_client_leaving_during_prefill_aborts_the_engine_request_before_the_prefill_ends(
    server, path, stream, caplog
):
    engine = engine_of(server)
    text = f"{path} {stream} " + "omega sigma tau rho " * 20  # its own prompt: no prefix hit from other cases
    prompt_tokens = len(engine.render_chat([{"role": "user", "content": text}]))
    assert prompt_tokens > 8 * BUDGET  # precondition: a prefill of many chunks
    before = server.stats()["models"][TINY_MODEL]
    prefilled = engine.stats().prefill_tokens
    body = json.dumps(body_of(path, text, stream)).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"anthropic-version: 2023-06-01\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    gate = StepGate(engine.core)
    try:
        with caplog.at_level(logging.INFO, logger="prefixgate.request"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
                raw.sendall(head.encode() + body)
                assert gate.entered.wait(60)  # the first chunk's forward is running (and held there)
            aborted = False
            for _ in range(2000):  # polls while the forward is held: the abort needs no step to end
                if engine_requests(engine) == 0:
                    aborted = True
                    break
                gate.release.wait(0.005)
            held_stats = engine.stats()
            gate.release.set()
            doc = server.wait_blocks_released(TINY_MODEL)
            lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.request"]
    finally:
        gate.remove()
    assert aborted, "the engine request outlived its client's disconnect during the prefill"
    assert held_stats.blocks_used == 0 and held_stats.running == 0  # freed while the chunk still ran
    assert gate.steps == [BUDGET]  # the chunk running at the disconnect was the last of this prompt
    after = doc["models"][TINY_MODEL]
    assert after["blocks"]["used"] == 0 and after["engine"]["running"] == after["engine"]["waiting"] == 0
    assert engine.stats().prefill_tokens - prefilled == BUDGET
    assert after["aborted"] == before["aborted"] + 1 and after["requests"] == before["requests"]
    assert [line for line in lines if path in line and "status=499" in line], lines
    # the gateway goes on serving: the same prompt now, to its end
    answer = httpx.post(
        server.base_url + path,
        json=body_of(path, text, False),
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
