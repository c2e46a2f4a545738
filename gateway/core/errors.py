"""Typed API errors and their JSON bodies.

Everything that goes wrong with a request is raised as an ``APIError`` subclass (or an engine error mapped by
``from_engine_error``; anything else by ``as_api_error``). One place turns them into HTTP responses: the app's
exception handler (``gateway.app.handle_error``), with the body ``error_shape_for(path)`` gives; a failure
after a stream started goes out in-band with the same body
(``gateway.service.pipeline.OpenedStream.guarded_events``).

- OpenAI (default): ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes, and the bodies the API returns).
- Anthropic (paths registered with ``register_error_shape``, ``/v1/messages`` by default):
  ``{"type": "error", "error": {"type", "message"}}`` (https://docs.anthropic.com/en/api/errors), ``type`` by
  ``anthropic_error_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.errors import (
    EngineClosedError,
    EngineError,
    PromptTooLongError,
    SamplingError,
    UnsupportedModelError,
)
from engine.errors import InvalidRequestError as EngineInvalidRequestError


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields.

    Attributes:
        status_code: HTTP status.
        error_type: OpenAI ``error.type`` (``invalid_request_error``, ``server_error``, ...).
        code: OpenAI ``error.code`` (``model_not_found``, ``context_length_exceeded``, ...) or None.
        param: the request field at fault (``"messages[0].content"``) or None.
        message: human-readable text; never contains prompt text or keys.
    """

    status_code: int = 500
    error_type: str = "server_error"
    default_code: str | None = None
    upstream_error: dict[str, Any] | None = None
    """The ``error`` object an upstream answered with (redacted), when the error came from one; an Anthropic
    error body keeps its ``type`` (see ``anthropic_error_type``)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def openai_body(self) -> dict[str, Any]:
        """The OpenAI error JSON of this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(APIError):
    """400: malformed JSON, a missing or ill-typed field, an unsupported value."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """400 ``context_length_exceeded``: the rendered prompt does not fit the model's context or KV pool.

    Attributes:
        anthropic_message: the same error in the Messages API's words, for the Anthropic face, or None (then
            ``message``): clients parse them (Claude Code retries with a smaller ``max_tokens`` on ``input length
            and `max_tokens` exceed context limit: P + M > L``, and compacts on ``prompt is too long``).
        prompt_tokens: the prompt's length in tokens, when known.
        excess_tokens: tokens over the room there is (the prompt and the completion asked for, or the prompt
            and one token, less the limit), when known: what Responses ``truncation: "auto"`` drops.
    """

    default_code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        anthropic_message: str | None = None,
        prompt_tokens: int | None = None,
        excess_tokens: int | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.anthropic_message = anthropic_message
        self.prompt_tokens = prompt_tokens
        self.excess_tokens = excess_tokens


class AuthenticationError(APIError):
    """401: a protected endpoint was called without the right ``Authorization: Bearer <token>``."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    """403: the key is valid but may not use this resource (a model outside its ``models``)."""

    status_code = 403
    error_type = "invalid_request_error"
    default_code = "permission_denied"


class NotFoundError(APIError):
    """404: no such route."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    """404 ``model_not_found``: the body names a model the config does not serve."""

    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.", param="model"
        )


class MethodNotAllowedError(APIError):
    """405: the route exists but not with this HTTP method."""

    status_code = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLargeError(APIError):
    """413: the body is larger than ``server.max_body_bytes``."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(APIError):
    """429: an upstream (or a limit of ours) refused for rate reasons."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class QuotaExceededError(RateLimitError):
    """429: a spend budget is used up (a key's ``budget_usd``). OpenAI's answer for an exhausted quota:
    ``type`` and ``code`` both ``insufficient_quota``
    (https://platform.openai.com/docs/guides/error-codes: "429 - You exceeded your current quota"); the
    Anthropic face keeps its own ``rate_limit_error`` (by status). No ``Retry-After``: a budget does not
    refill."""

    error_type = "insufficient_quota"
    default_code = "insufficient_quota"


class UpstreamError(APIError):
    """502: an upstream provider failed or answered something we cannot use."""

    status_code = 502
    error_type = "server_error"
    default_code = "upstream_error"


class ServiceUnavailableError(APIError):
    """503: the backend is shut down or not ready."""

    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class UpstreamTimeoutError(APIError):
    """504: an upstream did not answer in time."""

    status_code = 504
    error_type = "server_error"
    default_code = "upstream_timeout"


def from_engine_error(exc: EngineError, noun: str = "messages") -> APIError:
    """Map a named engine exception to the API error a client sees.

    ``PromptTooLongError`` -> 400 ``context_length_exceeded`` (param and wording ``noun``: ``messages``, or
    ``prompt`` for legacy completions); engine
    ``InvalidRequestError`` -> 400 with its ``param``; ``SamplingError`` (sampling this request failed, from its
    own parameters and state only: the engine and the other requests run on) -> 400 ``sampling_failed``;
    ``EngineClosedError`` -> 503; anything else -> 500.
    """
    if isinstance(exc, PromptTooLongError):
        return ContextLengthExceededError(
            exc.worded(noun),
            param=noun,
            anthropic_message=anthropic_context_message(exc),
            prompt_tokens=exc.prompt_tokens,
            excess_tokens=exc.prompt_tokens + (exc.completion_tokens or 1) - exc.limit,
        )
    if isinstance(exc, EngineInvalidRequestError):
        return InvalidRequestError(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, SamplingError):
        return InvalidRequestError(
            f"Sampling the next token failed with this request's sampling parameters ({exc.cause}); "
            "try less extreme temperature, top_p, logit_bias or penalty values.",
            code="sampling_failed",
        )
    if isinstance(exc, EngineClosedError):
        return ServiceUnavailableError("The model's engine is shut down.")
    if isinstance(exc, UnsupportedModelError):
        return APIError(str(exc))
    return APIError(f"Engine error: {exc}")


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the API error a client sees: an ``APIError`` as it is, an engine error mapped by
    ``from_engine_error``, anything else (a bug) a 500 that names only the exception's class."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    return APIError(f"The server had an error while processing your request ({type(exc).__name__}).")


def status_error(status_code: int, detail: str | None = None) -> APIError:
    """The API error for a bare HTTP status raised by the router (404 unknown route, 405 wrong method)."""
    if status_code == 404:
        return NotFoundError(detail or "Not found.")
    if status_code == 405:
        return MethodNotAllowedError(detail or "Method not allowed.")
    if 400 <= status_code < 500:
        error = InvalidRequestError(detail or "Bad request.")
        error.status_code = status_code
        return error
    error = APIError(detail or "Internal server error.")
    error.status_code = status_code
    return error


ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""HTTP status -> Anthropic ``error.type`` (https://docs.anthropic.com/en/api/errors). 503 is ours (backend
shut down, no replica left): Anthropic's nearest type is ``overloaded_error``. Other 4xx are
``invalid_request_error``, other 5xx ``api_error``."""

_KNOWN_ANTHROPIC_TYPES = frozenset(ANTHROPIC_ERROR_TYPES.values())


def openai_error_body(error: APIError) -> dict[str, Any]:
    """OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return error.openai_body()


def anthropic_error_type(error: APIError) -> str:
    """The Anthropic ``error.type`` of ``error``: the upstream's own ``type`` when it is one Anthropic
    documents (an Anthropic upstream's ``billing_error`` stays one whatever status we answer with), else by
    status."""
    upstream_type = (error.upstream_error or {}).get("type")
    if isinstance(upstream_type, str) and upstream_type in _KNOWN_ANTHROPIC_TYPES:
        return upstream_type
    if error.status_code in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[error.status_code]
    return "api_error" if error.status_code >= 500 else "invalid_request_error"


def anthropic_context_message(exc: PromptTooLongError) -> str:
    """A context or pool overflow in the Messages API's words: ``input length and `max_tokens` exceed context
    limit: P + M > L, decrease input length or `max_tokens` and try again`` when ``max_tokens`` overflowed, else
    ``prompt is too long: N tokens > L maximum`` (N counts one completion token); a pool shrunk by pins says so
    after it."""
    limit = exc.limit
    if exc.completion_tokens is not None:
        text = (
            f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + {exc.completion_tokens} > "
            f"{limit}, decrease input length or `max_tokens` and try again"
        )
    else:
        text = f"prompt is too long: {exc.prompt_tokens} tokens > {limit} maximum"
    if exc.what == "pool":
        text += f" (the KV block pool holds {limit} tokens" + (
            f" beside {exc.pinned_blocks} blocks pinned by warmed prefixes)" if exc.pinned_blocks else ")"
        )
    return text


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}`` (type from
    ``anthropic_error_type``; a context overflow in Anthropic's own words, ``anthropic_context_message``)."""
    message = getattr(error, "anthropic_message", None) or error.message
    return {"type": "error", "error": {"type": anthropic_error_type(error), "message": message}}


ErrorShape = Callable[[APIError], dict[str, Any]]

_ERROR_SHAPES: list[tuple[str, ErrorShape]] = [("/v1/messages", anthropic_error_body)]


def register_error_shape(path_prefix: str, shape: ErrorShape) -> None:
    """Use ``shape`` for errors of requests whose path starts with ``path_prefix`` (longest prefix wins)."""
    _ERROR_SHAPES.append((path_prefix, shape))
    _ERROR_SHAPES.sort(key=lambda item: len(item[0]), reverse=True)


def error_shape_for(path: str) -> ErrorShape:
    """The error formatter of a request path: a registered prefix's, else OpenAI's."""
    for prefix, shape in _ERROR_SHAPES:
        if path.startswith(prefix):
            return shape
    return openai_error_body
