"""``REPORT.md``: provenance, the note's table beside ours, then one section per figure with the numbers
behind it (from the benchmarks' JSON lines) and the command that measured them.

Invariant: every PNG of ``plots.PLOTS`` is referenced (``![...](name.png)``), and every number printed comes
from a record; a benchmark that did not run is listed with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report import note_table
from bench.report.provenance import Provenance
from bench.report.runner import Record


def _f(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.{digits}f}"
    return "n/a" if value is None else str(value)


def _command(records: dict[str, Record], *names: str) -> str:
    shown = [f"`{' '.join(records[n].command)}`" for n in names if n in records]
    return ("Measured by " + ", ".join(shown) + ".") if shown else ""


def _engine(records: dict[str, Record], peer_reason: str) -> list[str]:
    out = ["## Engine vs llama.cpp", "", "![engine vs llama.cpp](engine_vs_llamacpp.png)", ""]
    if "peers" in records:
        p = records["peers"].result
        a, b, r = p["prefixgate"], p["llama_server"], p["peer_ratios"]
        out += [
            "| Workload | prefixgate | llama-server | ratio |",
            "|---|---|---|---|",
            *[
                f"| {label} | {_f(a[k])} | {_f(b[k])} | {_f(r.get(k, a[k] / b[k]))} |"
                for label, k in (
                    ("W1 cold TTFT s", "w1_cold_ttft"),
                    ("W2 warm TTFT s", "w2_warm_ttft"),
                    ("W3 decode 1 stream tok/s", "w3_decode_b1"),
                    ("W4 4 alternating prompts TTFT s", "w4_alternating"),
                    ("W5 8 streams tok/s", "w5_8streams"),
                    ("peak RSS MiB", "peak_rss_mb"),
                )
            ],
            "",
        ]
    else:
        out += [f"The llama.cpp peer was not run: {peer_reason}.", ""]
    if "engine" in records:
        e = records["engine"].result
        out += [
            f"Embedded engine alone ({e['model']}, {e['prompt_tokens']}-token prompt, {e['cached_tokens']} cached):",
            "",
            "| cold TTFT s | cached TTFT s | cached / cold | decode b1 tok/s | decode b8 tok/s |",
            "|---|---|---|---|---|",
            f"| {_f(e['cold_ttft_s'])} | {_f(e['cached_ttft_s'])} | {_f(e['cached_over_cold'])} | "
            f"{_f(e['decode_tps_b1'], 1)} | {_f(e['decode_tps_b8'], 1)} |",
            "",
        ]
    return out + [_command(records, "peers", "engine"), ""]


def _hit_rates(records: dict[str, Record]) -> list[str]:
    out = [
        "## Prefix hit rate vs theoretical maximum",
        "",
        "![hit rate per corpus](hit_rate_by_corpus.png)",
        "",
        "![hit rate per turn](hit_rate_by_turn.png)",
        "",
    ]
    if "rules" in records:
        r = records["rules"].result
        out += [
            "| Kind | as sent | default rules | ideal |",
            "|---|---|---|---|",
            *[
                f"| {kind} | {v['off']:.1%} | {v['rules']:.1%} | {v['ideal']:.1%} |"
                for kind, v in r.get("hit_rate_by_kind", {}).items()
            ],
            f"| **all** | {r['hit_rate_prompts_off']:.1%} | {r['hit_rate_prompts_rules']:.1%} | "
            f"{r['hit_rate_prompts_ideal']:.1%} |",
            "",
            f"Share of ideal (prompts): {r['share_of_ideal_prompts']}; false hoists on stable lines: "
            f"{r['false_hoists']}.",
            "",
        ]
    if "traces" in records:
        t = records["traces"].result
        out += [
            f"Traces: {t['requests']} requests, share of ideal {t['share_of_ideal_traces']} with the transcript "
            f"memory ({t['share_of_ideal_traces_stateless']} without); cached tokens "
            + ", ".join(f"{k} {v}" for k, v in t["cached_tokens"].items())
            + f" of {t['prompt_tokens']} prompt tokens. 'Ideal' keeps no volatile value at all, so a turn can "
            "cache more with the rules (hoisted values at the end) than the ideal form of that turn.",
            "",
        ]
    return out + [_command(records, "rules", "traces"), ""]


def _one_row_section(
    records: dict[str, Record], heading: str, image: str, bench: str, header: str, row: Callable[[dict], str]
) -> list[str]:
    """A section of one bench: its heading, its plot, a one-row table (``header`` cells joined by " | ",
    ``row(result)`` the row's cells likewise) when the bench ran, and the command that ran it."""
    out = [f"## {heading}", "", f"![{heading}]({image})", ""]
    if bench in records:
        cells = header.count(" | ") + 1
        out += [f"| {header} |", "|" + "---|" * cells, f"| {row(records[bench].result)} |", ""]
    return out + [_command(records, bench), ""]


def _next_turn(records: dict[str, Record]) -> list[str]:
    out = ["## A chat's next turn", "", "![next-turn TTFT](next_turn_ttft.png)", ""]
    if "next_turn" in records:
        t = records["next_turn"].result
        cached = t.get("cached_tokens", {})
        out += [
            "| How the last reply is served | next-turn TTFT ms | cached tokens | text == cold |",
            "|---|---|---|---|",
            *[
                f"| {label} | {_f(t['next_turn_ttft_ms'][k], 1)} | {_f(cached.get(k), 1)} | "
                f"{_f(t['tokens_equal_cold'].get(k))} |"
                for k, label in (
                    ("idle", "prefilled while idle (default)"),
                    ("exact", "computed in the turn"),
                    ("generated", "decode KV cached (opt-in)"),
                    ("cold", "prefix caching off"),
                )
                if k in t["next_turn_ttft_ms"]
            ],
            "",
            f"Idle / exact TTFT: {_f(t.get('idle_over_exact'))}.",
            "",
        ]
    return out + [_command(records, "next_turn"), ""]


def _tiers(records: dict[str, Record]) -> list[str]:
    return _one_row_section(
        records,
        "KV tiers",
        "tiers_ttft.png",
        "tiers",
        "disk / recompute | Redis / recompute | RAM hit overhead (tiers on / off) | restart hit share",
        lambda t: (
            f"{_f(t.get('disk_over_recompute'))} | {_f(t.get('redis_over_recompute'))} | "
            f"{_f(t.get('ram_hit_overhead'))} | {_f(t.get('restart_hit_share'))}"
        ),
    )


def _tenants(records: dict[str, Record]) -> list[str]:
    return _one_row_section(
        records,
        "Tenants",
        "tenants_ttft.png",
        "tenants",
        "B on A's prefix ms | B cold ms | A repeat ms | p isolated | p open namespace | "
        "layered prefill ratio (largest N / 1)",
        lambda t: (
            f"{1000 * t['b_on_a_prefix_ttft_s']:.1f} | {1000 * t['b_cold_ttft_s']:.1f} | "
            f"{1000 * t['a_repeat_ttft_s']:.1f} | {_f(t['side_channel_p_value'], 4)} | "
            f"{t['open_namespace_p_value']:.2g} | {_f(t['shared_prefill_ratio_256'])} "
            f"(N = {t.get('largest_tenant_count', 256)})"
        ),
    )


def _fleet(records: dict[str, Record]) -> list[str]:
    out = ["## Fleet routing", "", "![fleet policies](fleet_policies.png)", ""]
    if "fleet" in records:
        f = records["fleet"].result
        headline = (
            f"cache-aware at high load: {_f(f.get('cache_aware_share_of_single'))} of one cache's hit rate at "
            f"max/mean load {_f(f.get('max_over_mean_load'))}; 4 gateways keep {_f(f.get('gateways4_share_of_1'))}"
            " of one gateway's hit rate"
        )
        out += [
            headline + (f" (mean over seeds {f['seeds']})." if f.get("seeds") else "."),
            "",
            "| gateways | seed | policy | load | busy | hit rate | share of single | max/mean load | TTFT p50 s | "
            "TTFT p99 s |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *[
                f"| {r['gateways']} | {r.get('seed', '-')} | {r['policy']} | {r['load']} | {_f(r.get('util'))} | "
                f"{r['hit_rate']:.3f} | {r['share_of_single']:.3f} | {r['max_over_mean_load']:.2f} | "
                f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} |"
                for r in f.get("rows", [])
            ],
            "",
        ]
        if f.get("soak_failed") is not None:
            out += [
                "| soak s | requests | failed | leaked blocks | RSS MB | RSS slope MB/min |",
                "|---|---|---|---|---|---|",
                f"| {_f(f.get('soak_duration_s'), 0)} | {f.get('soak_requests')} | {f['soak_failed']} | "
                f"{f.get('soak_leaked_blocks')} | {_f(f.get('soak_rss_mb'), 1)} | "
                f"{_f(f.get('soak_rss_slope_mb_per_min'))} |",
                "",
            ]
    return out + [_command(records, "fleet"), ""]


def _note(records: dict[str, Record]) -> list[str]:
    out = [
        "## The note's table, reproduced",
        "",
        'The note (`seed-prefix-caching.ko.txt`, "성능 지표", for a 1,000-token system prompt) beside ours, '
        "row by row. Ours: each workload with `enable_prefix_caching` on vs off on the embedded engine "
        "(times: `1 - on/off` as a change; throughput: `on/off`); API cost: the same requests against a "
        "simulated provider billing by the shipped price table, without prefixgate (no cache breakpoints) vs "
        "with prefixgate's breakpoints and retention choice.",
        "",
    ]
    if "note" in records:
        n = records["note"].result
        out += [note_table.markdown(n), "", note_table.details(n), ""]
    else:
        out += ["bench.note did not run.", ""]
    return out + [
        "![note table](note_table.png)",
        "",
        "![note latency](note_latency.png)",
        "",
        _command(records, "note"),
        "",
    ]


def render(
    prov: Provenance,
    records: dict[str, Record],
    skipped: dict[str, str],
    peer_reason: str,
    quick: bool,
    command: str,
) -> str:
    """The whole ``REPORT.md``."""
    out = [
        "# prefixgate benchmark report",
        "",
        f"Machine: {prov.cpu}, {prov.cores} logical cores, 1-minute load {prov.load:.1f} at the start. "
        f"Date: {prov.date}. Commit: `{prov.commit}`. Produced by `{command}`. With `--reuse` or `--no-run` "
        "this line is the note's record's; every benchmark's own machine, date and commit are in the table below.",
        "",
    ]
    if quick:
        out += [
            "**Quick run** (`--quick`): the tests' tiny random checkpoint and small sizes; the figures check "
            "that the report works, they measure nothing about the real model.",
            "",
        ]
    if prov.load > prov.cores * 0.5:
        out += [
            f"The machine was shared while this ran (load {prov.load:.1f} on {prov.cores} cores): absolute "
            "times are inflated and noisy; ratios measured within one run (on vs off, ours vs peer, "
            "interleaved) are the figures to read.",
            "",
        ]
    out += [
        "| Benchmark | What | Seconds | Measured at |",
        "|---|---|---|---|",
        *[
            f"| {name} | `{' '.join(r.command)}` | {r.seconds:.0f} | {r.provenance.get('date', '?')}, "
            f"commit `{r.provenance.get('commit', '?')}`, {r.provenance.get('cpu', '?')} |"
            for name, r in records.items()
        ],
        *[f"| {name} | not run: {reason} | | |" for name, reason in skipped.items()],
        "",
        "Raw output of each benchmark: `raw/<name>.txt`; JSON lines: `results.jsonl`.",
        "",
    ]
    for section in (_note(records), _engine(records, peer_reason), _hit_rates(records), _next_turn(records)):
        out += section
    for section in (_tiers(records), _tenants(records), _fleet(records)):
        out += section
    return "\n".join(out).rstrip() + "\n"
