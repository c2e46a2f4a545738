"""Replay a recorded request log through the real canonicalizer and measure the prefix each request shares.

``replay(lines)`` reads a trace, one JSON object a line: an OpenAI chat body or an Anthropic messages body,
or an envelope ``{"protocol": "openai"|"anthropic", "tenant": "...", "body": {...}}``. For each request, with
the rules on (the injectable ``canonicalize``, by default the shipped ``default`` pack) and off (nothing
changed), it renders the prompt the default model would see and reports the longest common prefix with any
earlier request of the same model (and tenant, when the envelope gives one), in characters and in tokens,
and the miss cause ``gateway.service.miss_explain`` gives against an ideal cache (one that kept every
earlier prompt: its cached tokens are the common prefix rounded down to whole 16-token blocks). A broken
line (not JSON, not an object, not a chat body of either protocol, or one the canonicalizer or the
template refuses) is reported with its 1-based line number and skipped; the rest goes on.

Tokens are those of the default model (``prompt_tokenizers.default_tokenizer``). The pieces live next to
this module: ``trace`` (lines -> requests), ``prompt_tokenizers``, ``rendered_prompt`` (canonical request ->
tokens and segments), ``replay_report`` (the results, totals and table); this module owns the loop, the
learned-slot spans and the command line.

Run ``python -m gateway.service.canonicalize.replay TRACE.jsonl [--rules PACK_OR_FILE ...] [--tokenizer smollm2|cl100k]``:
a table, a totals line, then one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gateway.service.canonicalize.prompt_tokenizers import PromptTokenizer, default_tokenizer
from gateway.service.canonicalize.rendered_prompt import RenderedPrompt, hoisted_value_spans, render_canonical
from gateway.service.canonicalize.replay_report import ReplayReport, RequestReport, SideResult
from gateway.service.canonicalize.trace import BrokenLine, TraceLineError, TraceRequest, parse_line
from gateway.service.miss_explain import MissExplainer
from gateway.service.miss_explanation import VolatileSpan, volatile_spans_from_chars
from rules import Canonical, RequestShapeError, RuleSet, load_ruleset
from rules.actions import match_view
from rules.learned import LEARNED_ROLES, SlotLearner
from rules.loader import DEFAULT_PACKS
from rules.messages import get_text, text_parts
from rules.patterns import group_span
from rules.span_diff import common_prefix_len

Canonicalize = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", str, str], Canonical]
"""``(messages, tools, model, tenant) -> Canonical``: the rules on (a conversation memory keyed by model and
tenant may sit behind it)."""


BLOCK_SIZE = 16

_VOLATILE_ACTIONS = frozenset({"hoist", "drop", "round"})
"""Rule actions whose matches are volatile values (the cache explanation's known volatile spans)."""


def first_rule_of(ruleset: RuleSet) -> Callable[[str], str | None]:
    """``value -> the id of the first rule of ruleset whose hoist/drop/round pattern matches in it`` (None when
    none does): names a hoisted value for the miss explanation."""

    def rule_of(value: str) -> str | None:
        for rule in ruleset.rules:
            if (
                rule.action in _VOLATILE_ACTIONS
                and rule.pattern is not None
                and rule.pattern.search(match_view(value))
            ):
                return rule.id
        return None

    return rule_of


def rule_value_spans(ruleset: RuleSet, text: str) -> list[tuple[int, int, str]]:
    """``(start, end, rule id)`` of every value ``ruleset``'s hoist / drop / round rules match in ``text``: a
    rules-off prompt's known volatile values, as the gateway names them (``Canonicalizer.rule_value_spans``
    memoizes this)."""
    return [
        (start, end, rule.id)
        for rule in ruleset.rules
        if rule.action in _VOLATILE_ACTIONS and rule.pattern is not None
        for match in rule.pattern.finditer(match_view(text))
        for start, end in (group_span(match, rule.group),)
        if 0 <= start < end
    ]


def rules_canonicalizer(ruleset: RuleSet) -> Canonicalize:
    """The ``canonicalize`` of a plain ``RuleSet`` (no conversation memory): ``ruleset.apply(messages, tools)``."""

    def canonicalize(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str, tenant: str
    ) -> Canonical:
        return ruleset.apply(messages, tools)

    return canonicalize


class _Side:
    """Earlier prompts of one side (rules on or off) and its explainer."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list[tuple[str, list[int]]]] = {}
        self.explainer = MissExplainer(block_size=BLOCK_SIZE, max_prompts_per_key=1 << 16, max_bytes=1 << 40)

    def measure(
        self, request: TraceRequest, rendered: RenderedPrompt, volatile: Sequence[VolatileSpan] = ()
    ) -> SideResult:
        key = (request.model, request.tenant)
        earlier = self.seen.setdefault(key, [])
        chars = max((common_prefix_len(rendered.text, t) for t, _ in earlier), default=0)
        tokens = max((common_prefix_len(rendered.tokens, ids) for _, ids in earlier), default=0)
        cached = tokens - tokens % BLOCK_SIZE
        e = self.explainer.explain(
            request.model,
            request.tenant,
            rendered.tokens,
            rendered.segments,
            rendered.stable_tokens,
            cached,
            volatile_spans=volatile,
            tools_digest=rendered.tools_digest,
        )
        self.explainer.record(
            request.model,
            request.tenant,
            rendered.tokens,
            rendered.segments,
            tools_digest=rendered.tools_digest,
        )
        self.explainer.mark_cached(request.model, request.tenant, rendered.tokens)
        earlier.append((rendered.text, rendered.tokens))
        at = (f"{e.segment}:{e.offset}" + (f" {e.slot}" if e.slot else "")) if e.miss else None
        return SideResult(
            len(rendered.text), len(rendered.tokens), chars, tokens, rendered.stable_tokens, e.cause, at
        )


def learned_spans(
    learner: SlotLearner,
    request: TraceRequest,
    canon: Canonical,
    rendered: RenderedPrompt,
    rule_of: Callable[[str], str | None] | None = None,
    rule_spans: Callable[[str], list[tuple[int, int, str]]] | None = None,
) -> list[VolatileSpan]:
    """Token ranges of the learned slots' matches in the canonical system/developer texts (each text found
    where the template put it in the rendered prompt), and of the values in hoisted-value blocks
    (``hoisted_value_spans``, named by ``rule_of``). ``rule_spans`` (a rules-off prompt): also what the rules
    would hoist, drop or round in those texts, named by rule id, as the gateway explains a rules-off request."""
    found: list[tuple[int, int, str | None]] = []
    for message in canon.messages:
        if message.get("role") not in LEARNED_ROLES:
            continue
        for part in text_parts(message):
            text = get_text(message, part)
            at = rendered.text.find(text) if text else -1
            if at >= 0:
                matches = learner.match_slots(request.model, request.tenant, text)
                if rule_spans is not None:
                    matches = [*matches, *rule_spans(text)]
                found.extend((at + start, at + end, slot) for start, end, slot in matches)
    found.extend(hoisted_value_spans(canon, rendered.text, rule_of))
    return volatile_spans_from_chars(found, rendered.starts)


def replay(
    lines: Iterable[str],
    canonicalize: Canonicalize | None = None,
    tokenizer: PromptTokenizer | None = None,
    learner: SlotLearner | None = None,
    rule_of: Callable[[str], str | None] | None = None,
    rule_spans: Callable[[str], list[tuple[int, int, str]]] | None = None,
) -> ReplayReport:
    """Replay a trace (see the module docstring).

    Args:
        lines: the trace's lines (a file object works), one JSON body each; blank lines are skipped.
        canonicalize: the rules on; ``rules_canonicalizer(load_ruleset(DEFAULT_PACKS))`` when None.
        tokenizer: ``default_tokenizer()`` when None.
        learner: learns volatile slots from the rules-on canonical system texts as the trace goes (a new
            ``SlotLearner()``, mode ``suggest``, when None); a miss inside a learned slot names it.
        rule_of: names the rule that knows a hoisted value (``Canonicalizer.rule_of``); with the default
            ``canonicalize``, the default pack's rules; else a hoisted value's slot is ``hoisted``.
        rule_spans: the rules' volatile values in a text (``Canonicalizer.rule_value_spans``,
            ``rule_value_spans``): the rules-off side's known volatile values, so its miss in one is
            ``volatile`` with the rule named, as the gateway says of a rules-off request; with the default
            ``canonicalize``, the default pack's; else none (a change there is ``system_changed``).

    Returns:
        the report; broken lines are in ``report.broken``, never raised.
    """
    if canonicalize is None:
        default = load_ruleset(list(DEFAULT_PACKS))
        canonicalize = rules_canonicalizer(default)
        rule_of = rule_of or first_rule_of(default)
        rule_spans = rule_spans or (lambda text: rule_value_spans(default, text))
    tokenizer = tokenizer or default_tokenizer()
    learner = learner if learner is not None else SlotLearner()
    off_rules = RuleSet()
    report = ReplayReport(tokenizer=tokenizer.name, learner=learner)
    on, off = _Side(), _Side()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            request = parse_line(text, number)
            canon_on = canonicalize(request.messages, request.tools, request.model, request.tenant)
            canon_off = off_rules.apply(request.messages, request.tools)
            rendered_on = render_canonical(canon_on, tokenizer)
            rendered_off = render_canonical(canon_off, tokenizer)
        except TraceLineError as e:
            report.broken.append(BrokenLine(number, str(e)))
            continue
        except RequestShapeError as e:
            report.broken.append(BrokenLine(number, f"wrong shape: {e}"))
            continue
        volatile = learned_spans(learner, request, canon_on, rendered_on, rule_of)
        on_result = on.measure(request, rendered_on, volatile)
        known_off = learned_spans(learner, request, canon_off, rendered_off, rule_spans=rule_spans)
        off_result = off.measure(request, rendered_off, known_off)
        report.requests.append(RequestReport(number, request.model, on_result, off_result))
        learner.observe(request.model, request.tenant, canon_on.messages)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.service.canonicalize.replay TRACE.jsonl``: print the table and a final JSON line of totals.
    Returns the exit status (2: the trace or a rule file cannot be read)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.service.canonicalize.replay", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trace", help="JSON lines: OpenAI chat or Anthropic messages bodies, one a line")
    parser.add_argument(
        "--rules",
        action="append",
        default=None,
        help="rule pack or file (repeatable; default: the shipped default pack)",
    )
    parser.add_argument("--tokenizer", choices=("smollm2", "cl100k"), default=None)
    args = parser.parse_args(argv)
    from rules import RuleError

    try:
        ruleset = load_ruleset(args.rules or list(DEFAULT_PACKS))
    except RuleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with open(args.trace, encoding="utf-8", errors="replace") as f:
            report = replay(
                f,
                rules_canonicalizer(ruleset),
                default_tokenizer(args.tokenizer),
                rule_of=first_rule_of(ruleset),
                rule_spans=lambda text: rule_value_spans(ruleset, text),
            )
    except OSError as e:
        print(f"error: cannot read {args.trace}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(report.table())
    print(json.dumps(report.totals(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
