"""The learned-slot configuration: the mode and every bound and threshold of a ``SlotLearner``.

Owns ``LEARNED_MODES`` and ``LearnConfig``. Invariants: a ``LearnConfig`` that exists is valid (checked in
``__post_init__``, ``ValueError`` naming the field): every count positive, ``min_distinct >= 2``,
``max_value_hashes >= min_distinct``, ``anchor_chars >= min_anchor_chars``, ``0 < max_diff_share < 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

LEARNED_MODES: tuple[str, ...] = ("off", "suggest", "apply")
"""``off``: learn nothing; ``suggest`` (default): learn, list and export; ``apply``: also hoist."""


@dataclass(frozen=True)
class LearnConfig:
    """Bounds and thresholds of a ``SlotLearner`` (all lengths in Python characters).

    Attributes:
        mode: one of ``LEARNED_MODES``.
        min_distinct: distinct values a candidate needs to become a slot.
        sample_size: texts sampled per model+tenant.
        max_keys: model+tenant keys kept (least recently used dropped first).
        max_text_chars: longer texts are not sampled.
        max_sample_chars: sampled characters over all keys.
        max_middle_chars: a pair whose differing middle region is longer is not diffed.
        max_span_chars: longest value a span may hold (also the upper bound of a slot's value class).
        max_spans: most differing spans a pair may have.
        max_diff_share: most of a text that may differ.
        merge_gap_chars: differences closer than this are one span.
        min_template_chars: least identical text a pair must share.
        min_anchor_chars: least identical text on each side of a span (unless the span touches the text's edge).
        anchor_chars: most characters an anchor keeps.
        max_candidates: candidates (slots included) per key.
        max_value_hashes: distinct value hashes kept per candidate (the distinct count saturates there).
    """

    mode: str = "suggest"
    min_distinct: int = 3
    sample_size: int = 8
    max_keys: int = 256
    max_text_chars: int = 32768
    max_sample_chars: int = 4_000_000
    max_middle_chars: int = 2048
    max_span_chars: int = 64
    max_spans: int = 4
    max_diff_share: float = 0.2
    merge_gap_chars: int = 12
    min_template_chars: int = 64
    min_anchor_chars: int = 12
    anchor_chars: int = 40
    max_candidates: int = 128
    max_value_hashes: int = 32

    def __post_init__(self) -> None:
        if self.mode not in LEARNED_MODES:
            raise ValueError(f"unknown learned-slot mode {self.mode!r} (one of: {', '.join(LEARNED_MODES)})")
        for name in (
            "min_distinct",
            "sample_size",
            "max_keys",
            "max_text_chars",
            "max_sample_chars",
            "max_middle_chars",
            "max_span_chars",
            "max_spans",
            "min_template_chars",
            "min_anchor_chars",
            "anchor_chars",
            "max_candidates",
            "max_value_hashes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.min_distinct < 2:
            raise ValueError("min_distinct must be at least 2")
        if self.max_value_hashes < self.min_distinct:
            raise ValueError("max_value_hashes must be at least min_distinct")
        if self.anchor_chars < self.min_anchor_chars:
            raise ValueError("anchor_chars must be at least min_anchor_chars")
        if not 0 < self.max_diff_share < 1:
            raise ValueError("max_diff_share must be between 0 and 1")
