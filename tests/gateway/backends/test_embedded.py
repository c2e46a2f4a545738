"""ChatRequest -> engine GenerationRequest in the embedded backend (no model needed)."""

from __future__ import annotations

import pytest

from engine.api import Constraint, SamplingParams
from gateway.backends.embedded_request import check_supported, generation_request
from gateway.core.errors import InvalidRequestError
from gateway.core.request import ChatRequest


def request(messages, params: SamplingParams | None = None, **fields) -> ChatRequest:
    return ChatRequest(model="m", messages=messages, params=params or SamplingParams(max_tokens=3), **fields)


def test_messages_become_template_messages():
    generation = generation_request(
        request(
            [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            ],
            tenant="acme",
            request_id="r1",
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f"},
                    "x-anthropic": {"cache_control": {"type": "ephemeral"}},
                }
            ],
        )
    )
    assert generation.messages[0] == {"role": "system", "content": "Be brief."}
    assert generation.messages[1] == {"role": "user", "content": "a\nb"}
    assert generation.messages[2]["content"] == "" and generation.messages[2]["tool_calls"][0]["id"] == "c"
    assert generation.tools == [{"type": "function", "function": {"name": "f"}}]
    assert (generation.cache_salt, generation.request_id, generation.params.max_tokens) == ("acme", "r1", 3)
    assert generation.prompt is None and generation.prompt_token_ids is None


def test_anthropic_thinking_parts_are_dropped():
    thinking = {"type": "x-anthropic", "block": {"type": "thinking", "thinking": "hmm", "signature": "s"}}
    generation = generation_request(
        request(
            [{"role": "assistant", "content": [thinking, {"type": "text", "text": "answer"}]}],
            anthropic_body={},
        )
    )
    assert generation.messages == [{"role": "assistant", "content": "answer"}]


def test_completion_requests_send_the_prompt():
    generation = generation_request(
        ChatRequest(model="m", messages=[], params=SamplingParams(), kind="completion", prompt="Once")
    )
    assert (generation.prompt, generation.messages, generation.tools) == ("Once", None, None)


@pytest.mark.parametrize(
    ("messages", "fields", "param"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "x-anthropic", "block": {"type": "document"}}]}],
            {},
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"tools": [{"type": "x-anthropic", "tool": {"type": "web_search"}}]},
            "tools[0]",
        ),
        ([{"role": "user", "content": "x"}], {"openai_body": {"best_of": 2}}, "best_of"),
        # before: accepted and ignored (found by a user trial); nothing stores a completion here
        ([{"role": "user", "content": "x"}], {"openai_body": {"store": True}}, "store"),
    ],
)
def test_what_the_engine_cannot_honour_is_a_400(messages, fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request(messages, **fields))
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (
        400,
        param,
        "unsupported_value",
    )


def test_neutral_values_and_bookkeeping_fields_are_accepted():
    body = {
        "logprobs": False,
        "frequency_penalty": 0,
        "response_format": {"type": "text"},
        "metadata": {"a": "b"},
        "store": False,
    }
    generation_request(request([{"role": "user", "content": "x"}], openai_body=body, tool_choice="none"))
    # an Anthropic body is not checked against OpenAI's fields (its own face validated it)
    generation_request(
        request([{"role": "user", "content": "x"}], anthropic_body={"tool_choice": {"type": "auto"}})
    )


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


class _GenericEngine:
    """What ``generation_request`` reads of an engine: its tool format and tokenizer's vocabulary size."""

    tool_format = "generic"

    class tokenizer:  # noqa: N801 - an attribute holder standing in for the engine's tokenizer
        vocab_size = 100


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        (None, None, ("auto", None, True)),
        ("auto", False, ("auto", None, False)),
        ("required", True, ("required", None, True)),
        ({"type": "function", "function": {"name": "get_time"}}, None, ("function", "get_time", True)),
    ],
)
def test_tool_choice_becomes_a_tool_calls_constraint(tool_choice, parallel, expected):
    generation = generation_request(
        request(
            [{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
        ),
        _GenericEngine(),
    )
    constraint = generation.params.constraint
    assert constraint.kind == "tool_calls" and [t["function"]["name"] for t in constraint.tools] == [
        "get_weather",
        "get_time",
    ]
    assert (constraint.tool_choice, constraint.tool_name, constraint.parallel_tool_calls) == expected


FORMAT_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("answer", "schema"),
    [
        (Constraint(kind="json_object"), {"type": "object"}),
        (Constraint(kind="json_schema", json_schema=FORMAT_SCHEMA), FORMAT_SCHEMA),
    ],
)
@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_a_response_format_with_tools_is_the_answer_branch_of_the_tool_constraint(
    answer, schema, tool_choice
):
    """Before: 400 "The embedded engine cannot combine 'response_format' with tool calls" even for ``auto``."""
    generation = generation_request(
        request(
            [{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            params=SamplingParams(max_tokens=3, constraint=answer),
        ),
        _GenericEngine(),
    )
    constraint = generation.params.constraint
    assert (constraint.kind, constraint.tool_choice, constraint.json_schema) == ("tool_calls", "auto", schema)
    assert len(constraint.tools) == 2 and generation.tools == TOOLS


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("required", ("tool_calls", "required", None)),
        ({"type": "function", "function": {"name": "get_time"}}, ("tool_calls", "function", None)),
        ("none", ("json_object", "auto", None)),
    ],
)
def test_a_forced_call_leaves_no_answer_to_format_and_none_leaves_only_the_format(tool_choice, expected):
    constraint = generation_request(
        request(
            [{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            params=SamplingParams(max_tokens=3, constraint=Constraint(kind="json_object")),
        ),
        _GenericEngine(),
    ).params.constraint
    assert (constraint.kind, constraint.tool_choice, constraint.json_schema) == expected


def test_anthropic_output_config_format_with_tools_is_the_answer_branch_too():
    generation = generation_request(
        request(
            [{"role": "user", "content": "x"}],
            tools=TOOLS,
            anthropic_body={"output_config": {"format": {"type": "json_schema", "schema": FORMAT_SCHEMA}}},
        ),
        _GenericEngine(),
    )
    constraint = generation.params.constraint
    assert (constraint.kind, constraint.tool_choice, constraint.json_schema) == (
        "tool_calls",
        "auto",
        FORMAT_SCHEMA,
    )


def test_tool_choice_none_renders_tools_without_a_constraint():
    generation = generation_request(
        request([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"), _GenericEngine()
    )
    assert generation.params.constraint is None and len(generation.tools) == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools
        ({"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"params": SamplingParams(logit_bias=((100, 1.0),))}, "logit_bias"),
    ],
)
def test_bad_tool_choice_and_logit_bias_are_400s(fields, param):
    fields = dict(fields)
    params = fields.pop("params", SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(
            ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], params=params, **fields),
            _GenericEngine(),
        )
    assert (caught.value.status_code, caught.value.param) == (400, param)


def test_a_template_tool_format_cannot_force_a_call():
    engine = _GenericEngine()
    engine.tool_format = "template"
    generation = generation_request(request([{"role": "user", "content": "x"}], tools=TOOLS), engine)
    assert generation.params.constraint is None
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(
            request([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required"), engine
        )
    assert (caught.value.param, caught.value.code) == ("tool_choice", "unsupported_value")


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, "image content"),
        ({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}, "audio content"),
        ({"type": "bogus"}, "'bogus' content"),
    ],
)
def test_a_non_text_part_is_named_in_words_with_its_place(part, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request(messages))
    assert caught.value.message == (
        f"messages[0].content[1]: {words} is not supported by the embedded engine (text only)."
    )
    assert caught.value.param == "messages[0].content[1].type"


def test_n_above_the_engine_limit_is_worded_as_the_other_400s():
    """Before: "n must be an integer in [1, 16], got 17" (the engine's own wording)."""
    asked = ChatRequest(
        model="m", messages=[{"role": "user", "content": "x"}], params=SamplingParams(max_tokens=4, n=17)
    )
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(asked)
    error = caught.value
    assert (error.param, error.code) == ("n", "integer_above_max_value")
    assert error.message == (
        "Invalid 'n': integer above maximum value. Expected a value <= 16 with the embedded engine, but got 17 "
        "instead."
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"container": "c1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "https://m.test", "name": "m"}]}, "mcp_servers"),
    ],
)
def test_anthropic_only_fields_the_engine_cannot_honour_are_400s(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request([{"role": "user", "content": "x"}], anthropic_body=fields))
    assert (caught.value.param, caught.value.code) == (param, "unsupported_value")
    assert "embedded" in caught.value.message


SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields",
    [
        {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        {"output_format": {"type": "json_schema", "schema": SCHEMA}},  # the deprecated beta form (was a 400)
    ],
)
def test_anthropic_structured_outputs_are_the_engine_json_schema_constraint(fields):
    generation = generation_request(request([{"role": "user", "content": "x"}], anthropic_body=fields))
    assert generation.params.constraint == Constraint(kind="json_schema", json_schema=SCHEMA)


def test_both_anthropic_output_formats_at_once_are_a_400():
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"output_format": fmt, "output_config": {"format": fmt}}
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request([{"role": "user", "content": "x"}], anthropic_body=body))
    assert caught.value.param == "output_format"


@pytest.mark.parametrize(
    ("deltas", "reason", "stop_string", "expected", "uncomputed"),
    [
        ([("a", (5, 6)), ("b", (7,))], "length", None, (5, 6, 7), 1),  # cut: every generated token is text
        (
            [("a", (5, 6)), ("", (2,))],
            "stop",
            None,
            (5, 6),
            0,
        ),  # the stop token (no text) ends it: not resent
        ([("a", (5,)), ("}", (9,))], "stop", None, (5, 9), 1),  # a grammar that ended on a token of text
        ([("a", (5,)), ("", (8,))], "stop", "xy", (), 0),  # a stop string cut the text: the ids are not it
        ([("", (7,))], "length", None, (7,), 1),  # a one-token reply cut mid-character: its token has no KV
    ],
)
def test_the_answer_recorded_for_the_next_explanation_is_what_a_client_resends(
    deltas, reason, stop_string, expected, uncomputed
):
    """``Finish.answer_token_ids`` (the cache explanation's record of the served answer) holds the generated
    ids as the resent reply renders them: without the silent stop token, none when a stop string cut it; and
    ``answer_uncomputed`` says whether its last id is the last sampled token, which the engine never fed to the
    model (so never cached)."""
    from engine.api import Finished, TextDelta, Usage
    from gateway.backends.embedded import _Choice

    choice = _Choice(None)
    for text, ids in deltas:
        choice.note_tokens(TextDelta(text, ids))
    finished = Finished(reason, Usage(10, 0, 3), None, "", stop_string=stop_string)
    assert choice.answer_token_ids(finished) == expected
    assert choice.answer_uncomputed(finished) == uncomputed


def test_a_tool_call_cut_by_max_tokens_is_accepted_back_with_its_arguments_as_sent():
    """A call the engine returned cut by ``max_tokens`` (arguments not valid JSON) comes back in the next turn
    of an agent loop: it goes to the engine as sent (before: 400 "not valid JSON", so the loop broke on the turn
    after a cut call); the engine renders it verbatim (``engine.tool_calls._history_call``)."""
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "w", "arguments": '{"city": "Par'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "x"},
        {"role": "tool", "tool_call_id": "b", "content": "y"},
    ]
    calls = generation_request(request(messages)).messages[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city": "Par']


def test_empty_tool_call_arguments_still_render_as_no_arguments():
    messages = [
        {"role": "user", "content": "ping"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "p", "arguments": ""}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "pong"},
    ]
    assert generation_request(request(messages)).messages[1]["tool_calls"][0]["function"]["arguments"] == ""


def test_an_anthropic_server_tool_is_named_by_its_own_type():
    """Before: "Tool type 'x-anthropic' is not supported" (the gateway's internal wrapper, not the client's
    ``web_search_20250305``)."""
    tools = [{"type": "x-anthropic", "tool": {"type": "web_search_20250305", "name": "web_search"}}]
    with pytest.raises(InvalidRequestError) as caught:
        generation_request(request([{"role": "user", "content": "x"}], tools=tools))
    error = caught.value
    assert (error.param, error.code) == ("tools[0]", "unsupported_value")
    assert "'web_search_20250305'" in error.message and "x-anthropic" not in error.message


def test_the_explanation_tokenizer_encodes_control_text_in_messages_as_the_engine_does():
    from engine.tokenizer import Tokenizer
    from gateway.backends.embedded import EnginePromptTokenizer
    from tests.engine.checkpoints import BOS, CHAT_TEMPLATE, EOS, IM_START, train_tokenizer

    backend = train_tokenizer()
    tok = Tokenizer(backend, CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": EOS}, [backend.token_to_id(EOS)])
    prompt = EnginePromptTokenizer(tok, "m")
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": f"hi{EOS}\n{IM_START}assistant\nok"},
    ]
    text = prompt.render(messages, None, True)
    ids, starts = prompt.encode_in_scope(text, "t")
    assert ids == tok.render_chat(messages) != tok.encode(text)
    assert all(
        text.startswith(tok.decode([i], skip_special_tokens=False), s)
        for i, s in zip(ids, starts, strict=True)
    )
    preamble = "<|tools|>\n[]\n\n"  # the explanation's tools preamble, before the rendering
    with_preamble, shifted = prompt.encode(preamble + text)
    assert with_preamble[-len(ids) :] == ids and shifted[-len(ids) :] == [s + len(preamble) for s in starts]
    plain = [{"role": "user", "content": "hello"}]
    assert prompt.encode(prompt.render(plain, None, True)) == tok.encode_with_offsets(
        tok.apply_chat_template(plain)
    )


@pytest.mark.parametrize(
    ("field", "value", "successor"),
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}], "tools"),
        ("function_call", {"name": "f"}, "tool_choice"),
    ],
)
def test_legacy_function_calling_is_refused_with_what_to_send_instead(field, value, successor):
    """Before: "only [] is supported." and nothing about ``tools`` (a fresh-user trial's report)."""
    with pytest.raises(InvalidRequestError) as caught:
        check_supported({field: value})
    assert (caught.value.param, caught.value.code) == (field, "unsupported_value")
    assert caught.value.message.endswith(f"Use '{successor}' instead.")
    check_supported({field: [] if field == "functions" else "auto"})  # the values that ask for nothing pass


def test_a_model_without_prefix_caching_is_warmed_as_an_upstream_is():
    """Before: ``POST /admin/cache/warm`` for a model with ``enable_prefix_caching: false`` prefilled the
    prompt and answered 200 with nothing cached; now the backend says it keeps no cache of its own (None), as
    an upstream does, which ``warm_messages`` answers with the same 400."""
    import asyncio

    from engine.api import EngineConfig, WarmResult
    from gateway.backends.base import Backend
    from gateway.backends.embedded import EmbeddedBackend
    from gateway.config.schema import EmbeddedModel

    class Engine:
        async def warm(self, generation, pin=False, prompt=None):
            return WarmResult("k", 10, 8, 0, None, 8)

    warm_request = request([{"role": "system", "content": "s"}])
    cached = EmbeddedBackend(EmbeddedModel(name="m"), engine=Engine())
    assert asyncio.run(cached.warm(warm_request, None, False)) is not None
    off = EmbeddedModel(name="m", engine=EngineConfig(enable_prefix_caching=False))
    assert asyncio.run(EmbeddedBackend(off, engine=Engine()).warm(warm_request, None, False)) is None
    assert asyncio.run(Backend.warm(cached, warm_request, None, False)) is None  # what an upstream answers


def _chunks_of(tokens: list[bytes], texts: list[str], close: bool = False) -> list[tuple[str, list[bytes]]]:
    """(text, logprob bytes) of each delta a choice makes of ``tokens`` and the engine's ``texts`` for them."""
    from gateway.backends.embedded import _Choice
    from gateway.core.events import TokenLogprob

    choice = _Choice(parser=None)
    deltas = []
    for raw, text in zip(tokens, texts, strict=True):
        deltas += choice.deltas(text, 0, (TokenLogprob(raw.decode("utf-8", "replace"), tuple(raw), -0.5),))
    if close:
        deltas += choice.close(0, cut=True)
    return [(d.text, [bytes(e.token_bytes) for e in d.logprobs]) for d in deltas]


def test_each_chunks_logprobs_are_the_tokens_of_its_text_across_multibyte_characters():
    """A trial: streaming "そ" (e3 81 9d, two tokens) then "れ" (e3 82 8c, two tokens), the chunk "そ" carried only
    its first token and the chunk "れ" the second token of "そ" and the first of "れ": every chunk's logprobs
    lagged its text by one token. Each chunk now carries the tokens that start inside its text."""
    tokens = [b"\xe3\x81", b"\x9d", b"\xe3\x82", b"\x8c", b" ok", b"\xe3\x81"]
    texts = ["", "そ", "", "れ", " ok", "\ufffd"]  # the engine's text per token (the last: cut, flushed)
    assert _chunks_of(tokens, texts, close=True) == [
        ("そ", [b"\xe3\x81", b"\x9d"]),
        ("れ", [b"\xe3\x82", b"\x8c"]),
        (" ok", [b" ok"]),
        ("\ufffd", [b"\xe3\x81"]),
    ]


def test_a_token_after_unfinished_bytes_it_breaks_off_starts_after_their_replacement_character():
    """Bytes that never finish a character become U+FFFD when the next token breaks them off: that token starts
    after it (the stop-string e2e test caught a first version that counted it as starting inside)."""
    tokens = [b"c", b"\xe3", b"\xf0", b" at"]
    texts = ["c", "", "\ufffd", "\ufffd at"]  # e3 broken off by f0, f0 by " at"
    assert _chunks_of(tokens, texts) == [
        ("c", [b"c"]),
        ("\ufffd", [b"\xe3"]),
        ("\ufffd at", [b"\xf0", b" at"]),
    ]
