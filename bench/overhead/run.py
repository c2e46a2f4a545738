"""The interleaved run of ``bench.overhead``: start the servers, warm them, time rounds, print the table and the
JSON line (see the package docstring)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.overhead import servers
from bench.overhead.load import Batch, build_request, percentile, run_batch

SYSTEM_PROMPT = (
    "You are Atlas, the support assistant of Northwind Rail, a regional train operator. Current date: "
    "2026-12-01. Answer questions about timetables, tickets, fares, refunds, delays, accessibility, bicycles "
    "and luggage on board. Be brief, friendly and exact: give the rule first, then one example. When a "
    "passenger asks about a refund, explain that tickets bought online can be refunded up to one hour before "
    "departure, minus a two euro fee, and that season tickets are refunded pro rata from the day the request "
    "arrives. When a train is more than sixty minutes late, passengers may claim a quarter of the fare back; "
    "more than one hundred and twenty minutes, half of it. Bicycles travel free outside the morning and "
    "evening peaks, in the marked carriages only. Wheelchair users should book assistance twenty four hours "
    "ahead through the app or at any staffed station. Never invent a timetable: when you do not know a time, "
    "say so and point to the journey planner. Do not discuss politics, other companies or internal matters. "
    "If a passenger is upset, acknowledge it once, then help. Keep answers under eighty words unless the "
    "passenger asks for details, and always answer in the language of the question."
)
QUESTION = "Passenger {n} asks: can I take my bicycle on the evening train to the coast?"
"""The user turn; ``n`` numbers the requests, so every request asks a new question behind the same system
prompt (what a chatbot's traffic looks like; a gateway cannot answer from a cache of whole requests)."""
EXPECT = b"forty-two"  # in the stub's reply, streamed or not
AUTH = {"authorization": f"Bearer {servers.CLIENT_KEY}"}


@dataclass(frozen=True)
class Plan:
    """How much to send: rounds, requests per batch at 1 and at 8 connections, warm-up requests."""

    rounds: int
    requests_1: int
    requests_8: int
    warmup: int


FULL = Plan(rounds=5, requests_1=60, requests_8=160, warmup=40)
QUICK = Plan(rounds=2, requests_1=10, requests_8=16, warmup=4)
CONNECTIONS = (1, 8)


def chat_body(stream: bool, n: int = 0) -> dict:
    """Request ``n`` (the model name is the gateways'; the stub ignores it)."""
    body = {
        "model": servers.MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTION.format(n=n)},
        ],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
    return body


async def measure(
    targets: dict[str, servers.Server], plan: Plan, modes: tuple[bool, ...]
) -> dict[tuple, list[Batch]]:
    """Warm every target, then ``plan.rounds`` interleaved rounds; (target, connections, stream) -> batches.
    ``targets``: name -> the server answering it (``direct``: the stub)."""
    numbers = itertools.count()

    def requests(name: str, stream: bool, count: int) -> list[bytes]:
        port = targets[name].port
        return [
            build_request("127.0.0.1", port, "/v1/chat/completions", chat_body(stream, next(numbers)), AUTH)
            for _ in range(count)
        ]

    for name, server in targets.items():
        for stream in modes:
            await run_batch("127.0.0.1", server.port, requests(name, stream, plan.warmup), 8, EXPECT)
    results: dict[tuple, list[Batch]] = defaultdict(list)
    names = list(targets)
    for round_ in range(plan.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for stream in modes:
            for connections in CONNECTIONS:
                count = plan.requests_1 if connections == 1 else plan.requests_8
                for name in order:
                    server = targets[name]
                    load = requests(name, stream, count)
                    cpu = server.cpu_s()
                    batch = await run_batch("127.0.0.1", server.port, load, connections, EXPECT)
                    batch.cpu_s = server.cpu_s() - cpu
                    results[(name, connections, stream)].append(batch)
    return results


def summarize(results: dict[tuple, list[Batch]]) -> dict[tuple, dict[str, float]]:
    """Per (target, connections, stream): p50 / p99 ms over all rounds, requests/s over the batches' time."""
    summary = {}
    for key, batches in results.items():
        latencies = [x for batch in batches for x in batch.latencies]
        wall = sum(batch.wall_s for batch in batches)
        summary[key] = {
            "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000,
            "rps": len(latencies) / wall if wall else 0.0,
            "cpu_ms": sum(batch.cpu_s for batch in batches) / len(latencies) * 1000 if latencies else 0.0,
        }
    return summary


def paired_rounds(results: dict[tuple, list[Batch]], modes: tuple[bool, ...]) -> str:
    """With a ``baseline`` target: per answer kind and connections, each round's CPU ms per request of
    ``prefixgate`` and ``baseline`` (batches of the same round ran back to back, so they shared its load) and the
    median of the rounds' ratios ``prefixgate / baseline``: a paired reading that the machine's drift between
    rounds does not move."""
    lines = []
    for stream in modes:
        for connections in CONNECTIONS:
            ours = results.get(("prefixgate", connections, stream), [])
            theirs = results.get(("baseline", connections, stream), [])
            pairs = [
                (a.cpu_s / len(a.latencies) * 1000, b.cpu_s / len(b.latencies) * 1000)
                for a, b in zip(ours, theirs, strict=False)
                if a.latencies and b.latencies and b.cpu_s > 0
            ]
            if not pairs:
                continue
            ratios = sorted(a / b for a, b in pairs)
            rounds = " ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs)
            lines.append(
                f"{'stream' if stream else 'json'} {connections} conns: CPU ms/req prefixgate/baseline by round "
                f"{rounds}; median ratio {statistics.median(ratios):.3f} (rounds below 1: "
                f"{sum(r < 1 for r in ratios)} of {len(ratios)})"
            )
    return "\n".join(lines)


def table(summary: dict[tuple, dict[str, float]], names: list[str], modes: tuple[bool, ...]) -> str:
    """The text table: one row per answer kind, connections and target (``cpu ms/req``: CPU time of the target's
    own server process per request; the stub's for ``direct``)."""
    lines = [
        f"{'answer':<9}{'conns':>6}  {'target':<11}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
        f"{'req/s':>9}{'cpu ms/req':>12}"
    ]
    for stream in modes:
        for connections in CONNECTIONS:
            base = summary[("direct", connections, stream)]
            for name in names:
                row = summary[(name, connections, stream)]
                added = "" if name == "direct" else f"{row['p50_ms'] - base['p50_ms']:9.2f}"
                added99 = "" if name == "direct" else f"{row['p99_ms'] - base['p99_ms']:9.2f}"
                lines.append(
                    f"{'stream' if stream else 'json':<9}{connections:>6}  {name:<11}{row['p50_ms']:9.2f}"
                    f"{row['p99_ms']:9.2f}{added:>9}{added99:>9}{row['rps']:9.0f}{row['cpu_ms']:12.3f}"
                )
    return "\n".join(lines)


def report(summary: dict[tuple, dict[str, float]], rss: dict[str, float], plan: Plan, load: float) -> dict:
    """The final JSON object (ms, requests/s, MiB)."""

    def added(name: str, connections: int, stream: bool, field: str = "p50_ms") -> float | None:
        if (name, connections, stream) not in summary:
            return None
        return round(
            summary[(name, connections, stream)][field] - summary[("direct", connections, stream)][field], 3
        )

    def rps(name: str, stream: bool = False) -> float | None:
        row = summary.get((name, 8, stream))
        return round(row["rps"], 1) if row else None

    def cpu(name: str) -> float | None:
        rows = [row for (n, _, _), row in summary.items() if n == name]
        return round(sum(row["cpu_ms"] for row in rows) / len(rows), 3) if rows else None

    gate, lite = rps("prefixgate"), rps("litellm")
    doc = {
        "overhead_p50_ms": added("prefixgate", 1, False),
        "rps_vs_litellm": round(gate / lite, 2) if gate and lite else None,
        "overhead_p99_ms": added("prefixgate", 1, False, "p99_ms"),
        "overhead_p50_ms_8conns": added("prefixgate", 8, False),
        "stream_overhead_p50_ms": added("prefixgate", 1, True),
        "litellm_overhead_p50_ms": added("litellm", 1, False),
        "litellm_stream_overhead_p50_ms": added("litellm", 1, True),
        "direct_p50_ms": round(summary[("direct", 1, False)]["p50_ms"], 3),
        "prefixgate_cpu_ms_per_request": cpu("prefixgate"),
        "litellm_cpu_ms_per_request": cpu("litellm"),
        "stub_cpu_ms_per_request": cpu("direct"),
        "prefixgate_rps_8": gate,
        "litellm_rps_8": lite,
        "direct_rps_8": rps("direct"),
        "prefixgate_stream_rps_8": rps("prefixgate", True),
        "litellm_stream_rps_8": rps("litellm", True),
        "prefixgate_rss_mb": rss.get("prefixgate"),
        "baseline_overhead_p50_ms": added("baseline", 1, False),
        "baseline_cpu_ms_per_request": cpu("baseline"),
        "baseline_rps_8": rps("baseline"),
        "litellm_rss_mb": rss.get("litellm"),
        "stub_rss_mb": rss.get("stub"),
        "rounds": plan.rounds,
        "requests_per_batch": {"1": plan.requests_1, "8": plan.requests_8},
        "load_avg_1m": round(load, 2),
    }
    return doc


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the bench, print the table and the JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few requests per batch (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 2)")
    parser.add_argument("--litellm", default=None, help="LiteLLM's `litellm` script, or the venv holding it")
    parser.add_argument("--no-litellm", action="store_true", help="direct and prefixgate only")
    parser.add_argument("--no-stream", action="store_true", help="non-streamed answers only")
    parser.add_argument("--log-level", default="info", help="prefixgate's --log-level (default info)")
    parser.add_argument(
        "--requests-1",
        type=int,
        default=None,
        metavar="N",
        help="requests per batch at 1 connection (default 60; quick 10). An A/B of builds a few %% apart needs "
        "~500: the CPU per request is read from /proc in 10 ms ticks",
    )
    parser.add_argument(
        "--requests-8",
        type=int,
        default=None,
        metavar="N",
        help="requests per batch at 8 connections (default 160)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="TREE",
        help="also run prefixgate from the checkout at TREE (target `baseline`, interleaved with the others): "
        "a before / after in one run",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    for name in ("rounds", "requests_1", "requests_8"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    plan = Plan(
        args.rounds or plan.rounds,
        args.requests_1 or plan.requests_1,
        args.requests_8 or plan.requests_8,
        plan.warmup,
    )
    litellm = None
    if not args.no_litellm:
        litellm = servers.find_litellm(args.litellm)
        if litellm is None:
            parser.error("LiteLLM not found: install the bench extra, pass --litellm PATH, or --no-litellm")
    modes = (False,) if args.no_stream else (False, True)
    _use_uvloop()
    with tempfile.TemporaryDirectory(prefix="prefixgate-overhead-") as tmp:
        workdir = Path(tmp)
        started: list[servers.Server] = []
        try:
            stub = servers.start_stub(workdir)
            started.append(stub)
            started.append(servers.start_prefixgate(workdir, stub.port, args.log_level))
            if args.baseline:
                tree = Path(args.baseline).resolve()
                started.append(servers.start_prefixgate(workdir, stub.port, args.log_level, tree, "baseline"))
            if litellm is not None:
                started.append(servers.start_litellm(workdir, stub.port, litellm))
            targets = {"direct": stub, **{s.name: s for s in started[1:]}}
            results = asyncio.run(measure(targets, plan, modes))
            rss = {s.name: round(s.rss_mb(), 1) for s in started}
        finally:
            for server in started:
                server.stop()
    summary = summarize(results)
    print(table(summary, list(targets), modes))
    if "baseline" in targets:
        print(paired_rounds(results, modes))
    print("RSS MiB: " + ", ".join(f"{name} {value}" for name, value in rss.items()))
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} CPUs")
    print(json.dumps(report(summary, rss, plan, load)))
    sys.stdout.flush()


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
