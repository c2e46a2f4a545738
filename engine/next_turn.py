"""The token ids a conversation's next turn is certain to begin with, once its newest message is the assistant's
reply: what ``AsyncEngine.prefill_next_turn`` prefills in idle time.

The next turn's prompt is the conversation as the client resends it (the reply now an earlier turn), then the
next message (a user message, or the results of the reply's tool calls), then the generation prompt. Only the
content of that next message is unknown. The prefix is found without knowing how the chat template writes a
turn: the conversation is rendered twice, followed by a next message that differs only in its content (``"?"``
and ``"!"``), and the common prefix of the two token sequences is what any next message of that role shares.
With ChatML that is the reply, its ``<|im_end|>`` and newline, and the next turn's ``<|im_start|>user`` and
newline; a template that writes an earlier reply otherwise than the newest one (dropping its reasoning, say) is
rendered as it will be, since the reply is no longer the last message.

Invariant: the ids returned are exactly the leading ids of the next turn's prompt, rendered by the same
tokenizer in the same scope, for any content of the next message (both probes agree there, and the pieces
between special tokens are encoded alone: ``engine.piece_memo``), unless the client resends the reply or tools
otherwise, which only costs the work of the idle prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.partial_hits import common_prefix_len

PROBES = ("?", "!")
"""Two contents of the next message that differ in their first character."""


def next_turn_prefix(
    tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None, scope: str
) -> list[int] | None:
    """Leading token ids of the next turn after ``messages`` (which end with the assistant's reply).

    Args:
        tokenizer: the checkpoint's ``engine.tokenizer.Tokenizer`` (``render_chat``).
        messages: the conversation in OpenAI chat form, the newest message the reply (``role: assistant``, its
            ``content`` and any ``tool_calls``).
        tools: the tools the next turn is expected to send (those of the request that got the reply).
        scope: the tokenizer memo's partition (the tenant's cache salt: ``engine.piece_memo``).

    Returns:
        The ids (the rendered conversation, the reply's end of turn and the next message's head), or None when
        the newest message is not an assistant reply or the template cannot render the next turn.
    """
    if not messages or messages[-1].get("role") != "assistant":
        return None
    calls = messages[-1].get("tool_calls")
    renders = []
    for text in PROBES:
        if calls:  # the next message holds the calls' results
            first = calls[0] if isinstance(calls[0], dict) else {}
            nxt = {"role": "tool", "tool_call_id": first.get("id") or "call_0", "content": text}
        else:
            nxt = {"role": "user", "content": text}
        try:
            renders.append(
                tokenizer.render_chat([*messages, nxt], tools, add_generation_prompt=False, scope=scope)
            )
        except InvalidRequestError:
            return None
    return renders[0][: common_prefix_len(renders[0], renders[1])]
