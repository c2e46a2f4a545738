"""The engine's features through the server with the official SDKs: tools (OpenAI ``tool_calls``, Anthropic
``tool_use``), ``response_format``, logprobs, ``n`` > 1, penalties, ``logit_bias`` and ``seed``.

The model is a tiny random checkpoint whose chat template has no tool section (like SmolLM2's), so the engine
uses the generic tool format and the gateway constrains and parses its output. Random output is fine: the
grammar forces every call and every JSON answer to be valid, whatever the model picks, so the tests check
validity against the schema, never a particular answer. After each test no KV block is left in use.
"""

from __future__ import annotations

import concurrent.futures
import copy
import enum
import json
import typing
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings

from tests.engine.checkpoints import CHAT_TEMPLATE, make_tiny_hf_llama
from tests.engine.test_constrained import SCHEMAS as RANDOM_SCHEMAS
from tests.engine.test_constrained import TASK_CREATE
from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.http.test_protocol_exact_e2e import assert_no_block_in_use
from tests.gateway.server import RunningServer, write_config

CONTEXT = 2048
OBJECT = {"type": "object", "additionalProperties": False}

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lisbon", "Seoul"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_PARAMETERS},
    {"name": "get_time", "input_schema": TIME_PARAMETERS},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def generic_tool_checkpoint(folder: Path) -> Path:
    """The tiny random Llama with a ChatML template that has no tool section (SmolLM2's kind), so the engine's
    ``tool_format`` is ``"generic"``; context raised to ``CONTEXT`` tokens for the tool preamble."""
    checkpoint = make_tiny_hf_llama(folder, seed=0)
    lines = CHAT_TEMPLATE.split("\n")
    assert lines[1] == "{%- if tools %}" and lines[7].startswith("{%- elif")
    template = "\n".join([lines[0], lines[7].replace("elif", "if", 1), *lines[8:]])
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=template, model_max_length=CONTEXT)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model_config = json.loads((checkpoint / "config.json").read_text())
    model_config["max_position_embeddings"] = CONTEXT
    (checkpoint / "config.json").write_text(json.dumps(model_config))
    return checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generic-tools")
    checkpoint = generic_tool_checkpoint(folder / "tiny")
    config = write_config(folder / "prefixgate.yaml", tiny_config_data(checkpoint, num_blocks=256))
    running = RunningServer(config).start()
    assert running.app.state.gateway.registry.get(TINY_MODEL).engine.tool_format == "generic"
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
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


def engine_of(server):
    return server.app.state.gateway.registry.get(TINY_MODEL).engine


def check_openai_calls(calls) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def tool_results(message) -> list[dict]:
    return [
        {"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name}: 18C, sunny"}
        for call in message.tool_calls
    ]


# ---- OpenAI --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_openai_tool_round_trip(client, tool_choice):
    first = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        seed=3,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_openai_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert {call.function.name for call in choice.message.tool_calls} == {"get_time"}
    history = [*QUESTION, choice.message.model_dump(exclude_none=True), *tool_results(choice.message)]
    answer = client.chat.completions.create(
        model=TINY_MODEL, messages=history, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=8, seed=3
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in (
        "stop",
        "length",
    )
    # the results are in the prompt: it is longer than the first turn's
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_openai_streamed_tool_calls_assemble_as_the_sdk_does(client):
    with client.chat.completions.stream(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        max_tokens=200,
        seed=5,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_openai_calls(choice.message.tool_calls)
    history = [*QUESTION, choice.message.model_dump(exclude_none=True), *tool_results(choice.message)]
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL, messages=history, tools=OPENAI_TOOLS, max_tokens=200, seed=5, stream=True
        )
    )
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[0] in ("stop", "length", "tool_calls")


def test_openai_auto_tool_choice_gives_text_or_valid_calls(client):
    for seed in range(3):
        result = client.chat.completions.create(
            model=TINY_MODEL, messages=QUESTION, tools=OPENAI_TOOLS, max_tokens=200, seed=seed
        )
        choice = result.choices[0]
        if choice.message.tool_calls:
            check_openai_calls(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_parallel_tool_calls_false_gives_one_call_at_most(client):
    for seed in range(3):
        result = client.chat.completions.create(
            model=TINY_MODEL,
            messages=QUESTION,
            tools=OPENAI_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
        )
        assert len(result.choices[0].message.tool_calls) == 1


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "sure": {"type": "boolean"},
            "level": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["answer", "sure", "level"],
        "additionalProperties": False,
    }
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=TINY_MODEL,
                    messages=QUESTION,
                    response_format=response_format,
                    max_tokens=200,
                    seed=1,
                    stream=True,
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][
                0
            ]
        else:
            result = client.chat.completions.create(
                model=TINY_MODEL, messages=QUESTION, response_format=response_format, max_tokens=200, seed=1
            )
            text, reason = result.choices[0].message.content, result.choices[0].finish_reason
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_json_object_output_is_an_object(client):
    result = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=2,
    )
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert result.choices[0].message.content.lstrip().startswith("{")


def test_chat_logprobs_shapes(server, client):
    result = client.chat.completions.create(
        model=TINY_MODEL, messages=QUESTION, logprobs=True, top_logprobs=3, max_tokens=6, seed=1
    )
    choice = result.choices[0]
    content = choice.logprobs.content
    assert len(content) == result.usage.completion_tokens == 6
    assert (
        b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace") == choice.message.content
    )
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    streamed = list(
        client.chat.completions.create(
            model=TINY_MODEL, messages=QUESTION, logprobs=True, max_tokens=6, seed=1, stream=True
        )
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]  # same seed, same tokens
    assert all(e.top_logprobs == [] for e in entries)
    plain = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_end_where_a_stop_string_cuts_the_text(client, stream):
    """A fresh-user trial: the stop string's tokens came back in ``logprobs`` (streamed: in a last chunk with an
    empty delta) though the text was cut before them. The logprobs' tokens now spell the text returned."""
    full = client.chat.completions.create(
        model=TINY_MODEL, messages=QUESTION, logprobs=True, max_tokens=12, temperature=0
    )
    tokens = full.choices[0].logprobs.content
    text = full.choices[0].message.content
    cut = None
    for k in range(2, len(tokens)):
        prefix = b"".join(bytes(t.bytes) for t in tokens[:k]).decode("utf-8", errors="replace")
        stop = tokens[k].token
        if stop.strip() and "\ufffd" not in stop and text.find(stop) == len(prefix):
            cut = (k, prefix, stop)
            break
    assert cut is not None, [t.token for t in tokens]  # a token whose text first appears where it starts
    k, prefix, stop = cut
    fields = {"model": TINY_MODEL, "messages": QUESTION, "logprobs": True, "max_tokens": 12, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(**fields, stop=stop, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [
            e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        result = client.chat.completions.create(**fields, stop=stop)
        content, entries = result.choices[0].message.content, result.choices[0].logprobs.content
        finish = [result.choices[0].finish_reason]
    assert finish == ["stop"] and content == prefix
    assert [e.token for e in entries] == [t.token for t in tokens[:k]]  # none of the stop string's
    legacy = client.completions.create(
        model=TINY_MODEL,
        prompt="Once upon",
        logprobs=1,
        max_tokens=12,
        temperature=0,
        stop=stop,
        stream=stream,
    )
    chunks = list(legacy) if stream else [legacy]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert all(offset < len(text) for offset in offsets)  # no token past the text's end


def test_completion_logprobs_shapes(client):
    result = client.completions.create(model=TINY_MODEL, prompt="Once upon", logprobs=2, max_tokens=5, seed=4)
    logprobs = result.choices[0].logprobs
    # every generated token but a stop token (not part of the text: it has no logprob)
    count = result.usage.completion_tokens - (result.choices[0].finish_reason == "stop")
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == count
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and all(o < len(result.choices[0].text) for o in offsets)
    if "\ufffd" not in "".join(logprobs.tokens):  # whole characters: each token's string is its text
        assert offsets == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(count)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == logprob and 2 <= len(top) <= 3
    chunks = list(
        client.completions.create(
            model=TINY_MODEL, prompt="Once upon", logprobs=2, max_tokens=5, seed=4, stream=True
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_n_choices_prefill_the_prompt_once(server, client):
    engine = engine_of(server)
    before = engine.stats()
    prompt = [{"role": "user", "content": "A prompt no other test sends, long enough for a few blocks. " * 4}]
    result = client.chat.completions.create(model=TINY_MODEL, messages=prompt, n=3, max_tokens=5, seed=7)
    after = engine.stats()
    usage = result.usage
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert (
        after.prefill_tokens - before.prefill_tokens
        == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    )
    assert after.forks - before.forks == 2
    assert after.forked_prefill_tokens_saved - before.forked_prefill_tokens_saved == 2 * usage.prompt_tokens
    assert usage.completion_tokens == after.decode_tokens - before.decode_tokens  # every choice's tokens
    stats = server.stats()["models"][TINY_MODEL]
    assert (
        stats["forks"] == after.forks
        and stats["forked_prefill_tokens_saved"] == after.forked_prefill_tokens_saved
    )
    # streamed: chunks per index, a finish chunk per choice, usage once
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL,
            messages=prompt,
            n=3,
            max_tokens=5,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    }
    assert sorted(finishes) == [0, 1, 2]
    texts = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert texts == {c.index: c.message.content for c in result.choices}  # seed + i per choice, same as above
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[
        -1
    ].usage.completion_tokens == usage.completion_tokens


def test_completions_n(client):
    result = client.completions.create(model=TINY_MODEL, prompt="Once upon", n=2, max_tokens=3, seed=1)
    assert [c.index for c in result.choices] == [0, 1] and result.usage.completion_tokens == 6


def test_logit_bias_and_penalties_are_honoured(server, client):
    engine = engine_of(server)
    token = engine.tokenizer.encode(" the")[0]
    result = client.completions.create(
        model=TINY_MODEL, prompt="Once upon", logit_bias={str(token): 100}, max_tokens=4, seed=1, logprobs=0
    )
    assert result.choices[0].text == engine.tokenizer.decode([token] * 4)
    penalized = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        max_tokens=4,
        seed=(1 << 63) - 1,
        extra_body={"repetition_penalty": 1.3},
    )
    assert penalized.usage.completion_tokens == 4


def test_a_vanishing_temperature_is_served_and_the_engine_keeps_serving(server, client):
    # 5e-324 passes the 0-2 range check; dividing logits by it overflowed and the NaN distribution made the
    # step loop fail, which took the engine (every later request) down with it
    for temperature in (5e-324, 1e-300):
        tiny = client.chat.completions.create(
            model=TINY_MODEL, messages=QUESTION, temperature=temperature, max_tokens=3, seed=3
        )
        assert tiny.usage.completion_tokens == 3
    greedy = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, temperature=0, max_tokens=3)
    assert greedy.usage.completion_tokens == 3


def test_a_request_whose_sampling_fails_gets_a_named_error_and_its_batch_runs_on(server):
    # repetition_penalty 1e-40 passes the > 0 check, but a seen token's positive logit divided by it is inf in
    # float32: at temperature 1 the distribution is NaN and torch.multinomial raises. Before the isolation the
    # step loop died: every request in the batch failed and the engine refused all later ones (503).
    url = f"{server.base_url}/v1/chat/completions"
    neighbour = {"model": TINY_MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    alone = httpx.post(url, json=neighbour, timeout=60).json()["choices"][0]["message"]["content"]
    poison = {**neighbour, "temperature": 1.0, "seed": 5, "repetition_penalty": 1e-40}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, url, json=body, timeout=60) for body in (neighbour, poison) * 2]
        streamed = pool.submit(httpx.post, url, json={**poison, "stream": True}, timeout=60)
        responses = [f.result() for f in futures]
        streamed = streamed.result()
    for failed in (responses[1], responses[3], streamed):
        assert failed.status_code == 400, failed.text
        error = failed.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "sampling_failed"
        assert "RuntimeError" in error["message"]
    for ok in (responses[0], responses[2]):
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"] == alone
    assert httpx.post(url, json=neighbour, timeout=60).json()["choices"][0]["message"]["content"] == alone


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": 1 << 64}, "seed"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": OPENAI_TOOLS, "tool_choice": 5}, "tool_choice"),
        (
            {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format",
        ),
    ],
)
def test_bad_values_are_400_with_param(server, fields, param):
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": TINY_MODEL, "messages": QUESTION, "max_tokens": 2, **fields},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- Anthropic -----------------------------------------------------------------------------------------------


def check_tool_use(message) -> list:
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for block in uses:
        jsonschema.validate(block.input, SCHEMAS[block.name])
    return uses


def anthropic_results(message) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": f"{block.name}: 18C, sunny"}
            for block in message.content
            if block.type == "tool_use"
        ],
    }


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_tool_round_trip(claude, tool_choice):
    # greedy: at the Messages API's default temperature (1.0, and it has no seed) the random model sometimes
    # kept adding parallel calls past max_tokens, so the stop reason depended on the draw
    first = claude.messages.create(
        model=TINY_MODEL,
        max_tokens=200,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice=tool_choice,
        extra_body={"temperature": 0},
    )
    uses = check_tool_use(first)
    if tool_choice["type"] == "tool":
        assert {block.name for block in uses} == {"get_weather"}
    history = [*QUESTION, {"role": "assistant", "content": first.content}, anthropic_results(first)]
    answer = claude.messages.create(
        model=TINY_MODEL, max_tokens=8, messages=history, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}
    )
    assert all(block.type == "text" for block in answer.content)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    )


def test_anthropic_streamed_tool_use(claude):
    with claude.messages.stream(
        model=TINY_MODEL,
        max_tokens=200,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert "input_json" in kinds and kinds.count("content_block_start") == 1
    assert len(check_tool_use(message)) == 1
    history = [*QUESTION, {"role": "assistant", "content": message.content}, anthropic_results(message)]
    with claude.messages.stream(
        model=TINY_MODEL, max_tokens=200, messages=history, tools=ANTHROPIC_TOOLS
    ) as stream:
        answer = stream.get_final_message()
    if answer.stop_reason == "tool_use":
        check_tool_use(answer)
    else:
        assert answer.stop_reason in ("end_turn", "max_tokens")
        assert all("<tool_call>" not in block.text for block in answer.content if block.type == "text")


def test_anthropic_tool_choice_without_tools_is_400(server):
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": TINY_MODEL, "max_tokens": 2, "messages": QUESTION, "tool_choice": {"type": "any"}},
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["type"] == "error"


@pytest.mark.parametrize("tool_choice", ["none", "auto", "required"])
def test_a_tool_whose_arguments_are_not_an_object_is_400_on_both_faces(server, tool_choice):
    """Before (a tools trial): accepted; a forced call was written with array arguments, dropped by the parser,
    and answered 200 with neither a call nor text (``stop`` / ``end_turn``), even under ``tool_choice: none``
    nothing said the tool was unusable. OpenAI and Anthropic refuse such a schema."""
    schema = {"type": "array", "items": {"type": "integer"}}
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": TINY_MODEL,
            "messages": QUESTION,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "x", "parameters": schema}}],
            "tool_choice": tool_choice,
        },
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "Invalid schema for function 'x'" in error["message"]
    anthropic_choice = {"none": "none", "auto": "auto", "required": "any"}[tool_choice]
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={
            "model": TINY_MODEL,
            "messages": QUESTION,
            "max_tokens": 2,
            "tools": [{"name": "x", "input_schema": schema}],
            "tool_choice": {"type": anthropic_choice},
        },
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "Invalid schema for function 'x'" in response.json()["error"]["message"]
    assert_no_block_in_use(server)


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)  # bounded, so the random model's string ends within max_tokens
    unit: Unit


PYDANTIC_TOOL = openai.pydantic_function_tool(GetWeather)
"""The user trial's tool: ``unit`` is ``{"$ref": "#/$defs/Unit"}``, as pydantic, LangChain and MCP write enums."""


@pytest.mark.parametrize(
    "tool_choice", [None, "required", {"type": "function", "function": {"name": "GetWeather"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_with_refs_is_served_on_the_openai_face(client, tool_choice, stream):
    """Before: 400 ``Pointer '/$defs/Unit' does not exist`` for every ``tool_choice``, the default included."""
    parameters = PYDANTIC_TOOL["function"]["parameters"]
    assert parameters["properties"]["unit"] == {"$ref": "#/$defs/Unit"}
    request = dict(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=[PYDANTIC_TOOL],
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    if tool_choice is not None:
        request["tool_choice"] = tool_choice
    if stream:
        calls, finish, _, _, _ = streamed_calls(client, **request)
    else:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        finish = choice.finish_reason
    if tool_choice is None and finish != "tool_calls":
        assert calls == []  # auto: the random model may answer with text
        return
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        assert name == "GetWeather"
        GetWeather.model_validate_json(arguments)
        jsonschema.validate(json.loads(arguments), parameters)


def test_a_tool_schema_with_refs_is_served_on_the_anthropic_face(claude):
    schema = GetWeather.model_json_schema()
    assert "$defs" in schema
    request = dict(
        model=TINY_MODEL,
        max_tokens=200,
        messages=QUESTION,
        tools=[{"name": "get_weather", "input_schema": schema}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses
        for block in uses:
            jsonschema.validate(block.input, schema)
    assert [b.input for b in whole.content] == [b.input for b in streamed.content]


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("#/$defs/Nope", "Pointer '/$defs/Nope' does not exist"),
        ("#/definitions/Unit", "Pointer '/definitions/Unit' does not exist"),
        ("http://example.com/unit.json", "'http://example.com/unit.json'"),
    ],
)
def test_a_ref_that_does_not_resolve_is_400_naming_the_tool_and_the_pointer(server, ref, problem):
    schema = copy.deepcopy(PYDANTIC_TOOL["function"]["parameters"])
    schema["properties"]["unit"] = {"$ref": ref}
    openai_body = {
        "model": TINY_MODEL,
        "messages": QUESTION,
        "max_tokens": 2,
        "tools": [PYDANTIC_TOOL, {"type": "function", "function": {"name": "broken", "parameters": schema}}],
    }
    anthropic_body = {
        "model": TINY_MODEL,
        "messages": QUESTION,
        "max_tokens": 2,
        "tools": [{"name": "broken", "input_schema": schema}],
    }
    for choice in (None, "required"):
        body = openai_body if choice is None else {**openai_body, "tool_choice": choice}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tools" and error["code"] == "invalid_value"
        assert error["message"].startswith("Invalid 'tools': the schema of tool 'broken' "), error
        assert problem in error["message"], error
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json=anthropic_body,
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "tool 'broken'" in error["error"]["message"] and problem in error["error"]["message"], error


def test_claude_codes_default_task_tools_are_called_through_the_messages_api(claude):
    """Before (a Claude Code trial): every default Claude Code request was a 400 ``Unimplemented keys:
    ["propertyNames"]`` (TaskCreate's ``metadata``); a ``propertyNames`` every key satisfies is dropped, and the
    call holds to the rest of the schema."""
    message = claude.messages.create(
        model=TINY_MODEL,
        max_tokens=300,
        messages=QUESTION,
        tools=[
            {"name": "TaskCreate", "description": "Create a task", "input_schema": TASK_CREATE},
            *ANTHROPIC_TOOLS,
        ],
        tool_choice={"type": "tool", "name": "TaskCreate"},
        extra_body={"temperature": 0},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [b.name for b in uses] == ["TaskCreate"], message
    if message.stop_reason == "tool_use":
        jsonschema.validate(uses[0].input, TASK_CREATE)
    else:  # the random model's strings run on until max_tokens: what it wrote still holds to the keys
        assert message.stop_reason == "max_tokens" and set(uses[0].input) <= set(TASK_CREATE["properties"])


NOT_PARAMETERS = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}


def test_a_tool_schema_the_engine_cannot_compile_falls_back_unless_strict(server):
    """A non-strict tool whose schema llguidance does not implement (``not``) takes any JSON object as
    arguments (Anthropic and OpenAI accept any JSON Schema there, and promise no conformance); a strict one
    (OpenAI ``function.strict``, Anthropic ``strict``) is still a 400 naming it."""
    for strict in (False, True):
        odd = {"name": "odd", "parameters": NOT_PARAMETERS, **({"strict": True} if strict else {})}
        chat = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={
                "model": TINY_MODEL,
                "messages": QUESTION,
                "max_tokens": 200,
                "tools": [*OPENAI_TOOLS, {"type": "function", "function": odd}],
                "tool_choice": {"type": "function", "function": {"name": "odd"}},
            },
            timeout=60,
        )
        anthropic_tool = {
            "name": "odd",
            "input_schema": NOT_PARAMETERS,
            **({"strict": True} if strict else {}),
        }
        messages = httpx.post(
            f"{server.base_url}/v1/messages",
            json={
                "model": TINY_MODEL,
                "messages": QUESTION,
                "max_tokens": 200,
                "tools": [*ANTHROPIC_TOOLS, anthropic_tool],
                "tool_choice": {"type": "tool", "name": "odd"},
            },
            headers={"anthropic-version": "2023-06-01"},
            timeout=60,
        )
        if strict:
            for response in (chat, messages):
                assert response.status_code == 400, response.text
            assert chat.json()["error"]["param"] == "tools"
            assert chat.json()["error"]["message"] == (
                "Invalid 'tools': the schema of tool 'odd' is not supported by constrained decoding: "
                'Unimplemented keys: ["not"]'
            )
            assert "tool 'odd'" in messages.json()["error"]["message"], messages.text
            continue
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["odd"]
        assert calls[0]["function"]["arguments"].startswith("{")
        if choice["finish_reason"] != "length":  # a random model's string may run on until max_tokens
            assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
        assert messages.status_code == 200, messages.text
        uses = [b for b in messages.json()["content"] if b["type"] == "tool_use"]
        assert [b["name"] for b in uses] == ["odd"] and isinstance(uses[0]["input"], dict)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    schema=RANDOM_SCHEMAS,
    parameters=RANDOM_SCHEMAS.map(lambda s: {**OBJECT, "properties": {"x": s}, "required": ["x"]}),
)
def test_random_schemas_hold_through_the_server(client, schema, parameters):
    """Over random bounded schemas (the engine's property-test generator): a ``json_schema`` answer and a forced
    tool call's arguments always parse and validate, as the SDK receives them."""
    result = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
        max_tokens=400,
        seed=0,
    )
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].message.content), schema)
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    called = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=400,
        seed=0,
    )
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_responses_forced_tool_call_is_a_function_call_item(client):
    """The embedded engine's constrained tool call, through the Responses face: a ``function_call`` output item
    whose arguments validate against the tool's schema (whatever the random tiny model chose to put in them)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "name": "weather", "description": "Weather in a city", "parameters": schema}
    ]
    response = client.responses.create(
        model=TINY_MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    if response.status == "completed":
        assert len(calls) == 1 and calls[0].name == "weather"
        jsonschema.validate(json.loads(calls[0].arguments), schema)
    else:  # cut by max_output_tokens: no half call is reported as one
        assert response.status == "incomplete" and all(call.status != "completed" for call in calls)


def test_responses_streams_of_a_forced_call_carry_the_cache_header_whatever_max_output_tokens(client):
    """The Responses face's streams of a forced call, cut by every ``max_output_tokens``: each carries
    ``x-prefixgate-cache`` with the cached count its usage reports (before: none when the call arrived whole at
    the end of the output, or nothing was delivered), and no output item is a message (no markup as text)."""
    request = dict(
        model=TINY_MODEL,
        input="What is the weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}],
        tool_choice="required",
        temperature=0,
    )
    full = client.responses.create(max_output_tokens=400, **request)
    assert full.status == "completed"
    for max_tokens in range(1, full.usage.output_tokens + 1):
        raw = client.responses.with_raw_response.create(stream=True, max_output_tokens=max_tokens, **request)
        done = [
            event.response
            for event in raw.parse()
            if event.type in ("response.completed", "response.incomplete")
        ]
        assert len(done) == 1
        header = cached_in_header(raw.headers.get("x-prefixgate-cache"))
        assert header == done[0].usage.input_tokens_details.cached_tokens, max_tokens
        assert [item.type for item in done[0].output if item.type != "function_call"] == [], max_tokens


def test_anthropic_structured_output_validates(claude):
    """Anthropic's structured outputs (``output_config.format``) constrain the embedded engine like OpenAI's
    ``json_schema``: the text parses and validates, streamed and not (the tiny model's weights are random)."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    extra = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    message = claude.messages.create(model=TINY_MODEL, messages=QUESTION, max_tokens=64, extra_body=extra)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)
    with claude.messages.stream(
        model=TINY_MODEL, messages=QUESTION, max_tokens=64, extra_body=extra
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text), schema)


PREFILLED = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("prefill", "tools"), [('{"answer": "', False), ("{", False), ('{"', True)])
def test_an_anthropic_prefill_under_a_format_is_continued_so_both_together_validate(
    claude, stream, prefill, tools
):
    """Before: the continuation started a fresh instance (``{"a":`` + ``{"a": 100}``). The format now covers
    prefill and continuation together; with tools the answer has begun, so a JSON text block, no call."""
    request = dict(
        model=TINY_MODEL,
        max_tokens=64,
        messages=[*QUESTION, {"role": "assistant", "content": prefill}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": PREFILLED}}},
    )
    if tools:
        request["tools"] = ANTHROPIC_TOOLS
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
    jsonschema.validate(json.loads(prefill + message.content[0].text), PREFILLED)


def test_an_anthropic_prefill_no_answer_of_the_format_starts_with_is_a_400(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model=TINY_MODEL,
            max_tokens=8,
            messages=[*QUESTION, {"role": "assistant", "content": "Sure, here it is:"}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": PREFILLED}}},
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "prefill" in err.value.body["error"]["message"]


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_an_output_schema_the_engine_cannot_enforce_is_named_as_the_client_sent_it(claude, field):
    """The engine refuses the schema in chat terms (``response_format``); the Anthropic face names
    ``output_config.format`` (or the deprecated ``output_format``) in the 400."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    fmt = {"type": "json_schema", "schema": schema}
    extra = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=TINY_MODEL, messages=QUESTION, max_tokens=8, extra_body=extra)
    error = caught.value.body["error"]
    name = "output_config.format" if field == "output_config" else "output_format"
    assert error["message"].startswith(f"Invalid '{name}': the JSON schema is not supported"), error
    assert "response_format" not in error["message"]


def cached_in_header(header: str | None) -> int | None:
    """The ``cached=`` count of an ``x-prefixgate-cache`` value (None: no header)."""
    if header is None:
        return None
    fields = dict(part.strip().split("=", 1) for part in header.split(";"))
    return int(fields["cached"])


def streamed_calls(client, **request) -> tuple[list[tuple[str, str]], str, str, int | None, int]:
    """What a stream delivers: its calls (assembled by index, as the SDK does), finish reason, content, the
    ``cached=`` count of its ``x-prefixgate-cache`` header, and the cached count of its usage."""
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    raw = client.chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **request
    )
    usage = None
    for chunk in raw.parse():
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for fragment in choice.delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"name": "", "arguments": ""})
                call["name"] += fragment.function.name or ""
                call["arguments"] += fragment.function.arguments or ""
            finish = choice.finish_reason or finish
    assembled = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    header = cached_in_header(raw.headers.get("x-prefixgate-cache"))
    return assembled, finish, content, header, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_and_whole_answers_deliver_the_same_calls_under_max_tokens(client, tool_choice):
    """Greedy forced calls cut by every ``max_tokens`` from 1 to the whole answer: the stream and the
    non-streamed answer list the same calls and the same finish reason: the complete calls, then the call
    ``max_tokens`` cut once its name was written, with its arguments text as far as it got (before: a call cut
    inside its arguments was in neither, so a forced call cut by ``max_tokens`` answered neither a call nor
    content; earlier still, a call whose closing tag was cut was streamed only). No markup is ever content
    (before: a second call cut before its name left ``<tool_call>\\n{"name":`` there). Every stream carries
    ``x-prefixgate-cache`` with its cached count, also when its first event is a call the parser held back
    to the end of the output, or the finish of an answer with nothing to deliver (before: no header)."""
    request = dict(
        model=TINY_MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice=tool_choice, temperature=0
    )
    full = client.chat.completions.create(max_tokens=400, **request)
    assert full.choices[0].finish_reason == "tool_calls"
    whole_calls = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    seen = set()
    cut_inside = []  # max_tokens values that cut a call after its name, before its arguments closed
    before = 0
    for max_tokens in range(1, full.usage.completion_tokens + 1):
        answer = client.chat.completions.create(max_tokens=max_tokens, **request)
        choice = answer.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        streamed, finish, content, header_cached, usage_cached = streamed_calls(
            client, max_tokens=max_tokens, **request
        )
        assert (streamed, finish) == (calls, choice.finish_reason)
        assert not choice.message.content and content == ""  # forced calls: no text, no markup
        assert header_cached == usage_cached, max_tokens
        expected_reason = "tool_calls" if max_tokens == full.usage.completion_tokens else "length"
        assert choice.finish_reason == expected_reason
        assert len(calls) >= before  # once a call is named, every longer answer holds it
        before = len(calls)
        assert calls[:-1] == whole_calls[: len(calls) - 1]  # all but the last are whole, the greedy ones
        if calls:
            (name, arguments), (whole_name, whole_arguments) = calls[-1], whole_calls[len(calls) - 1]
            assert name == whole_name and whole_arguments.startswith(arguments), max_tokens
            if arguments != whole_arguments:
                cut_inside.append(max_tokens)
            else:
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        seen.add(len(calls))
    assert seen == set(range(len(whole_calls) + 1))
    assert cut_inside  # a cut call came back as a call


def test_anthropic_streamed_and_whole_messages_deliver_the_same_tool_uses_under_max_tokens(claude):
    """The same rule on the Anthropic face (``tool_choice: {type: tool}``): for every ``max_tokens`` the
    streamed Message (as the SDK assembles it) and the non-streamed one hold the same ``tool_use`` blocks and
    ``stop_reason``, no text block, and the stream carries ``x-prefixgate-cache``. A ``tool_use`` cut inside
    its input is delivered (``stop_reason`` ``max_tokens``), its ``input`` the members it completed, read in
    jiter's partial mode as the SDK reads the stream's ``input_json_delta`` fragments (before: not delivered)."""
    request = dict(
        model=TINY_MODEL,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0.0},
    )
    full = claude.messages.create(max_tokens=400, **request)
    assert full.stop_reason == "tool_use"
    full_uses = [(b.name, b.input) for b in full.content if b.type == "tool_use"]
    cut_inside = []
    before = 0
    for max_tokens in range(1, full.usage.output_tokens + 1):
        whole = claude.messages.create(max_tokens=max_tokens, **request)
        with claude.messages.stream(max_tokens=max_tokens, **request) as stream:
            streamed = stream.get_final_message()
            header = stream.response.headers.get("x-prefixgate-cache")
        assert cached_in_header(header) == streamed.usage.cache_read_input_tokens, max_tokens
        assert [b.type for b in whole.content + streamed.content if b.type != "tool_use"] == []  # no text
        uses = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == uses
        assert streamed.stop_reason == whole.stop_reason
        assert whole.stop_reason == ("tool_use" if max_tokens == full.usage.output_tokens else "max_tokens")
        assert len(uses) >= before
        before = len(uses)
        assert uses[:-1] == full_uses[: len(uses) - 1]
        if uses:
            (name, arguments), (full_name, full_arguments) = uses[-1], full_uses[len(uses) - 1]
            assert name == full_name and arguments.items() <= full_arguments.items(), max_tokens
            if arguments != full_arguments:
                cut_inside.append(max_tokens)
        if whole.stop_reason == "tool_use":
            for _, arguments in uses:
                jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert cut_inside  # a tool_use cut inside its input came back


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_can_be_sent_back_and_keeps_its_cache(client, stream):
    """The next turn of an agent loop resends the cut call as it came back (its arguments not valid JSON) with
    a tool result: it is served, not refused (before: 400 "not valid JSON"), and the prompt reuses the KV of
    the previous prompt whole (the cut call's own KV is not cached by default, ``engine.cache_generated_kv``:
    the next turn computes it as prompt)."""
    request = dict(
        model=TINY_MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="required", temperature=0
    )
    full = client.chat.completions.create(max_tokens=400, **request)
    arguments = full.choices[0].message.tool_calls[0].function.arguments
    resent = 0
    for max_tokens in range(1, full.usage.completion_tokens):
        first = client.chat.completions.create(max_tokens=max_tokens, **request)
        message = first.choices[0].message
        if not message.tool_calls or message.tool_calls[0].function.arguments in ("", arguments):
            continue  # no call yet, or cut before its arguments began, or the first call is whole
        cut = message.tool_calls[0].function.arguments
        with pytest.raises(json.JSONDecodeError):
            json.loads(cut)
        history = [*QUESTION, message.model_dump(exclude_none=True), *tool_results(message)]
        follow = dict(
            model=TINY_MODEL, messages=history, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=2
        )
        if stream:
            chunks = list(
                client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **follow)
            )
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(**follow).usage
        cached = usage.prompt_tokens_details.cached_tokens
        # at least the previous prompt; an earlier cut's follow-up prompt may have cached more of this call
        assert cached >= first.usage.prompt_tokens, (max_tokens, cut)
        resent += 1
    assert resent >= 3


# ---- a response format with tools ------------------------------------------------------------------------------
VERDICT = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "level": {"type": "integer", "enum": [1, 2]},
    },
    "required": ["answer", "level"],
    "additionalProperties": False,
}
VERDICT_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True},
}


def check_call_or_answer(calls, content, finish, schema, ended=("tool_calls", "stop")) -> str:
    """An answer to tools + a response format: valid calls (finish ``tool_calls``, no content) or content
    that is an instance of ``schema`` (finish ``stop``, no calls). Which of the two it was. ``json_object``'s
    answer (any object: a random model's keys are unbounded) may run out of ``max_tokens``: then a prefix of one.
    """
    if calls:
        check_openai_calls(calls)
        assert not content and finish == ended[0]
        return "calls"
    if finish == "length" and schema == {"type": "object"}:
        assert content.startswith("{")
        return "answer"
    assert finish == ended[1], (finish, content)
    jsonschema.validate(json.loads(content), schema)
    return "answer"


@pytest.mark.parametrize(
    ("response_format", "schema"), [(VERDICT_FORMAT, VERDICT), ({"type": "json_object"}, {"type": "object"})]
)
@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_a_response_format_with_tools_answers_with_calls_or_the_format(
    client, response_format, schema, tool_choice
):
    """Before: 400 "The embedded engine cannot combine 'response_format' with tool calls" (agent frameworks
    send both: the OpenAI Agents SDK's ``output_type`` with tools, LangChain's structured output with tools).
    Each seed's answer, streamed and not, is valid calls or valid JSON of the format, and both give the same."""
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    kinds = set()
    for seed in range(4):
        request = dict(
            model=TINY_MODEL,
            messages=QUESTION,
            tools=OPENAI_TOOLS,
            response_format=response_format,
            max_tokens=300,
            seed=seed,
            **extra,
        )
        choice = client.chat.completions.create(**request).choices[0]
        kind = check_call_or_answer(
            choice.message.tool_calls, choice.message.content, choice.finish_reason, schema
        )
        kinds.add(kind)
        calls, finish, content, _, _ = streamed_calls(client, **request)
        assert (calls, finish, content) == (
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
            choice.finish_reason,
            choice.message.content or "",
        )
    assert kinds == {"calls", "answer"}  # these seeds draw both (fixed random weights)


def test_the_user_trial_request_is_served(server):
    """The exact body of the report: a tool without parameters and ``json_object``, ``tool_choice`` omitted."""
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": TINY_MODEL,
            "messages": QUESTION,
            "tools": [{"type": "function", "function": {"name": "x"}}],
            "response_format": {"type": "json_object"},
            "max_tokens": 300,
            "seed": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    if choice["message"].get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["x"]
    else:
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_with_a_response_format_is_a_call_and_none_is_the_format(client, stream):
    for tool_choice, expected in (
        ("required", "calls"),
        ({"type": "function", "function": {"name": "get_time"}}, "calls"),
        ("none", "answer"),
    ):
        for seed in range(2):
            request = dict(
                model=TINY_MODEL,
                messages=QUESTION,
                tools=OPENAI_TOOLS,
                tool_choice=tool_choice,
                response_format=VERDICT_FORMAT,
                max_tokens=300,
                seed=seed,
            )
            if stream:
                calls, finish, content, _, _ = streamed_calls(client, **request)
                got = "calls" if calls else check_call_or_answer([], content, finish, VERDICT)
                if calls:
                    assert finish == "tool_calls" and content == ""
                    for name, arguments in calls:
                        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            else:
                choice = client.chat.completions.create(**request).choices[0]
                got = check_call_or_answer(
                    choice.message.tool_calls, choice.message.content, choice.finish_reason, VERDICT
                )
                if isinstance(tool_choice, dict):
                    assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
            assert got == expected, (tool_choice, seed)


class Verdict(pydantic.BaseModel):
    answer: typing.Literal["yes", "no"]
    level: typing.Literal[1, 2]


def test_the_sdk_parse_helper_gets_a_parsed_answer_or_parsed_calls(client):
    """``client.chat.completions.parse`` with a pydantic ``response_format`` and a strict pydantic tool (what
    the OpenAI Agents SDK sends for an ``output_type`` with tools): ``message.parsed`` or each call's
    ``parsed_arguments``."""
    kinds = set()
    for seed in range(4):
        completion = client.chat.completions.parse(
            model=TINY_MODEL,
            messages=QUESTION,
            tools=[PYDANTIC_TOOL],
            response_format=Verdict,
            max_tokens=300,
            seed=seed,
        )
        message = completion.choices[0].message
        if message.tool_calls:
            kinds.add("calls")
            assert completion.choices[0].finish_reason == "tool_calls" and message.parsed is None
            assert all(isinstance(call.function.parsed_arguments, GetWeather) for call in message.tool_calls)
        else:
            kinds.add("answer")
            assert completion.choices[0].finish_reason == "stop" and isinstance(message.parsed, Verdict)
    assert kinds  # whichever the random model picks, it parsed


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_responses_text_format_with_tools_gives_function_calls_or_a_json_message(client, stream, tool_choice):
    """``text.format`` with tools on the Responses face: ``function_call`` items only, or one ``message`` whose
    text is an instance of the format. The Responses API has no ``seed``: four draws at temperature 1 (one call
    at most, so the answer is short), each checked whichever branch it took."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}]
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    for _ in range(4):
        request = dict(
            model=TINY_MODEL,
            input="What is the weather in Paris?",
            tools=tools,
            text=text,
            parallel_tool_calls=False,
            max_output_tokens=300,
            temperature=1,
            **extra,
        )
        if stream:
            events = list(client.responses.create(stream=True, **request))
            (response,) = [
                e.response for e in events if e.type in ("response.completed", "response.incomplete")
            ]
        else:
            response = client.responses.create(**request)
        assert response.status == "completed"
        kinds_of_items = [item.type for item in response.output]
        if "function_call" in kinds_of_items:
            (call,) = response.output
            assert call.type == "function_call" and call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        else:
            assert tool_choice is None and kinds_of_items == ["message"]
            jsonschema.validate(json.loads(response.output_text), VERDICT)


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def check_tool_use_or_json_text(message, tool_choice) -> None:
    if message.stop_reason == "tool_use":
        assert tool_choice != {"type": "none"}
        check_tool_use(message)
        assert [b.type for b in message.content if b.type != "tool_use"] == []
    else:
        assert tool_choice not in ({"type": "any"}, {"type": "tool", "name": "get_time"})
        assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
        jsonschema.validate(json.loads(message.content[0].text), ANSWER)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice",
    [
        None,
        {"type": "auto", "disable_parallel_tool_use": True},
        {"type": "any"},
        {"type": "tool", "name": "get_time"},
        {"type": "none"},
    ],
)
def test_anthropic_output_config_format_with_tools_gives_tool_use_or_a_json_text(claude, stream, tool_choice):
    """Before: 400 "The embedded engine cannot combine 'output_config.format' with tool calls". Greedy for
    each ``tool_choice`` (``tool_use`` blocks and ``stop_reason`` ``tool_use``, or one text block of the
    format and ``end_turn``), then, for ``auto`` with one call at most, three draws at temperature 1 (the
    Messages API has no seed), each checked whichever branch it took."""
    request = dict(
        model=TINY_MODEL,
        max_tokens=300,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": ANSWER}}},
    )
    if tool_choice is not None:
        request["tool_choice"] = tool_choice
    temperatures = [0.0] + (
        [1.0] * 3 if tool_choice == {"type": "auto", "disable_parallel_tool_use": True} else []
    )
    for temperature in temperatures:
        request["extra_body"]["temperature"] = temperature
        if stream:
            with claude.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = claude.messages.create(**request)
        check_tool_use_or_json_text(message, tool_choice)
        if tool_choice is not None and tool_choice["type"] == "tool":
            assert {b.name for b in message.content} == {"get_time"}


UNENFORCEABLE = {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_a_format_schema_the_engine_cannot_enforce_with_tools_is_a_400_naming_the_format(server, tool_choice):
    """As without tools: the 400 names the face's own format field (the answer's sub-grammar is refused)."""
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": TINY_MODEL,
            "messages": QUESTION,
            "tools": OPENAI_TOOLS,
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNENFORCEABLE}},
            **choice,
        },
        timeout=60,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "response_format", chat.text
    assert chat.json()["error"]["message"] == (
        "Invalid 'response_format': the JSON schema is not supported by constrained decoding: Unknown format: nope"
    )
    responses = httpx.post(
        f"{server.base_url}/v1/responses",
        json={
            "model": TINY_MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS}],
            "max_output_tokens": 2,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": UNENFORCEABLE}},
            **choice,
        },
        timeout=60,
    )
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "text.format", (
        responses.text
    )
    anthropic_choice = {} if tool_choice is None else {"tool_choice": {"type": tool_choice}}
    messages = httpx.post(
        f"{server.base_url}/v1/messages",
        json={
            "model": TINY_MODEL,
            "max_tokens": 2,
            "messages": QUESTION,
            "tools": ANTHROPIC_TOOLS,
            "output_config": {"format": {"type": "json_schema", "schema": UNENFORCEABLE}},
            **anthropic_choice,
        },
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert messages.status_code == 400, messages.text
    error = messages.json()["error"]
    assert error["message"].startswith("Invalid 'output_config.format': the JSON schema is not supported"), (
        error
    )
