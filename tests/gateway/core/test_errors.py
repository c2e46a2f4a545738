"""Typed API errors and their two JSON shapes (gateway.core.errors), with no server: OpenAI's, Anthropic's,
the Anthropic type of each status and of an upstream's own error, and the mapping of engine errors and
bugs."""

from __future__ import annotations

import json

import pytest

from engine.errors import EngineClosedError, PromptTooLongError, SamplingError
from engine.errors import InvalidRequestError as EngineInvalidRequestError
from gateway.core.errors import (
    APIError,
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UpstreamTimeoutError,
    anthropic_error_body,
    as_api_error,
    error_shape_for,
    from_engine_error,
    openai_error_body,
    status_error,
)
from gateway.protocols.anthropic.stream import encode_error_event
from gateway.transport.failures import UpstreamCallError
from gateway.transport.sse import parse_sse


def test_engine_errors_map_to_api_errors():
    too_long = from_engine_error(PromptTooLongError(9000, 8192))
    assert (too_long.status_code, too_long.code, too_long.param) == (
        400,
        "context_length_exceeded",
        "messages",
    )
    bad = from_engine_error(EngineInvalidRequestError("max_tokens must be >= 1", param="max_tokens"))
    assert (bad.status_code, bad.param) == (400, "max_tokens")
    assert from_engine_error(EngineClosedError("closed")).status_code == 503
    failed = from_engine_error(SamplingError("req#1", "RuntimeError: probability tensor contains nan"))
    assert (failed.status_code, failed.error_type, failed.code) == (
        400,
        "invalid_request_error",
        "sampling_failed",
    )
    assert "RuntimeError: probability tensor contains nan" in failed.message
    assert anthropic_error_body(failed)["error"]["type"] == "invalid_request_error"
    assert json.loads(parse_sse(encode_error_event(failed))[0].data) == anthropic_error_body(failed)


def test_as_api_error_keeps_api_errors_maps_engine_errors_and_names_only_the_class_of_a_bug():
    error = InvalidRequestError("bad")
    assert as_api_error(error) is error
    assert as_api_error(EngineClosedError("closed")).status_code == 503
    bug = as_api_error(KeyError("secret prompt text"))
    assert bug.status_code == 500 and "KeyError" in bug.message and "secret" not in bug.message


def test_error_shapes_by_path():
    error = ModelNotFoundError("nope")
    assert error_shape_for("/v1/chat/completions") is openai_error_body
    assert openai_error_body(error) == {
        "error": {
            "message": "The model `nope` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error_shape_for("/v1/messages") is anthropic_error_body
    assert anthropic_error_body(InvalidRequestError("bad")) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }


@pytest.mark.parametrize(
    "error, kind",
    [
        (InvalidRequestError("bad"), "invalid_request_error"),
        (AuthenticationError("no"), "authentication_error"),
        (status_error(402, "pay"), "billing_error"),
        (status_error(403, "no"), "permission_error"),
        (ModelNotFoundError("x"), "not_found_error"),
        (PayloadTooLargeError("big"), "request_too_large"),
        (RateLimitError("slow down"), "rate_limit_error"),
        (APIError("bug"), "api_error"),
        (UpstreamCallError(502, "connection", "reset"), "api_error"),
        (ServiceUnavailableError("down"), "overloaded_error"),
        (UpstreamCallError(503, "no_replica", "none"), "overloaded_error"),
        (UpstreamTimeoutError("slow"), "timeout_error"),
        (UpstreamCallError(504, "timeout", "slow"), "timeout_error"),
        (UpstreamCallError(529, "overloaded", "busy"), "overloaded_error"),
        (status_error(409, "conflict"), "invalid_request_error"),  # other 4xx
        (status_error(501, "no"), "api_error"),  # other 5xx
    ],
)
def test_anthropic_error_type_by_status(error, kind):
    assert anthropic_error_body(error)["error"]["type"] == kind


def test_anthropic_error_type_prefers_a_known_upstream_type():
    # an Anthropic upstream's billing_error answered 400 stays billing_error, not invalid_request_error
    billing = UpstreamCallError(
        400, "client_error", "credit", upstream_error={"type": "billing_error", "message": "credit"}
    )
    assert anthropic_error_body(billing)["error"] == {"type": "billing_error", "message": "credit"}
    # an unknown upstream type (OpenAI's server_error) falls back to the status
    other = UpstreamCallError(
        502, "server_error", "x", upstream_error={"type": "server_error", "message": "x"}
    )
    assert anthropic_error_body(other)["error"]["type"] == "api_error"
    not_a_string = UpstreamCallError(429, "rate_limit", "x", upstream_error={"type": ["rate_limit_error"]})
    assert anthropic_error_body(not_a_string)["error"]["type"] == "rate_limit_error"


def test_anthropic_stream_error_event_has_the_same_body_as_the_error_response():
    overloaded = UpstreamCallError(
        529, "overloaded", "busy", upstream_error={"type": "overloaded_error", "message": "Overloaded"}
    )
    event = parse_sse(encode_error_event(overloaded))[0]
    assert event.event == "error"
    assert json.loads(event.data) == anthropic_error_body(overloaded)
    assert json.loads(event.data)["error"] == {"type": "overloaded_error", "message": "busy"}
