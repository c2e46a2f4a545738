"""The generic tool format: canonical tool rendering before the system text, history rendered back exactly as the
model writes calls, and the incremental parser (any split of the stream gives the same calls and content)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.tool_calls import (
    ContentDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
    canonical_json,
    function_tools,
    parse_tool_calls,
    render_call,
    render_messages_with_tools,
    render_tools_prompt,
)
from tests.engine.engine_helpers import tiny_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"name": "get_time", "parameters": {"properties": {"tz": {"type": "string"}}, "type": "object"}}


def ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def test_tools_render_identically_whatever_the_key_order():
    reordered = {
        "function": {
            "parameters": WEATHER["function"]["parameters"],
            "description": "Weather of a city",
            "name": "get_weather",
        },
        "type": "function",
    }
    a = render_tools_prompt(function_tools([WEATHER, TIME]))
    b = render_tools_prompt(function_tools([reordered, {"type": "function", "function": TIME}]))
    assert a == b
    assert '{"function": {"description": "Weather of a city", "name": "get_weather"' in a


def test_tools_go_before_the_system_text_and_history_renders_as_the_model_writes():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz":"CET"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "09:00"},
    ]
    out = render_messages_with_tools(msgs, function_tools([WEATHER, TIME]))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    assert out[0]["content"].endswith("</tool_call>\n\nBe brief.")
    assistant = out[2]["content"]
    assert assistant == "Checking.\n" + render_call("get_weather", {"city": "Paris"}) + "\n" + render_call(
        "get_time", {"tz": "CET"}
    )
    content, calls = parse_tool_calls(assistant, ids())
    assert content == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\n09:00\n</tool_response>",
    }
    assert len(out) == 4


def test_no_system_message_gets_one_with_the_tools():
    out = render_messages_with_tools([{"role": "user", "content": "hi"}], function_tools([TIME]))
    assert out[0]["role"] == "system" and out[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "retrieval"}],
        [{"function": {"description": "x"}}],
        [{"name": "f", "parameters": 3}],
        "x",
    ],
)
def test_bad_tools_are_refused(tools):
    with pytest.raises(InvalidRequestError) as err:
        function_tools(tools)
    assert err.value.param == "tools"


def test_a_call_cut_by_max_tokens_renders_back_as_the_model_wrote_it():
    """Arguments that are not JSON are a call this engine returned cut by ``max_tokens``: resent, the call
    renders its text verbatim after the call head (the tokens the model wrote, whose KV is cached), closed."""
    cut = '{"city": "Pa'
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": cut}}]}]
    (out,) = render_messages_with_tools(msgs, None)
    whole = render_call("get_weather", {"city": "Paris"})
    assert out["content"] == whole.replace('{"city": "Paris"}', cut)
    assert out["content"].startswith(whole[: whole.index(cut) + len(cut)])  # the model's text, to the cut


def test_ill_formed_calls_in_history_are_refused():
    for call in ({"function": {"arguments": "{}"}}, "f", {"function": {"name": "", "arguments": "{}"}}):
        with pytest.raises(InvalidRequestError):
            render_messages_with_tools([{"role": "assistant", "tool_calls": [call]}], None)


OUTPUT = (
    "Sure.\n"
    + render_call("get_weather", {"city": 'Pa"ris }', "deep": {"a": [1, {"b": "}"}]}})
    + "\n"
    + render_call("get_time", {})
)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(OUTPUT)), max_size=12))
def test_incremental_parse_equals_whole_parse_for_any_split(cuts):
    bounds = sorted(set([0, len(OUTPUT), *cuts]))
    parser = ToolCallParser(ids())
    events = []
    for a, b in itertools.pairwise(bounds):
        events += parser.feed(OUTPUT[a:b])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    args = [
        "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == i)
        for i in (0, 1)
    ]
    whole_content, whole_calls = parse_tool_calls(OUTPUT, ids())
    assert content == whole_content == "Sure."
    assert [s.name for s in starts] == [c.name for c in whole_calls] == ["get_weather", "get_time"]
    assert [e.call for e in ends] == whole_calls
    assert args == [c.arguments_json for c in whole_calls]
    assert events.index(starts[0]) < events.index(ends[0]) < events.index(starts[1])


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("just text", "just text", []),
        ("a <tool_call> inline mention", "a <tool_call> inline mention", []),
        ('<tool_call>\n{"name": 3}\n</tool_call>', '<tool_call>\n{"name": 3}\n</tool_call>', []),
        # ended inside the arguments without a cut (possible only unconstrained): not a call
        ('<tool_call>\n{"name": "f", "arguments": {"a": ', "", []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1', "", []),
        # cut by max_tokens after complete arguments, before "}" / "</tool_call>": a call
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}', "", ["f"]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool', "", ["f"]),
        (render_call("f", {}) + '\n<tool_call>\n{"name": "g", "arguments": {}}', "", ["f", "g"]),
        ('<tool_call>\n{"name": "f", "arguments": [1]}', "", []),  # arguments that are not an object
        (render_call("f", {}) + "\nafter", "\nafter", ["f"]),
    ],
)
def test_parser_edge_cases(text, content, names):
    got_content, calls = parse_tool_calls(text, ids())
    assert got_content == content and [c.name for c in calls] == names


CUT_OUTPUT = (
    "Let me check.\n" + render_call("get_weather", {"city": "Paris"}) + "\n" + render_call("get_time", {})
)


@pytest.mark.parametrize(
    ("text", "cut", "content", "names"),
    [
        # the user's report: a second call cut by max_tokens before its name leaked '<tool_call>\n{"name":'
        (
            render_call("get_weather", {"city": "Paris"}) + '\n<tool_call>\n{"name":',
            True,
            "",
            ["get_weather"],
        ),
        ('<tool_call>\n{"na', True, "", []),
        ("<tool_call>\n", True, "", []),
        ('<tool_call>\n{"name": "f"', False, "", []),  # a stop string cut it: still no call, no markup
        (render_call("f", {}) + "\n<tool_", True, "", ["f"]),  # the next call's tag, cut
        (render_call("f", {}) + "\n", True, "", ["f"]),  # its separator
        ("Let me check.\n<tool_ca", True, "Let me check.", []),  # text before a tag cut: the text only
        ("Let me check.\n<tool_ca", False, "Let me check.\n<tool_ca", []),  # ended by itself: all text
        ("a < b", True, "a < b", []),
        ("Let me check.\n" + render_call("f", {}), True, "Let me check.", ["f"]),
    ],
)
def test_a_cut_call_leaves_no_markup_in_the_content(text, cut, content, names):
    got_content, calls = parse_tool_calls(text, ids(), cut=cut)
    assert (got_content, [c.name for c in calls]) == (content, names)


@pytest.mark.parametrize("end", range(len(CUT_OUTPUT) + 1))
def test_every_cut_of_text_and_two_calls_gives_the_text_and_every_named_call(end):
    """Cut after every character (as ``max_tokens`` may): the content is the text before the calls as far as
    it was written (never a character of a tag, a separator or a call's JSON); the calls are the complete ones,
    in order, then the one cut after its name, if any, with its arguments text so far (a prefix of the whole
    call's) and what of it parses (a subset of the whole call's arguments)."""
    content, calls = parse_tool_calls(CUT_OUTPUT[:end], ids(), cut=end < len(CUT_OUTPUT))
    assert content == CUT_OUTPUT[: min(end, len("Let me check."))]
    whole = parse_tool_calls(CUT_OUTPUT, ids())[1]
    done = [c for c in calls if c.complete]
    assert [(c.name, c.arguments, c.arguments_json) for c in done] == [
        (c.name, c.arguments, c.arguments_json) for c in whole[: len(done)]
    ]
    assert calls[: len(done)] == done and len(calls) - len(done) <= 1
    if len(calls) > len(done):
        cut, full = calls[-1], whole[len(calls) - 1]
        assert cut.name == full.name and full.arguments_json.startswith(cut.arguments_json)
        assert cut.arguments.items() <= full.arguments.items()
        name_end = CUT_OUTPUT.index('"', CUT_OUTPUT.index(f'"{cut.name}') + 1) + 1
        assert end >= name_end


@pytest.mark.parametrize(
    ("text", "name", "arguments_json", "arguments"),
    [
        ('<tool_call>\n{"name": "lookup_order"', "lookup_order", "", {}),
        ('<tool_call>\n{"name": "lookup_order", "argu', "lookup_order", "", {}),
        ('<tool_call>\n{"name": "lookup_order", "arguments": ', "lookup_order", "", {}),
        # the user's report: a runaway string cut by max_tokens; the call comes back, its text as written
        (
            '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "}}</tool_call>  # This is',
            "lookup_order",
            '{"order_id": "}}</tool_call>  # This is',
            {},
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [true, "x',
            "f",
            '{"a": 1, "b": [true, "x',
            {"a": 1, "b": [True]},
        ),
        ('<tool_call>\n{"name": "f", "arguments": {"a": {"b": 2', "f", '{"a": {"b": 2', {"a": {"b": 2}}),
    ],
)
def test_a_call_cut_after_its_name_is_a_call_with_its_arguments_so_far(text, name, arguments_json, arguments):
    """Before: a call cut inside its arguments was dropped, so ``tool_choice: required`` cut by ``max_tokens``
    answered neither a call nor content. Now it is a call marked incomplete (OpenAI returns a cut call with
    the arguments it got to), streamed events and the whole parse alike."""
    content, calls = parse_tool_calls(text, ids(), cut=True)
    assert content == "" and len(calls) == 1
    call = calls[0]
    assert (call.name, call.arguments_json, call.arguments, call.complete) == (
        name,
        arguments_json,
        arguments,
        False,
    )
    parser = ToolCallParser(ids())
    events = [e for k in range(len(text)) for e in parser.feed(text[k])] + parser.finish(cut=True)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    streamed = "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta))
    ends = [e.call for e in events if isinstance(e, ToolCallEnd)]
    assert [s.name for s in starts] == [name] and streamed == arguments_json
    assert [(c.name, c.arguments_json, c.complete) for c in ends] == [(name, arguments_json, False)]
    assert parse_tool_calls(text, ids(), cut=False)[1] == []  # not cut (unconstrained output): no call


JSON_ANSWERS = [
    '{"a": "x <tool_c',  # a string that looks like the start of a tag, cut there
    '{"a": "<tool_call>\\n", "b": [1, 2]}',  # the tag inside a string (its newline escaped, as JSON writes it)
    '["x", "\\n<tool_call>"]',
    '"just a string answer"',
]


@pytest.mark.parametrize("text", JSON_ANSWERS)
@pytest.mark.parametrize("cut", [False, True])
def test_with_json_answer_an_answer_is_all_content_as_it_arrives(text, cut):
    """A response format sent with tools: an output that does not open with ``<`` is the JSON answer, every
    character of it content as soon as it arrives, cut or not (without ``json_answer`` a trailing ``<tool_c``
    would be held back, then dropped by a cut)."""
    assert parse_tool_calls(text, ids(), cut=cut, json_answer=True) == (text, [])
    parser = ToolCallParser(ids(), json_answer=True)
    for k in range(len(text)):
        assert parser.feed(text[k]) == [ContentDelta(text[k])]
    assert parser.finish(cut=cut) == [] and parser.calls == []


@pytest.mark.parametrize("end", range(len(OUTPUT.split("\n", 1)[1]) + 1))
def test_with_json_answer_calls_parse_as_without_it_for_every_cut(end):
    calls_only = OUTPUT.split("\n", 1)[1]  # the two calls, without the text before them
    assert calls_only.startswith("<tool_call>")
    text, cut = calls_only[:end], end < len(calls_only)
    assert parse_tool_calls(text, ids(), cut=cut, json_answer=True) == parse_tool_calls(text, ids(), cut=cut)


def test_tiny_template_renders_tools_itself_and_smollm2_style_does_not():
    tok = tiny_checkpoint().tokenizer
    assert tok.template_renders_tools and tok.tool_format == "template"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], [WEATHER])
    assert "You may call these tools" in prompt  # the template's own tool section


def test_generic_format_when_the_template_has_no_tool_section():
    from engine.tokenizer import Tokenizer

    base = tiny_checkpoint().tokenizer
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    tok = Tokenizer(base.backend, template, base.special_tokens, base.eos_token_ids)
    assert not tok.template_renders_tools and tok.tool_format == "generic"
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = tok.apply_chat_template(msgs, [WEATHER])
    assert with_tools.startswith("<system># Tools") and with_tools.endswith("<user>hi</user>")
    assert with_tools == tok.apply_chat_template(msgs, [WEATHER])
    assert tok.render_chat(msgs, [WEATHER]) != tok.render_chat(msgs)  # tools are no longer dropped


def test_a_ref_schema_reaches_the_prompt_as_the_client_sent_it():
    """A tool whose schema uses ``$defs`` / ``$ref`` (pydantic's enums) is listed in the prompt with its
    ``$defs`` and ``$ref`` as sent, in the generic listing (canonical JSON) and in a template's own section."""
    from engine.tokenizer import Tokenizer

    parameters = {
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
        "type": "object",
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    base = tiny_checkpoint().tokenizer
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    generic = Tokenizer(base.backend, template, base.special_tokens, base.eos_token_ids)
    prompt = generic.apply_chat_template([{"role": "user", "content": "hi"}], [tool])
    assert canonical_json(tool) in prompt and '"$ref": "#/$defs/Unit"' in prompt
    templated = base.apply_chat_template([{"role": "user", "content": "hi"}], [tool])
    assert "$defs" in templated and "#/$defs/Unit" in templated


def test_a_duplicate_tool_name_is_named_by_its_path():
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "other"}}
    with pytest.raises(InvalidRequestError) as caught:
        function_tools([tool, other, tool])
    assert caught.value.param == "tools[2].function.name"
    assert "tools[2]" in str(caught.value) and "tools[0]" in str(caught.value)


def test_strict_is_read_from_function_strict_and_never_rendered():
    """``strict`` decides whether a schema constrained decoding cannot enforce is refused or loosened
    (``engine.constrained``); only ``true`` is strict, and the prompt is the same either way."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    tools = function_tools([strict, {**TIME, "strict": "yes"}])
    assert [t.strict for t in tools] == [True, False]
    assert function_tools([WEATHER])[0].strict is False
    assert render_tools_prompt(tools[:1]) == render_tools_prompt(function_tools([WEATHER]))
