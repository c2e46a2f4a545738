"""The OpenAPI 3.1 document of the gateway's client faces (served at ``GET /openapi.json``): the request body
schemas of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` and
``/v1/messages/count_tokens`` as the parsers accept them (JSON Schema 2020-12), and both protocols' error
bodies. It is the contract fuzz tests generate bodies from; the parsers, not this document, are the authority
(a body the schema allows may still get a 400 for a cross-field rule, never a 500).
"""

from __future__ import annotations

from typing import Any

from gateway.protocols.anthropic.validate import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS
from gateway.protocols.openai.parse import CHAT_FIELDS, COMPLETION_FIELDS, MAX_STOP_SEQUENCES
from gateway.protocols.openai.responses import RESPONSES_FIELDS

INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
ANY = {}
"""The empty schema: any JSON value (fields passed on to upstreams, judged by each backend)."""


def _object(properties: dict[str, Any], required: list[str], known: frozenset[str] | None = None) -> dict:
    """An object schema; ``known`` top-level fields not described in ``properties`` accept any value."""
    props = dict(properties)
    for name in sorted(known or ()):
        props.setdefault(name, ANY)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
    "required": ["role", "content"],
}
_FUNCTION_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_SEQUENCES},
        {"type": "null"},
    ]
}
_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "seed": INT64,
    "n": {"const": 1},
    "stream": {"type": "boolean"},
    "user": {"type": "string"},
}

CHAT_REQUEST = _object(
    {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "stop": _STOP,
        "tools": {"type": "array", "items": _FUNCTION_TOOL},
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "function"},
                        "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                    },
                    "required": ["type", "function"],
                },
            ]
        },
        **_SAMPLING,
    },
    ["model", "messages"],
    CHAT_FIELDS,
)
COMPLETION_REQUEST = _object(
    {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop": _STOP,
        **_SAMPLING,
    },
    ["model", "prompt"],
    COMPLETION_FIELDS,
)
_RESPONSES_ITEM = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "type": {"enum": ["input_text", "output_text"]},
                                    "text": {"type": "string"},
                                },
                                "required": ["type", "text"],
                            },
                        },
                    ]
                },
            },
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "function_call"},
                "call_id": {"type": "string"},
                "name": {"type": "string"},
                "arguments": {"type": "string"},
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"type": "string"},
                "output": {"type": "string"},
            },
            "required": ["type", "call_id", "output"],
        },
        {  # a reasoning item sent back (store: false): dropped from the prompt
            "type": "object",
            "properties": {"type": {"const": "reasoning"}, "summary": {"type": "array"}},
            "required": ["type"],
        },
    ]
}
_RESPONSES_FUNCTION = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "minLength": 1},
        "parameters": {"type": "object"},
    },
    "required": ["type", "name"],
}
RESPONSES_REQUEST = _object(
    {
        "model": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _RESPONSES_ITEM, "minItems": 1}]},
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "store": {"const": False},
        "tools": {
            "type": "array",
            "items": {
                "anyOf": [
                    _RESPONSES_FUNCTION,
                    {  # flattened into its functions
                        "type": "object",
                        "properties": {
                            "type": {"const": "namespace"},
                            "name": {"type": "string", "minLength": 1},
                            "description": {"type": "string"},
                            "tools": {"type": "array", "items": _RESPONSES_FUNCTION},
                        },
                        "required": ["type", "name", "description", "tools"],
                    },
                ]
            },
        },
    },
    ["model", "input"],
    RESPONSES_FIELDS - {"previous_response_id", "conversation", "prompt", "context_management", "background"},
)
_ANTHROPIC_BLOCK = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_ANTHROPIC_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ANTHROPIC_BLOCK}]},
    },
    "required": ["role", "content"],
}
_ANTHROPIC_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE, "minItems": 1},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ANTHROPIC_BLOCK}]},
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1}, "input_schema": {"type": "object"}},
            "required": ["name", "input_schema"],
        },
    },
    "tool_choice": {
        "type": "object",
        "properties": {"type": {"enum": ["auto", "any", "none"]}},
        "required": ["type"],
    },
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
}
MESSAGES_REQUEST = _object(
    {
        **_ANTHROPIC_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "stream": {"type": "boolean"},
    },
    ["model", "messages", "max_tokens"],
    MESSAGES_FIELDS,
)
COUNT_TOKENS_REQUEST = _object(_ANTHROPIC_COMMON, ["model", "messages"], COUNT_TOKENS_FIELDS)

OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
ANTHROPIC_ERROR = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
    },
    "required": ["type", "error"],
}


def _answer(object_name: str | None, required: list[str]) -> dict[str, Any]:
    """The schema of a 200 answer: an object with ``required`` fields (``object`` fixed to ``object_name``)."""
    props: dict[str, Any] = {name: ANY for name in required}
    if object_name is not None:
        props["object"] = {"const": object_name}
    return {"type": "object", "properties": props, "required": required}


_USAGE_OPENAI = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}
CHAT_ANSWER = _answer("chat.completion", ["id", "object", "created", "model", "choices", "usage"])
CHAT_ANSWER["properties"]["usage"] = _USAGE_OPENAI
COMPLETION_ANSWER = _answer("text_completion", ["id", "object", "created", "model", "choices", "usage"])
COMPLETION_ANSWER["properties"]["usage"] = _USAGE_OPENAI
RESPONSES_ANSWER = _answer("response", ["id", "object", "created_at", "status", "model", "output", "usage"])
MESSAGES_ANSWER = _answer(None, ["id", "type", "role", "content", "model", "stop_reason", "usage"])
MESSAGES_ANSWER["properties"]["type"] = {"const": "message"}
COUNT_TOKENS_ANSWER = {
    "type": "object",
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
    "required": ["input_tokens"],
}
MODEL_OBJECT = _answer("model", ["id", "object", "created", "owned_by"])
MODEL_LIST = {
    "type": "object",
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_OBJECT}},
    "required": ["object", "data"],
}
HEALTH = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}

FACES: dict[str, tuple[str, dict[str, Any], str, dict[str, Any]]] = {
    "/v1/chat/completions": ("createChatCompletion", CHAT_REQUEST, "OpenAIError", CHAT_ANSWER),
    "/v1/completions": ("createCompletion", COMPLETION_REQUEST, "OpenAIError", COMPLETION_ANSWER),
    "/v1/responses": ("createResponse", RESPONSES_REQUEST, "OpenAIError", RESPONSES_ANSWER),
    "/v1/messages": ("createMessage", MESSAGES_REQUEST, "AnthropicError", MESSAGES_ANSWER),
    "/v1/messages/count_tokens": ("countTokens", COUNT_TOKENS_REQUEST, "AnthropicError", COUNT_TOKENS_ANSWER),
}
"""Path -> (operation id, request body schema, error schema name, 200 answer schema when not streamed)."""

READS: dict[str, tuple[str, dict[str, Any]]] = {
    "/v1/models": ("listModels", MODEL_LIST),
    "/v1/models/{model}": ("retrieveModel", MODEL_OBJECT),
    "/healthz": ("health", HEALTH),
}
"""GET paths -> (operation id, 200 answer schema). ``/v1/models`` answers in Anthropic's shape when the request
carries ``anthropic-version`` (README); the schema is the OpenAI one."""


def openapi_document(version: str, model_names: list[str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document (``model_names`` listed as examples of every ``model`` field)."""
    paths: dict[str, Any] = {}
    for path, (operation, schema, error, answer) in FACES.items():
        body = {**schema, "properties": dict(schema["properties"])}
        body["properties"]["model"] = {**body["properties"]["model"], "examples": list(model_names)}
        error_ref = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
        paths[path] = {
            "post": {
                "operationId": operation,
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": {
                    "200": {
                        "description": "the answer (JSON), or with stream: true server-sent events",
                        "content": {"application/json": {"schema": answer}, "text/event-stream": {}},
                    },
                    "400": {"description": "a bad request", **error_ref},
                    "404": {"description": "unknown model", **error_ref},
                    "413": {"description": "body over server.max_body_bytes", **error_ref},
                },
            }
        }
    for path, (operation, answer) in READS.items():
        get: dict[str, Any] = {
            "operationId": operation,
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": answer}}}},
        }
        if "{model}" in path:
            get["parameters"] = [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
            get["responses"]["404"] = {
                "description": "unknown model",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
            }
        paths[path] = {"get": get}
    return {
        "openapi": "3.1.0",
        "info": {"title": "prefixgate", "version": version},
        "paths": paths,
        "components": {"schemas": {"OpenAIError": OPENAI_ERROR, "AnthropicError": ANTHROPIC_ERROR}},
    }
