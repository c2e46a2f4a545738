"""Corpora for the rules benchmark and tests, written for prefixgate (no published prompt text).

- ``prompts.yaml`` (corpus a): system prompts in the shapes real products use. Each prompt is a template in
  which ``{{name}}`` marks a volatile span and ``{{@name}}`` includes a shared stable block; ``variants``
  renders it several times with different volatile values, each with the list of its volatile spans, so the
  prefix an ideal canonicalizer reaches is known.
- ``stable_lines.yaml`` (corpus c): stable lines and short contexts that look volatile (examples,
  schedules, cutoffs, versions, prices, format specs, phone numbers, addresses, math, code); the default
  rules must leave every one of them alone.

Invariants: loading is deterministic (no clock, no randomness); a variant's spans appear in its system text
in order, each exactly as given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

CORPUS_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = CORPUS_DIR / "prompts.yaml"
STABLE_LINES_FILE = CORPUS_DIR / "stable_lines.yaml"

_SLOT = re.compile(r"\{\{(@?)([A-Za-z_][A-Za-z0-9_]*)\}\}")
_KO_AMPM = ("오전", "오후")
_ZH_AMPM = ("上午", "下午")
_ZONE_NAMES = {60: "Central European Standard Time", 120: "Central European Summer Time"}


class CorpusError(ValueError):
    """A corpus file is malformed; the message names the file, the prompt id and the problem."""


@dataclass(frozen=True)
class Variant:
    """One rendering of a prompt template.

    Attributes:
        messages: ``[system, user]`` OpenAI chat messages.
        spans: the volatile values in the system text, in order of appearance.
    """

    messages: list[dict[str, Any]]
    spans: tuple[str, ...]


@dataclass(frozen=True)
class PromptCase:
    """A corpus (a) prompt: id, product kind, and its variants (same stable text, other volatile values)."""

    id: str
    kind: str
    variants: tuple[Variant, ...]


@dataclass(frozen=True)
class StableLine:
    """A corpus (c) entry: its category and its text (one line or a short multi-line context)."""

    category: str
    text: str


def format_time(spec: str, when: datetime) -> str:
    """``when`` rendered by ``spec``: ``strftime`` directives, then these fields: ``{day}`` ``{month}``
    ``{hour}`` ``{minute}`` (no padding), ``{h12}`` (1-12), ``{ampm}`` (AM/PM), ``{ko_ampm}`` (오전/오후),
    ``{zh_ampm}`` (上午/下午), ``{month_lower}`` ``{weekday_lower}``, ``{isoweek}`` (2025-W10-2), ``{ydm}``
    (YYYY-DD-MM), ``{offset}`` (+0100), ``{offset_colon}`` (+01:00), ``{zone_name}``, ``{epoch}`` (Unix
    seconds)."""
    offset = when.utcoffset()
    minutes = int(offset.total_seconds() // 60) if offset is not None else 0
    sign = "+" if minutes >= 0 else "-"
    hh, mm = divmod(abs(minutes), 60)
    iso = when.isocalendar()
    fields = {
        "day": when.day,
        "month": when.month,
        "hour": when.hour,
        "minute": when.minute,
        "h12": when.hour % 12 or 12,
        "ampm": "AM" if when.hour < 12 else "PM",
        "ko_ampm": _KO_AMPM[when.hour >= 12],
        "zh_ampm": _ZH_AMPM[when.hour >= 12],
        "month_lower": when.strftime("%B").lower(),
        "weekday_lower": when.strftime("%A").lower(),
        "isoweek": f"{iso.year}-W{iso.week:02d}-{iso.weekday}",
        "ydm": f"{when:%Y}-{when:%d}-{when:%m}",
        "offset": f"{sign}{hh:02d}{mm:02d}",
        "offset_colon": f"{sign}{hh:02d}:{mm:02d}",
        "zone_name": _ZONE_NAMES.get(minutes, "Coordinated Universal Time"),
        "epoch": int(when.timestamp()),
    }
    return when.strftime(spec).format(**fields)


def _slot_values(name: str, spec: Any, times: list[datetime], count: int, where: str) -> list[str]:
    if isinstance(spec, dict) and set(spec) == {"date"} and isinstance(spec["date"], str):
        return [format_time(spec["date"], times[i % len(times)]) for i in range(count)]
    if isinstance(spec, list) and spec and all(isinstance(v, str) for v in spec):
        if len(set(spec)) < 2:
            raise CorpusError(f"{where}: slot '{name}' needs at least two different values")
        return [spec[i % len(spec)] for i in range(count)]
    raise CorpusError(f"{where}: slot '{name}' must be a list of strings or {{date: FORMAT}}")


def _render(
    template: str, blocks: dict[str, str], slots: dict[str, list[str]], i: int, where: str
) -> tuple[str, tuple[str, ...]]:
    """Variant ``i`` of ``template``: (system text, its volatile spans in order)."""
    spans: list[str] = []

    def fill(match: re.Match[str]) -> str:
        if match.group(1):
            if match.group(2) not in blocks:
                raise CorpusError(f"{where}: unknown block {match.group(2)!r}")
            return blocks[match.group(2)]
        value = slots[match.group(2)][i]
        spans.append(value)
        return value

    return _SLOT.sub(fill, template), tuple(spans)


def load_prompts(path: Path = PROMPTS_FILE) -> list[PromptCase]:
    """Corpus (a): every prompt of ``path`` with its variants.

    Raises:
        CorpusError: a missing key, an unknown block or slot, a slot never used, a bad time.
    """
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    count = int(data["variants"])
    times = [datetime.fromisoformat(t) for t in data["times"]]
    blocks: dict[str, str] = data.get("blocks") or {}
    cases: list[PromptCase] = []
    for entry in data["prompts"]:
        where = f"{path.name}: prompt {entry.get('id')!r}"
        try:
            template, user, kind = entry["system"], entry["user"], entry["kind"]
        except KeyError as e:
            raise CorpusError(f"{where}: missing key {e}") from None
        slots = {name: _slot_values(name, spec, times, count, where) for name, spec in entry["slots"].items()}
        used = {m.group(2) for m in _SLOT.finditer(template) if not m.group(1)}
        if used != set(slots):
            raise CorpusError(f"{where}: slots used {sorted(used)} but defined {sorted(slots)}")
        variants = []
        for i in range(count):
            system, spans = _render(template, blocks, slots, i, where)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            variants.append(Variant(messages, spans))
        cases.append(PromptCase(entry["id"], kind, tuple(variants)))
    return cases


def load_stable_lines(path: Path = STABLE_LINES_FILE) -> list[StableLine]:
    """Corpus (c): every entry of ``path`` with its category, in file order.

    Raises:
        CorpusError: the file is not a mapping of category -> list of strings.
    """
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise CorpusError(f"{path.name}: expected a mapping of category -> list of lines")
    out: list[StableLine] = []
    for category, lines in data.items():
        if not isinstance(lines, list) or not all(isinstance(line, str) and line.strip() for line in lines):
            raise CorpusError(f"{path.name}: category {category!r} must be a list of non-empty strings")
        out.extend(StableLine(category, line) for line in lines)
    return out
