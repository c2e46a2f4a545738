"""The report's figures: one function per PNG, each drawn from benchmarks' JSON lines (``results.jsonl``).

Every figure has a title (what was measured, units on the axes) and a subtitle with the machine, date and
commit (``Provenance.line``). A figure whose benchmark did not run still gets its file, saying only that and
why (nothing is drawn in its place). Matplotlib runs headless (Agg).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench.report.provenance import Provenance  # noqa: E402

Results = dict[str, dict[str, Any]]
"""Benchmark name -> its JSON line."""

OURS, PEER, THIRD, FOURTH = "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"


def _figure(title: str, prov: Provenance, what: str, ncols: int = 1, nrows: int = 1, width: float = 10.0):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.6 * nrows + 1.0), squeeze=False)
    fig.suptitle(title, fontsize=12, fontweight="bold", y=0.995)
    fig.text(
        0.5,
        0.93 if nrows == 1 else 0.96,
        textwrap.fill(what, 150) + f"\n{prov.line()}",
        ha="center",
        va="top",
        fontsize=8,
    )
    return fig, axes


def _save(fig: Figure, path: Path, nrows: int = 1) -> None:
    fig.tight_layout(rect=(0, 0, 1, 0.85 if nrows == 1 else 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _not_run(path: Path, title: str, prov: Provenance, reason: str) -> None:
    fig, axes = _figure(title, prov, "not measured in this run")
    ax = axes[0][0]
    ax.axis("off")
    ax.text(0.5, 0.5, f"not run: {reason}", ha="center", va="center", fontsize=11)
    _save(fig, path)


def _bars(
    ax, labels: list[str], series: dict[str, list[float]], colors: list[str], fmt: str = "{:.3g}"
) -> None:
    """Grouped bars: one group per label, one bar per series, each bar annotated with its value."""
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (n - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name, color=colors[i % len(colors)])
        for bar, v in zip(bars, values, strict=True):
            if v == v:  # not NaN
                ax.annotate(
                    fmt.format(v),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.legend(fontsize=8)


def engine_vs_llamacpp(results: Results, prov: Provenance, path: Path, peer_reason: str) -> None:
    """prefixgate vs llama.cpp's llama-server per workload (``peers``); without a peer run, the embedded engine's
    own figures (``engine``) and the reason the peer did not run."""
    title = "Engine vs llama.cpp per workload"
    peers = results.get("peers")
    if peers is not None:
        a, b = peers["prefixgate"], peers["llama_server"]
        fig, axes = _figure(
            title,
            prov,
            "same GGUF and threads, streamed /v1/chat/completions, greedy; medians, W4 the mean of its turns (bench.engine --peers)",
            ncols=2,
        )
        ttft = [("W1 cold", "w1_cold_ttft"), ("W2 warm", "w2_warm_ttft"), ("W4 4 prompts", "w4_alternating")]
        _bars(
            axes[0][0],
            [k for k, _ in ttft],
            {"prefixgate": [a[k] for _, k in ttft], "llama-server": [b[k] for _, k in ttft]},
            [OURS, PEER],
        )
        axes[0][0].set_ylabel("TTFT (s), lower is better")
        rate = [("W3 decode 1 stream", "w3_decode_b1"), ("W5 8 streams", "w5_8streams")]
        _bars(
            axes[0][1],
            [k for k, _ in rate],
            {"prefixgate": [a[k] for _, k in rate], "llama-server": [b[k] for _, k in rate]},
            [OURS, PEER],
            "{:.1f}",
        )
        axes[0][1].set_ylabel("tokens/s, higher is better")
        _save(fig, path)
        return
    engine = results.get("engine")
    if engine is None:
        _not_run(path, title, prov, f"neither bench.engine nor the peer ran ({peer_reason})")
        return
    fig, axes = _figure(
        title,
        prov,
        f"llama.cpp peer not run: {peer_reason}. Embedded engine alone ({engine['model']}, "
        f"{engine['prompt_tokens']}-token prompt), medians (bench.engine)",
        ncols=2,
    )
    series = {"prefixgate": [engine["cold_ttft_s"], engine["cached_ttft_s"]]}
    hf = engine.get("hf_cold_ttft_s")
    if isinstance(hf, float) and hf == hf:
        series["transformers"] = [hf, float("nan")]
    _bars(axes[0][0], ["cold TTFT", "cached TTFT"], series, [OURS, THIRD])
    axes[0][0].set_ylabel("TTFT (s), lower is better")
    rates = {"prefixgate": [engine["decode_tps_b1"], engine["decode_tps_b8"]]}
    hf_b1 = engine.get("hf_decode_tps_b1")
    if isinstance(hf_b1, float) and hf_b1 == hf_b1:
        rates["transformers"] = [hf_b1, float("nan")]
    _bars(axes[0][1], ["decode batch 1", "decode batch 8"], rates, [OURS, THIRD], "{:.1f}")
    axes[0][1].set_ylabel("decode tokens/s, higher is better")
    _save(fig, path)


def hit_rate_by_corpus(results: Results, prov: Provenance, path: Path) -> None:
    """Prefix hit rate per corpus kind: as sent, after the default rules, and the ideal (theoretical maximum)."""
    title = "Prefix hit rate vs theoretical maximum, per corpus"
    rules = results.get("rules")
    if rules is None or "hit_rate_by_kind" not in rules:
        _not_run(path, title, prov, "bench.rules did not run")
        return
    kinds = rules["hit_rate_by_kind"]
    labels = [*kinds, "all"]
    series = {
        name: [100 * kinds[k][mode] for k in kinds] + [100 * rules[f"hit_rate_prompts_{mode}"]]
        for name, mode in (("as sent", "off"), ("default rules", "rules"), ("ideal (oracle rules)", "ideal"))
    }
    fig, axes = _figure(
        title,
        prov,
        f"corpus a (bench/corpora/prompts.yaml), {rules['prompt_requests']} requests: common prefix with an "
        f"earlier variant / prompt length, tokens ({rules['token_counter']})",
        width=12,
    )
    _bars(axes[0][0], labels, series, [PEER, OURS, THIRD], "{:.0f}")
    axes[0][0].set_ylabel("hit rate (% of prompt tokens)")
    axes[0][0].set_ylim(0, 110)
    axes[0][0].tick_params(axis="x", labelrotation=20)
    _save(fig, path)


def hit_rate_by_turn(results: Results, prov: Provenance, path: Path) -> None:
    """Cached share of the prompt per turn of the multi-turn traces: off / rules on / stateless / ideal."""
    title = "Prefix hit rate vs theoretical maximum, per turn"
    traces = results.get("traces")
    if traces is None or not traces.get("turns"):
        _not_run(path, title, prov, "bench.rules_traces did not run")
        return
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for row in traces["turns"]:
        by_turn.setdefault(row["turn"], []).append(row)
    turns = sorted(t for t in by_turn if t > 1)
    fig, axes = _figure(
        title,
        prov,
        f"{len({r['trace'] for r in traces['turns']})} traces (bench/corpora/traces), cached tokens (16-token "
        "blocks) / prompt tokens, summed over the traces at each turn",
    )
    ax = axes[0][0]
    for way, label, color in (
        ("off", "as sent", PEER),
        ("stateless", "rules, no transcript memory", FOURTH),
        ("on", "rules + transcript memory", OURS),
        ("ideal", "ideal: no volatile value left", THIRD),
    ):
        share = [
            100
            * sum(r[f"cached_{way}"] for r in by_turn[t])
            / max(sum(r["prompt_tokens"] for r in by_turn[t]), 1)
            for t in turns
        ]
        ax.plot(turns, share, marker="o", label=label, color=color, linestyle="--" if way == "ideal" else "-")
    counts = [len(by_turn[t]) for t in turns]
    ax.set_xlabel(
        "turn (request number within its trace); traces reaching it: " + ", ".join(map(str, counts))
    )
    ax.set_ylabel("cached share of prompt (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    _save(fig, path)


def tiers_ttft(results: Results, prov: Provenance, path: Path) -> None:
    """TTFT per prefix size with the prefix recomputed, hit in RAM (tiers off / on), or restored after a restart."""
    title = "TTFT by KV tier"
    tiers = _record_or_placeholder(results, "tiers", prov, path, title)
    if tiers is None:
        return
    sizes = sorted({int(k.rsplit("_", 1)[1]) for k in tiers if k.startswith("recompute_ttft_s_")})
    kinds = [
        ("recompute", "recomputed"),
        ("ram_off", "RAM hit, no tiers"),
        ("ram_on", "RAM hit, disk tier on"),
        ("disk", "disk, after restart"),
        ("redis", "Redis, after restart"),
    ]
    series = {label: [tiers[f"{k}_ttft_s_{n}"] for n in sizes] for k, label in kinds}
    fig, axes = _figure(
        title,
        prov,
        "a block-aligned prefix + 16-token question, seconds to the first token, medians (bench.tiers); "
        f"restart hit share {tiers.get('restart_hit_share', float('nan')):.2f}",
    )
    _bars(axes[0][0], [f"{n}-token prefix" for n in sizes], series, [PEER, OURS, "#17becf", THIRD, FOURTH])
    axes[0][0].set_ylabel("TTFT (s)")
    _save(fig, path)


def tenants_ttft(results: Results, prov: Provenance, path: Path) -> None:
    """Distributions of tenant B's TTFT on A's cached prefix and on a cold one, and of A's own repeat (a hit)."""
    title = "Tenants' TTFT distributions (prompt-cache side channel)"
    tenants = results.get("tenants")
    if tenants is None or "ttft_samples_s" not in tenants:
        _not_run(path, title, prov, "bench.tenants did not run")
        return
    samples = tenants["ttft_samples_s"]
    groups = [
        ("B on A's cached prefix\n(isolated)", samples["b_on_a_prefix"]),
        ("B on a cold prefix", samples["b_cold"]),
        ("A's own repeat\n(hit, = one shared namespace)", samples["a_repeat"]),
    ]
    fig, axes = _figure(
        title,
        prov,
        f"{tenants['pairs']} pairs; Wilcoxon p isolated {tenants['side_channel_p_value']:.3g}, "
        f"open namespace {tenants['open_namespace_p_value']:.2g} (bench.tenants)",
    )
    ax = axes[0][0]
    data = [[1000 * v for v in values] for _, values in groups]
    ax.boxplot(data, showfliers=False)
    for i, values in enumerate(data, 1):
        xs = [i + 0.18 * ((j % 7) / 6 - 0.5) for j in range(len(values))]
        ax.scatter(xs, values, s=8, alpha=0.6, color=[OURS, PEER, THIRD][i - 1])
    ax.set_xticks([1, 2, 3], [label for label, _ in groups], fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    _save(fig, path)


def _mean_over_seeds(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, dict[str, float]]:
    """``keys`` of the fleet's rows averaged per (gateways, policy, load) cell over the seeds run there (rows
    without a ``seed`` are one seed each)."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["gateways"], r["policy"], r["load"]), []).append(r)
    return {cell: {k: sum(r[k] for r in rs) / len(rs) for k in keys} for cell, rs in cells.items()}


def fleet_policies(results: Results, prov: Provenance, path: Path) -> None:
    """Fleet routing policies: prefix hit rate and TTFT p99 per policy, by gateway count, at each load."""
    title = "Fleet routing policies"
    fleet = results.get("fleet")
    if fleet is None or not fleet.get("rows"):
        _not_run(path, title, prov, "bench.fleet did not run")
        return
    rows = fleet["rows"]
    loads = [lv for lv in ("low", "high") if any(r["load"] == lv for r in rows)]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    gateways = sorted({r["gateways"] for r in rows})
    fig, axes = _figure(
        title,
        prov,
        "8 replicas with the embedded engine's measured timing, sessions sharing prefixes, the gateway's own "
        "routing code in simulated time; bars: mean over the workload seeds run in each cell (bench.fleet)",
        ncols=len(loads),
        nrows=2,
        width=6.0 * len(loads),
    )
    index = _mean_over_seeds(rows, ("hit_rate", "ttft_p99_s"))
    colors = [OURS, PEER, THIRD, FOURTH]
    for col, load in enumerate(loads):
        for row, key, label, fmt in (
            (0, "hit_rate", "prefix hit rate", "{:.2f}"),
            (1, "ttft_p99_s", "TTFT p99 (s)", "{:.2f}"),
        ):
            series = {
                f"{g} gateway{'s' if g > 1 else ''}": [
                    index.get((g, p, load), {}).get(key, float("nan")) for p in policies
                ]
                for g in gateways
            }
            ax = axes[row][col]
            _bars(ax, policies, series, colors, fmt)
            ax.set_ylabel(label)
            ax.set_title(f"{load} load", fontsize=9)
            ax.tick_params(axis="x", labelrotation=15)
    _save(fig, path, nrows=2)


def _record_or_placeholder(results: Results, bench: str, prov: Provenance, path: Path, title: str) -> Any:
    """``results[bench]``, or None after drawing the "not run" placeholder at ``path``."""
    record = results.get(bench)
    if record is None:
        _not_run(path, title, prov, f"bench.{bench} did not run")
    return record


def note_table(results: Results, prov: Provenance, path: Path) -> None:
    """The note's four promised improvements (shaded range) beside ours, per workload."""
    title = "The note's table, measured: prefix caching on vs off"
    note = _record_or_placeholder(results, "note", prov, path, title)
    if note is None:
        return
    workloads = list(note["workloads"])
    fig, axes = _figure(
        title,
        prov,
        f"{note['model']}, embedded engine, {note['new_tokens']} tokens per request; API cost: "
        f"{next(iter(note['workloads'].values()))['price_model']} prices, simulated provider (bench.note)",
        ncols=2,
        nrows=2,
        width=11,
    )
    metrics = [
        ("prefill_reduction", "prefill time reduction (%)", 100),
        ("e2e_reduction", "end-to-end latency reduction (%)", 100),
        ("throughput_gain", "throughput gain (x)", 1),
        ("cost_reduction", "API cost reduction (%)", 100),
    ]
    for i, (key, label, scale) in enumerate(metrics):
        ax = axes[i // 2][i % 2]
        low, high = note["note_claims"][key]
        ax.axhspan(
            low * scale, high * scale if high > low else low * scale * 1.01, color="#cccccc", alpha=0.7
        )
        ax.axhline(low * scale, color="#888888", linewidth=0.8)
        values = [note["workloads"][w][key] * scale for w in workloads]
        _bars(ax, workloads, {"ours": values}, [OURS], "{:.2f}" if scale == 1 else "{:.0f}")
        ax.set_ylabel(label)
        ax.set_title(f"note: {_claim(key, low, high)} (grey)", fontsize=9)
        ax.axhline(0, color="black", linewidth=0.6)
    _save(fig, path, nrows=2)


def note_latency(results: Results, prov: Provenance, path: Path) -> None:
    """Prefill (TTFT) and end-to-end seconds per workload, prefix caching on vs off."""
    title = "The note's workloads: latency with prefix caching on vs off"
    note = _record_or_placeholder(results, "note", prov, path, title)
    if note is None:
        return
    workloads = list(note["workloads"])
    fig, axes = _figure(
        title,
        prov,
        f"{note['model']}, medians over the requests after the first, each alone (bench.note)",
        ncols=2,
    )
    for ax, key, label in (
        (axes[0][0], "prefill_s", "prefill time = TTFT (s)"),
        (axes[0][1], "e2e_s", f"end-to-end latency, {note['new_tokens']} tokens (s)"),
    ):
        series = {mode: [note["workloads"][w][mode][key] for w in workloads] for mode in ("off", "on")}
        _bars(ax, workloads, {"caching off": series["off"], "caching on": series["on"]}, [PEER, OURS])
        ax.set_ylabel(label)
    _save(fig, path)


NEXT_TURN_ARMS = (
    ("idle", "reply prefilled\nwhile idle (default)"),
    ("exact", "reply computed\nin the turn"),
    ("generated", "reply's decode KV\ncached (opt-in)"),
    ("cold", "prefix caching off"),
)
"""``bench.next_turn``'s arms in the figure's order, with their labels."""


def next_turn_ttft(results: Results, prov: Provenance, path: Path) -> None:
    """A chat's next-turn TTFT per way of serving the previous reply (``next_turn``), each bar marked with its mean
    cached tokens and whether its greedy text equalled the cold arm's."""
    title = "A chat's next turn: TTFT by how the last reply is served"
    turn = _record_or_placeholder(results, "next_turn", prov, path, title)
    if turn is None:
        return
    fig, axes = _figure(
        title,
        prov,
        "the whole conversation resent each turn, the model's replies as text; mean TTFT of turns 2.. (ms, median "
        f"of runs); idle / exact {turn['idle_over_exact']:.3f} (bench.next_turn)",
    )
    ax = axes[0][0]
    ttft, cached, equal = turn["next_turn_ttft_ms"], turn.get("cached_tokens", {}), turn["tokens_equal_cold"]
    arms = [(k, label) for k, label in NEXT_TURN_ARMS if k in ttft]
    _bars(ax, [label for _, label in arms], {"TTFT (ms)": [ttft[k] for k, _ in arms]}, [OURS], "{:.1f}")
    for x, (k, _) in enumerate(arms):
        note = f"{cached[k]:g} cached" if k in cached else ""
        note += "" if equal.get(k, False) else "\n!= cold text"
        ax.annotate(
            note, (x, 0), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7, color="white"
        )
    ax.set_ylabel("next-turn TTFT (ms)")
    _save(fig, path)


def _claim(key: str, low: float, high: float) -> str:
    if key == "throughput_gain":
        return f"{low:g}-{high:g}x"
    return f"-{100 * low:.0f} %" if low == high else f"-{100 * low:.0f}-{100 * high:.0f} %"


PLOTS: dict[str, Callable[..., None]] = {
    "engine_vs_llamacpp.png": engine_vs_llamacpp,
    "hit_rate_by_corpus.png": hit_rate_by_corpus,
    "hit_rate_by_turn.png": hit_rate_by_turn,
    "next_turn_ttft.png": next_turn_ttft,
    "tiers_ttft.png": tiers_ttft,
    "tenants_ttft.png": tenants_ttft,
    "fleet_policies.png": fleet_policies,
    "note_table.png": note_table,
    "note_latency.png": note_latency,
}
SOURCES: dict[str, tuple[str, ...]] = {
    "engine_vs_llamacpp.png": ("peers", "engine"),
    "hit_rate_by_corpus.png": ("rules",),
    "hit_rate_by_turn.png": ("traces",),
    "next_turn_ttft.png": ("next_turn",),
    "tiers_ttft.png": ("tiers",),
    "tenants_ttft.png": ("tenants",),
    "fleet_policies.png": ("fleet",),
    "note_table.png": ("note",),
    "note_latency.png": ("note",),
}
"""The benchmarks each figure is drawn from (the first one present gives its subtitle's provenance)."""

"""Every figure of the report: file name -> drawing function (``engine_vs_llamacpp`` also takes the reason
the peer did not run)."""
