"""Idle reply prefill through the real server and the official SDKs (``engine.idle_reply_prefill``, on by
default): once a reply is out, the conversation's next turn is prefilled while the engine is idle, so the client's
next turn, its reply resent as received, is served everything but its new message: exactly the tokens
``engine.next_turn.next_turn_prefix`` gives, for a text reply (streamed or not), a tool call and the Anthropic
face. Each test uses its own tenant; each waits until the engine is idle before the next turn."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from engine.next_turn import next_turn_prefix
from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.http.test_engine_features_e2e import generic_tool_checkpoint
from tests.gateway.server import ADMIN_HEADERS, RunningServer, write_config

SYSTEM = "You are the assistant of the idle prefill test. Answer every question in one short line, please."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Lisbon"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def start(folder, checkpoint, **engine) -> RunningServer:
    # no residency bound: these tests send turn after turn into a 128-block pool, which at that pace turns over
    # in under the default 5 s, so the default would drop the idle prefills they look at
    # (tests/engine/test_idle_prefill.py checks that rule)
    engine = {"idle_prefill_min_residency_s": 0, **engine}
    data = tiny_config_data(checkpoint, idle_reply_prefill=True, **engine)
    return RunningServer(write_config(folder / "prefixgate.yaml", data)).start()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with ``idle_reply_prefill`` on, as every config has it by default."""
    running = start(tmp_path_factory.mktemp("idle"), tiny_checkpoint)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The same on a template without a tool section (calls in the generic format, which the engine can
    force)."""
    folder = tmp_path_factory.mktemp("idle-tools")
    running = start(folder, generic_tool_checkpoint(folder / "tiny"))
    yield running
    running.stop()


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def idle_after(server) -> dict:
    """The model's stats once the engine has nothing waiting or running (its idle prefills done)."""
    return server.wait_blocks_released(TINY_MODEL)["models"][TINY_MODEL]


def prefix_len(server, messages: list[dict], tools=None) -> int:
    """Tokens of the next turn's prefix after ``messages`` (template form), by the served engine's tokenizer."""
    engine = server.app.state.gateway.registry.get(TINY_MODEL).engine
    return len(next_turn_prefix(engine.tokenizer, messages, tools, ""))


def chat(client: openai.OpenAI, messages: list[dict], who: str, **kwargs):
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL,
        messages=messages,
        extra_headers={"x-prefixgate-tenant": who},
        **{"max_tokens": 12, "temperature": 0, **kwargs},
    )
    return raw.parse(), raw.headers.get("x-prefixgate-cache")


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_turn_is_served_its_whole_history_reply_included(server, client, stream):
    """Before (default config): the next turn was served turn 1's prompt only and computed the reply again."""
    who = tenant()
    before = idle_after(server)["idle_prefills"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block table?"}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=TINY_MODEL,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-prefixgate-tenant": who},
            )
        )
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        first_prompt = chunks[-1].usage.prompt_tokens
    else:
        first = chat(client, messages, who)[0]
        reply, first_prompt = first.choices[0].message.content, first.usage.prompt_tokens
    stats = idle_after(server)
    assert stats["idle_prefills"] == before + 1 and stats["idle_prefill_tokens"] > 0
    messages.append({"role": "assistant", "content": reply})
    expected = prefix_len(server, messages)
    messages.append({"role": "user", "content": "And a slot mapping?"})
    answer, header = chat(client, messages, who)
    assert answer.usage.prompt_tokens_details.cached_tokens == expected
    assert expected > first_prompt  # the reply too, where the previous prompt was all a cold cache gave
    assert "miss=none" in header
    stats = idle_after(server)
    assert stats["blocks"]["used"] == 0 and stats["idle_prefills_dropped"] == 0
    metrics = httpx.get(f"{server.base_url}/metrics", headers=ADMIN_HEADERS, timeout=30).text
    for name in ("idle_prefills", "idle_prefill_tokens", "idle_prefills_yielded", "idle_prefills_dropped"):
        assert f"prefixgate_{name}_total{{" in metrics, name


def test_an_agent_loop_s_every_tool_result_turn_is_served_the_call_it_answers(tool_server):
    """Forced calls answered by tool results, resent whole turn after turn, as the SDK returned them."""
    with openai.OpenAI(
        base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0, timeout=120
    ) as client:
        who = tenant()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
        expected = None
        for turn in range(4):
            answer, header = chat(
                client, messages, who, tools=TOOLS, tool_choice="required", max_tokens=120, seed=turn
            )
            if expected is not None:
                assert answer.usage.prompt_tokens_details.cached_tokens == expected, turn
                assert "miss=none" in header
            assert answer.choices[0].finish_reason == "tool_calls"
            idle_after(tool_server)
            sent = answer.choices[0].message.model_dump(exclude_none=True)  # as the SDK user resends it
            messages.append(sent)
            expected = prefix_len(tool_server, messages, TOOLS)
            call = sent["tool_calls"][0]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'})
    assert expected > answer.usage.prompt_tokens  # the last call's turn is longer than its prompt


def test_the_anthropic_face_s_next_turn_is_served_the_reply(server):
    who = tenant()
    headers = {"x-prefixgate-tenant": who}
    turns: list[dict] = [{"role": "user", "content": "What is a slot mapping?"}]
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as ant:
        first = ant.messages.create(
            model=TINY_MODEL, max_tokens=12, system=SYSTEM, messages=turns, extra_headers=headers
        )
        idle_after(server)
        reply = "".join(block.text for block in first.content if block.type == "text")
        turns.append({"role": "assistant", "content": [block.model_dump() for block in first.content]})
        expected = prefix_len(
            server,
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": turns[0]["content"]},
                {"role": "assistant", "content": reply},
            ],
        )
        turns.append({"role": "user", "content": "Thanks. And a block?"})
        second = ant.messages.create(
            model=TINY_MODEL, max_tokens=2, system=SYSTEM, messages=turns, extra_headers=headers
        )
    assert second.usage.cache_read_input_tokens == expected


def test_several_choices_queue_no_idle_prefill(server, client):
    """``n`` = 2: which choice the client goes on with is unknown."""
    before = idle_after(server)["idle_prefills"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Two answers, please."}]
    answer, _ = chat(client, messages, tenant(), n=2, temperature=1.0, seed=3)
    assert len(answer.choices) == 2
    stats = idle_after(server)
    assert stats["idle_prefills"] == before and stats["blocks"]["used"] == 0


def test_with_idle_reply_prefill_off_the_next_turn_computes_the_reply(tiny_checkpoint, tmp_path):
    data = tiny_config_data(tiny_checkpoint, idle_reply_prefill=False)
    running = RunningServer(write_config(tmp_path / "prefixgate.yaml", data)).start()
    try:
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=60) as sdk:
            who = tenant()
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is a block?"},
            ]
            first, _ = chat(sdk, messages, who)
            idle_after(running)
            messages.append({"role": "assistant", "content": first.choices[0].message.content})
            expected = prefix_len(running, messages)
            messages.append({"role": "user", "content": "And a table?"})
            second, header = chat(sdk, messages, who)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # turn 1's prompt (its generation prompt is the reply's head), none of the reply
        assert cached == first.usage.prompt_tokens < expected
        assert "miss=none" in header
        stats = idle_after(running)
        assert (stats["idle_prefills"], stats["idle_prefill_tokens"]) == (0, 0)
    finally:
        running.stop()


def test_the_responses_face_s_next_turn_is_served_the_reply(server, client):
    """A Responses client resends the output items it got (``store: false``: the whole input every turn)."""
    who = tenant()
    headers = {"x-prefixgate-tenant": who}
    items: list = [{"role": "user", "content": "What is a slot mapping?"}]
    first = client.responses.create(
        model=TINY_MODEL,
        instructions=SYSTEM,
        input=items,
        max_output_tokens=12,
        store=False,
        extra_headers=headers,
    )
    idle_after(server)
    expected = prefix_len(
        server,
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": items[0]["content"]},
            {"role": "assistant", "content": first.output_text},
        ],
    )
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "And a block table?"})
    second = client.responses.create(
        model=TINY_MODEL,
        instructions=SYSTEM,
        input=items,
        max_output_tokens=2,
        store=False,
        extra_headers=headers,
    )
    assert second.usage.input_tokens_details.cached_tokens == expected


def test_an_anthropic_call_cut_by_max_tokens_is_prefilled_as_the_client_resends_it(tool_server):
    """Before (a trial): the Anthropic face returns a cut call's ``input`` as the members it completed
    (``{"city":`` -> ``{}``), which its client resends, while the idle prefill rendered the raw cut text: the
    next turn computed the whole reply again."""
    tools = [
        {
            "name": "get_weather",
            "description": "Weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with anthropic.Anthropic(base_url=tool_server.base_url, api_key="x", max_retries=0, timeout=120) as ant:
        cut = None
        for max_tokens in range(8, 120, 3):  # the first budget that ends inside the call's arguments
            who = tenant()
            with ant.messages.stream(
                model=TINY_MODEL,
                max_tokens=max_tokens,
                system=SYSTEM,
                messages=question,
                tools=tools,
                tool_choice={"type": "any"},
                extra_body={"temperature": 0},
                extra_headers={"x-prefixgate-tenant": who},
            ) as stream:
                raw = "".join(
                    event.delta.partial_json
                    for event in stream
                    if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
                )
                reply = stream.get_final_message()
            try:
                json.loads(raw)
            except ValueError:
                if reply.stop_reason == "max_tokens" and raw.strip():  # cut inside the arguments
                    cut = reply
                    break
        assert cut is not None, "no max_tokens cut the call inside its arguments"
        idle_after(tool_server)
        resent = [block.model_dump(exclude_none=True) for block in cut.content]
        (use,) = [block for block in resent if block["type"] == "tool_use"]
        call = {
            "id": use["id"],
            "type": "function",
            "function": {"name": use["name"], "arguments": json.dumps(use["input"])},
        }
        expected = prefix_len(
            tool_server,
            [
                {"role": "system", "content": SYSTEM},
                *question,
                {"role": "assistant", "content": "", "tool_calls": [call]},
            ],
            TOOLS,
        )
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": '{"temperature": 21}'}
        following = ant.messages.create(
            model=TINY_MODEL,
            max_tokens=2,
            system=SYSTEM,
            messages=[
                *question,
                {"role": "assistant", "content": resent},
                {"role": "user", "content": [result]},
            ],
            tools=tools,
            extra_headers={"x-prefixgate-tenant": who},
        )
    assert following.usage.cache_read_input_tokens == expected
