"""Learned volatile slots: spans of system/developer text that change between otherwise identical prompts.

Rules never know every product's prompt, so the gateway learns the rest from traffic. For each model+tenant
a ``SlotLearner`` keeps a small sample of recent system/developer texts (never user, assistant or tool
text). When a new text differs from its nearest sampled text only in short spans with identical text around
them, each span is recorded as a *candidate*: its anchors (the identical text just before and after it) and
a one-way hash of each value seen there. A candidate whose anchors have been seen with ``min_distinct``
distinct values becomes a *learned slot*. A slot becomes a ``hoist`` rule: escaped left anchor, a bounded
value class built from the characters the values used, escaped right anchor, in RE2 syntax (linear time); a
labelled field's rule hoists the label with the value (``label_split``),
loadable by ``rules.load_ruleset`` from the YAML that ``export_yaml`` writes.

Modes: ``off`` (nothing is sampled), ``suggest`` (the default: slots are learned, listed and exported, never
applied), ``apply`` (``rules_for`` also returns them as rules for the canonicalizer).

Invariants:

- values are never stored: a candidate keeps value hashes (8-byte BLAKE2b), lengths and character classes.
  ``slots`` (the stats listing) holds no prompt text at all: anchors appear as hashes and lengths. The
  exported rule file holds the anchors (template text, which a person reviews), never a value.
- bounded memory whatever the traffic: at most ``max_keys`` model+tenant keys (LRU), ``sample_size`` texts
  of at most ``max_text_chars`` each per key, ``max_sample_chars`` sampled characters in all, and
  ``max_candidates`` candidates of at most ``max_value_hashes`` hashes per key (see ``footprint``).
- bounded work per text: one linear scan per sampled text to find the nearest, then one span diff
  (``rules.span_diff.diff_spans``, whose invariants keep unrelated prompts from teaching anything).

The pieces: ``rules.learn_config`` (mode and bounds), ``rules.span_diff`` (the diff of a pair),
``rules.slot_candidate`` (a candidate's value shape, the RE2 value class and escaping); this module owns the
learner's state (samples and candidates per key) and the slots' listing, rules and export.

Not thread-safe by itself; each public method takes the learner's lock.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import yaml

from rules.learn_config import LearnConfig
from rules.messages import get_text, text_parts
from rules.model import DEFAULT_PLACEMENT, MessageSelector, Rule
from rules.patterns import compile_pattern
from rules.placement import extract_turn_blocks
from rules.slot_candidate import SlotCandidate, describe, escape_re2, short_hash, value_class
from rules.span_diff import Span, common_prefix_len, common_suffix_len, diff_spans

LEARNED_ROLES: frozenset[str] = frozenset({"system", "developer"})
"""The only roles whose text is ever sampled."""

LEARNED_FILE = "<learned>"
"""``Rule.file`` of rules built by ``SlotLearner.rules_for``."""

_MAX_COMPILED = 1024

LABEL_CHARS = 40
"""Most characters of a field label hoisted with its value (``label_split``)."""

_LABEL_END = re.compile(r"[:=：][ \t]*\Z")
_FIELD_START = re.compile(r"(?:\n|[.!?;][ \t]+)[ \t]*(?:[-*•+][ \t]+)?")
_SENTENCE_STOP = re.compile(r"[.;](?:[ \t]+|(?=\n)|\Z)")


def label_split(left: str, at_start: bool) -> tuple[str, str] | None:
    """``(before, label)``: a left anchor cut before the label of the field whose value follows it, or None.

    A label ends the anchor with ``:``, ``=`` or ``：`` (and spaces or tabs) and starts after the anchor's last
    line break or sentence end (and a list marker), or at the text's start (``at_start``); it holds 1 to
    ``LABEL_CHARS`` characters and no quote or bracket (a JSON member's key stays, so the JSON stays valid).
    """
    if _LABEL_END.search(left) is None:
        return None
    starts = [m.end() for m in _FIELD_START.finditer(left)]
    if starts:
        cut = starts[-1]
    elif at_start:
        cut = len(left) - len(left.lstrip())
    else:
        return None
    label = left[cut:]
    if not 1 <= len(label.strip()) <= LABEL_CHARS or any(c in label for c in "\"'`{}[]()<>"):
        return None
    if _LABEL_END.search(label) is None or not label.strip(" \t:=："):
        return None
    return left[:cut], label


@dataclass
class _Key:
    sample: deque[str]
    candidates: OrderedDict[tuple[str, str, bool, bool], SlotCandidate] = field(default_factory=OrderedDict)
    sample_chars: int = 0


class SlotLearner:
    """Learns volatile slots per model+tenant from system/developer texts (see the module docstring).

    Args:
        config: bounds and thresholds; ``LearnConfig()`` by default.
        clock: seconds since the epoch (``time.time`` by default; tests pass their own).
    """

    def __init__(self, config: LearnConfig | None = None, clock: Any = time.time) -> None:
        self.config = config or LearnConfig()
        self._clock = clock
        self._keys: OrderedDict[tuple[str, str], _Key] = OrderedDict()
        self._sample_chars = 0
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        """The configured mode (one of ``LEARNED_MODES``)."""
        return self.config.mode

    # ----- learning ---------------------------------------------------------------------------------------
    def observe(self, model: str, tenant: str, messages: list[dict[str, Any]]) -> int:
        """Sample the system/developer texts of one request and learn from them. Pass the canonical messages
        (``Canonical.messages``, after the rules): what a rule already hoists is then never learned again, and a
        hoisted-value block at the end of a system message (``system_end`` placement) is taken out first.

        Returns:
            the number of spans recorded (0 in mode ``off``). Messages of other roles are never read.
        """
        if self.config.mode == "off":
            return 0
        chosen = [
            copy.deepcopy(m) for m in messages if isinstance(m, dict) and m.get("role") in LEARNED_ROLES
        ]
        extract_turn_blocks(chosen, 0, len(chosen))  # values the rules already hoisted are not template text
        texts = [get_text(m, part) for m in chosen for part in text_parts(m)]
        recorded = 0
        for text in texts:
            recorded += self.observe_text(model, tenant, text)
        return recorded

    def observe_text(self, model: str, tenant: str, text: str) -> int:
        """Learn from one system/developer text (the caller guarantees the role). Returns spans recorded."""
        cfg = self.config
        if cfg.mode == "off" or not isinstance(text, str):
            return 0
        if not cfg.min_template_chars <= len(text) <= cfg.max_text_chars:
            return 0
        with self._lock:
            key = self._key(model, tenant)
            if text in key.sample:
                key.sample.remove(text)
                key.sample.append(text)
                return 0
            recorded = 0
            nearest = self._nearest(key, text)
            if nearest is not None:
                spans = diff_spans(nearest, text, cfg)
                for span in spans or ():
                    recorded += self._record(key, span, nearest, text)
            self._sample(key, text)
            return recorded

    def _key(self, model: str, tenant: str) -> _Key:
        k = (model, tenant)
        key = self._keys.get(k)
        if key is None:
            key = _Key(sample=deque())
            self._keys[k] = key
            while len(self._keys) > self.config.max_keys:
                _, dropped = self._keys.popitem(last=False)
                self._sample_chars -= dropped.sample_chars
        else:
            self._keys.move_to_end(k)
        return key

    def _nearest(self, key: _Key, text: str) -> str | None:
        """The sampled text sharing the most identical prefix + suffix with ``text``, if enough."""
        best, best_score = None, self.config.min_template_chars - 1
        for old in key.sample:
            p = common_prefix_len(old, text)
            score = p + common_suffix_len(old, text, min(len(old), len(text)) - p)
            if score > best_score:
                best, best_score = old, score
        return best

    def _sample(self, key: _Key, text: str) -> None:
        key.sample.append(text)
        key.sample_chars += len(text)
        self._sample_chars += len(text)
        if len(key.sample) > self.config.sample_size:
            dropped = key.sample.popleft()
            key.sample_chars -= len(dropped)
            self._sample_chars -= len(dropped)
        while self._sample_chars > self.config.max_sample_chars:
            victim = next((k for k in self._keys.values() if k.sample and k is not key), None)
            victim = victim or key
            dropped = victim.sample.popleft()
            victim.sample_chars -= len(dropped)
            self._sample_chars -= len(dropped)

    def _record(self, key: _Key, span: Span, old: str, new: str) -> int:
        cfg = self.config
        ident = (span.left, span.right, span.at_start, span.at_end)
        now = self._clock()
        candidate = key.candidates.get(ident)
        if candidate is None:
            candidate = SlotCandidate(span.left, span.right, span.at_start, span.at_end, first_seen=now)
            key.candidates[ident] = candidate
            self._bound_candidates(key)
        else:
            key.candidates.move_to_end(ident)
        seen = 0
        for i, value in enumerate((old[span.old_start : span.old_end], new[span.new_start : span.new_end])):
            digest = short_hash(value)
            # the new prompt's value is one more observation; the earlier prompt's only when its value is new
            # to the candidate (it was sampled, and counted, when it was the new one): observations are the
            # prompts whose value was seen here, so never fewer than the distinct values
            seen += 1 if i == 1 or digest not in candidate.value_hashes else 0
            if not candidate.add_value(value, digest, cfg.max_value_hashes):
                key.candidates.pop(ident, None)
                return 0
        candidate.observations += seen
        candidate.last_seen = now
        if candidate.slot_since is None and len(candidate.value_hashes) >= cfg.min_distinct:
            candidate.slot_since = now
        return 1

    def _bound_candidates(self, key: _Key) -> None:
        while len(key.candidates) > self.config.max_candidates:
            victim = next((i for i, c in key.candidates.items() if c.slot_since is None), None)
            if victim is None:
                key.candidates.popitem(last=False)
            else:
                del key.candidates[victim]

    # ----- reading ----------------------------------------------------------------------------------------
    def _slots(
        self, model: str | None, tenant: str | None, include_candidates: bool = False
    ) -> list[tuple[str, str, SlotCandidate]]:
        out = []
        for (m, t), key in self._keys.items():
            if (model is not None and m != model) or (tenant is not None and t != tenant):
                continue
            for c in key.candidates.values():
                if c.slot_since is not None or include_candidates:
                    out.append((m, t, c))
        return out

    @staticmethod
    def slot_id(left: str, right: str, at_start: bool = False, at_end: bool = False) -> str:
        """The rule id of a slot: ``learned.`` + 12 hex digits of a hash of its anchors (the same slot learned
        under two tenants has one id)."""
        return "learned." + short_hash(left, right, str(at_start), str(at_end)).hex()[:12]

    def pattern_source(self, candidate: SlotCandidate) -> str:
        """The RE2 source of a slot's hoist rule: ``\\A``? escaped left anchor, ``(?P<value>CLASS{lo,hi}?)``,
        escaped right anchor, ``\\z``?.

        A labelled field (``label_split``: the anchor ends in ``Label:`` or ``Label =`` from its line's or
        sentence's start) is hoisted with its label, and with the sentence's end (``.`` or ``;`` and the spaces
        after it) when one follows: the block reads ``App version: 1.4.9`` and the system prompt keeps no label
        without its value. Any other value is hoisted bare (``Hello Zed,`` keeps ``Hello ,``: which words of a
        sentence belong to its value is not known)."""
        split = label_split(candidate.left, candidate.at_start)
        value = value_class(candidate, self.config.max_span_chars)
        right_text = candidate.right
        end = ""
        if split is not None:
            before, label = split
            stop = _SENTENCE_STOP.match(right_text)
            if stop is not None:
                end, right_text = escape_re2(stop.group(0)), right_text[stop.end() :]
            value = escape_re2(label) + value
        else:
            before = candidate.left
        left = (r"\A" if candidate.at_start else "") + escape_re2(before)
        right = escape_re2(right_text) + (r"\z" if candidate.at_end else "")
        return f"{left}(?P<value>{value}{end}){right}"

    def slots(
        self, model: str | None = None, tenant: str | None = None, include_candidates: bool = False
    ) -> list[dict[str, Any]]:
        """The stats listing: shape and counts of each learned slot (and candidate, when asked), never a value
        and never prompt text.

        Returns:
            dicts with ``id``, ``model``, ``tenant``, ``state`` (``slot``/``candidate``), ``left_anchor``
            and ``right_anchor`` (each ``{"sha": 12 hex digits, "chars": length, "edge": bool}``),
            ``value_chars`` ([shortest, longest]), ``value_classes`` (class names, plus ``punct`` when the
            values held other characters), ``distinct_values`` (saturates at ``max_value_hashes``),
            ``observations`` (prompts whose value at the slot was seen: never fewer than ``distinct_values``),
            ``first_seen``, ``last_seen``, ``slot_since`` (epoch seconds or None); sorted
            by model, tenant, id.
        """
        with self._lock:
            rows = []
            for m, t, c in self._slots(model, tenant, include_candidates):
                classes = sorted(c.classes) + (["punct"] if c.punct else [])
                rows.append(
                    {
                        "id": self.slot_id(c.left, c.right, c.at_start, c.at_end),
                        "model": m,
                        "tenant": t,
                        "state": "slot" if c.slot_since is not None else "candidate",
                        "left_anchor": {
                            "sha": short_hash(c.left).hex()[:12],
                            "chars": len(c.left),
                            "edge": c.at_start,
                        },
                        "right_anchor": {
                            "sha": short_hash(c.right).hex()[:12],
                            "chars": len(c.right),
                            "edge": c.at_end,
                        },
                        "value_chars": [c.min_len, c.max_len],
                        "value_classes": classes,
                        "distinct_values": len(c.value_hashes),
                        "observations": c.observations,
                        "first_seen": c.first_seen,
                        "last_seen": c.last_seen,
                        "slot_since": c.slot_since,
                    }
                )
        return sorted(rows, key=lambda r: (r["model"], r["tenant"], r["id"]))

    def rules_for(self, model: str, tenant: str) -> tuple[Rule, ...]:
        """Hoist rules of the slots learned for ``model`` + ``tenant`` in mode ``apply`` (``()`` otherwise),
        ordered by id, ready to append to a ``RuleSet``'s rules (``RuleSet(base.rules + rules, ...)``).
        Each matches system/developer messages, skips fenced code, hoists group ``value`` to the default
        placement."""
        if self.config.mode != "apply":
            return ()
        with self._lock:
            found = {
                self.slot_id(c.left, c.right, c.at_start, c.at_end): c
                for _, _, c in self._slots(model, tenant)
            }
            return tuple(self._rule(slot_id, found[slot_id]) for slot_id in sorted(found))

    def _rule(self, slot_id: str, candidate: SlotCandidate) -> Rule:
        source = self.pattern_source(candidate)
        return Rule(
            id=slot_id,
            action="hoist",
            selector=MessageSelector(roles=LEARNED_ROLES),
            pattern=compile_pattern(source, {}),
            pattern_source=source,
            group="value",
            placement=DEFAULT_PLACEMENT,
            skip_code=True,
            description=describe(candidate),
            file=LEARNED_FILE,
            line=0,
        )

    def _compile(self, source: str) -> Any:
        """The compiled RE2 pattern of a slot (cached: a slot's pattern changes only when its shape does)."""
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = compile_pattern(source, {})
            while len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(source)
        return compiled

    def match_slots(self, model: str, tenant: str, text: str) -> list[tuple[int, int, str]]:
        """Where the learned slots of ``model`` + ``tenant`` (any mode but ``off``) match in a system/developer
        ``text``: ``(start, end, slot id)`` character ranges of the values, sorted. For the miss explanation
        (a divergence inside such a range is ``volatile`` with that slot as candidate)."""
        if self.config.mode == "off":
            return []
        with self._lock:
            found = [
                (self.slot_id(c.left, c.right, c.at_start, c.at_end), c)
                for _, _, c in self._slots(model, tenant)
            ]
            out = []
            for slot_id, c in found:
                pattern = self._compile(self.pattern_source(c))
                for m in pattern.finditer(text):
                    start, end = m.span(pattern.groupindex["value"])
                    out.append((start, end, slot_id))
        return sorted(out)

    def export_yaml(self, model: str | None = None, tenant: str | None = None) -> str:
        """A rule file (YAML, the ``rules.loader`` format) with one ``hoist`` rule per learned slot of the given
        model/tenant (every one when None), for a person to review and commit. Holds the anchors (template
        text), never a value. A slot learned under several keys is written once."""
        with self._lock:
            found = {
                self.slot_id(c.left, c.right, c.at_start, c.at_end): c
                for _, _, c in self._slots(model, tenant)
            }
            rules = [
                {
                    "id": slot_id,
                    "description": describe(found[slot_id]),
                    "match": {
                        "role": sorted(LEARNED_ROLES),
                        "skip_code": True,
                        "pattern": self.pattern_source(found[slot_id]),
                    },
                    "action": "hoist",
                    "group": "value",
                }
                for slot_id in sorted(found)
            ]
        doc = {
            "description": "Volatile slots learned from traffic by prefixgate; review before committing.",
            "rules": rules,
        }
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1 << 16)

    def footprint(self) -> dict[str, int]:
        """What the learner holds now: ``keys``, ``sampled_texts``, ``sampled_chars``, ``candidates``,
        ``slots``, ``value_hashes`` (every count bounded by ``config``)."""
        with self._lock:
            cands = [c for k in self._keys.values() for c in k.candidates.values()]
            return {
                "keys": len(self._keys),
                "sampled_texts": sum(len(k.sample) for k in self._keys.values()),
                "sampled_chars": self._sample_chars,
                "candidates": len(cands),
                "slots": sum(1 for c in cands if c.slot_since is not None),
                "value_hashes": sum(len(c.value_hashes) for c in cands),
            }
