"""The miss explainer's recorded prompts (``gateway.service.miss_explain.MissExplainer``): what one recorded
prompt holds (``Entry``; ``Reply`` for a prompt followed by its served answer) and which of a key's recorded
prompts explains where a new prompt leaves them (``nearest_entry``).

Invariants: an entry's ``tokens`` never change once recorded (an answer extends a prompt by a new entry or an
in-place replacement, ``MissExplainer._extend``); ``nearest_entry`` reads entries, never changes them.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gateway.service.miss_explanation import PromptSegment
from gateway.service.token_chains import common_tokens

ENTRY_OVERHEAD = 256
"""Bytes counted per recorded prompt besides its tokens (the explainer's byte bound)."""

CUT_TAIL = 3
"""Tokens at the end of a reply cut by ``max_tokens`` that its resent text may spell otherwise: a cut inside a
UTF-8 character leaves at most 3 of its bytes, in at most the reply's last 3 tokens, and the client gets U+FFFD
in their place (``engine.detokenizer``), which tokenizes differently."""


class Reply(NamedTuple):
    """What ``MissExplainer.record_answer`` knows of an entry's answer: ``computed``, the entry's leading tokens
    the engine computed KV for (all but the answer's ``uncomputed`` last ids), and ``cut_from``, where the tail
    that a reply cut by ``max_tokens`` may resend re-tokenized starts (None when the reply was not cut)."""

    computed: int
    cut_from: int | None


@dataclass
class Entry:
    """One recorded prompt.

    Attributes:
        tokens: its token ids (``array("I")``).
        segments: its segments as token ranges.
        seen_at: when it was recorded (the explainer's clock, seconds).
        digest: BLAKE2b-128 of ``tokens`` (the key of ``MissExplainer._seqs``).
        tools: the prompt's tools digest, None when not given.
        reply: set for a prompt followed by its served answer (``record_answer``), else None.
    """

    tokens: array
    segments: tuple[PromptSegment, ...]
    seen_at: float
    digest: bytes = b""
    tools: bytes | None = None
    reply: Reply | None = None

    @property
    def nbytes(self) -> int:
        """Bytes counted against the explainer's bound: ``ENTRY_OVERHEAD`` plus 4 per token."""
        return ENTRY_OVERHEAD + 4 * len(self.tokens)


def nearest_entry(entries: Mapping[int, Entry], data: array, upto: int | None) -> tuple[Entry, int] | None:
    """Of a key's recorded prompts (by recording sequence number, oldest first; those recorded as ``upto`` or
    earlier; all when None), the one sharing the longest token prefix with ``data``, and that length; None when
    there is none. Ties: an entry that goes on past the shared tokens (it says what came there before: an
    answer the client edited) over one they use up, then the most recent. (The gateway records a prompt after
    its answer: without the first rule, an edit of the reply's first token was explained against the bare
    prompt, ``cold``.)"""
    best: tuple[Entry, int] | None = None
    for seq, entry in reversed(entries.items()):
        if upto is not None and seq > upto:
            continue
        d = common_tokens(data, entry.tokens, 0)
        if best is None or d > best[1]:
            best = (entry, d)
        elif d == best[1] and len(best[0].tokens) <= d < len(entry.tokens):
            best = (entry, d)
    return best
