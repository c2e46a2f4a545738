"""The bench corpora as tests: zero false hoists on the stable lines (exact count), every volatile span of the
product-shaped prompts hoisted and nothing else, and the share of the ideal prefix the rules reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.corpora import CorpusError, load_prompts, load_stable_lines
from bench.rules import Context, default_counter, prompts_section, run, stable_lines_section
from rules import load_ruleset
from tests.rules.helpers import all_text

DEFAULT = load_ruleset(["default"])


def test_corpus_sizes_and_variants() -> None:
    cases = load_prompts()
    assert len(cases) >= 40
    assert {c.kind for c in cases} >= {"assistant", "coding-agent", "search", "office-add-in"}
    for case in cases:
        assert len(case.variants) >= 3
        assert len({v.spans for v in case.variants}) == len(case.variants), case.id
        for variant in case.variants:
            assert all(span in variant.messages[0]["content"] for span in variant.spans)
    assert len(load_stable_lines()) >= 200


def test_zero_false_hoists_on_the_stable_lines() -> None:
    section = stable_lines_section(Context(DEFAULT, default_counter()))
    assert section.summary["stable_lines"] >= 200
    assert section.summary["false_hoists"] == 0


@pytest.mark.parametrize("case", load_prompts(), ids=lambda c: c.id)
def test_every_volatile_span_is_hoisted_and_nothing_else(case) -> None:
    materials = set()
    for variant in case.variants:
        canon = DEFAULT.apply(variant.messages)
        assert [s for s in variant.spans if not any(s in h for h in canon.hoisted)] == []
        assert [h for h in canon.hoisted if not any(s in h for s in variant.spans)] == []
        text = all_text(canon.messages)
        assert all(span in text for span in variant.spans)
        materials.add(canon.stable_prefix_material(level=1))
    assert len(materials) == 1


def test_rules_reach_at_least_95_percent_of_the_ideal_prefix() -> None:
    _, summary = run([prompts_section, stable_lines_section], ruleset=DEFAULT)
    assert summary["share_of_ideal_prompts"] >= 0.95
    assert summary["hit_rate_prompts_rules"] > summary["hit_rate_prompts_off"]
    assert summary["missed_spans"] == 0
    assert summary["false_hoists_in_prompts"] == 0
    assert summary["false_hoists"] == 0
    assert "SmolLM2" in summary["token_counter"]


def test_a_malformed_corpus_is_a_named_error(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.yaml"
    bad.write_text(
        "variants: 2\ntimes: ['2025-03-04T09:05:07+01:00']\nprompts:\n"
        "  - {id: p, kind: k, system: 'Date: {{d}} {{e}}', user: q, slots: {d: [a, b]}}\n"
    )
    with pytest.raises(CorpusError, match="prompt 'p': slots used"):
        load_prompts(bad)
    bad.write_text(
        "variants: 2\ntimes: ['2025-03-04T09:05:07+01:00']\nprompts:\n"
        "  - {id: p, kind: k, system: 'Date: {{d}}', user: q, slots: {d: [a, a]}}\n"
    )
    with pytest.raises(CorpusError, match="at least two different values"):
        load_prompts(bad)
    lines = tmp_path / "lines.yaml"
    lines.write_text("examples: 'not a list'\n")
    with pytest.raises(CorpusError, match="category 'examples'"):
        load_stable_lines(lines)


def test_a_section_is_added_by_one_call_and_its_keys_join_the_json_line() -> None:
    from bench import rules as bench_rules

    def traces(ctx: Context) -> bench_rules.Section:
        tokens = ctx.counter.tokens(ctx.counter.text([{"role": "user", "content": "hi"}]))
        return bench_rules.Section("traces", [f"{len(tokens)} tokens"], {"share_of_ideal_traces": 1.0})

    before = list(bench_rules.SECTIONS)
    try:
        bench_rules.register_section(traces)
        bench_rules.register_section(traces)
        assert bench_rules.SECTIONS == [*before, traces]
        results, summary = run([traces, stable_lines_section], ruleset=DEFAULT)
        assert [r.title for r in results] == ["traces", "stable lines (corpus c)"]
        assert summary["share_of_ideal_traces"] == 1.0 and summary["false_hoists"] == 0
    finally:
        bench_rules.SECTIONS[:] = before
