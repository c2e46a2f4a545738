"""Volatile text in a system prompt, end to end through ``/v1/messages`` (the Anthropic SDK) over the embedded
tiny model: the default rules hoist a ``Current date:`` line behind the stable prefix, so a new date still
reads the system prompt from the prefix cache; with rules off the changed line breaks the prefix."""

from __future__ import annotations

import anthropic
import pytest
from tokenizers import Tokenizer

from tests.gateway.conftest import TINY_MODEL

STABLE = (
    "you are the {tag} model of the prefix cache test . answer every question about the capital of france , "
    "the quick brown fox and the lazy dog in one short answer . each answer names the document and the block "
    "table it used , and what is the key value of the query head in the attention layer . "
)


def system_text(tag: str, date: str) -> str:
    """A system prompt that starts with a date line (the worst place for a prefix cache) then stable text."""
    return f"Current date: {date}\n" + STABLE.format(tag=tag) * 2


def system_param(text: str, shape: str):
    return text if shape == "string" else [{"type": "text", "text": text}]


def ask(ant: anthropic.Anthropic, system, stream: bool, rules: str = "on"):
    kwargs = dict(
        model=TINY_MODEL,
        max_tokens=2,
        system=system,
        messages=[{"role": "user", "content": "what is the capital of france ?"}],
        extra_headers={"x-prefixgate-rules": rules},
    )
    if not stream:
        return ant.messages.create(**kwargs).usage
    with ant.messages.stream(**kwargs) as events:
        return events.get_final_message().usage


@pytest.mark.parametrize(("shape", "stream"), [("string", False), ("blocks", True)])
def test_a_new_date_in_the_system_prompt_reads_the_system_prompt_from_cache(
    server, tiny_checkpoint, shape, stream
):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    tag = f"{shape} volatile"
    texts = [system_text(tag, date) for date in ("2025-05-14", "2025-05-15", "2025-05-16")]
    system_tokens = len(tokenizer.encode(texts[1], add_special_tokens=False).ids)
    assert 150 <= system_tokens <= 350  # long enough that 90 % is more than rounding to a 16-token block

    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        first = ask(ant, system_param(texts[0], shape), stream)
        second = ask(ant, system_param(texts[1], shape), stream)
        unhoisted = ask(ant, system_param(texts[2], shape), stream, rules="off")

    assert first.cache_read_input_tokens < system_tokens // 2  # a new system prompt: nothing much cached
    assert second.cache_read_input_tokens >= 0.9 * system_tokens
    whole = second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens
    assert whole == first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens
    # without the rules the changed first line ends the shared prefix after a block or two
    assert unhoisted.cache_read_input_tokens < system_tokens // 4
