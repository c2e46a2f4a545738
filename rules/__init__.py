"""Prompt canonicalization rules: YAML rule files that make prompts start the same way.

This package knows nothing of HTTP and nothing of ``engine``. Use::

    from rules import load_ruleset
    ruleset = load_ruleset(["default", "/path/my_rules.yaml"])   # [] -> changes nothing
    canon = ruleset.apply(messages, tools)
    key_material = canon.stable_prefix_material()                # bytes to hash into the prefix key
    memory = TranscriptMemory()                                  # one per process (or a Redis-backed store)
    canon = ruleset.apply(messages, tools, memory=memory, scope=model + "\0" + tenant)

Modules: ``model`` (rule data), ``loader`` (YAML + validation), ``patterns`` (RE2 + fragments),
``messages`` (text slots), ``actions`` (what each action does), ``placement`` (where hoisted values go),
``segments`` (levels and the stable prefix), ``canonicalize`` (``RuleSet.apply``), ``transcript`` (the
canonical transcript memory), ``cli``.
"""

from rules.canonicalize import Canonical, HistoryInfo, RuleSet
from rules.errors import RequestShapeError, RuleError, RuleErrors
from rules.loader import DEFAULT_PACKS, list_packs, load_ruleset
from rules.segments import Position, Segment, SegmentLevel
from rules.transcript import InProcessTranscriptStore, TranscriptMemory, TranscriptStore

__all__ = [
    "DEFAULT_PACKS",
    "Canonical",
    "HistoryInfo",
    "InProcessTranscriptStore",
    "Position",
    "RequestShapeError",
    "RuleError",
    "RuleErrors",
    "RuleSet",
    "Segment",
    "SegmentLevel",
    "TranscriptMemory",
    "TranscriptStore",
    "list_packs",
    "load_ruleset",
]
