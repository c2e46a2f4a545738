"""``CacheExplanations`` in the backend's own prompt: the header's ``cached=`` is the count the backend reported
and a miss never starts inside it, also when the explainer's render carries a tools preamble the model's
template leaves out."""

from __future__ import annotations

from typing import Any

from engine.api import SamplingParams
from gateway.core.request import ChatRequest
from gateway.service.cache_explain import CacheExplanations
from gateway.service.canonicalize import Canonicalizer
from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "description": "look a word up", "parameters": {"type": "object"}},
    }
]
SYSTEM = "You answer questions about the fleet and its ships. " * 8


class ToolBlindTokenizer:
    """A model whose chat template ignores tools (the explainer then renders them as a preamble the model's
    prompt does not have): the cl100k layout without the tools."""

    name = "tool-blind"

    def __init__(self) -> None:
        self._inner = Cl100kTokenizer()

    def render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        return self._inner.render(messages, None, add_generation_prompt)

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        return self._inner.encode(text)


def request(question: str) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=TOOLS,
        params=SamplingParams(),
        tenant="t",
    )


def test_the_header_reports_the_backends_count_in_its_own_prompt():
    canonicalizer = Canonicalizer([])
    explanations = CacheExplanations(canonicalizer)
    tokenizer = ToolBlindTokenizer()
    first = request("what is the fleet ?")
    canonicalizer.apply(first)
    prepared = explanations.prepare(first, tokenizer)
    assert prepared.shift > 0  # the explainer's prompt starts with a tools preamble the model never saw
    model_prompt = tokenizer.encode(tokenizer.render(first.canonical.messages, None, True))[0]
    assert len(prepared.rendered.tokens) == prepared.shift + len(model_prompt)
    miss = explanations.explain(first, 0, tokenizer)
    assert (miss.cached, miss.cause, miss.offset) == (0, "cold", 0)
    # the model's cache served 48 tokens of its own prompt (its system prompt): the header says 48
    second = request("and its ships ?")
    canonicalizer.apply(second)
    e = explanations.explain(second, 48, tokenizer)
    assert e.cached == 48 and e.header_value().startswith("cached=48; ")
    assert not e.miss or e.offset >= 48


def test_an_upstreams_count_beyond_the_explainers_own_prompt_is_reported_as_sent():
    """Before: an OpenAI-compatible upstream (another tokenizer) reported 112 cached tokens of a prompt that
    counts fewer in ``cl100k_base``; the header said the clamped figure (104) while the answer's usage said 112.
    The header is token-exact to the backend's report; the explanation itself is a hit."""
    canonicalizer = Canonicalizer([])
    explanations = CacheExplanations(canonicalizer)
    first = request("what is the fleet ?")
    canonicalizer.apply(first)
    explanations.explain(first, 0)
    second = request("what is the fleet ?")
    canonicalizer.apply(second)
    prompt = len(explanations.prepare(second).rendered.tokens)
    e = explanations.explain(second, prompt + 9)  # the upstream's own count: more tokens than cl100k's
    assert e.cached == prompt + 9 and e.header_value() == f"cached={prompt + 9}; miss=none"
