"""Tool calls through the server, two properties a user trial found broken:

- stop sequences apply to the answer's text, never to a tool call (OpenAI's semantics): a forced or named call
  whose arguments hold a stop string comes back whole with ``finish_reason: "tool_calls"`` (Anthropic
  ``stop_reason: "tool_use"``), streamed or not; text before a call is still cut. The Responses API has no
  stop sequences: a ``stop`` field there is refused, as OpenAI refuses it.
- an agent loop (calls, results, resent turn after turn) keeps its cache: each turn's prompt is served from the
  cache up to the end of the previous prompt, and with ``engine.cache_generated_kv`` up to the end of the
  previous reply (the engine keeps the ids it served, ``engine.served_turns``).

The model is the tiny random checkpoint with a template that has no tool section (``generic`` tool format);
the grammar forces every call to be valid whatever it picks, so the tests check properties, never an answer.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.http.test_engine_features_e2e import generic_tool_checkpoint
from tests.gateway.server import RunningServer, write_config

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lisbon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": CITY}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# every call holds these: its JSON quotes and braces, its name, its city
STOPS = ['"', "get_weather", "Paris", "Lisbon"]
AUTO_STOPS = [" ", "e", '"', "Paris"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-turns")
    checkpoint = generic_tool_checkpoint(folder / "tiny")
    config = write_config(folder / "prefixgate.yaml", tiny_config_data(checkpoint, num_blocks=512))
    running = RunningServer(config).start()
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def generated_kv_server(tmp_path_factory):
    """``server`` caching replies' KV too (``engine.cache_generated_kv``: served turns run)."""
    folder = tmp_path_factory.mktemp("tool-turns-generated-kv")
    checkpoint = generic_tool_checkpoint(folder / "tiny")
    data = tiny_config_data(checkpoint, num_blocks=512, cache_generated_kv=True)
    running = RunningServer(write_config(folder / "prefixgate.yaml", data)).start()
    yield running
    running.stop()


@pytest.fixture
def generated_kv_client(generated_kv_server):
    with openai.OpenAI(
        base_url=f"{generated_kv_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as sdk:
        yield sdk


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(autouse=True)
def no_block_leaked(server):
    yield
    stats = server.wait_blocks_released(TINY_MODEL)
    assert stats["models"][TINY_MODEL]["blocks"]["used"] == 0


FORCED = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("tool_choice", FORCED)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_stop_string_in_a_forced_calls_arguments_does_not_swallow_the_call(client, tool_choice, seed):
    answer = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        stop=STOPS,
        max_tokens=200,
        seed=seed,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)


@pytest.mark.parametrize("tool_choice", FORCED)
def test_a_streamed_forced_call_is_not_cut_by_a_stop_string_either(client, tool_choice):
    request = dict(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        stop=STOPS,
        max_tokens=200,
        seed=2,
    )
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(stream=True, **request))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert reasons == ["tool_calls"] == [whole.choices[0].finish_reason]
    assert [call.function.arguments for call in calls] == [
        call.function.arguments for call in whole.choices[0].message.tool_calls
    ]


def test_stop_strings_still_cut_the_text_of_an_automatic_choice(client):
    """``auto``: stop strings that little text can avoid (``" "``, ``"e"``) end the text; a call, when the model
    makes one, is still whole. Every answer is then either cut text (``stop``) or calls (``tool_calls``)."""
    for seed in range(3):
        answer = client.chat.completions.create(
            model=TINY_MODEL,
            messages=QUESTION,
            tools=OPENAI_TOOLS,
            stop=AUTO_STOPS,
            max_tokens=60,
            seed=seed,
        )
        choice = answer.choices[0]
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), CITY)
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
        else:
            assert choice.finish_reason in ("stop", "length")
            assert not any(s in (choice.message.content or "") for s in AUTO_STOPS)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_stop_sequences_do_not_swallow_a_forced_tool_use(claude, tool_choice, stream):
    request = dict(
        model=TINY_MODEL,
        max_tokens=200,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice={**tool_choice, "disable_parallel_tool_use": True},
        stop_sequences=STOPS,
        extra_body={"temperature": 0},
    )
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, CITY)


def test_the_responses_api_has_no_stop_sequences(server):
    """OpenAI's Responses API has no ``stop``; a forced call there is never cut by one. The field is refused."""
    response = httpx.post(
        f"{server.base_url}/v1/responses",
        json={
            "model": TINY_MODEL,
            "input": "What is the weather in Paris?",
            "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}],
            "tool_choice": "required",
            "stop": ["Paris"],
        },
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stop"


LOOKUP = {
    "type": "object",
    "properties": {
        "query": {"enum": ["paris france", "lisbon", "the lazy dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["query", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("generated_kv", [False, True])
def test_an_agent_loop_is_served_from_the_cache_up_to_each_previous_reply(request, generated_kv):
    """Forced calls answered by tool results, resent whole turn after turn (seeded sampling: some calls are
    spelled otherwise than the tokenizer spells their text, which the engine's served turns count): each turn's
    cached tokens cover the previous prompt, and with ``cache_generated_kv`` all of its reply that the engine
    computed (prompt + reply - 1: the last reply token's KV is computed only by the next request); by default
    the reply is computed again as prompt (cache on == cache off)."""
    server = request.getfixturevalue("generated_kv_server" if generated_kv else "server")
    client = request.getfixturevalue("generated_kv_client" if generated_kv else "client")
    served = server.app.state.gateway.registry.get(TINY_MODEL).engine.tokenizer.served
    recorded = served.recorded
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
    messages = [{"role": "system", "content": "the quick brown fox"}, *QUESTION]
    previous = None
    for turn in range(4):
        answer = client.chat.completions.create(
            model=TINY_MODEL,
            messages=messages,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=4 + turn,  # seed 4 spells the first call non-canonically
        )
        usage = answer.usage
        if previous is not None:
            assert usage.prompt_tokens_details.cached_tokens == previous, turn
        previous = usage.prompt_tokens + (usage.completion_tokens - 1 if generated_kv else 0)
        (call,) = answer.choices[0].message.tool_calls
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
        ]
    # the loop had replies that do not re-tokenize to their ids: served turns keep them, with the opt-in only
    assert (served.recorded > recorded) is generated_kv
