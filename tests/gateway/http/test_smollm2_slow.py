"""The real default model (SmolLM2-135M-Instruct, ``path: default``) behind the gateway, with the official openai
and anthropic SDKs, as a newcomer following README.md would use them."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gateway.config.schema import DEFAULT_MODEL_NAME
from tests.gateway.server import RunningServer, write_config

SYSTEM = (
    "You are a helpful assistant for a travel company. Answer in one short sentence. "
    "Our offices are in Paris, Lisbon and Seoul. Bookings can be changed up to 24 hours before departure. "
    "Refunds take five business days. Never invent prices; say that an agent will confirm them. "
    "Be polite, be brief, and do not use lists."
)


def _default_model_config(tmp_path):
    return write_config(
        tmp_path / "prefixgate.yaml",
        {
            "models": [
                {
                    "name": DEFAULT_MODEL_NAME,
                    "path": "default",
                    "engine": {"num_blocks": 256, "device": "cpu"},
                }
            ]
        },
    )


@pytest.mark.slow
def test_default_model_streams_and_caches_the_system_prompt(tmp_path):
    server = RunningServer(_default_model_config(tmp_path)).start(timeout_s=300)
    try:
        engine = server.app.state.gateway.registry.get(DEFAULT_MODEL_NAME).engine
        n_system = len(engine.tokenizer.encode(SYSTEM))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(question: str):
            stream = client.chat.completions.create(
                model=DEFAULT_MODEL_NAME,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage

        text, usage = ask("Where are your offices?")
        assert text.strip(), "the model answered nothing"
        assert usage.completion_tokens <= 24 and usage.prompt_tokens > n_system
        text2, usage2 = ask("How long do refunds take?")
        assert text2.strip()
        assert usage2.prompt_tokens_details.cached_tokens >= n_system // 16 * 16
        stats = server.stats()
        assert (
            stats["requests"] == 2
            and stats["cached_tokens"]
            == usage.prompt_tokens_details.cached_tokens + usage2.prompt_tokens_details.cached_tokens
        )
        # the idle reply prefills of both answers (the default config) hold blocks until they are done
        stats = server.wait_blocks_released(DEFAULT_MODEL_NAME)["models"][DEFAULT_MODEL_NAME]
        assert stats["blocks"]["used"] == 0 and stats["idle_prefills"] == 2
    finally:
        server.stop()


@pytest.mark.slow
def test_the_readme_anthropic_example_answers_greedily_and_reads_the_system_prompt_from_the_cache(tmp_path):
    """README's Anthropic example: the SDK at the server root, ``temperature`` through ``extra_body`` (anthropic
    2.x has no such argument), the same request twice: the same text, and the second reads all but its last
    token from the cache (``input_tokens`` counts the rest, as Anthropic's prompt caching does)."""
    server = RunningServer(_default_model_config(tmp_path)).start(timeout_s=300)
    try:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

        def ask():
            return client.messages.create(
                model=DEFAULT_MODEL_NAME,
                max_tokens=24,
                system=SYSTEM,
                messages=[{"role": "user", "content": "Where are your offices?"}],
                extra_body={"temperature": 0},
            )

        first, second = ask(), ask()
        assert first.content[0].text.strip() and second.content[0].text == first.content[0].text
        total = first.usage.input_tokens + first.usage.cache_read_input_tokens
        assert first.usage.cache_read_input_tokens == 0
        assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
        assert second.usage.cache_read_input_tokens == total - 1
    finally:
        server.stop()
