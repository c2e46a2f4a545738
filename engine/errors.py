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
        what: ``"context"`` (the model's max length) or ``"pool"`` (the whole block pool, less the blocks pins
            hold that the prompt does not reuse: ``pinned_blocks`` of them).
        completion_tokens: the completion tokens requested (``max_tokens``) when they are what overflowed
            the context or the pool, else None (then the prompt alone, plus one token, does not fit).
        pinned_blocks: blocks held by pins (``/admin/cache/warm`` with ``pin``) that made the pool too small, or 0.
    """

    def __init__(
        self,
        prompt_tokens: int,
        limit: int,
        what: str = "context",
        completion_tokens: int | None = None,
        pinned_blocks: int = 0,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.what = what
        self.completion_tokens = completion_tokens
        self.pinned_blocks = pinned_blocks
        super().__init__(self.worded("messages"))

    def worded(self, noun: str) -> str:
        """The message, calling the prompt ``noun`` (``"messages"`` for chat, ``"prompt"`` for legacy completions,
        as OpenAI words each)."""
        prompt_tokens, limit, completion_tokens = self.prompt_tokens, self.limit, self.completion_tokens
        if self.what == "context" and completion_tokens is not None:
            return (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {noun}, "
                f"{completion_tokens} in the completion). Please reduce the length of the {noun} or completion."
            )
        if self.what == "context":
            return (
                f"This model's maximum context length is {limit} tokens. However, your {noun} resulted in "
                f"{prompt_tokens} tokens (including room for at least one completion token)."
            )
        pool = (
            f"the block pool holds only {limit} tokens beside the {self.pinned_blocks} blocks pinned by warmed "
            "prefixes (DELETE /admin/cache?prefix_key= drops a pin)"
            if self.pinned_blocks
            else f"the whole block pool holds only {limit} tokens"
        )
        if completion_tokens is not None:
            return (
                f"The request needs {prompt_tokens + completion_tokens} tokens of KV cache ({prompt_tokens} in "
                f"the {noun}, {completion_tokens} in the completion) but {pool}. Please reduce the length of the "
                f"{noun} or completion."
            )
        return f"The prompt needs {prompt_tokens} tokens of KV cache but {pool}."


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
