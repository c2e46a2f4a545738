"""A gateway ``ChatRequest`` as the embedded engine's ``GenerationRequest``: sampling parameters, the output
constraint of tools / ``response_format`` / Anthropic structured outputs, template-ready messages and tools, and
the refusal (a 400 naming the field) of what the engine cannot honour. Pure functions; no engine call here."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.api import MAX_N, Constraint, GenerationRequest
from gateway.core.errors import InvalidRequestError
from gateway.core.request import ChatRequest
from gateway.protocols.anthropic.parse import OPAQUE, THINKING_TYPES
from gateway.protocols.anthropic.strip import check_anthropic_only_fields, failed_result
from gateway.protocols.anthropic.structured_outputs import anthropic_output_schema

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "web_search_options": (None,),
    # an effort hint: a model that does not reason meets every level as it is (Codex sends one when configured)
    "reasoning_effort": (None, "none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "verbosity": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    # stored completions (distillation, evals, GET /v1/chat/completions): nothing stores one here
    "store": (None, False),
}
"""OpenAI body fields the embedded engine cannot honour -> the values it accepts (the neutral ones)."""

EMBEDDED_HONOURS = frozenset({"thinking", "output_config", "output_format"})
"""Anthropic-only fields ``check_supported_anthropic`` checks (and, for ``output_config.format`` /
``output_format``, honours)."""

_ROLE_FOR_TEMPLATE = {"developer": "system"}


def generation_request(request: ChatRequest, engine: Any = None) -> GenerationRequest:
    """The engine request for a canonical ``ChatRequest``: its sampling parameters with ``logit_bias`` checked
    against the vocabulary and the tools' ``Constraint`` (``tool_constraint``) when the engine's tool format
    is generic.

    Args:
        request: the canonical request.
        engine: the ``AsyncEngine`` (its tokenizer and tool format); None checks no vocabulary and adds no
            tool constraint.

    Raises:
        InvalidRequestError: unsupported parameters (``UNSUPPORTED`` for OpenAI bodies, Anthropic-only fields
            for Anthropic ones), ``n`` above the engine's ``MAX_N``, a bad ``tool_choice``,
            a ``logit_bias`` token outside the vocabulary, non-text content parts, or server tools.
    """
    if request.openai_body is not None:
        check_supported(request.openai_body)
    output_format = None
    if request.anthropic_body is not None:
        check_anthropic_only_fields(request.anthropic_body, "the embedded", EMBEDDED_HONOURS)
        output_format = check_supported_anthropic(request.anthropic_body)
    params = request.params
    if params.n > MAX_N:  # the engine's own check words it otherwise: worded here as the other 400s are
        raise InvalidRequestError(
            f"Invalid 'n': integer above maximum value. Expected a value <= {MAX_N} with the embedded engine, "
            f"but got {params.n} instead.",
            param="n",
            code="integer_above_max_value",
        )
    if output_format is not None:  # Anthropic structured outputs: the same constraint as json_schema
        params = replace(params, constraint=output_format)
    if engine is not None and params.logit_bias:
        vocab = engine.tokenizer.vocab_size
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise InvalidRequestError(
                    f"Invalid 'logit_bias': token id {token_id} is not in the vocabulary [0, {vocab}).",
                    param="logit_bias",
                    code="invalid_value",
                )
    common = {
        "cache_salt": request.tenant,
        "request_id": request.request_id,
        "prefix_key": request.prefix_key or None,
        "level_ends": request.level_ends,
    }
    if request.kind == "completion":
        return GenerationRequest(prompt=request.prompt or "", params=params, **common)
    tools = template_tools(request.tools)
    constraint = tool_constraint(request, tools, engine.tool_format if engine is not None else "template")
    if constraint is not None:
        params = replace(params, constraint=with_answer_format(constraint, params.constraint))
    messages = [template_message(message, index) for index, message in enumerate(request.messages)]
    return GenerationRequest(
        messages=messages,
        tools=tools,
        params=params,
        shared_prefix_messages=request.shared_prefix_messages,
        shared_salt=request.shared_salt,
        continue_final_message=request.continue_final_message and messages[-1]["role"] == "assistant",
        **common,
    )


def with_answer_format(tools: Constraint, answer: Constraint | None) -> Constraint:
    """The tool-call constraint of a request that also asked for a response format (OpenAI ``response_format``,
    Responses ``text.format``, Anthropic ``output_config.format``): with ``tool_choice`` ``auto``, calls or an
    answer in that format (``json_object`` as the schema ``{"type": "object"}``; ``Constraint.json_schema``);
    a forced call (``required``, a named function) leaves no answer to format, so the tool constraint alone.
    ``tools`` itself when ``answer`` is None (a request with tools only is constrained as before)."""
    if answer is None or tools.tool_choice != "auto":
        return tools
    schema = {"type": "object"} if answer.kind == "json_object" else answer.json_schema
    return replace(tools, json_schema=schema)


def tool_constraint(
    request: ChatRequest, tools: list[dict[str, Any]] | None, tool_format: str
) -> Constraint | None:
    """The output ``Constraint`` of the request's tools: ``tool_choice`` (OpenAI's shape; Anthropic's is
    translated at parsing) ``auto`` (the default) / ``required`` / a named function -> a ``"tool_calls"``
    constraint, ``none`` -> None. Only for the generic tool format; a template that renders tools itself has
    its own call syntax, so only ``auto`` / ``none`` are honoured there (unconstrained).

    Raises:
        InvalidRequestError: a ``tool_choice`` that is not one of those values, names a function that is not
            among the tools, is given without tools, or forces a call the template format cannot enforce.
    """
    choice = request.tool_choice
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise _bad_tool_choice(choice)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                "Missing required parameter: 'tool_choice.function.name'.",
                param="tool_choice.function.name",
                code="missing_required_parameter",
            )
        mode = "function"
    elif choice is None:
        mode = "auto"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise _bad_tool_choice(choice)
    if not tools:
        if choice is not None and mode != "none":
            raise InvalidRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                param="tool_choice",
                code="invalid_value",
            )
        return None
    if name is not None and name not in {tool["function"]["name"] for tool in tools}:
        raise InvalidRequestError(
            f"Invalid value for 'tool_choice': no function named '{name}' in 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )
    if mode == "none":
        return None
    if tool_format != "generic":
        if mode != "auto":
            raise InvalidRequestError(
                "This model's chat template renders tools itself; the embedded engine cannot force a tool "
                "call with it: tool_choice must be 'auto' or 'none'.",
                param="tool_choice",
                code="unsupported_value",
            )
        return None
    return Constraint(
        kind="tool_calls",
        tools=tuple(tools),
        tool_choice=mode,
        tool_name=name,
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )


def _bad_tool_choice(choice: Any) -> InvalidRequestError:
    return InvalidRequestError(
        "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}, '
        f"but got {json.dumps(choice)[:100]} instead.",
        param="tool_choice",
        code="invalid_value",
    )


INSTEAD = {
    "functions": "tools",
    "function_call": "tool_choice",
}
"""What to send instead of a refused field, where the API has a successor (OpenAI's legacy function calling)."""


def check_supported(body: dict[str, Any]) -> None:
    """Refuse body fields with values the engine cannot honour (400 naming the field, and its successor where
    ``INSTEAD`` has one)."""
    for name, accepted in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], value) for value in accepted):
            hint = f" Use '{INSTEAD[name]}' instead." if name in INSTEAD else ""
            raise InvalidRequestError(
                f"Unsupported value for '{name}' with the embedded engine: only {_accepted(accepted)} is "
                f"supported.{hint}",
                param=name,
                code="unsupported_value",
            )


def check_supported_anthropic(body: dict[str, Any]) -> Constraint | None:
    """Refuse Anthropic fields the engine cannot honour rather than ignore them, and return the output
    constraint of Anthropic's structured outputs (``output_config.format`` ``{"type": "json_schema", "schema":
    {...}}``, or the deprecated top-level ``output_format``; ``structured_outputs.anthropic_output_schema``;
    https://platform.claude.com/docs/en/build-with-claude/structured-outputs), or None.

    Raises:
        InvalidRequestError: ``thinking`` other than ``{"type": "disabled"}`` or ``{"type": "adaptive"}`` (the
            checkpoint has no extended thinking; adaptive leaves it to the model); an ``output_config`` /
            ``format`` that is not an object, a format that is not ``json_schema`` with an object ``schema``, or
            both forms at once (400 naming the field).
    """
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict)
        and thinking.get("type") in ("disabled", "adaptive")
        and set(thinking) == {"type"}
    ):
        raise InvalidRequestError(
            "thinking: the embedded engine has no extended thinking; omit 'thinking' or send "
            '{"type": "disabled"} or {"type": "adaptive"} (the model decides, and does not think).',
            param="thinking",
            code="unsupported_value",
        )
    schema = anthropic_output_schema(body, "the embedded")
    return None if schema is None else Constraint(kind="json_schema", json_schema=schema)


_PART_NOUNS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "file": "file",
    "input_file": "file",
}
"""What a non-text content part is, in words both protocols' users read (the canonical request names an
Anthropic image ``image_url``, OpenAI's part type); any other type is named as sent, in quotes."""


def template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as the chat template expects it: ``content`` a string (text parts joined by newlines),
    ``developer`` rendered as ``system``; tool-call fields kept; a failed tool result (Anthropic's ``is_error``)
    starting with ``Error: `` (``gateway.protocols.anthropic.strip.failed_result``).

    A tool call's ``function.arguments`` may be text that is not JSON: a call cut by ``max_tokens``, as the
    engine returns it, sent back in the next turn; the engine renders it verbatim
    (``engine.tool_calls._history_call``).

    Raises:
        InvalidRequestError: a content part that is not text (images, audio, files).
    """
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.get("type") == OPAQUE and (part.get("block") or {}).get("type") in THINKING_TYPES:
                continue  # an Anthropic thinking block from an earlier turn: not prompt text for this model
            if part.get("type") not in ("text", "input_text", "refusal"):
                kind = part.get("type")
                if kind == OPAQUE:  # an Anthropic block riding through: name it by its own type
                    kind = (part.get("block") or {}).get("type")
                what = _PART_NOUNS.get(kind, f"'{kind}'")
                raise InvalidRequestError(
                    f"messages[{index}].content[{part_index}]: {what} content is not supported by the embedded "
                    "engine (text only).",
                    param=f"messages[{index}].content[{part_index}].type",
                    code="unsupported_value",
                )
            texts.append(part.get("text", part.get("refusal", "")))
        content = "\n".join(texts)
    # an Anthropic tool_result that failed: the template has no field for it, the model reads it in the text
    if message.get("role") == "tool" and message.get("is_error") is True:
        content = failed_result(content)
    out = {key: value for key, value in message.items() if key not in ("content", "is_error")}
    out["role"] = _ROLE_FOR_TEMPLATE.get(message["role"], message["role"])
    out["content"] = "" if content is None else content
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools for the chat template, without the Anthropic-only extras riding under ``x-anthropic``.

    Raises:
        InvalidRequestError: an Anthropic server tool (``type: x-anthropic``), which only Anthropic can run.
    """
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            kind = tool.get("type")
            if kind == OPAQUE:  # an Anthropic-defined tool riding through: name it by its own type
                kind = (tool.get("tool") or {}).get("type")
            raise InvalidRequestError(
                f"Tool type '{kind}' (tools[{index}]) is not supported by the embedded engine: it takes custom "
                "(function) tools only; Anthropic's own tool types (web search, bash, ...) need an Anthropic model.",
                param=f"tools[{index}]",
                code="unsupported_value",
            )
        out.append({key: value for key, value in tool.items() if key != OPAQUE})
    return out


def _same(value: Any, accepted: Any) -> bool:
    """Equal and of the same JSON type (so ``false`` is not ``0``)."""
    return type(value) is type(accepted) and value == accepted


def _accepted(values: tuple[Any, ...]) -> str:
    shown = [json.dumps(v) for v in values if v is not None]
    return " or ".join(shown) if shown else "omitting it"
