"""Named exceptions raised by the engine. The gateway maps them to protocol errors in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class PromptTooLongError(EngineError):
    """The prompt (plus room for the completion) does not fit the context window or the block pool.

    Raised by ``submit`` / ``check_prompt`` before any block is taken. The message follows OpenAI's
    ``context_length_exceeded`` wording.

    Attributes:
        prompt_tokens: length of the rendered prompt, in tokens.
        limit: the limit it broke, in tokens.
        what: ``"context"`` (the model's max length) or ``"pool"`` (the whole block pool).
        completion_tokens: the completion tokens requested (``max_tokens``) when they are what overflowed
            the context or the pool, else None (then the prompt alone, plus one token, does not fit).
    """

    def __init__(
        self, prompt_tokens: int, limit: int, what: str = "context", completion_tokens: int | None = None
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.what = what
        self.completion_tokens = completion_tokens
        if what == "context" and completion_tokens is not None:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, "
                f"{completion_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        elif what == "context":
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{prompt_tokens} tokens (including room for at least one completion token)."
            )
        elif completion_tokens is not None:
            msg = (
                f"The request needs {prompt_tokens + completion_tokens} tokens of KV cache ({prompt_tokens} in "
                f"the messages, {completion_tokens} in the completion) but the whole block pool holds only "
                f"{limit} tokens. Please reduce the length of the messages or completion."
            )
        else:
            msg = (
                f"The prompt needs {prompt_tokens} tokens of KV cache but the whole block pool holds only "
                f"{limit} tokens."
            )
        super().__init__(msg)


class UnsupportedModelError(EngineError):
    """A checkpoint file, architecture or tensor type the engine cannot load. The message names what it found."""


class InvalidRequestError(EngineError):
    """Bad sampling parameters or prompt (e.g. negative max_tokens, empty prompt). ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class EngineClosedError(EngineError):
    """The engine was shut down while a request was waiting or running."""


class PinCapError(EngineError):
    """Pinning a prefix would take more of the block pool than ``EngineConfig.max_pinned_fraction`` allows.

    Attributes:
        requested: blocks the new pin needs (beyond those already pinned).
        pinned: blocks pinned now.
        cap: most blocks pins may hold.
    """

    def __init__(self, requested: int, pinned: int, cap: int) -> None:
        super().__init__(
            f"pinning {requested} more blocks would exceed the pin cap: {pinned} of {cap} pinned blocks used"
        )
        self.requested = requested
        self.pinned = pinned
        self.cap = cap


class SamplingError(EngineError):
    """Sampling one request's next token failed: its logits processors or its draw raised (e.g. a NaN
    distribution from extreme parameters such as a vanishing ``repetition_penalty`` at a temperature > 0, or a
    constraint state that fails to advance). Only that request ends with this error, its blocks freed at
    once; every other request of the batch runs on as if alone (``LLMEngine.finish_step``).

    Attributes:
        request_id: the engine request that failed.
        cause: ``"<exception class>: <message>"`` of what the sampler raised (no prompt text).
    """

    def __init__(self, request_id: str, cause: str) -> None:
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"sampling the next token failed ({cause}); the request was ended")
