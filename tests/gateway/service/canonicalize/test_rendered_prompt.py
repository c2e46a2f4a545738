"""``render_canonical``'s segment boundaries: where the render of the messages before a boundary is a prefix of
the whole render, the boundary is that render's length, taken with one ``startswith`` instead of the binary
search of ``common_prefix_len``; the result is the search's, for requests the default rules shape (volatile
spans cut inside a message, documents, history, tools, content parts) and for every tokenizer layout."""

from __future__ import annotations

from typing import Any

import pytest

import gateway.service.canonicalize.rendered_prompt as rendered_prompt
from gateway.config.loader import parse_config
from gateway.http.app import create_app
from gateway.protocols.openai.parse import parse_chat_request
from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer, SmolLM2Tokenizer
from gateway.service.pipeline import canonicalize

SYSTEM = (
    "You are Atlas, the support assistant of Northwind Rail. Current date: 2026-12-01. Session id: "
    "4f9c2a7e-1b3d-4c5e-9a8b-7c6d5e4f3a2b. Answer questions about timetables and fares."
)
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I bring a bike?"}]},
    {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Can I bring a bike?"},
            {"role": "assistant", "content": "Yes, outside the peaks."},
            {"role": "user", "content": "And a dog?"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<document>Fares table 2026: zone A 3 EUR.</document>"},
                    {"type": "text", "text": "What does zone A cost?"},
                ],
            },
        ],
        "tools": [TOOL],
    },
    {"messages": [{"role": "user", "content": "Only a question, today is 2026-12-02."}]},
]


class NoPrefixText(str):
    """A render whose ``startswith`` always says no: ``render_canonical`` then takes the binary search for every
    boundary (the reference)."""

    def startswith(self, *args: Any) -> bool:  # type: ignore[override]
        return False


class SearchOnly:
    """``tokenizer`` whose renders are ``NoPrefixText``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer.name

    def render(self, *args: Any) -> str:
        return NoPrefixText(self.tokenizer.render(*args))

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode(str(text))


@pytest.fixture(scope="module")
def canonicals() -> list[Any]:
    config = parse_config(
        {"models": [{"name": "m", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}]}
    )
    gateway = create_app(config).state.gateway
    out = []
    for body in BODIES:
        request = parse_chat_request({"model": "m", **body}, {}, False)
        canonicalize(gateway, request)
        assert request.canonical is not None
        out.append(request.canonical)
    return out


@pytest.mark.parametrize("tokenizer", [Cl100kTokenizer, SmolLM2Tokenizer])
def test_boundaries_equal_the_binary_searchs(canonicals, tokenizer):
    tok = tokenizer()
    for canon in canonicals:
        fast = rendered_prompt.render_canonical(canon, tok)
        reference = rendered_prompt.render_canonical(canon, SearchOnly(tok))
        assert fast.text == reference.text
        assert fast.tokens == reference.tokens and fast.starts == reference.starts
        assert fast.segments == reference.segments
        assert fast.stable_tokens == reference.stable_tokens


def test_whole_message_boundaries_take_no_search(canonicals, monkeypatch):
    """The bench's request (a system prompt, a question) under cl100k: every boundary is a whole-message
    render, so the binary search never runs."""
    calls: list[int] = []
    search = rendered_prompt.common_prefix_len

    def counted(a: Any, b: Any) -> int:
        calls.append(1)
        return search(a, b)

    monkeypatch.setattr(rendered_prompt, "common_prefix_len", counted)
    rendered = rendered_prompt.render_canonical(canonicals[0], Cl100kTokenizer())
    assert [segment.name for segment in rendered.segments][-1] == "tail"
    assert calls == []


@pytest.mark.parametrize(
    "tools",
    [
        None,
        [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Look something up",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
        ],
    ],
)
def test_what_the_template_puts_before_a_first_user_message_is_not_its_tail(tools):
    """A fresh-user trial: with no system message, SmolLM2's template puts its default system prompt (or the
    tools' system message) before the question, but the question's segment was taken to start at token 0, so
    the question after the tools was called ``system`` and a new question ``system_changed``. The tail now
    starts at the question's own text; what comes before it is stable."""
    config = parse_config(
        {"models": [{"name": "m", "backend": "openai", "base_url": "http://127.0.0.1:9/v1"}]}
    )
    gateway = create_app(config).state.gateway
    question = "What is the capital of Peru?"
    body = {"model": "m", "messages": [{"role": "user", "content": question}]}
    if tools:
        body["tools"] = tools
    request = parse_chat_request(body, {}, False)
    canonicalize(gateway, request)
    rendered = rendered_prompt.render_canonical(request.canonical, SmolLM2Tokenizer())
    tail = rendered.segments[-1]
    assert tail.name == "tail" and [s.name for s in rendered.segments].count("tail") == 1
    assert rendered.text[rendered.starts[tail.start] :].startswith(question)
    assert rendered.stable_tokens == tail.start > 0  # the template's own part is stable


class RefusesAlone:
    """``SmolLM2Tokenizer`` whose template refuses a conversation of one message (as strict templates refuse one
    that does not alternate): the probe of where the first message's text starts cannot be made."""

    def __init__(self) -> None:
        self.inner = SmolLM2Tokenizer()
        self.name = self.inner.name

    def render(self, messages: list, tools: Any, add_generation_prompt: bool) -> str:
        if len(messages) == 1 and messages[0].get("content") in ("a", "b"):
            raise ValueError("the template refuses this conversation")
        return self.inner.render(messages, tools, add_generation_prompt)

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        return self.inner.encode(text)


def test_a_template_that_refuses_the_probe_leaves_the_tail_at_the_start():
    config = parse_config(
        {"models": [{"name": "m", "backend": "openai", "base_url": "http://127.0.0.1:9/v1"}]}
    )
    gateway = create_app(config).state.gateway
    request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {}, False)
    canonicalize(gateway, request)
    rendered = rendered_prompt.render_canonical(request.canonical, RefusesAlone())
    assert [s.name for s in rendered.segments] == ["tail"] and rendered.stable_tokens == 0  # as before
