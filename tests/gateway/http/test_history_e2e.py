"""Issue 11 through the real server and the official SDKs, over the embedded tiny model: conversations resent
whole every turn keep their history cached with the rules on (the canonical transcript memory), an agent loop
whose time line changes every turn hits its whole history, a fork keeps both branches, and every answer says
in ``x-prefixgate-cache`` how much was cached and why the rest missed.

Every test uses its own tenant (cache salt), so the session server's prefix cache and transcript memory of
other tests never help or hurt it."""

from __future__ import annotations

import random
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.gateway.conftest import BLOCK_SIZE, TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS

SYSTEM = (
    "You are the assistant of the prefix cache test. Answer every question about the capital of france, the "
    "quick brown fox and the lazy dog in one short answer.\nCurrent date: 2026-12-01\n"
    "Each answer names the document and the block table it used."
)
USER_TURNS = (
    "what is the capital of france ?",
    "and the quick brown fox ?",
    "how many blocks in the table ?",
    "what is the key value of the query head ?",
)
REPLIES = ("paris is the capital.", "it jumps over the lazy dog.", "eight blocks.", "the key of the head.")


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def chat(client: openai.OpenAI, messages, who: str, rules: str = "on", stream: bool = False, tools=None):
    """(usage, x-prefixgate-cache header) of one chat completion."""
    kwargs = dict(model=TINY_MODEL, messages=messages, max_tokens=2, temperature=0)
    if tools is not None:
        kwargs["tools"] = tools
    headers = {"x-prefixgate-tenant": who, "x-prefixgate-rules": rules}
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, extra_headers=headers, **kwargs
        )
        usage = None
        for chunk in raw.parse():
            usage = chunk.usage or usage
        return usage, raw.headers.get("x-prefixgate-cache")
    raw = client.chat.completions.with_raw_response.create(extra_headers=headers, **kwargs)
    return raw.parse().usage, raw.headers.get("x-prefixgate-cache")


def conversation(turn: int) -> list[dict]:
    """The request a chat client sends for turn ``turn`` (1-based): the whole history, then the new question."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for k in range(turn):
        messages.append({"role": "user", "content": USER_TURNS[k]})
        if k < turn - 1:
            messages.append({"role": "assistant", "content": REPLIES[k]})
    return messages


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_four_turn_chat_caches_at_least_as_much_with_rules_on_on_every_turn(client):
    on_tenant, off_tenant = tenant(), tenant()
    on, off = [], []
    for turn in range(1, 5):
        on.append(chat(client, conversation(turn), on_tenant)[0])
        off.append(chat(client, conversation(turn), off_tenant, rules="off")[0])
    for turn in range(1, 4):
        assert cached(on[turn]) >= cached(off[turn])
        # the whole previous prompt is served from the cache (up to its last partial block and the reply)
        previous = on[turn - 1].prompt_tokens
        assert cached(on[turn]) >= previous - previous % BLOCK_SIZE - BLOCK_SIZE
    # the date line sits in the system prompt with the rules off: the history is cached there too, and the
    # rules on never cost a token of it
    assert [cached(u) for u in on[1:]] >= [cached(u) for u in off[1:]]


def test_agent_loop_whose_time_changes_every_turn_hits_the_whole_history(client):
    who, who_off = tenant(), tenant()
    result = " ".join(["the block table of the document lists every cached prefix block"] * 3)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_document",
                "description": "read a document",
                "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
        }
    ]

    def request(turn: int) -> list[dict]:
        system = (
            f"You are a coding agent of the prefix cache test.\nCurrent time: 09:4{turn}:1{turn}\nBe brief."
        )
        messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": "read it"}]
        for k in range(turn):
            call = {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": "read_document", "arguments": "{}"},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k}: {result}"})
        return messages

    on = [chat(client, request(turn), who, tools=tools)[0] for turn in range(1, 3)]
    off = [chat(client, request(turn), who_off, rules="off", tools=tools)[0] for turn in range(1, 3)]
    previous = on[0].prompt_tokens
    assert previous > 120  # a large tool result
    assert cached(on[1]) >= previous - previous % BLOCK_SIZE - BLOCK_SIZE
    assert cached(off[1]) < 64  # the time line at the top of the system prompt ends the prefix early
    assert cached(on[1]) >= cached(off[1])


def test_a_fork_keeps_both_branches(client, server):
    who = tenant()
    history = conversation(2) + [{"role": "assistant", "content": REPLIES[1]}]
    branches = {
        "a": history + [{"role": "user", "content": "what is the capital of france ?"}],
        "b": history + [{"role": "user", "content": "what is the lazy dog ?"}],
    }
    for turn in (conversation(1), conversation(2)):
        chat(client, turn, who)
    first = {name: chat(client, messages, who)[0] for name, messages in branches.items()}
    second = {}
    for name, messages in branches.items():
        follow = messages + [
            {"role": "assistant", "content": f"answer {name}."},
            {"role": "user", "content": "thanks ."},
        ]
        second[name] = chat(client, follow, who)[0]
        canon = server.app.state.gateway.canonicalizer.canonicalize(follow, None, TINY_MODEL, who)
        texts = [m["content"] for m in canon.messages if isinstance(m.get("content"), str)]
        assert any(messages[-1]["content"] in t for t in texts)  # its own turn 3
        assert canon.history.reused_turns >= 3  # turn 4 continues its own branch's transcript
        other = branches["b" if name == "a" else "a"][-1]["content"]
        assert not any(t.endswith(other) for t in texts[-3:])
    for name in branches:
        previous = first[name].prompt_tokens
        assert cached(second[name]) >= previous - previous % BLOCK_SIZE - BLOCK_SIZE


def header_fields(value: str | None) -> dict[str, str]:
    assert value is not None
    return dict(part.strip().split("=", 1) for part in value.split(";"))


@pytest.mark.parametrize("stream", [False, True])
def test_cache_header_names_cold_volatile_and_tools_changed(client, stream):
    who = tenant()
    system = SYSTEM.replace("2026-12-01", "2026-12-0{day}")
    ask = [{"role": "user", "content": USER_TURNS[0]}]

    def send(day: int, rules: str = "off", tools=None):
        return chat(
            client, [{"role": "system", "content": system.format(day=day)}, *ask], who, rules, stream, tools
        )

    usage, header = send(1)
    fields = header_fields(header)
    assert fields["miss"] == "cold" and int(fields["cached"]) == cached(usage) == 0
    usage, header = send(2)  # rules off: the changed date sits inside the system prompt
    fields = header_fields(header)
    # a value the configured rules would hoist (rules off here: it stayed in the system prompt) is a known
    # volatile value: the rule names it
    assert fields["miss"] == "volatile" and fields["at"].startswith("system:") and fields["slot"], header
    assert int(fields["cached"]) == cached(usage)
    usage, header = send(2, rules="on")  # the rules hoist the date: nothing stable missed... once cached
    usage, header = send(3, rules="on")
    assert header_fields(header)["miss"] == "none"
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "look {x} up", "parameters": {}},
    }
    first_tools = [{**tool, "function": {**tool["function"], "description": "look one up"}}]
    other_tools = [{**tool, "function": {**tool["function"], "description": "look two up"}}]
    send(3, rules="on", tools=first_tools)
    usage, header = send(3, rules="on", tools=other_tools)
    assert header_fields(header)["miss"] == "tools_changed"
    assert "capital" not in header and "look" not in header  # never prompt text


@pytest.mark.parametrize("rules", ["off", "on"])
def test_cache_header_calls_an_ordinary_edit_system_changed_and_a_first_prompt_cold(client, rules):
    # The tryout: "Alpha helper. ..." then "Beta helper. ..." (fresh tenant) said "miss=volatile; at=system:3"
    # with no slot; a sentence inserted before an unchanged time too; and a first "You are terse." + a
    # question said "cached=0; miss=none".
    who = tenant()
    body = "helper. You answer questions about the fleet, its ships and their crews, briefly and politely."
    ask = [{"role": "user", "content": USER_TURNS[0]}]
    usage, header = chat(
        client, [{"role": "system", "content": "Alpha " + body}, *ask], who, rules, False, None
    )
    assert header_fields(header)["miss"] == "cold" and cached(usage) == 0
    usage, header = chat(
        client, [{"role": "system", "content": "Beta " + body}, *ask], who, rules, False, None
    )
    fields = header_fields(header)
    assert fields["miss"] == "system_changed" and fields["at"].startswith("system:") and "slot" not in fields
    timed = "Gamma helper. Current time: 09:45:12. Answer briefly."
    inserted = "Gamma helper. Be exact. Current time: 09:45:12. Answer briefly."
    chat(client, [{"role": "system", "content": timed}, *ask], who, rules, False, None)
    usage, header = chat(client, [{"role": "system", "content": inserted}, *ask], who, rules, False, None)
    fields = header_fields(header)
    assert fields["miss"] == "system_changed" and "slot" not in fields, header
    fresh = tenant()
    terse = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": USER_TURNS[1]}]
    usage, header = chat(client, terse, fresh, rules, False, None)
    fields = header_fields(header)
    assert cached(usage) == 0 and fields["miss"] in ("cold", "below_minimum"), header
    usage, header = chat(client, terse, fresh, rules, False, None)
    assert header_fields(header)["miss"] == "none" and cached(usage) > 0, header


def test_concurrent_first_requests_are_cold_never_evicted(server):
    # The tryout: 10 concurrent requests (AsyncOpenAI, max_tokens 20) sharing a never-seen system prompt; the
    # one that computed the prefix sometimes said "cached=0; miss=evicted; cached_ago=0" while the engine had
    # evicted nothing (peers that finished first had recorded the prompt before it was explained). Each
    # run's prompt is new, so no block of it can have been cached before the run: never "evicted".
    import asyncio

    async def burst(who: str, system: str) -> list[tuple[int, str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as sdk:

            async def one(i: int) -> tuple[int, str]:
                raw = await sdk.chat.completions.with_raw_response.create(
                    model=TINY_MODEL,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}?"}],
                    max_tokens=20,
                    temperature=0,
                    extra_headers={"x-prefixgate-tenant": who},
                )
                return cached(raw.parse().usage), raw.headers["x-prefixgate-cache"]

            return await asyncio.gather(*(one(i) for i in range(10)))

    who = tenant()
    words = SYSTEM.replace("\n", " ").split()
    for run in range(3):
        # a never-seen system prompt each run: the same words, shuffled (nothing in common but the template's
        # header with the previous runs'; an edit of an earlier prompt would be named as that edit)
        system = " ".join(random.Random(run).sample(words, len(words)))
        for count, header in asyncio.run(burst(who, system)):
            fields = header_fields(header)
            assert int(fields["cached"]) == count
            assert fields["miss"] != "evicted", header
            if count == 0:
                assert fields["miss"] == "cold" and fields["at"] == "system:0", header


def test_cache_header_on_the_anthropic_face_streamed_and_not(server):
    who = tenant()
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        for stream in (False, True):
            kwargs = dict(
                model=TINY_MODEL,
                max_tokens=2,
                system=SYSTEM,
                messages=[{"role": "user", "content": USER_TURNS[0]}],
                extra_headers={"x-prefixgate-tenant": who + str(stream)},
            )
            if stream:
                with ant.messages.with_streaming_response.create(stream=True, **kwargs) as raw:
                    header = raw.headers.get("x-prefixgate-cache")
                    for _ in raw.iter_lines():
                        pass
            else:
                header = ant.messages.with_raw_response.create(**kwargs).headers.get("x-prefixgate-cache")
            assert header_fields(header)["miss"] == "cold"
    doc = server.stats()
    assert doc["cache_misses"]["models"][TINY_MODEL]["by_cause"]["cold"] >= 2
    assert doc["transcript"]["memory"]["stored"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_edit_of_the_newest_reply_is_history_rewritten_at_the_edited_token(
    generated_kv_server, generated_kv_client, stream
):
    """The tryout: a client edits the reply it got ("." -> "!") before sending its next turn. The explainer
    knew only the prompts, never the reply, so the edit was ``cold`` (or ``none``); it now records the answer
    as the engine cached it, and the edit is ``history_rewritten`` at the edited token (with
    ``cache_generated_kv``: by default the reply is not cached, and the next turn computes it). The reply is made of
    two one-byte tokens the tiny BPE never merges (``logit_bias``), so it resends as the very tokens the model
    generated, one per character: the edit at character ``k`` is token ``prompt_tokens + k``."""
    server, client = generated_kv_server, generated_kv_client
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    q, z = (
        engine.tokenizer.encode("Q", add_special_tokens=False),
        engine.tokenizer.encode("Z", add_special_tokens=False),
    )
    assert len(q) == len(z) == 1
    who = tenant()
    system = "You are the assistant of the reply edit test. Answer every question with letters only. " * 3
    first = [{"role": "system", "content": system}, {"role": "user", "content": USER_TURNS[0]}]
    headers = {"x-prefixgate-tenant": who}
    kwargs = dict(model=TINY_MODEL, temperature=0, extra_headers=headers)
    answer = client.chat.completions.create(
        messages=first, max_tokens=40, logit_bias={str(q[0]): 100, str(z[0]): 100}, **kwargs
    )
    reply = answer.choices[0].message.content
    assert len(reply) == 40 and set(reply) <= {"Q", "Z"} and answer.choices[0].finish_reason == "length"
    start = answer.usage.prompt_tokens  # the reply's first token in the next prompts

    def next_turn(content: str, question: str) -> dict[str, str]:
        messages = [*first, {"role": "assistant", "content": content}, {"role": "user", "content": question}]
        raw = client.chat.completions.with_raw_response.create(
            messages=messages, max_tokens=2, stream=stream, **kwargs
        )
        if stream:
            list(raw.parse())
        return header_fields(raw.headers.get("x-prefixgate-cache"))

    k = 27
    edited = reply[:k] + ("Z" if reply[k] == "Q" else "Q") + reply[k + 1 :]
    fields = next_turn(edited, USER_TURNS[2])  # the first prompt that holds the reply
    assert (fields["miss"], fields["at"]) == ("history_rewritten", f"history:{start + k}"), fields
    assert int(fields["cached"]) <= start + k
    unedited = next_turn(reply, USER_TURNS[1])
    assert unedited["miss"] == "none", unedited  # a new turn: the reply itself was served


@pytest.mark.parametrize("stream", [False, True])
def test_the_turn_after_a_reply_cut_by_max_tokens_is_a_hit(server, client, stream):
    """The trial: after a reply cut by ``max_tokens`` the next turn of the conversation said
    ``cached=4734; miss=cold; at=history:4735`` about half the time. The engine never feeds the last token it
    sampled, so the cache holds the prompt and the reply less that token, while the explanation's target (the
    stable prefix, which now ends after the reply's end of turn, rounded down to a block) reached past it
    whenever the prompt and the reply together were 14, 15 or 0 modulo 16 tokens. Each turn here is cut so that
    they total 15 (the prompt counted ahead with ``count_tokens``), and replies are cut mid-word: the tiny BPE's
    ``Q``, ``Z``, `` the`` and ``ab`` tokens (``logit_bias``) make words the cut splits."""
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    pieces = [engine.tokenizer.encode(text, add_special_tokens=False) for text in ("Q", "Z", " the", "ab")]
    bias = {str(ids[0]): 100 for ids in pieces if len(ids) == 1}
    assert len(bias) == 4
    who = tenant()
    headers = {"x-prefixgate-tenant": who}
    turns: list[dict] = [{"role": "user", "content": USER_TURNS[0]}]
    seen = []
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        for turn in range(4):
            counted = ant.messages.count_tokens(
                model=TINY_MODEL, system=SYSTEM, messages=turns, extra_headers=headers
            ).input_tokens
            max_tokens = 16 + (15 - counted) % 16
            raw = client.chat.completions.with_raw_response.create(
                model=TINY_MODEL,
                messages=[{"role": "system", "content": SYSTEM}, *turns],
                max_tokens=max_tokens,
                temperature=0,
                logit_bias=bias,
                stream=stream,
                stream_options={"include_usage": True} if stream else None,
                extra_headers=headers,
            )
            if stream:
                chunks = list(raw.parse())
                usage = chunks[-1].usage
                reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = next(
                    c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
                )
            else:
                answer = raw.parse()
                usage, reply, finish = (
                    answer.usage,
                    answer.choices[0].message.content,
                    answer.choices[0].finish_reason,
                )
            assert usage.prompt_tokens == counted and finish == "length"
            assert (usage.prompt_tokens + usage.completion_tokens) % BLOCK_SIZE == 15
            seen.append((header_fields(raw.headers.get("x-prefixgate-cache")), cached(usage), counted))
            turns += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": USER_TURNS[(turn + 1) % len(USER_TURNS)]},
            ]
    assert seen[0][0]["miss"] == "cold"
    for fields, served, _ in seen[1:]:
        assert fields["miss"] == "none", seen
        assert int(fields["cached"]) == served
    # the cache served all the engine computed: the previous prompt and its reply less the last sampled token
    for (_, served, _), (_, _, counted_before) in zip(seen[1:], seen, strict=False):
        assert served >= counted_before


def test_rules_off_requests_never_touch_the_transcript_memory(client, server):
    before = server.stats()["transcript"]["memory"]
    chat(client, conversation(3), tenant(), rules="off")
    after = server.stats()["transcript"]["memory"]
    assert (after["lookups"], after["stored"]) == (before["lookups"], before["stored"])


def test_a_failing_explanation_costs_no_request(client, server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("explainer bug")

    monkeypatch.setattr(server.app.state.gateway.cache.explainer, "explain", broken)
    errors = server.stats()["cache_misses"]["errors"]
    for stream in (False, True):
        usage, header = chat(client, conversation(1), tenant(), stream=stream)
        assert usage.completion_tokens >= 1 and header is None
    assert server.stats()["cache_misses"]["errors"] == errors + 2


def test_metrics_count_misses_by_cause(client, server):
    chat(client, conversation(1), tenant())
    text = httpx.get(f"{server.base_url}/metrics", headers=ADMIN_HEADERS, timeout=30).text
    assert f'prefixgate_cache_misses_total{{cause="cold",model="{TINY_MODEL}"}}' in text
    assert 'prefixgate_transcript_total{event="stored"}' in text


@pytest.mark.parametrize("stream", [False, True])
def test_the_cache_header_never_places_a_miss_inside_what_the_engine_served(server, client, stream):
    # A system prompt warmed through /admin/cache/warm is cached in the engine but was never explained, so the
    # explainer's nearest recorded prompt (another system prompt sharing only its first words) diverged inside
    # the span the engine served. Seen as "cached=336; miss=system_changed; at=system:26".
    who = tenant()
    first = "You are the helper of the fleet. " + " ".join(
        f"rule {i} says alpha beta gamma." for i in range(12)
    )
    warmed = "You are the helper of the fleet. " + " ".join(
        f"law {i} reads delta epsilon zeta." for i in range(12)
    )
    history = [
        {"role": "user", "content": USER_TURNS[0]},
        {"role": "assistant", "content": REPLIES[0]},
    ]

    def messages(system: str, question: str) -> list[dict]:
        return [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]

    chat(client, messages(first, USER_TURNS[1]), who, stream=stream)
    response = httpx.post(
        f"{server.base_url}/admin/cache/warm",
        json={"model": TINY_MODEL, "tenant": who, "system": warmed},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    warmed_tokens = response.json()["cached_tokens"]
    usage, header = chat(client, messages(warmed, USER_TURNS[2]), who, stream=stream)
    fields = header_fields(header)
    assert cached(usage) >= warmed_tokens - BLOCK_SIZE > 0  # the engine served the warmed system prompt
    assert int(fields["cached"]) == cached(usage)
    if fields["miss"] != "none":
        segment, offset = fields["at"].split(":")
        assert int(offset) >= cached(usage), header
        assert fields["miss"] == "cold"


def test_a_reply_cut_between_characters_is_recorded_as_resent_unchanged(server, client, monkeypatch):
    """Only a reply cut inside a character (text ending in U+FFFD) is recorded as one whose resent end may be
    spelled otherwise (``record_answer(cut=True)``, ``reply_cut``). Before, every reply cut by ``max_tokens``
    was, so a client edit (or another reply, sampled) diverging in its last 3 tokens read ``reply_cut``
    instead of ``history_rewritten`` (seen in the SmolLM2 four-turn test)."""
    cache = server.app.state.gateway.cache
    seen: list[bool] = []
    record = cache.record_answer

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cut"))
        return record(*args, **kwargs)

    monkeypatch.setattr(cache, "record_answer", spy)
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    letters = [engine.tokenizer.encode(c, add_special_tokens=False) for c in ("Q", "Z")]
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    contents = []
    for bias in ({str(ids[0]): 100 for ids in letters}, None):  # whole characters; then the model's own bytes
        answer = client.chat.completions.create(
            model=TINY_MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            logit_bias=bias,
            extra_headers={"x-prefixgate-tenant": tenant()},
        )
        assert answer.choices[0].finish_reason == "length"
        contents.append(answer.choices[0].message.content)
    assert [c.endswith("\ufffd") for c in contents] == [False, True], contents  # both kinds of cut happened
    assert seen == [False, True]
