"""``gateway.service.usage_estimate``: the output an unfinished request is charged (per choice, tool-call
fragments included, compacted as it grows), the prompt's counts (the backend's when given, else the local
estimate), a held ``Finish`` winning, and the reservation's arithmetic."""

from __future__ import annotations

from gateway.config.price_table import ModelPrices
from gateway.core.events import BackendUsage, Delta, Finish
from gateway.protocols.openai.parse import parse_chat_request
from gateway.service.usage_estimate import (
    DEFAULT_OUTPUT_TOKENS,
    GeneratedText,
    estimate_prompt_tokens,
    output_cap,
    reservation_usd,
    unfinished_usage,
)


class Words:
    name = "words"

    def encode(self, text: str) -> tuple[list[str], list[int]]:
        return text.split(), []


def request(**body):
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, {})


def test_choices_and_tool_call_fragments_are_counted_and_a_long_answer_is_compacted():
    generated = GeneratedText()
    generated.add(Delta(" one", prompt_tokens=30, cached_tokens=16))
    generated.add(Delta(" two", index=1))
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    generated.add(Delta(tool_calls=[call]))
    generated.add(Delta(tool_calls=[{"index": 0, "function": {"arguments": " city paris"}}]))
    for _ in range(GeneratedText.COMPACT_PIECES * 2):
        generated.add(Delta(" w", index=1))
    usage = unfinished_usage(request(), generated, tokenizer=Words())
    # choice 0: "one" + "lookup" + "city paris" = 4 words; choice 1: "two" + 512 x "w"
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (30, 16, 4 + 1 + 512)
    assert usage.counted_by == "words"
    assert len(generated._pieces[1]) < GeneratedText.COMPACT_PIECES  # joined as it grew


def test_without_prompt_counts_the_prompt_is_the_local_estimate_and_a_held_finish_wins():
    chat = request()
    held = Delta(" a b")  # the first event, never handed out
    usage = unfinished_usage(chat, GeneratedText(), held)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (
        estimate_prompt_tokens(chat),
        0,
        2,
    )
    assert unfinished_usage(chat, GeneratedText(), held, prompt_estimate=99).prompt_tokens == 99
    final = BackendUsage(prompt_tokens=5, completion_tokens=1, counted_by="upstream")
    assert unfinished_usage(chat, GeneratedText(), Finish("stop", final)) is final


def test_the_reservation_prices_the_prompt_as_input_and_the_output_cap_as_output():
    prices = ModelPrices(
        "p", "m", input=2.0, cache_read=0.2, cache_write={}, retentions={}, default_retention=""
    )
    assert output_cap(request(max_tokens=10)) == 10
    assert output_cap(request()) == DEFAULT_OUTPUT_TOKENS
    assert output_cap(request(max_tokens=10, n=3)) == 30
    assert reservation_usd(prices, 1_000_000, 10) == 2.0  # no output price: output costs nothing
    priced = ModelPrices(
        "p", "m", input=2.0, cache_read=0.2, cache_write={}, retentions={}, default_retention="", output=8.0
    )
    assert reservation_usd(priced, 500_000, 250_000) == 1.0 + 2.0
