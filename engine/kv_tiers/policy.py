"""Per-level policies of the tiers: how long a block is kept (TTL) and what share of a tier's byte budget
its level may take.

Levels are the rules' segments of a canonical prompt (DESIGN.md, "The way a request travels"): 1
``system`` (tools + system prompt), 2 ``documents``, 3 ``history``. A request tells the engine where each
level ends in its tokens (``level_of_blocks``); a block spanning two levels, or shared by requests that give
it different levels, keeps the *longest* policy (longest TTL, then larger budget share). Inside a level,
each tier evicts least recently used first once the level's share of the budget is full; an entry older
than its level's TTL is expired (a miss, counted per level). A block without a level gets
``TierPolicies.default_level``.

Invariants: every tier's shares sum to at most 1; a TTL is None (never expires) or > 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LEVELS: tuple[str, ...] = ("system", "documents", "history")
"""Level names, in prompt order (level 1, 2, 3)."""


MAX_TTL_S = 100 * 365 * 86_400.0
"""The longest ``ttl_s`` (100 years): a Redis TTL is a 64-bit count of milliseconds, and a trial's ``1e16`` seconds
passed the config, then every Redis write was refused ("value is not an integer or out of range"). ``null``
keeps entries until the budget evicts them."""


@dataclass(frozen=True)
class TierPolicy:
    """One level's policy in one tier.

    Attributes:
        ttl_s: seconds an entry is kept after it was written, at most ``MAX_TTL_S`` (None: until evicted by the
            budget).
        budget_share: fraction of the tier's byte budget this level may use, in (0, 1].
    """

    ttl_s: float | None
    budget_share: float

    def __post_init__(self) -> None:
        if self.ttl_s is not None and not 0 < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:.0f}] or None, got {self.ttl_s!r}")
        if not 0 < self.budget_share <= 1:
            raise ValueError(f"budget_share must be in (0, 1], got {self.budget_share!r}")

    def sort_key(self) -> tuple[float, float]:
        """Larger = longer policy: TTL first (None counts as infinite), then the budget share."""
        return (float("inf") if self.ttl_s is None else self.ttl_s, self.budget_share)


DEFAULT_POLICIES: dict[str, TierPolicy] = {
    "system": TierPolicy(ttl_s=86_400.0, budget_share=0.4),
    "documents": TierPolicy(ttl_s=3_600.0, budget_share=0.35),
    "history": TierPolicy(ttl_s=600.0, budget_share=0.25),
}
"""System prompts a day, documents an hour, history ten minutes (the issue's example)."""


@dataclass(frozen=True)
class TierPolicies:
    """The policies of every level in every tier.

    Attributes:
        per_tier: tier name (``"disk"``, ``"redis"``) -> level name -> policy. A tier not named uses
            ``DEFAULT_POLICIES``; a level not named in a tier uses the default of that level.
        default_level: level of a block the request gave no level.

    Raises:
        ValueError: an unknown level name, or a tier whose shares sum above 1.
    """

    per_tier: Mapping[str, Mapping[str, TierPolicy]] = field(default_factory=dict, hash=False)
    default_level: str = "history"

    def __post_init__(self) -> None:
        if self.default_level not in LEVELS:
            raise ValueError(f"default_level must be one of {LEVELS}, got {self.default_level!r}")
        for tier, levels in self.per_tier.items():
            unknown = set(levels) - set(LEVELS)
            if unknown:
                raise ValueError(f"tier {tier!r}: unknown level(s) {sorted(unknown)}; levels are {LEVELS}")
            total = sum(self.policy(tier, lv).budget_share for lv in LEVELS)
            if total > 1 + 1e-9:
                raise ValueError(f"tier {tier!r}: {self.shares_problem(tier, levels, total)}")

    def shares_problem(self, tier: str, given: Iterable[str], total: float) -> str:
        """Why ``tier``'s shares are refused: their sum, each level's share, and which of them are defaults
        (a level not set keeps its default share, which a person setting one level may not think of)."""
        given = set(given)
        parts = []
        for lv in LEVELS:
            share = self.policy(tier, lv).budget_share
            parts.append(f"{lv} {share:g}" + ("" if lv in given else " (default)"))
        defaults = [lv for lv in LEVELS if lv not in given]
        hint = (
            f"; levels not set keep their default share, so lower the shares or set {', '.join(defaults)} too"
            if defaults
            else ""
        )
        return f"budget shares sum to {total:.3f} > 1 ({', '.join(parts)}){hint}"

    def policy(self, tier: str, level: str) -> TierPolicy:
        """The policy of ``level`` in ``tier``."""
        return self.per_tier.get(tier, {}).get(level) or DEFAULT_POLICIES[level]

    def resolve(self, tier: str, levels: Iterable[str]) -> tuple[str, TierPolicy]:
        """The level (and its policy) a block claimed by ``levels`` is kept under in ``tier``: the longest.

        An empty ``levels`` means ``default_level``.
        """
        names = set(levels) or {self.default_level}
        best = max(sorted(names), key=lambda lv: self.policy(tier, lv).sort_key())
        return best, self.policy(tier, best)


def level_of_blocks(
    num_blocks: int, block_size: int, level_ends: Sequence[tuple[int, str]] | None, default_level: str
) -> list[frozenset[str]]:
    """The levels each block's tokens belong to.

    Args:
        num_blocks: full blocks of the prompt.
        block_size: tokens per block.
        level_ends: ``(end token, level)`` pairs in increasing ``end``: tokens ``[previous end, end)`` are of
            that level; tokens after the last end are ``default_level``. None: every block is
            ``default_level``.
        default_level: see above.

    Returns:
        ``num_blocks`` sets of level names.

    Raises:
        ValueError: an unknown level or ends that do not increase.
    """
    out: list[frozenset[str]] = []
    spans: list[tuple[int, int, str]] = []
    start = 0
    for end, level in level_ends or ():
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; levels are {LEVELS}")
        if end < start:
            raise ValueError(f"level ends must increase, got {end} after {start}")
        spans.append((start, end, level))
        start = end
    for i in range(num_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        names = {lv for s, e, lv in spans if s < hi and e > lo}
        if hi > start:
            names.add(default_level)
        out.append(frozenset(names))
    return out
