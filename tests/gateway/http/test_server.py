"""End to end: the real gateway (uvicorn) over the tiny random checkpoint, driven by the official openai
SDK."""

from __future__ import annotations

import json

import httpx

from gateway.transport.sse import parse_sse
from tests.gateway.conftest import BLOCK_SIZE, TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS

SYSTEM = " ".join(
    f"Rule {i}: the quick brown fox answers every question about the document with one short answer."
    for i in range(7)
)


def system_tokens(server, text: str = SYSTEM) -> int:
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    return len(engine.tokenizer.encode(text))


def shared_prefix_tokens(server, first: list[dict], second: list[dict]) -> int:
    """Prompt tokens of ``second`` the prefix cache serves after ``first`` ran: their whole common rendered
    prefix (token-granular hits), short of ``second``'s last token (which is always computed)."""
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    a, b = engine.render_chat(first), engine.render_chat(second)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return min(common, len(b) - 1)


def test_healthz_and_models(server, client):
    health = httpx.get(f"{server.base_url}/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [TINY_MODEL]
    assert client.models.retrieve(TINY_MODEL).id == TINY_MODEL


def test_chat_completion_non_stream(client):
    response = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "What is the capital of france?"}],
        max_tokens=5,
        temperature=0,
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == TINY_MODEL
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert (
        usage.completion_tokens <= 5 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens  # the last token is computed


def test_stream_matches_non_stream_and_reports_usage(client):
    kwargs = dict(
        model=TINY_MODEL,
        messages=[
            {"role": "system", "content": "You answer."},
            {"role": "user", "content": "Hello world, how many tokens?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: same tokens, cached prefix or not
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    # the second run found the first one's whole prompt in the cache (all but its last token)
    assert last.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_sse_framing_matches_openai(server):
    body = {
        "model": TINY_MODEL,
        "messages": [{"role": "user", "content": "the lazy dog"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n")
    assert all(part.startswith(b"data: ") for part in raw.split(b"\n\n") if part)
    events = parse_sse(raw)
    chunks = [json.loads(e.data) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == TINY_MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
        )
    )
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completions(client):
    whole = client.completions.create(
        model=TINY_MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens <= 6
    chunks = list(
        client.completions.create(
            model=TINY_MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_shared_system_prompt_is_cached_and_stats_agree(server, client):
    n_system = system_tokens(server)
    assert 200 <= n_system <= 400, n_system  # long enough to span many blocks, short enough for a 512 context
    before = server.stats()
    first_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the document?"},
    ]
    second_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many answers?"},
    ]
    first = client.chat.completions.create(
        model=TINY_MODEL, messages=first_messages, max_tokens=2, temperature=0
    )
    second = client.chat.completions.create(
        model=TINY_MODEL, messages=second_messages, max_tokens=2, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == shared_prefix_tokens(server, first_messages, second_messages)
    assert n_system // BLOCK_SIZE * BLOCK_SIZE <= cached < second.usage.prompt_tokens
    after = server.stats()
    delta_cached = after["cached_tokens"] - before["cached_tokens"]
    delta_prompt = after["prompt_tokens"] - before["prompt_tokens"]
    assert delta_cached == first.usage.prompt_tokens_details.cached_tokens + cached
    assert delta_prompt == first.usage.prompt_tokens + second.usage.prompt_tokens
    model = after["models"][TINY_MODEL]
    assert model["cached_tokens"] == after["cached_tokens"] and after["requests"] - before["requests"] == 2
    assert after["prefill_tokens_saved"] - before["prefill_tokens_saved"] >= cached
    assert after["hit_rate"] == after["cached_tokens"] / after["prompt_tokens"]
    assert after["prefill_seconds_saved"] > 0
    assert after["blocks"]["total"] == 128 and after["blocks"]["used"] == 0 and after["blocks"]["cached"] > 0
    groups = {g["prefix_key"]: g for g in after["prefixes"]}
    shared = [g for g in groups.values() if g["requests"] >= 2 and g["cached_tokens"] >= cached]
    assert shared, after["prefixes"]
    assert SYSTEM[:20] not in json.dumps(after)  # never prompt text


def test_rules_hoist_the_current_time_so_the_prefix_hits(server, client):
    def system(time_line: str) -> str:
        return f"Current time: {time_line}\n{SYSTEM}"

    n_system = system_tokens(server, system("2025-05-14 09:45:12"))

    def conversation(time_line: str, question: str) -> list[dict]:
        return [{"role": "system", "content": system(time_line)}, {"role": "user", "content": question}]

    def ask(time_line: str, question: str, rules: str | None = None):
        headers = {"x-prefixgate-rules": rules} if rules else None
        return client.chat.completions.create(
            model=TINY_MODEL,
            messages=conversation(time_line, question),
            max_tokens=2,
            temperature=0,
            extra_headers=headers,
        )

    before = server.stats()
    ask("2025-05-14 09:45:12", "What is the document?")
    hit = ask("2025-05-14 09:46:31", "What is the document?")
    assert hit.usage.prompt_tokens_details.cached_tokens >= 0.9 * n_system
    after = server.stats()
    fired = {rule: after["rules"].get(rule, 0) - before["rules"].get(rule, 0) for rule in after["rules"]}
    assert sum(fired.values()) >= 2, fired  # at least one application per request

    ask("2031-01-02 17:03:59", "How many answers?", rules="off")
    miss = ask("2032-11-30 23:10:08", "How many answers?", rules="off")
    # the hit ends where the two time lines differ (token-granular), well before the system text
    reach = shared_prefix_tokens(
        server,
        conversation("2031-01-02 17:03:59", "How many answers?"),
        conversation("2032-11-30 23:10:08", "How many answers?"),
    )
    assert miss.usage.prompt_tokens_details.cached_tokens == reach < 2 * BLOCK_SIZE
    assert server.stats()["rules"] == after["rules"]  # rules off: nothing applied


def test_tenants_do_not_share_cached_prefixes(client):
    messages = [{"role": "system", "content": SYSTEM + " Tenant test."}, {"role": "user", "content": "hello"}]
    client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=1, extra_headers={"x-prefixgate-tenant": "a"}
    )
    other = client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=1, extra_headers={"x-prefixgate-tenant": "b"}
    )
    same = client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=1, extra_headers={"x-prefixgate-tenant": "a"}
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens - 1


def test_metrics_endpoint_serves_the_same_counters(server):
    stats = server.stats()
    text = httpx.get(f"{server.base_url}/metrics", headers=ADMIN_HEADERS, timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("prefixgate_cached_tokens_total{"))
    assert float(line.rsplit(" ", 1)[1]) >= stats["cached_tokens"]  # monotonic: later scrape >= earlier
    assert 'prefixgate_blocks{model="tiny",state="total"} 128.0' in text
