"""What a replay measured: per request, the results with the rules on and off, and their totals and table.

Owns ``SideResult`` (one request on one side), ``RequestReport``, ``ReplayReport`` (with ``totals``, the
final JSON line's keys, and ``table``, the fixed-width listing).

Invariants: a report holds counts, causes and offsets, never prompt text; ``totals``'s ``causes_on`` and
``causes_off`` hold every cause of ``MISS_CAUSES`` (zero when unseen).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.service.canonicalize.trace import BrokenLine
from gateway.service.miss_explanation import MISS_CAUSES
from rules.learned import SlotLearner


@dataclass(frozen=True)
class SideResult:
    """One request with the rules on or off.

    Attributes:
        prompt_chars, prompt_tokens: the rendered prompt's length.
        common_chars, common_tokens: longest common prefix with an earlier request of the same key.
        stable_tokens: where the canonical stable prefix ends, in tokens.
        cause: the miss cause against an ideal cache, or None (a hit, or nothing stable to miss).
        at: ``segment:offset`` of the miss (then the learned slot's id when one covers it), or None.
    """

    prompt_chars: int
    prompt_tokens: int
    common_chars: int
    common_tokens: int
    stable_tokens: int
    cause: str | None
    at: str | None


@dataclass(frozen=True)
class RequestReport:
    """One replayed request: its line, model, and the results with rules on and off."""

    line: int
    model: str
    on: SideResult
    off: SideResult


@dataclass
class ReplayReport:
    """Everything ``replay`` measured."""

    tokenizer: str
    requests: list[RequestReport] = field(default_factory=list)
    broken: list[BrokenLine] = field(default_factory=list)
    learner: SlotLearner | None = None

    def totals(self) -> dict[str, Any]:
        """Sums over the requests: ``requests``, ``broken``, ``tokenizer``, prompt and common tokens and
        characters on/off, ``share_on``/``share_off`` (common tokens / prompt tokens), ``turns_worse_than_off``
        (requests whose common prefix in tokens is shorter with the rules on), ``causes_on``/``causes_off``
        (cause -> requests), ``learned_slots`` (slots learned from the trace's system texts)."""
        out: dict[str, Any] = {
            "requests": len(self.requests),
            "broken": len(self.broken),
            "tokenizer": self.tokenizer,
        }
        for side in ("on", "off"):
            results = [getattr(r, side) for r in self.requests]
            prompt = sum(s.prompt_tokens for s in results)
            common = sum(s.common_tokens for s in results)
            out[f"prompt_tokens_{side}"] = prompt
            out[f"common_tokens_{side}"] = common
            out[f"prompt_chars_{side}"] = sum(s.prompt_chars for s in results)
            out[f"common_chars_{side}"] = sum(s.common_chars for s in results)
            out[f"share_{side}"] = round(common / prompt, 4) if prompt else 0.0
            causes = dict.fromkeys(MISS_CAUSES, 0)
            for s in results:
                if s.cause is not None:
                    causes[s.cause] += 1
            out[f"causes_{side}"] = causes
        out["turns_worse_than_off"] = sum(
            1 for r in self.requests if r.on.common_tokens < r.off.common_tokens
        )
        out["learned_slots"] = len(self.learner.slots()) if self.learner is not None else 0
        return out

    def table(self) -> str:
        """A fixed-width table: one row per request, the broken lines, a totals row."""
        head = (
            f"{'line':>5} {'model':<24} {'tok on':>8} {'common':>8} {'chr common':>10} {'tok off':>8} "
            f"{'common':>8} {'chr common':>10}  {'miss on':<28} {'miss off':<28}"
        )
        rows = [head, "-" * len(head)]
        for r in self.requests:
            rows.append(
                f"{r.line:>5} {r.model[:24]:<24} {r.on.prompt_tokens:>8} {r.on.common_tokens:>8} "
                f"{r.on.common_chars:>10} {r.off.prompt_tokens:>8} {r.off.common_tokens:>8} "
                f"{r.off.common_chars:>10}  {_miss(r.on):<28} {_miss(r.off):<28}"
            )
        t = self.totals()
        rows.append("-" * len(head))
        rows.append(
            f"{'total':>5} {str(t['requests']) + ' requests':<24} {t['prompt_tokens_on']:>8} "
            f"{t['common_tokens_on']:>8} {t['common_chars_on']:>10} {t['prompt_tokens_off']:>8} "
            f"{t['common_tokens_off']:>8} {t['common_chars_off']:>10}  "
            f"share on {t['share_on']:.3f}, off {t['share_off']:.3f}; "
            f"worse than off: {t['turns_worse_than_off']}"
        )
        for b in self.broken:
            rows.append(f"line {b.line}: skipped: {b.reason}")
        return "\n".join(rows)


def _miss(side: SideResult) -> str:
    return "-" if side.cause is None else f"{side.cause}@{side.at}"
