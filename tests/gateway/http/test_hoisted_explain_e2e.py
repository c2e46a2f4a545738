"""The miss explanation of conversations whose system prompt holds a value the rules hoist, through the real
server and the official SDKs over the embedded tiny model (both faces, streamed and not).

The trial: with a hoisted time in the system prompt, a conversation whose system prompt also changed said
``cached=25; miss=none`` (the previous turn had 87 tokens), or ``miss=cold; at=system:15``; a first turn whose
only change was the hoisted time said ``history_rewritten``; and a first user message resent as one text part
instead of a string lost the cache. Every test uses its own tenant."""

from __future__ import annotations

import json
import random
import uuid

import anthropic
import pytest

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.http.test_history_e2e import chat, header_fields

QUESTIONS = ("name a fruit .", "name a color .", "name a city .")


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _anthropic_turn(
    server, system: str, messages: list[dict], who: str, stream: bool
) -> tuple[int, int, str]:
    """(input tokens, cached tokens, header) of one Anthropic Messages request."""
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        kwargs = dict(
            model=TINY_MODEL,
            max_tokens=3,
            system=system,
            messages=messages,
            extra_headers={"x-prefixgate-tenant": who},
        )
        if stream:
            with ant.messages.with_streaming_response.create(stream=True, **kwargs) as raw:
                header = raw.headers.get("x-prefixgate-cache")
                lines = list(raw.iter_lines())
            usage = None
            for line in lines:
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("type") == "message_start":
                        usage = event["message"]["usage"]
            assert usage is not None
            return usage["input_tokens"], usage.get("cache_read_input_tokens") or 0, header
        raw = ant.messages.with_raw_response.create(**kwargs)
        usage = raw.parse().usage
        return usage.input_tokens, usage.cache_read_input_tokens or 0, raw.headers.get("x-prefixgate-cache")


SYSTEMS = {
    # the system prompt changes past its first cache unit, and at its very end inside the first unit
    "late": "You are the terse assistant of the hoist explanation test {r}. Current time: 2026-12-03 05:0{t}:1{t}. "
    "Variant {t} of the rules.",
    "early": "Be terse. Current time: 2026-12-03 05:0{t}:1{t}. Mode {t}",
    # inside the first cache unit and at the system prompt's end: the conversation after it re-converges
    "first-unit": "T{t}. Current time: 2026-12-03 05:0{t}:1{t}.",
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", sorted(SYSTEMS))
def test_a_changed_system_prompt_with_a_hoisted_value_is_system_changed(client, stream, where):
    who = tenant()
    r = random.randrange(10**9)
    history: list[dict] = []
    previous = None
    for t, question in enumerate(QUESTIONS):
        system = SYSTEMS[where].format(r=r, t=t)
        messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
        usage, header = chat(client, messages, who, stream=stream)
        fields = header_fields(header)
        if previous is not None:
            assert usage.prompt_tokens_details.cached_tokens < previous  # the change cost the history
            assert fields["miss"] == "system_changed", header
            assert fields["at"].startswith("system:"), header
        previous = usage.prompt_tokens
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": "ok ."}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["early", "first-unit"])
def test_the_anthropic_face_names_a_changed_system_prompt_with_a_hoisted_value(server, stream, where):
    who = tenant()
    r = random.randrange(10**9)
    history: list[dict] = []
    for t, question in enumerate(QUESTIONS):
        system = SYSTEMS[where].format(r=r, t=t)
        _, _, header = _anthropic_turn(
            server, system, [*history, {"role": "user", "content": question}], who, stream
        )
        if t:
            fields = header_fields(header)
            assert fields["miss"] == "system_changed" and fields["at"].startswith("system:"), header
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": "ok ."}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_turn_whose_only_change_is_a_hoisted_value_is_volatile(client, stream):
    # a system prompt shorter than a cache unit: the target is the whole prompt, and the new time misses it
    who = tenant()
    for t in range(3):
        system = f"Hi. Current time: 05:0{t}:1{t}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
        _, header = chat(client, messages, who, stream=stream)
        fields = header_fields(header)
        if t:
            assert fields["miss"] == "volatile", header
            assert fields["slot"].startswith("dates."), header
            assert fields["at"].startswith("tail:"), header


def _parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("variant", ["user parts", "assistant parts", "system parts"])
def test_a_message_resent_as_one_text_part_keeps_the_cache_with_a_hoisted_value(client, stream, variant):
    # The trial (/tmp/t/parts2.py "user parts"): turn 0 sent "Hi there" as a string, turn 1 resent it as one text
    # part: the block became a part of its own, rendered one line break longer, and `cached=49` of 67.
    who = tenant()
    system = f"You are helper {random.randrange(10**6, 10**9)}. Current date: 2026-12-03."
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Hi there"}]
    usage, _ = chat(client, first, who, stream=stream)
    served = usage.prompt_tokens  # the reply's KV is not cached (engine.cache_generated_kv): the prompt is
    reply = client.chat.completions.create(
        model=TINY_MODEL,
        messages=first,
        max_tokens=2,
        temperature=0,
        extra_headers={"x-prefixgate-tenant": who},
    )
    text = reply.choices[0].message.content
    resent = [
        {"role": "system", "content": _parts(system) if variant == "system parts" else system},
        {"role": "user", "content": _parts("Hi there") if variant == "user parts" else "Hi there"},
        {"role": "assistant", "content": _parts(text) if variant == "assistant parts" else text},
        {"role": "user", "content": "Next"},
    ]
    usage, header = chat(client, resent, who, stream=stream)
    assert usage.prompt_tokens_details.cached_tokens == served, header
    assert header_fields(header)["miss"] == "none", header


@pytest.mark.parametrize("stream", [False, True])
def test_the_anthropic_face_calls_a_first_turn_with_only_a_new_hoisted_value_volatile(server, stream):
    who = tenant()
    for t in range(3):
        ask = [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[0]}]}]
        _, _, header = _anthropic_turn(server, f"Hi. Session ID: sess-{t}a{t}b{t}", ask, who, stream)
        if t:
            fields = header_fields(header)
            assert fields["miss"] == "volatile" and fields["slot"].startswith("ids."), header
