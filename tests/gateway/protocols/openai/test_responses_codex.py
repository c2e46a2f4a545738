"""What the OpenAI Codex CLI sends to ``POST /v1/responses`` by default (a trial of Codex 0.171 got a 400 for each):
``client_metadata``, ``namespace`` tools (flattened for the model, calls given back with their ``namespace``),
hosted tools (dropped; a ``tool_choice`` forcing one stays a 400), ``reasoning`` input items (dropped)."""

from __future__ import annotations

import logging

import pytest
from openai.types.responses import Response, ResponseFunctionToolCall

from gateway.core.errors import InvalidRequestError
from gateway.core.events import BackendUsage, Finish
from gateway.protocols.openai.parse import parse_chat_request
from gateway.protocols.openai.response_builder import ResponseBuilder
from gateway.protocols.openai.responses import responses_to_chat_body
from gateway.protocols.openai.responses_params import to_responses_error
from gateway.protocols.openai.responses_tools import chat_tool_paths, flat_tool_name, namespaced_tool_names

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents",
    "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
        {"type": "function", "name": "wait", "description": "Wait", "parameters": {"type": "object"}},
    ],
}
SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
USAGE = BackendUsage(prompt_tokens=5, completion_tokens=2, cached_tokens=0)


def chat(**fields):
    return responses_to_chat_body({"model": "m", "input": "hi", **fields})


def refused(**fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**fields)
    return caught.value


def test_client_metadata_is_a_known_field_checked_and_not_passed_on():
    body = chat(client_metadata={"x-codex-installation-id": "abc", "thread_id": "t"})
    assert "client_metadata" not in body and "metadata" not in body
    parse_chat_request(body, {})
    assert (refused(client_metadata=[]).param, refused(client_metadata=[]).code) == (
        "client_metadata",
        "invalid_type",
    )
    assert refused(client_metadata={"n": 1}).param == "client_metadata.n"
    assert "client_metadata" not in chat(client_metadata=None)


def test_the_sdk_top_level_fields_are_all_known():
    """Every ``responses.create`` argument of the installed openai SDK is a known field (none is unknown_parameter)."""
    import typing

    from openai.types.responses import response_create_params

    from gateway.protocols.openai.responses import RESPONSES_FIELDS

    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert fields <= RESPONSES_FIELDS


def test_a_namespace_tool_is_flattened_into_its_functions():
    body = chat(tools=[SHELL, NAMESPACE])
    names = [tool["function"]["name"] for tool in body["tools"]]
    assert names == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait"]
    assert body["tools"][2]["function"]["description"] == "Wait"
    parse_chat_request(body, {})
    assert flat_tool_name("ns_", "_f") == "ns__f"  # the Codex CLI's flat spelling trims around the delimiter


def test_a_function_call_item_with_a_namespace_names_the_flat_function():
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "function_call",
            "call_id": "c",
            "name": "wait",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c", "output": "done"},
    ]
    body = chat(input=items, tools=[NAMESPACE])
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__wait"
    error = refused(input=[items[0], {**items[1], "namespace": 3}, items[2]])
    assert (error.param, error.code) == ("input[1].namespace", "invalid_type")


def test_chat_tool_errors_name_the_clients_tool_path():
    body = {"model": "m", "input": "hi", "tools": [{"type": "web_search"}, SHELL, NAMESPACE]}
    assert chat_tool_paths(body) == ["tools[1]", "tools[2].tools[0]", "tools[2].tools[1]"]
    error = InvalidRequestError(
        "Invalid type for 'tools[2].function.parameters': expected an object.",
        param="tools[2].function.parameters",
    )
    to_responses_error(error, [], chat_tool_paths(body))
    assert error.param == "tools[2].tools[1].parameters"
    assert "'tools[2].tools[1].parameters'" in error.message


def test_a_namespaced_name_colliding_with_another_tool_is_a_400():
    clash = {**SHELL, "name": "multi_agent_v1__wait"}
    error = refused(tools=[clash, NAMESPACE])
    assert (error.param, error.code) == ("tools[1].tools[1].name", "invalid_value")
    chat(tools=[SHELL, SHELL])  # plain duplicates: left to the chat path, as before


@pytest.mark.parametrize(
    "member",
    [{"type": "custom", "name": "x"}, "f", {"type": "function"}],
)
def test_a_namespace_holds_named_function_tools(member):
    error = refused(tools=[{**NAMESPACE, "tools": [member]}])
    assert error.param.startswith("tools[0].tools[0]")
    assert refused(tools=[{"type": "namespace", "name": "n", "description": "d"}]).param == "tools[0].tools"
    assert refused(tools=[{"type": "namespace", "description": "d", "tools": []}]).param == "tools[0].name"


def test_hosted_tools_are_dropped_with_one_info_line(caplog):
    hosted = [
        {"type": "web_search", "external_web_access": False},
        {"type": "web_search_preview"},
        {"type": "file_search", "vector_store_ids": ["vs"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "image_generation"},
        {"type": "mcp", "server_label": "x"},
        {"type": "local_shell"},
        {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
    ]
    with caplog.at_level(logging.INFO, logger="gateway.protocols.openai.responses_tools"):
        body = chat(tools=[*hosted, SHELL], tool_choice="auto")
    assert [tool["function"]["name"] for tool in body["tools"]] == ["shell"]
    assert body["tool_choice"] == "auto"
    lines = [r for r in caplog.records if r.name == "gateway.protocols.openai.responses_tools"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    for tool in hosted:
        assert tool["type"] in lines[0].getMessage()


def test_hosted_tools_alone_leave_no_tools_and_no_auto_choice():
    body = chat(tools=[{"type": "web_search"}], tool_choice="auto")
    assert "tools" not in body and "tool_choice" not in body
    parse_chat_request(body, {})
    error = refused(tools=[{"type": "web_search"}], tool_choice="required")
    assert (error.param, error.code) == ("tool_choice", "unsupported_parameter")


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "web_search_preview"},
        {"type": "file_search"},
        {"type": "code_interpreter"},
        {"type": "image_generation"},
        {"type": "computer_use_preview"},
        {"type": "mcp", "server_label": "x"},
        {"type": "shell"},
    ],
)
def test_a_tool_choice_forcing_a_hosted_tool_is_a_clear_400(choice):
    error = refused(tools=[{"type": choice["type"]}, SHELL], tool_choice=choice)
    assert (error.param, error.code) == ("tool_choice.type", "unsupported_parameter")
    assert repr(choice["type"]) in error.message and "hosted tool" in error.message


@pytest.mark.parametrize("tool", [{"type": "custom", "name": "g"}, {"type": "retrieval"}, {"name": "f"}])
def test_custom_and_unknown_tools_stay_a_400(tool):
    error = refused(tools=[tool])
    assert (error.param, error.code) == ("tools[0].type", "unsupported_parameter")


def test_a_forced_function_may_name_a_namespaces_member():
    assert chat(tools=[NAMESPACE], tool_choice={"type": "function", "name": "wait"})["tool_choice"] == {
        "type": "function",
        "function": {"name": "multi_agent_v1__wait"},
    }
    flat = {"type": "function", "name": "multi_agent_v1__wait"}
    assert (
        chat(tools=[NAMESPACE], tool_choice=flat)["tool_choice"]["function"]["name"] == "multi_agent_v1__wait"
    )


def test_reasoning_input_items_are_dropped():
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "think"}],
            "encrypted_content": "gAAA",
        },
        {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
        {"type": "reasoning"},
        {"role": "assistant", "content": "done"},
    ]
    body = chat(input=items, tools=[SHELL], include=["reasoning.encrypted_content"])
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]
    parse_chat_request(body, {})
    assert refused(input=[{"type": "reasoning", "summary": "x"}, *items]).param == "input[0].summary"
    assert refused(input=[{"type": "reasoning"}]).code == "empty_array"  # nothing left to prompt with


def test_codexs_other_fields_pass():
    body = chat(
        tools=[SHELL],
        tool_choice="auto",
        parallel_tool_calls=False,
        store=False,
        stream=True,
        prompt_cache_key="thread-1",
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        text={"verbosity": "low"},
    )
    assert body["parallel_tool_calls"] is False and body["prompt_cache_key"] == "thread-1"
    assert body["stream"] is True and body["verbosity"] == "low"  # the backend decides on verbosity
    assert "logprobs" not in body


def test_a_call_to_a_namespaced_function_comes_back_with_its_namespace():
    body = {"model": "m", "input": "hi", "tools": [SHELL, NAMESPACE]}
    assert namespaced_tool_names(body) == {
        "multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent"),
        "multi_agent_v1__wait": ("multi_agent_v1", "wait"),
    }
    builder = ResponseBuilder(body, "m", "abc")
    events = builder.start()
    events += builder.tool_calls(
        [
            {"index": 0, "id": "c0", "function": {"name": "multi_agent_v1__wait", "arguments": "{}"}},
            {"index": 1, "id": "c1", "function": {"name": "shell", "arguments": "{}"}},
        ]
    )
    events += builder.finish(Finish(finish_reason="tool_calls", usage=USAGE))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert (added[0]["name"], added[0]["namespace"]) == ("wait", "multi_agent_v1")
    assert "namespace" not in added[1]
    response = Response.model_validate(events[-1]["response"])
    first, second = response.output
    assert isinstance(first, ResponseFunctionToolCall)
    assert (first.name, first.namespace, first.call_id) == ("wait", "multi_agent_v1", "c0")
    assert (second.name, second.namespace) == ("shell", None)
    assert [tool.type for tool in response.tools] == ["function", "namespace"]
