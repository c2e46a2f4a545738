"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) -> ``ChatRequest``, with OpenAI's own
error messages and codes for bad input. Pure functions, no I/O.
Reference: https://platform.openai.com/docs/api-reference/chat/create
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.api import Constraint, SamplingParams
from gateway.core.errors import InvalidRequestError
from gateway.core.headers import MAX_TENANT_CHARS, rules_enabled, tenant
from gateway.core.json_types import json_kind
from gateway.core.request import ChatRequest, given_sampling, nucleus_zero_as_greedy
from gateway.protocols.openai.field_errors import check_enums, check_types, invalid_type, missing_param
from gateway.protocols.openai.tool_fields import (
    check_function_name,
    check_tool_calls,
    check_tool_messages,
    parse_tool_choice,
    parse_tools,
)

MAX_STOP_SEQUENCES = 4

CHAT_FIELDS = frozenset(
    {
        "model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop",
        "seed", "user", "n", "stream", "stream_options", "tools", "tool_choice",
        # accepted and passed on (upstreams); the embedded backend refuses values it cannot honour
        "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format",
        "parallel_tool_calls", "metadata", "store", "service_tier", "modalities", "audio", "prediction",
        "reasoning_effort", "functions", "function_call", "web_search_options", "verbosity",
        "prompt_cache_key", "safety_identifier", "prompt_cache_retention", "prompt_cache_options", "moderation",
        "repetition_penalty", "cache_salt",
    }
)  # fmt: skip
COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "user", "n",
        "stream", "stream_options", "echo", "suffix", "logprobs", "best_of", "presence_penalty",
        "frequency_penalty", "logit_bias", "repetition_penalty", "cache_salt",
    }
)  # fmt: skip
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of every integer field (OpenAI's are 64-bit; ``seed`` is documented as one): larger values are a
400, never an overflow deeper down."""
MAX_TOP_LOGPROBS = 20
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
"""Keys of ``stream_options`` (OpenAI's; ``include_obfuscation`` changes nothing here: no obfuscation padding is
sent)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default of ``max_tokens`` for ``/v1/completions`` (chat has no default: up to the
context window)."""


# ---- parsing ---------------------------------------------------------------------------------------------


def parse_chat_request(
    body: dict[str, Any], headers: Mapping[str, str], refuse_unknown: bool = True
) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body into a ``ChatRequest``.

    Args:
        refuse_unknown: refuse an unknown top-level field (``server.unknown_fields: refuse``), else keep it.

    Raises:
        InvalidRequestError: a missing, unknown or ill-typed field, or a value out of range (``n`` != 1...).
    """
    if refuse_unknown:
        _reject_unknown(body, CHAT_FIELDS)
    model = _model(body)
    messages = _messages(body)
    tools = parse_tools(body)
    stream, include_usage = _stream(body)
    max_tokens = _optional_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", minimum=1)
    _check_metadata(body)
    check_enums(body, CHAT_ENUMS)
    check_types(body, CHAT_TYPES)
    return ChatRequest(
        model=model,
        messages=messages,
        params=_sampling(body, max_tokens, "chat"),
        tools=tools,
        tool_choice=parse_tool_choice(body, tools),
        parallel_tool_calls=_parallel_tool_calls(body),
        stream=stream,
        include_usage=include_usage,
        user=_optional_str(body, "user"),
        tenant=tenant(headers),
        cache_salt=_cache_salt(body),
        kind="chat",
        openai_body=body,
        sampling_given=given_sampling(body),
        rules_enabled=rules_enabled(headers),
    )


def parse_completion_request(
    body: dict[str, Any], headers: Mapping[str, str], refuse_unknown: bool = True
) -> ChatRequest:
    """Validate a ``/v1/completions`` body (a single string prompt) into a ``ChatRequest`` of kind completion.

    Raises:
        InvalidRequestError: as ``parse_chat_request``; also a prompt that is not one string.
    """
    if refuse_unknown:
        _reject_unknown(body, COMPLETION_FIELDS)
    model = _model(body)
    if "prompt" not in body:
        raise missing_param("prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequestError(
            "Invalid 'prompt': prefixgate accepts one string prompt per request.",
            param="prompt",
            code="invalid_type",
        )
    stream, include_usage = _stream(body)
    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    _check_best_of(body)
    return ChatRequest(
        model=model,
        messages=[],
        params=_sampling(
            body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, "completion"
        ),
        stream=stream,
        include_usage=include_usage,
        user=_optional_str(body, "user"),
        tenant=tenant(headers),
        cache_salt=_cache_salt(body),
        kind="completion",
        prompt=prompt,
        openai_body=body,
        sampling_given=given_sampling(body),
        rules_enabled=rules_enabled(headers),
    )


CHAT_TYPES: dict[str, str] = {
    "parallel_tool_calls": "a boolean", "store": "a boolean", "prompt_cache_key": "a string",
    "safety_identifier": "a string", "prompt_cache_options": "an object", "moderation": "an object",
}  # fmt: skip
"""Chat fields passed on or ignored, typed as OpenAI's reference types them (checked by ``check_types``, so a
wrong type is a 400 here rather than a field that silently does nothing or an upstream's error)."""

CHAT_ENUMS: dict[str, tuple[str, ...]] = {
    "service_tier": ("auto", "default", "flex", "scale", "priority"),
    "prompt_cache_retention": ("in-memory", "24h"),
}
"""String fields of a chat body with a closed set of values (OpenAI's API reference): another value is a 400
``invalid_value``, as OpenAI answers it, never passed on or ignored."""


def _check_best_of(body: dict[str, Any]) -> None:
    best_of = _optional_int(body, "best_of", minimum=1)
    n = _optional_int(body, "n", minimum=1)
    if best_of is not None and best_of < (1 if n is None else n):
        raise InvalidRequestError(
            f"best_of must be greater than or equal to n (best_of {best_of}, n {n}).",
            param="best_of",
            code="invalid_value",
        )


def _parallel_tool_calls(body: dict[str, Any]) -> bool | None:
    value = body.get("parallel_tool_calls")
    return value if isinstance(value, bool) else None


def _reject_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter"
            )


def _model(body: dict[str, Any]) -> str:
    if "model" not in body:
        raise missing_param("model")
    model = body["model"]
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a non-empty string", model)
    return model


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body:
        raise missing_param("messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    if not messages:
        raise InvalidRequestError(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
            "array instead.",
            param="messages",
            code="empty_array",
        )
    checked = [_message(message, index) for index, message in enumerate(messages)]
    check_tool_messages(checked)
    return checked


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_type(where, "an object", message)
    if "role" not in message:
        raise missing_param(f"{where}.role")
    role = message["role"]
    if not isinstance(role, str):
        raise invalid_type(f"{where}.role", "a string", role)
    if role not in ROLES:
        raise InvalidRequestError(
            f"Invalid value: '{role}'. Supported values are: {', '.join(sorted(ROLES))}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    if message.get("function_call") is not None and not isinstance(message["function_call"], dict):
        raise invalid_type(f"{where}.function_call", "an object", message["function_call"])
    if message.get("tool_calls") is not None:
        check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    content = message.get("content")
    has_tool_calls = role == "assistant" and bool(message.get("tool_calls"))
    if content is None:
        if not (has_tool_calls or (role == "assistant" and "function_call" in message)):
            raise missing_param(f"{where}.content")
    elif isinstance(content, list):
        if (
            not content and not has_tool_calls
        ):  # as OpenAI answers it; an assistant turn's calls carry it alone
            raise InvalidRequestError(
                f"Invalid '{where}.content': empty array. Expected an array with minimum length 1, but got an "
                "empty array instead.",
                param=f"{where}.content",
                code="empty_array",
            )
        for part_index, part in enumerate(content):
            _content_part(part, f"{where}.content[{part_index}]")
    elif not isinstance(content, str):
        raise invalid_type(f"{where}.content", "a string or array of content parts", content)
    if "name" in message and not isinstance(message["name"], str):
        raise invalid_type(f"{where}.name", "a string", message["name"])
    if role == "tool":
        if "tool_call_id" not in message:
            raise missing_param(f"{where}.tool_call_id")
        if not isinstance(message["tool_call_id"], str):
            raise invalid_type(f"{where}.tool_call_id", "a string", message["tool_call_id"])
    return message


def _content_part(part: Any, where: str) -> None:
    if not isinstance(part, dict):
        raise invalid_type(where, "an object", part)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise missing_param(f"{where}.type")
    if kind in ("text", "input_text") and not isinstance(part.get("text"), str):
        raise invalid_type(f"{where}.text", "a string", part.get("text"))
    if kind == "refusal" and not isinstance(part.get("refusal"), str):
        raise invalid_type(f"{where}.refusal", "a string", part.get("refusal"))


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_type("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    if not isinstance(options, dict):
        raise invalid_type("stream_options", "an object", options)
    for key in options:
        if key not in STREAM_OPTIONS:
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: stream_options.{key}",
                param=f"stream_options.{key}",
                code="unknown_parameter",
            )
    if not isinstance(options.get("include_obfuscation", False), bool):
        raise invalid_type("stream_options.include_obfuscation", "a boolean", options["include_obfuscation"])
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid_type("stream_options.include_usage", "a boolean", include_usage)
    return stream, include_usage


def _sampling(body: dict[str, Any], max_tokens: int | None, kind: str) -> SamplingParams:
    n = _optional_int(body, "n", minimum=1)
    temperature = _optional_number(body, "temperature", 0.0, 2.0)
    top_p = _optional_number(body, "top_p", 0.0, 1.0)
    top_k = _optional_int(body, "top_k", minimum=0)
    seed = _optional_int(body, "seed")
    presence = _optional_number(body, "presence_penalty", -2.0, 2.0)
    frequency = _optional_number(body, "frequency_penalty", -2.0, 2.0)
    repetition = _optional_number(body, "repetition_penalty", 0.0, float("inf"))
    if repetition is not None and repetition <= 0.0:
        raise InvalidRequestError(
            f"Invalid 'repetition_penalty': expected a value > 0, but got {repetition:g} instead.",
            param="repetition_penalty",
            code="invalid_value",
        )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        seed=seed,
        stop=_stop(body),
        n=1 if n is None else n,
        logprobs=_chat_logprobs(body) if kind == "chat" else _completion_logprobs(body),
        presence_penalty=0.0 if presence is None else presence,
        frequency_penalty=0.0 if frequency is None else frequency,
        repetition_penalty=1.0 if repetition is None else repetition,
        logit_bias=_logit_bias(body),
        constraint=_response_format(body) if kind == "chat" else None,
    )
    return nucleus_zero_as_greedy(params)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat ``logprobs: true`` (+ ``top_logprobs: k``) -> the engine's ``logprobs`` k; None when off."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid_type("logprobs", "a boolean", logprobs)
    top = _optional_int(body, "top_logprobs", minimum=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"Invalid 'top_logprobs': integer above maximum value. Expected a value <= {MAX_TOP_LOGPROBS}, "
            f"but got {top} instead.",
            param="top_logprobs",
            code="integer_above_max_value",
        )
    if top is not None and not logprobs:
        raise InvalidRequestError(
            "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.",
            param="top_logprobs",
            code="invalid_value",
        )
    return (top or 0) if logprobs else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions ``logprobs: k`` (the chosen token plus the k most likely ones) -> the engine's ``logprobs``."""
    top = _optional_int(body, "logprobs", minimum=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"Invalid 'logprobs': integer above maximum value. Expected a value <= {MAX_TOP_LOGPROBS}, but "
            f"got {top} instead.",
            param="logprobs",
            code="integer_above_max_value",
        )
    return top


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``{"token id as a string": bias}`` -> ``((token_id, bias), ...)``; bias in [-100, 100] (OpenAI). Whether
    each id is in the vocabulary is the backend's to check (it knows the tokenizer)."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise invalid_type("logit_bias", "an object", bias)
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(
                f"Invalid 'logit_bias': key {key!r} is not a token id (a non-negative integer as a string).",
                param="logit_bias",
                code="invalid_value",
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise InvalidRequestError(
                f"Invalid 'logit_bias': the bias of token {key} must be a number in [-100, 100].",
                param="logit_bias",
                code="invalid_value",
            )
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _response_format(body: dict[str, Any]) -> Constraint | None:
    """``response_format`` -> the engine's output ``Constraint``: ``json_object`` (any JSON object) or
    ``json_schema`` (``json_schema.schema``, enforced whether ``strict`` or not); ``text`` -> None. The schema's
    ``name`` follows OpenAI's rule (``[a-zA-Z0-9_-]``, at most 64 characters), as a function name does."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_type("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if kind != "json_schema":
        raise InvalidRequestError(
            f"Invalid value for 'response_format.type': {json_kind(kind) if not isinstance(kind, str) else kind!r}"
            ". Supported values are: 'text', 'json_object' and 'json_schema'.",
            param="response_format.type",
            code="invalid_value",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise missing_param("response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise missing_param("response_format.json_schema.name")
    check_function_name(
        spec["name"], "response_format.json_schema.name"
    )  # OpenAI: the same rule as a function's
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise invalid_type("response_format.json_schema.strict", "a boolean", spec["strict"])
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid_type("response_format.json_schema.schema", "an object", schema)
    return Constraint(kind="json_schema", json_schema=schema)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(
            f"Invalid 'stop': array too long. Expected at most {MAX_STOP_SEQUENCES} items, got {len(stop)}.",
            param="stop",
            code="array_above_max_length",
        )
    if any(s == "" for s in stop):
        raise InvalidRequestError(
            "Invalid 'stop': stop sequences must not be empty.", param="stop", code="invalid_value"
        )
    return tuple(stop)


def _optional_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(
            f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, but got "
            f"{value} instead.",
            param=name,
            code="integer_below_min_value",
        )
    if value < INT64_MIN:
        raise InvalidRequestError(
            f"Invalid '{name}': integer below minimum value. Expected a value >= {INT64_MIN}, but got "
            f"{value} instead.",
            param=name,
            code="integer_below_min_value",
        )
    if value > INT64_MAX:
        raise InvalidRequestError(
            f"Invalid '{name}': integer above maximum value. Expected a value <= {INT64_MAX}, but got "
            f"{value} instead.",
            param=name,
            code="integer_above_max_value",
        )
    return value


def _optional_number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_type(name, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer literal past the float range (JSON allows 4,300 digits)
        number = math.inf
    if not low <= value <= high or not math.isfinite(number):
        raise InvalidRequestError(
            f"Invalid '{name}': expected a value between {low:g} and {high:g}, but got {value} instead.",
            param=name,
            code="invalid_value",
        )
    return number


METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512
"""OpenAI's ``metadata`` limits (Chat Completions and Responses references: "Set of 16 key-value pairs ...
Keys are strings with a maximum length of 64 characters. Values are strings with a maximum length of 512
characters.")."""


def _check_metadata(body: dict[str, Any]) -> None:
    """Validate ``metadata`` (absent or null, or an object of string values within OpenAI's limits): it is
    passed on to upstreams and echoed by the Responses answer, so a value of another shape is refused here.

    Raises:
        InvalidRequestError: not an object (``invalid_type``, param ``metadata``), more than 16 pairs
            (``object_above_max_properties``), a key over 64 characters or a value over 512
            (``string_above_max_length``), a value that is not a string (``invalid_type``,
            param ``metadata.<key>``).
    """
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid_type("metadata", "an object", metadata)
    if len(metadata) > METADATA_MAX_PAIRS:
        raise InvalidRequestError(
            f"Invalid 'metadata': too many properties. Expected an object with at most {METADATA_MAX_PAIRS} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            param="metadata",
            code="object_above_max_properties",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise InvalidRequestError(
                f"Invalid 'metadata': key too long. Expected a key with maximum length "
                f"{METADATA_MAX_KEY_CHARS}, but got a key with length {len(key)} instead.",
                param="metadata",
                code="string_above_max_length",
            )
        if not isinstance(value, str):
            raise invalid_type(f"metadata.{key}", "a string", value)
        if len(value) > METADATA_MAX_VALUE_CHARS:
            raise InvalidRequestError(
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum length "
                f"{METADATA_MAX_VALUE_CHARS}, but got a string with length {len(value)} instead.",
                param=f"metadata.{key}",
                code="string_above_max_length",
            )


def _cache_salt(body: dict[str, Any]) -> str:
    """vLLM's / SGLang's ``cache_salt``: a non-empty string of at most ``MAX_TENANT_CHARS`` characters, or ""
    when absent (``ChatRequest.cache_salt``).

    Raises:
        InvalidRequestError: not a string, empty, or too long.
    """
    value = _optional_str(body, "cache_salt")
    if value is None:
        return ""
    if not value or len(value) > MAX_TENANT_CHARS:
        raise InvalidRequestError(
            f"Invalid 'cache_salt': expected a non-empty string of at most {MAX_TENANT_CHARS} characters.",
            param="cache_salt",
            code="invalid_value",
        )
    return value


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(name, "a string", value)
    return value


# ---- formatting ------------------------------------------------------------------------------------------
