"""Where a canonical prompt's levels end in the model's tokens: the rules' segments (tools + system,
documents, history) located in the rendering of the prompt, as the ``level_ends`` the engine tags blocks with
(they choose a block's TTL and byte-budget share in the KV tiers, docs/kv-tiers.md).

Computed only for backends that ask for it (``Backend.wants_level_ends``: an embedded model with tiers), as it
renders the prompt once per segment boundary. The ends are on the model's own chat template and tokenizer
(``render_canonical``); they only choose policies, so a boundary one token off costs nothing but a policy.
"""

from __future__ import annotations

from engine.errors import EngineError
from gateway.backends.base import Backend
from gateway.core.request import ChatRequest
from gateway.service.canonicalize.replay import TraceLineError, render_canonical

_SEGMENT_LEVEL = {"tools": "system", "system": "system", "documents": "documents", "history": "history"}
"""``render_canonical`` segment names -> the tier policy levels (``engine.kv_tiers.policy.LEVELS``)."""


def level_ends(
    request: ChatRequest, backend: Backend, tail_level: str | None = None
) -> list[tuple[int, str]] | None:
    """``(end token, level)`` of a canonicalized request's segments in the model's rendering of its prompt
    (``render_canonical``); None without canonical segments or the model's tokenizer.

    Args:
        tail_level: the level of the volatile tail (the last turn), which a request never reuses (None: left
            to the default level); a warmed prompt has no volatile turn: its last part is what it warms.
    """
    tokenizer = backend.prompt_tokenizer()
    if request.canonical is None or tokenizer is None:
        return None
    try:
        rendered = render_canonical(request.canonical, tokenizer)
    except (TraceLineError, EngineError, ValueError, TypeError, KeyError):
        return None  # the levels only choose tier policies: without them the blocks get the default level
    ends: list[tuple[int, str]] = []
    for segment in rendered.segments:
        level = tail_level if segment.name == "tail" else _SEGMENT_LEVEL.get(segment.name)
        if level is None or segment.end <= (ends[-1][0] if ends else 0):
            continue
        if ends and ends[-1][1] == level:
            ends[-1] = (segment.end, level)
        else:
            ends.append((segment.end, level))
    return ends or None
