"""The user's note's table ("성능 지표", for a 1,000-token system prompt) beside ours, row by row, in Markdown.

Rows are the note's metrics in its order (prefill time, end-to-end latency, throughput, API cost); columns the
note's figure, then ours per workload of ``bench.note`` (on vs off: ``1 - on/off`` for times and cost, ``on/off``
for throughput), then whether ours falls in, above or below the note's range.
"""

from __future__ import annotations

from typing import Any

ROWS = [
    ("Prefill time", "prefill_reduction", "90% reduction"),
    ("End-to-end latency", "e2e_reduction", "30-50% reduction"),
    ("Throughput", "throughput_gain", "2-3x"),
    ("Cost (API)", "cost_reduction", "80-90% reduction"),
]
"""(the note's row name, ``bench.note`` key, the note's figure as it reads)."""


def fmt(key: str, value: float) -> str:
    """``-87 %`` for a reduction of 0.87, ``2.40x`` for a gain of 2.4."""
    if key == "throughput_gain":
        return f"{value:.2f}x"
    return f"{-100 * value:+.0f} %"


def verdict(key: str, values: list[float], claims: dict[str, list[float]]) -> str:
    """How many workloads reach the note's low end, e.g. ``2 of 4 reach -90 %``."""
    low = claims[key][0]
    reached = sum(v >= low for v in values)
    target = f"{low:g}x" if key == "throughput_gain" else f"-{100 * low:.0f} %"
    return f"{reached} of {len(values)} reach {target}"


def markdown(note: dict[str, Any]) -> str:
    """The table (Markdown) from ``bench.note``'s JSON line."""
    workloads = list(note["workloads"])
    head = ["Metric (note's row)", "Note", *[f"Ours: {w}" for w in workloads], "Verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, key, claim in ROWS:
        values = [note["workloads"][w][key] for w in workloads]
        cells = [name, claim, *[fmt(key, v) for v in values], verdict(key, values, note["note_claims"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def details(note: dict[str, Any]) -> str:
    """Per workload: its shape, and the on / off figures behind the table (Markdown)."""
    head = (
        "| Workload | Shape | Prefill s off / on | End-to-end s off / on | Throughput tok/s off / on "
        "| Cached tokens on | API cost USD without / with (min cacheable) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, w in note["workloads"].items():
        on, off = w["on"], w["off"]
        lines.append(
            f"| {name} | {w['describe']}, {w['requests']} requests | {off['prefill_s']:.3f} / {on['prefill_s']:.3f} "
            f"| {off['e2e_s']:.3f} / {on['e2e_s']:.3f} | {off['throughput_tps']:.1f} / {on['throughput_tps']:.1f} "
            f"| {on['cached_tokens']} of {on['prompt_tokens']} | {w['cost_without_usd']:.4f} / "
            f"{w['cost_with_usd']:.4f} ({w['min_cacheable_tokens']}; stable prefix {w['stable_prefix_tokens']}) |"
        )
    return "\n".join(lines)
