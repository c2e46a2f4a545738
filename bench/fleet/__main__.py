"""``python -m bench.fleet``: routing policies over 8 replicas with 1, 2 and 4 gateways at three loads, then
the soak.

The matrix runs in virtual time (``bench.fleet.sim``: the gateway's own routing code, the stub replica's
scheduler and costs, Redis for the gateways' exchange), so its figures do not depend on the machine's other
work; ``--realtime`` runs it through real HTTP replicas on loopback instead (``bench.fleet.run``; CPU-bound on
a small machine: its TTFT then measures the event loop). A load level is offered work over the fleet's
capacity with nothing cached (``SimConfig.load``); the ``util`` column is the busy share each policy really
reached. The cache-aware gateways' index holds about a replica's cache (``--index-blocks``, default: the
replica capacity in the 64-character blocks of this workload, as an operator would size llm-d's
``LRUCapacityPerServer``).

Prints one table row per (gateways, policy, load) and ends with one JSON line: ``cache_aware_share_of_single``
and ``max_over_mean_load`` (cache-aware, 1 gateway, high load), the same at every load
(``cache_aware_share_of_single_by_load``, ``max_over_mean_load_by_load``), ``gateways4_share_of_1``
(cache-aware hit rate with 4 gateways / with 1, high load), ``cache_aware_p99_ttft_over_round_robin_low``
(1 gateway, low load), ``cache_aware_kv_share_of_single`` and ``cache_aware_kv_max_over_mean_load``, the
soak's ``soak_failed``, ``soak_leaked_blocks``, ``soak_rss_slope_mb_per_min``,
``soak_rss_slope_second_half_mb_per_min`` and ``soak_rss_mb_by_quarter`` (``bench.fleet.soak``; the first two
None with ``--soak 0``), the load average at the start and end, and ``rows``. ``--quick`` runs small sizes for CI.
SIGTERM or SIGINT stops the run cleanly (gateway processes and replicas included) and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import replace

from bench.fleet.replica import EngineTiming
from bench.fleet.sim import POLICY_NAMES, SimConfig, index_blocks_for, simulate
from bench.fleet.soak import SoakConfig, run_soak, until_signal
from bench.fleet.workload import WorkloadConfig

LOADS = {"low": 0.3, "mid": 0.9, "high": 1.5}
"""Offered work over the fleet's capacity with nothing cached (1.0: every replica busy without a hit)."""


def _row(r: dict, level: str, seed: int) -> str:
    return (
        f"| {r['gateways']} | {seed} | {r['policy']} | {level} | {r['requests']} | {r['util']:.2f} | {r['hit_rate']:.3f} | "
        f"{r['share_of_single']:.3f} | {r['max_over_mean_load']:.2f} | {r['max_over_mean_served']:.2f} | "
        f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['errors']} | {r['retries']} | {r['wall_s']:.1f} |"
    )


async def _run_cell(args: argparse.Namespace, cfg: SimConfig) -> dict:
    start = time.monotonic()
    if args.realtime:
        from bench.fleet.run import RunConfig, run_once

        options = dict(cfg.policy_options)
        r = await run_once(
            RunConfig(
                policy=cfg.policy,
                n_gateways=cfg.n_gateways,
                load=cfg.load,
                timing=EngineTiming(time_scale=args.time_scale),
                workload=replace(cfg.workload, think_s=cfg.think_s * args.time_scale),
                capacity_tokens=cfg.capacity_tokens,
                overlap_weight=float(options.get("overlap_weight", 1.0)),
            )
        )
        r |= {"util": float("nan"), "retries": r["failovers"] or 0}
    else:
        r = await simulate(cfg)
    r["wall_s"] = time.monotonic() - start
    return r


async def main_async(args: argparse.Namespace) -> dict:
    """Run the matrix (and the soak); returns the JSON line's object."""
    seeds = [args.seed + i for i in range(max(1, args.seeds))]
    wl = WorkloadConfig(n_sessions=args.sessions, seed=args.seed)
    index_blocks = args.index_blocks or index_blocks_for(args.capacity_tokens, wl)
    base = SimConfig(
        policy="",
        n_gateways=1,
        load=0.0,
        workload=wl,
        faults=not args.no_faults,
        capacity_tokens=args.capacity_tokens,
        load_factor=args.load_factor,
        policy_options=(("index_capacity_blocks", index_blocks),),
    )
    out: dict = {"mode": "realtime" if args.realtime else "virtual_time", "index_blocks": index_blocks}
    out["load_avg_start"] = round(os.getloadavg()[0], 2)
    results: dict[tuple[int, str, str, int], dict] = {}
    print(f"loads (offered / capacity with nothing cached): {json.dumps({k: LOADS[k] for k in args.loads})}")
    print(
        "| gateways | seed | policy | load | requests | util | hit rate | share of single | max/mean load "
        "| max/mean served | TTFT p50 s | TTFT p99 s | errors | retries | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gateways in args.gateways:
        # Several seeds at 1 gateway (cheap cells: the headline is their mean); one at 2 and 4 gateways,
        # whose cells pay a real Redis round trip per gateway every 0.2 s of virtual time.
        levels = args.loads if gateways == 1 else [lv for lv in args.loads if lv in args.multi_gateway_loads]
        for seed in seeds if gateways == 1 else seeds[:1]:
            for level in levels:
                for policy in args.policies:
                    cfg = replace(
                        base,
                        policy=policy,
                        n_gateways=gateways,
                        load=LOADS[level],
                        workload=replace(wl, seed=seed),
                    )
                    r = await _run_cell(args, cfg)
                    results[(gateways, policy, level, seed)] = r
                    print(_row(r, level, seed), flush=True)

    def each(g: int, p: str, level: str, key: str) -> list[float]:
        return [r[key] for (g2, p2, l2, _), r in results.items() if (g2, p2, l2) == (g, p, level)]

    def mean(g: int, p: str, level: str, key: str) -> float | None:
        values = each(g, p, level, key)
        return statistics.mean(values) if values else None

    out["seeds"] = seeds
    out["cache_aware_share_of_single"] = mean(1, "cache_aware", "high", "share_of_single")
    out["max_over_mean_load"] = mean(1, "cache_aware", "high", "max_over_mean_load")
    out["cache_aware_share_of_single_by_seed"] = each(1, "cache_aware", "high", "share_of_single")
    out["max_over_mean_load_by_seed"] = each(1, "cache_aware", "high", "max_over_mean_load")
    out["cache_aware_share_of_single_by_load"] = {
        level: mean(1, "cache_aware", level, "share_of_single") for level in args.loads
    }
    out["max_over_mean_load_by_load"] = {
        level: mean(1, "cache_aware", level, "max_over_mean_load") for level in args.loads
    }
    one = results.get((1, "cache_aware", "high", seeds[0]))
    four = results.get((4, "cache_aware", "high", seeds[0]))
    out["gateways4_share_of_1"] = four["hit_rate"] / one["hit_rate"] if one and four else None
    p99 = [
        results[(1, "cache_aware", "low", seed)]["ttft_p99_s"]
        / results[(1, "round_robin", "low", seed)]["ttft_p99_s"]
        for seed in seeds
        if (1, "cache_aware", "low", seed) in results and (1, "round_robin", "low", seed) in results
    ]
    out["cache_aware_p99_ttft_over_round_robin_low"] = max(p99) if p99 else None  # the worst seed
    out["cache_aware_kv_share_of_single"] = mean(1, "cache_aware_kv", "high", "share_of_single")
    out["cache_aware_kv_max_over_mean_load"] = mean(1, "cache_aware_kv", "high", "max_over_mean_load")
    out["errors"] = sum(r["errors"] for r in results.values())
    out["load_avg_matrix_end"] = round(os.getloadavg()[0], 2)
    if args.soak > 0:
        soak = await run_soak(SoakConfig(duration_s=args.soak, streams=args.soak_streams))
        print(f"soak: {json.dumps(soak)}", flush=True)
        out.update({k: v for k, v in soak.items() if k != "soak_failures_sample"})
        out["load_avg_end"] = round(os.getloadavg()[0], 2)
    else:
        out["soak_failed"] = None
        out["soak_leaked_blocks"] = None
    out["rows"] = [
        {"gateways": g, "policy": p, "load": level, "seed": seed}
        | {
            k: r[k]
            for k in ("util", "hit_rate", "share_of_single", "max_over_mean_load", "ttft_p50_s", "ttft_p99_s")
        }
        for (g, p, level, seed), r in results.items()
    ]
    return _rounded(out)


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for CI")
    parser.add_argument("--sessions", type=int, default=400, help="sessions per cell")
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES))
    parser.add_argument("--no-faults", action="store_true", help="no replica joining, failing or restarting")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument(
        "--seeds", type=int, default=3, help="workload seeds at 1 gateway (seed, seed+1, ...)"
    )
    parser.add_argument(
        "--multi-gateway-loads",
        nargs="+",
        choices=list(LOADS),
        default=["low", "high"],
        help="loads run with 2 and 4 gateways",
    )
    parser.add_argument("--capacity-tokens", type=int, default=8000, help="prefix cache tokens per replica")
    parser.add_argument("--load-factor", type=float, default=1.25, help="the ring's bound c")
    parser.add_argument(
        "--index-blocks",
        type=int,
        default=0,
        help="cache-aware index blocks per replica (0: sized to the cache)",
    )
    parser.add_argument("--realtime", action="store_true", help="real HTTP replicas instead of virtual time")
    parser.add_argument("--time-scale", type=float, default=0.04, help="--realtime: real s per engine s")
    parser.add_argument(
        "--soak",
        type=float,
        default=None,
        help="soak seconds after the matrix (default 0: none; --quick: 15)",
    )
    parser.add_argument("--soak-streams", type=int, default=64, help="concurrent streams of the soak")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions = min(args.sessions, 60)
        args.gateways = [1, 2]
        args.policies = ["round_robin", "cache_aware"]
        args.loads = ["low", "high"]
        args.seeds = 1
        args.soak = 15.0 if args.soak is None else min(args.soak, 15.0)
        args.soak_streams = min(args.soak_streams, 16)
    if args.soak is None:
        args.soak = 0.0
    out = asyncio.run(until_signal(main_async(args)))
    if out is None:
        print("bench.fleet: stopped by a signal", file=sys.stderr)
        return 130
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
