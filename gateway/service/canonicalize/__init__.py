"""Canonicalization of chat requests by the configured rules (the opt-out header is read in
``gateway.core.headers``).

Every chat request to every backend passes through ``Canonicalizer.apply`` before routing. With rules on
(the default), the request's messages and tools are replaced by the rules' canonical ones. With
``x-prefixgate-rules: off`` (or ``rules: []`` in the config) the request is sent exactly as it came, and an
empty rule set is still applied to a copy only to find the segments whose stable part names the prefix group.
Completion requests (a raw ``prompt``) are not chat-shaped and are never rewritten.

One ``Canonicalizer`` per app owns the conversation state of the rules:
- the canonical transcript memory (``rules.transcript.TranscriptMemory`` over an in-process store, or over
  ``RedisTranscriptStore`` when ``transcript.redis_url`` is set), scoped by model and tenant, so the earlier
  turns of a conversation come back byte-identical to what was sent (docs/history-stability.md); requests
  with the rules off never touch it; ``close`` releases its Redis connections;
- the ``SlotLearner`` (``rules_learning``), fed with the canonical system/developer messages of every
  rules-on request that finished (``learn``); in mode ``apply`` its slots join the rule set of that model and
  tenant.

This module is the gateway's only door to the ``rules`` package (``tests/test_layers.py`` holds it to that):
``RuleError`` (a bad rule file, raised while building a ``Canonicalizer``) and the ``prefixgate rules``
subcommands (``run_rules_command``, ``run_replay``) are reached through it.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TextIO

from gateway.config.schema import LearningConfig, TranscriptConfig
from gateway.core.errors import InvalidRequestError
from gateway.core.request import ChatRequest
from gateway.service.canonicalize.prompt_tokenizers import PromptTokenizer, default_tokenizer
from gateway.service.canonicalize.rendered_prompt import RenderedPrompt, hoisted_value_spans, render_canonical
from gateway.service.canonicalize.replay import replay, rule_value_spans
from gateway.service.canonicalize.transcript_store import RedisTranscriptStore
from gateway.service.miss_explanation import VolatileSpan, volatile_spans_from_chars
from rules import RequestShapeError, RuleError, RuleSet, load_ruleset
from rules import cli as rules_cli
from rules.learn_config import LearnConfig
from rules.learned import LEARNED_ROLES, SlotLearner
from rules.messages import get_text, text_parts
from rules.transcript import USER_MARK, InProcessTranscriptStore, TranscriptMemory

__all__ = ["PREFIX_KEY_LEVEL", "Canonicalizer", "RuleError", "run_replay", "run_rules_command"]

_MAX_LEARNED_RULESETS = 256

PREFIX_KEY_LEVEL = 2
"""Segments named by the prefix key: 1 = tools + system, 2 = + documents (3 would add the history, which
changes every turn, so a conversation's turns would land in different prefix groups and, behind several
replicas, on different machines; level 2 keeps every turn of every conversation on one system prompt and
document together)."""


class Canonicalizer:
    """Applies the configured rule set to chat requests, with the transcript memory and the learned slots.

    Args:
        rules: pack names or YAML paths, as in the config's ``rules:`` (empty = rewriting off).
        transcript: bounds of the transcript memory and its optional Redis URL (defaults when None).
        learning: the learned-slot mode and threshold (``suggest`` when None).

    Raises:
        rules.RuleError: a bad rule file or unknown pack (file, line and rule id in its message).
    """

    def __init__(
        self,
        rules: Sequence[str],
        transcript: TranscriptConfig | None = None,
        learning: LearningConfig | None = None,
    ) -> None:
        self.rule_names = tuple(rules)
        self._ruleset = load_ruleset(list(rules)) if rules else None
        self._plain = RuleSet()
        transcript = transcript or TranscriptConfig()
        local = InProcessTranscriptStore(transcript.max_entries, transcript.max_bytes, transcript.ttl_s)
        self.redis: RedisTranscriptStore | None = None
        if transcript.redis_url is not None:
            self.redis = RedisTranscriptStore(
                url=transcript.redis_url,
                local=local,
                prefix=transcript.redis_prefix,
                socket_timeout_s=transcript.socket_timeout_s,
                retry_after_s=transcript.retry_after_s,
            )
        self.local_store = local
        self.memory = TranscriptMemory(self.redis if self.redis is not None else local)
        learning = learning or LearningConfig()
        self.learner = SlotLearner(LearnConfig(mode=learning.mode, min_distinct=learning.min_distinct))
        self._learned: OrderedDict[tuple[str, ...], RuleSet] = OrderedDict()
        self._value_spans: OrderedDict[str, list[tuple[int, int, str]]] = OrderedDict()
        self._lock = threading.Lock()
        self.learn_errors = 0

    @staticmethod
    def tenant_scope(request: ChatRequest) -> str:
        """A request's model and tenant, a NUL between them (what memos shared by a tenant's users key on)."""
        return request.model + "\0" + request.tenant

    @staticmethod
    def scope(request: ChatRequest) -> str:
        """The transcript memory's scope of a request: model and tenant (a NUL between them), and the end
        user the client named (OpenAI ``user`` or ``safety_identifier``, Anthropic ``metadata.user_id``):
        one user's stored history is never reused for another's request (the rules narrow it further by the
        hoisted values that tell whose conversation it is: ``rules.transcript.conversation_scope``)."""
        scope = Canonicalizer.tenant_scope(request)
        user = request.user
        if user is None and request.openai_body is not None:
            named = request.openai_body.get("safety_identifier")
            user = named if isinstance(named, str) else None
        return scope if not user else scope + USER_MARK + user

    def ruleset_for(self, model: str, tenant: str) -> RuleSet | None:
        """The rule set a rules-on request of ``model`` + ``tenant`` gets: the configured rules, followed in
        mode ``apply`` by the slots learned for that model and tenant (None when rewriting is off)."""
        if self._ruleset is None:
            return None
        learned = self.learner.rules_for(model, tenant)
        if not learned:
            return self._ruleset
        ids = tuple(rule.pattern_source for rule in learned)
        with self._lock:
            ruleset = self._learned.get(ids)
            if ruleset is None:
                ruleset = RuleSet(
                    self._ruleset.rules + learned,
                    self._ruleset.sources,
                    history_memo=self._ruleset.history_memo,  # one bound for the base and all learned sets
                )
                self._learned[ids] = ruleset
                while len(self._learned) > _MAX_LEARNED_RULESETS:
                    self._learned.popitem(last=False)
            else:
                self._learned.move_to_end(ids)
        return ruleset

    def apply(self, request: ChatRequest) -> None:
        """Canonicalize ``request`` in place: sets ``request.canonical`` and, when rules are on, replaces
        ``request.messages`` / ``request.tools`` by the canonical ones (earlier turns as the transcript memory
        holds them for this model and tenant). No-op for completion requests.

        Raises:
            InvalidRequestError: a request shape the rules refuse (400).
        """
        if request.kind != "chat":
            return
        ruleset = self.ruleset_for(request.model, request.tenant) if request.rules_enabled else None
        try:
            if ruleset is not None:
                canonical = ruleset.apply(
                    request.messages, request.tools, memory=self.memory, scope=self.scope(request)
                )
            else:
                canonical = self._plain.apply(request.messages, request.tools)
        except RequestShapeError as exc:
            raise InvalidRequestError(
                f"Invalid request shape: {exc}", param="messages", code="invalid_value"
            ) from exc
        if ruleset is not None:
            request.messages = canonical.messages
            request.tools = canonical.tools
        request.canonical = canonical

    def canonicalize(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str, tenant: str
    ) -> Any:
        """The rules-on canonical form (``rules.Canonical``) of a chat request of ``model`` + ``tenant``, as
        ``apply`` computes it (transcript memory and learned rules included); the plain form when rewriting
        is off. The ``canonicalize`` of ``replay``.

        Raises:
            rules.RequestShapeError: messages or tools that are not chat-shaped.
        """
        ruleset = self.ruleset_for(model, tenant)
        if ruleset is None:
            return self._plain.apply(messages, tools)
        return ruleset.apply(messages, tools, memory=self.memory, scope=model + "\0" + tenant)

    def learn(self, request: ChatRequest) -> None:
        """Feed the learner with the canonical system/developer messages of a finished rules-on chat request.
        Never raises: a failure is counted in ``learn_errors``."""
        if request.kind != "chat" or not request.rules_enabled or self._ruleset is None:
            return
        try:
            self.learner.observe(request.model, request.tenant, request.messages)
        except Exception:  # noqa: BLE001 - learning must never fail a request
            self.learn_errors += 1

    def render(
        self,
        request: ChatRequest,
        tokenizer: PromptTokenizer,
        encode: Callable[[str], tuple[list[int], list[int]]] | None = None,
    ) -> tuple[RenderedPrompt, list[VolatileSpan]]:
        """The canonical request as the model's prompt (token ids, segments as token ranges, stable end) and
        the token ranges of the known volatile values in its system/developer texts: the learned slots'
        values (slot id ``learned.…``) and, for a rules-off request, what the configured rules'
        ``hoist``/``drop``/``round`` patterns match (its date; the rule's id; a rules-on request no longer
        holds those in its system prompt, and is not scanned); for a rules-on request, the values inside its
        hoisted-value blocks (``hoisted_value_spans``; the id of the rule whose pattern matches the value). ``encode``: in place of ``tokenizer.encode``,
        same result; see ``render_canonical``.

        Raises:
            ValueError: a completion request (no canonical messages), or messages the template refuses.
        """
        canonical = request.canonical
        if canonical is None:
            raise ValueError("only canonicalized chat requests can be rendered")
        rendered = render_canonical(canonical, tokenizer, encode)  # type: ignore[arg-type]
        found: list[tuple[int, int, str | None]] = []
        for message in canonical.messages:  # type: ignore[attr-defined]
            if message.get("role") not in LEARNED_ROLES:
                continue
            for part in text_parts(message):
                text = get_text(message, part)
                at = rendered.text.find(text) if text else -1
                if at >= 0:
                    for start, end, slot in self.learner.match_slots(request.model, request.tenant, text):
                        found.append((at + start, at + end, slot))
                    if not request.rules_enabled:  # rules on: what they act on has left the system prompt
                        for start, end, rule in self.rule_value_spans(text):
                            found.append((at + start, at + end, rule))
        if request.rules_enabled:  # ... into <request_context> blocks: their values are known volatile values
            found.extend(hoisted_value_spans(canonical, rendered.text, self.rule_of))  # type: ignore[arg-type]
        return rendered, volatile_spans_from_chars(found, rendered.starts)

    def rule_of(self, value: str) -> str | None:
        """The id of the first configured rule whose ``hoist``/``drop``/``round`` pattern matches in ``value`` (a
        hoisted value standing alone, as in its block), or None (``rule_value_spans``, memoized)."""
        spans = self.rule_value_spans(value)
        return spans[0][2] if spans else None

    def rule_value_spans(self, text: str) -> list[tuple[int, int, str]]:
        """``(start, end, rule id)`` of every value the configured rules would hoist, drop or round in
        ``text`` (a rules-on request no longer holds them in its system prompt; a rules-off one does: they are
        its known volatile values). Memoized for the last 256 texts (a system prompt repeats)."""
        if self._ruleset is None or not text:
            return []
        with self._lock:
            known = self._value_spans.get(text)
            if known is not None:
                self._value_spans.move_to_end(text)
                return known
        spans = rule_value_spans(self._ruleset, text)
        with self._lock:
            self._value_spans[text] = spans
            while len(self._value_spans) > 256:
                self._value_spans.popitem(last=False)
        return spans

    def learned_yaml(self, model: str | None = None, tenant: str | None = None) -> str:
        """The learned slots as a rule file (``SlotLearner.export_yaml``): anchors, never values."""
        return self.learner.export_yaml(model, tenant)

    def stats(self) -> dict[str, Any]:
        """The ``rules`` part of ``/admin/stats``: the transcript memory's counters (``memory``, ``store``,
        ``redis`` when configured) and the learned slots (mode, footprint and shape and counts of each slot,
        never a value)."""
        doc: dict[str, Any] = {
            "rule_packs": list(self.rule_names),
            "transcript": {
                "memory": asdict(self.memory.stats),
                "store": asdict(self.local_store.stats),
                "redis": asdict(self.redis.stats) if self.redis is not None else None,
            },
            "learned": {
                "mode": self.learner.mode,
                "footprint": self.learner.footprint(),
                "learn_errors": self.learn_errors,
                "slots": self.learner.slots(),
            },
        }
        return doc

    def close(self) -> None:
        """Release the Redis connections of the transcript memory (the in-process store stays usable)."""
        if self.redis is not None:
            self.redis.close()

    def stable_material(self, request: ChatRequest) -> bytes | None:
        """The bytes that name the request's prefix group: its stable segments up to ``PREFIX_KEY_LEVEL``
        (None for completion requests)."""
        if request.canonical is None:
            return None
        return request.canonical.stable_prefix_material(PREFIX_KEY_LEVEL)

    @staticmethod
    def applied(request: ChatRequest) -> dict[str, int]:
        """Rule id -> times applied to this request (empty when rules were off)."""
        if request.canonical is None or not request.rules_enabled:
            return {}
        return dict(request.canonical.applied)


def run_replay(
    trace: str,
    canonicalizer: Canonicalizer,
    tokenizer: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``prefixgate rules replay TRACE.jsonl``: replay a request log (``replay.replay``) through
    ``canonicalizer`` (its rules, transcript memory and slot learner: what the gateway would do), print the
    table, the broken lines (``line N: skipped: why``) and a final JSON line of totals.

    Returns:
        the exit status: 0 (broken lines included: they are reported, the rest is replayed), 2 when the trace
        cannot be read or the tokenizer is missing.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        chosen = default_tokenizer(tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: tokenizer {tokenizer}: {exc}", file=err)
        return 2
    try:
        with open(trace, encoding="utf-8", errors="replace") as lines:
            report = replay(
                lines,
                canonicalizer.canonicalize,
                chosen,
                canonicalizer.learner,
                canonicalizer.rule_of,
                canonicalizer.rule_value_spans,
            )
    except OSError as exc:
        print(f"error: cannot read {trace}: {exc.strerror or exc}", file=err)
        return 2
    print(report.table(), file=out)
    print(json.dumps(report.totals(), sort_keys=True), file=out)
    return 0


def run_rules_command(
    command: str, files: list[str], request: str | None = None, placement: str | None = None
) -> int:
    """``prefixgate rules check FILE...`` (``command="check"``) or ``prefixgate rules apply [--rules FILE...]
    REQUEST.json`` (``command="apply"``): the ``rules`` package's own commands; returns the exit status."""
    if command == "check":
        return rules_cli.check(files)
    if request is None:
        raise ValueError("rules apply needs a REQUEST.json path")
    return rules_cli.apply(files, request, placement)
