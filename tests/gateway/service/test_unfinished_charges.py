"""What a request is charged when it ends before its ``Finish`` (cancelled, or failed mid-stream), and the
cost a request reserves against its key's budget: through ``gateway.service.pipeline`` with scripted backends
and a real ``Gateway`` (no server).

- A cancelled stream is charged its prompt and the tokens generated until then: the key's and tenant's usage
  counters, the tpm bucket (the next request is refused), the spend and the model's cost; its 499 log line
  carries the counts; a second close charges nothing more. A request that finished is charged once, whatever
  closes after. A mid-stream failure is charged too (prompt estimated locally when the backend said nothing).
- Concurrent requests reserve their estimate (prompt at the input price + max_tokens at the output price): the
  ones that would pass the budget are refused up front (429 ``insufficient_quota``), so spend stays within it;
  every reservation is released when its request ends (finished, cancelled, failed to open).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from gateway.backends.base import Backend
from gateway.config.loader import parse_config
from gateway.core.errors import QuotaExceededError, RateLimitError, UpstreamError
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish
from gateway.core.request import ChatRequest
from gateway.http.app import create_app
from gateway.protocols.openai.parse import parse_chat_request
from gateway.service.gateway import Gateway
from gateway.service.pipeline import OpenedStream, open_stream
from gateway.service.usage_estimate import estimate_prompt_tokens

MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_ESTIMATE = estimate_prompt_tokens(parse_chat_request({"model": "m", "messages": MESSAGES}, {}))
"""The local estimate of the prompt (cl100k over the messages' JSON): reserved, and charged when the backend
said nothing of the prompt."""
PRICES = {"input": 1.0, "cached_input": 0.5, "output": 1000.0}
"""USD per million tokens: one output token costs 0.001 USD, one input token 0.000001 USD."""


class WordTokenizer:
    """A model tokenizer whose tokens are words (exact counts in tests)."""

    name = "words"

    def encode(self, text: str) -> tuple[list[str], list[int]]:
        words = text.split()
        return words, list(range(len(words)))


class Scripted(Backend):
    """Yields ``script`` (raising its exceptions); then, without a ``Finish`` in it, waits until ``go`` is set
    (a generation the client leaves before its end). ``tokenizer``: the model's own (None: an upstream)."""

    def __init__(self, name: str, script: list, tokenizer: WordTokenizer | None = None) -> None:
        self.name = name
        self.script = script
        self.tokenizer = tokenizer
        self.go = asyncio.Event()

    async def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Finish):
                await self.go.wait()
            yield item
        await asyncio.Event().wait()  # generating on: only a close ends it

    def prompt_tokenizer(self) -> WordTokenizer | None:
        return self.tokenizer


def gateway_of(backends: dict[str, Backend], **limits) -> Gateway:
    config = parse_config(
        {
            "rules": [],
            "models": [
                {"name": name, "backend": "openai", "base_url": "http://unused", "prices": PRICES}
                for name in backends
            ],
            "keys": [{"name": "k", "key": "sk-k-0123456789", "tenant": "acme", **limits}],
        }
    )
    return create_app(config, backends=backends).state.gateway


def chat(gateway: Gateway, model: str, max_tokens: int = 200) -> ChatRequest:
    """A keyed request admitted as ``gateway.http.auth.authorize`` admits it."""
    request = parse_chat_request({"model": model, "messages": MESSAGES, "max_tokens": max_tokens}, {})
    key = gateway.keys.lookup("sk-k-0123456789")
    request.client_key, request.tenant, request.request_id = key.name, key.tenant, "req-1"
    gateway.clients.admit(key, request.tenant)
    return request


async def drain(opened: OpenedStream, events: int) -> None:
    """Take ``events`` events of the stream, then close it (the client left)."""
    stream = opened.events()
    for _ in range(events):
        await anext(stream)
    await stream.aclose()


def usage_of(gateway: Gateway, scope: str, name: str) -> tuple[int, int, int, int]:
    doc = gateway.stats_snapshot()[scope][name]
    return doc["requests"], doc["prompt_tokens"], doc["cached_tokens"], doc["completion_tokens"]


async def test_a_cancelled_stream_is_charged_its_prompt_and_generated_tokens_once(caplog):
    script = [Delta(" w", prompt_tokens=10, cached_tokens=4)] + [Delta(" w")] * 119  # 120 generated tokens
    gateway = gateway_of({"m": Scripted("m", script, WordTokenizer())}, tpm=100)
    request = chat(gateway, "m")
    opened = await open_stream(gateway, request, "/v1/chat/completions", 0.0)
    with caplog.at_level(logging.INFO, logger="prefixgate.request"):
        await drain(opened, 120)
        await opened.aclose()  # closed again (the HTTP layer's own close): charged once
    assert usage_of(gateway, "keys", "k") == (0, 10, 4, 120)
    assert usage_of(gateway, "tenants", "acme") == (0, 10, 4, 120)
    spend = (6 * 1.0 + 4 * 0.5 + 120 * 1000.0) / 1e6
    doc = gateway.stats_snapshot()
    assert doc["keys"]["k"]["spend_usd"] == pytest.approx(spend)
    assert doc["tenants"]["acme"]["spend_usd"] == pytest.approx(spend)
    model = doc["models"]["m"]
    assert (model["requests"], model["aborted"], model["completion_tokens"]) == (0, 1, 0)  # as told: none
    assert model["output_cost_usd"] == pytest.approx(0.12)
    lines = [r.getMessage() for r in caplog.records if "status=499" in r.getMessage()]
    assert len(lines) == 1 and "prompt_tokens=10 cached_tokens=4 completion_tokens=120" in lines[0]
    # 130 tokens charged to a 100-token-per-minute bucket: the next request waits
    with pytest.raises(RateLimitError) as caught:
        chat(gateway, "m")
    assert caught.value.code == "rate_limit_exceeded" and caught.value.retry_after_s > 0


async def test_a_finished_request_closed_afterwards_is_charged_once_and_a_held_finish_counts_as_usage():
    usage = BackendUsage(prompt_tokens=7, completion_tokens=3, cached_tokens=0, counted_by="upstream")
    done = Scripted("done", [Delta(" a"), Delta(" b c"), Finish("stop", usage)], WordTokenizer())
    done.go.set()
    gateway = gateway_of({"done": done})
    opened = await open_stream(gateway, chat(gateway, "done"), "/v1/chat/completions", 0.0)
    events = [event async for event in opened.events()]
    assert isinstance(events[-1], Finish)
    await opened.aclose()
    assert usage_of(gateway, "keys", "k") == (1, 7, 0, 3)
    assert gateway.stats_snapshot()["models"]["done"]["aborted"] == 0

    # the backend finished before the client took anything (its Finish is the first event), then it left
    only = Scripted("only", [Finish("stop", usage)])
    only.go.set()
    gateway = gateway_of({"only": only})
    opened = await open_stream(gateway, chat(gateway, "only"), "/v1/chat/completions", 0.0)
    await opened.aclose()
    await opened.aclose()
    assert usage_of(gateway, "keys", "k") == (0, 7, 0, 3)


async def test_a_mid_stream_failure_is_charged_with_a_local_prompt_estimate():
    backend = Scripted("fails", [Delta(" a"), Delta(" b"), UpstreamError("upstream went away")])
    gateway = gateway_of({"fails": backend})
    request = chat(gateway, "fails")
    opened = await open_stream(gateway, request, "/v1/chat/completions", 0.0)
    items = [item async for item in opened.guarded_events(lambda error: b"error")]
    assert items[-1] == b"error"
    prompt = PROMPT_ESTIMATE  # the upstream said nothing of the prompt before it failed
    assert prompt == estimate_prompt_tokens(request) > 0
    assert usage_of(gateway, "keys", "k") == (0, prompt, 0, 2)  # " a b": 2 cl100k tokens
    doc = gateway.stats_snapshot()
    assert doc["keys"]["k"]["spend_usd"] == pytest.approx((prompt * 1.0 + 2 * 1000.0) / 1e6)
    assert doc["errors"] == {"502": 1} and doc["models"]["fails"]["aborted"] == 0


async def test_concurrent_requests_reserve_their_estimate_and_cannot_overshoot_the_budget():
    # each request may cost 10 output tokens (0.01 USD) plus its prompt: four fit in 0.05 USD, six do not
    usage = BackendUsage(prompt_tokens=10, completion_tokens=10, counted_by="upstream")
    backend = Scripted("m", [Delta(" w"), Finish("length", usage)])
    gateway = gateway_of({"m": backend}, budget_usd=0.05)
    refused: list[QuotaExceededError] = []

    async def one() -> None:
        try:
            opened = await open_stream(
                gateway, chat(gateway, "m", max_tokens=10), "/v1/chat/completions", 0.0
            )
        except QuotaExceededError as error:
            refused.append(error)
            return
        async for _ in opened.events():
            pass

    tasks = [asyncio.create_task(one()) for _ in range(6)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    key = gateway.stats_snapshot()["keys"]["k"]
    assert len(refused) == 2 and key["rate_limited"] == 2
    assert key["reserved_usd"] == pytest.approx(4 * (0.01 + PROMPT_ESTIMATE / 1e6))
    assert all(e.status_code == 429 and e.code == "insufficient_quota" for e in refused)
    assert all(e.openai_body()["error"]["type"] == "insufficient_quota" for e in refused)
    backend.go.set()
    await asyncio.gather(*tasks)
    key = gateway.stats_snapshot()["keys"]["k"]
    assert key["requests"] == 4 and key["reserved_usd"] == 0.0
    assert key["spend_usd"] == pytest.approx(4 * (10 * 1.0 + 10 * 1000.0) / 1e6)
    assert key["spend_usd"] <= 0.05


async def test_a_reservation_is_released_when_the_request_is_cancelled_or_fails_to_open():
    gateway = gateway_of(
        {
            "m": Scripted("m", [Delta(" w", prompt_tokens=10)] + [Delta(" w")] * 2, WordTokenizer()),
            "early": Scripted("early", [UpstreamError("no replica")]),
        },
        budget_usd=1.0,
    )
    opened = await open_stream(gateway, chat(gateway, "m", max_tokens=100), "/v1/chat/completions", 0.0)
    assert gateway.stats_snapshot()["keys"]["k"]["reserved_usd"] == pytest.approx(0.1 + PROMPT_ESTIMATE / 1e6)
    await drain(opened, 3)
    key = gateway.stats_snapshot()["keys"]["k"]
    assert key["reserved_usd"] == 0.0 and key["spend_usd"] == pytest.approx((10 + 3 * 1000.0) / 1e6)
    with pytest.raises(UpstreamError):
        await open_stream(gateway, chat(gateway, "early"), "/v1/chat/completions", 0.0)
    assert gateway.stats_snapshot()["keys"]["k"]["reserved_usd"] == 0.0
    # an estimate larger than the budget left is refused before the backend is asked
    with pytest.raises(QuotaExceededError) as caught:
        await open_stream(gateway, chat(gateway, "m", max_tokens=1000), "/v1/chat/completions", 0.0)
    assert f"may cost up to {1.0 + PROMPT_ESTIMATE / 1e6:.6f} USD" in caught.value.message
    assert gateway.stats_snapshot()["keys"]["k"]["rate_limited"] == 1
