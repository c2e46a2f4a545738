"""``DELETE /admin/cache?prefix_key=`` then the conversations under that prefix, through the OpenAI SDK: each one
is cached again by its next request, as before the delete.

Before (a trial with the official SDKs): two conversations shared a system prompt, so one prefix key and one row.
After the delete, the conversation that was not the row's stayed at the system prompt's hit however often it was
resent (32 of 73 tokens, 72 before): its own blocks, chained on the dropped ones, were still in the pool, where no
lookup reached them and their hashes kept the same blocks computed again out of the cache."""

from __future__ import annotations

import httpx
import openai

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS

SYSTEM = "You are the help desk of a small railway. Answer questions about tickets and refunds in one line."
QUESTIONS = (
    "I booked a train to the coast next month; how many suitcases does my basic fare include, please?",
    "My connecting train was cancelled yesterday evening; am I owed a full refund or only a voucher?",
)


def cached(client: openai.OpenAI, question: str) -> int:
    completion = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_headers={"x-prefixgate-tenant": "drop-test"},
    )
    return completion.usage.prompt_tokens_details.cached_tokens


def test_every_conversation_under_a_dropped_prefix_is_cached_again(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        before = {}
        for question in QUESTIONS:
            cached(client, question)
            before[question] = cached(client, question)
        rows = httpx.get(
            f"{server.base_url}/admin/cache",
            params={"tenant": "drop-test"},
            headers=ADMIN_HEADERS,
            timeout=30,
        ).json()["data"]
        assert len(rows) == 1  # one system prompt, one prefix key
        dropped = httpx.delete(
            f"{server.base_url}/admin/cache",
            params={"prefix_key": rows[0]["prefix_key"]},
            headers=ADMIN_HEADERS,
            timeout=30,
        )
        assert dropped.status_code == 200 and dropped.json()["dropped"]["prefixes"] == 1, dropped.text
        for question in QUESTIONS:
            cached(client, question)  # computes what the delete dropped
            assert cached(client, question) == before[question] > 0
