"""``python -m bench.fleet``: routing policies over 8 stub replicas with 1, 2 and 4 gateways, two loads.

Prints one table row per (gateways, policy, load) and ends with one JSON line:
``cache_aware_share_of_single`` and ``max_over_mean_load`` (cache-aware, 1 gateway, high load),
``gateways4_share_of_1`` (cache-aware hit rate with 4 gateways / with 1, high load),
``cache_aware_p99_ttft_over_round_robin_low`` (1 gateway, low load), and with ``--soak SECONDS`` the soak's
``soak_failed``, ``soak_leaked_blocks`` and ``soak_rss_slope_mb_per_min`` (``bench.fleet.soak``), and ``rows``:
hit rate, share of single, load balance and TTFT p50/p99 of every (gateways, policy, load) run.
``--quick`` runs small sizes for CI, with a 15-second soak of 16 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace

from bench.fleet.replica import EngineTiming
from bench.fleet.run import RunConfig, run_once
from bench.fleet.soak import SoakConfig, run_soak
from bench.fleet.workload import WorkloadConfig

POLICIES = ("round_robin", "least_load", "consistent_hash", "cache_aware", "cache_aware_kv")
LOADS = {"low": 0.2, "high": 0.8}


def _row(r: dict, level: str) -> str:
    return (
        f"| {r['gateways']} | {r['policy']} | {level} | {r['requests']} | {r['hit_rate']:.3f} | "
        f"{r['share_of_single']:.3f} | {r['max_over_mean_load']:.2f} | {r['max_over_mean_served']:.2f} | "
        f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['errors']} | {'-' if r['failovers'] is None else r['failovers']} | {r['wall_s']:.1f} |"
    )


async def main_async(args: argparse.Namespace) -> dict:
    wl = WorkloadConfig(n_sessions=args.sessions, seed=args.seed)
    timing = EngineTiming(time_scale=args.time_scale)
    base = RunConfig(
        policy="",
        n_gateways=1,
        load=0.0,
        timing=timing,
        workload=wl,
        faults=not args.no_faults,
        capacity_tokens=args.capacity_tokens,
        load_factor=args.load_factor,
        overlap_weight=args.overlap_weight,
    )
    results: dict[tuple[int, str, str], dict] = {}
    print(
        "| gateways | policy | load | requests | hit rate | share of single | max/mean load | max/mean served "
        "| TTFT p50 s | TTFT p99 s | errors | failovers | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gateways in args.gateways:
        for level in args.loads:
            for policy in args.policies:
                cfg = replace(base, policy=policy, n_gateways=gateways, load=LOADS[level])
                r = await run_once(cfg)
                results[(gateways, policy, level)] = r
                print(_row(r, level), flush=True)
    out: dict = {}

    def get(g: int, p: str, level: str, key: str) -> float | None:
        r = results.get((g, p, level))
        return None if r is None else r[key]

    out["cache_aware_share_of_single"] = get(1, "cache_aware", "high", "share_of_single")
    out["max_over_mean_load"] = get(1, "cache_aware", "high", "max_over_mean_load")
    one, four = get(1, "cache_aware", "high", "hit_rate"), get(4, "cache_aware", "high", "hit_rate")
    out["gateways4_share_of_1"] = four / one if one and four is not None else None
    ca_low, rr_low = get(1, "cache_aware", "low", "ttft_p99_s"), get(1, "round_robin", "low", "ttft_p99_s")
    out["cache_aware_p99_ttft_over_round_robin_low"] = ca_low / rr_low if ca_low and rr_low else None
    out["cache_aware_kv_share_of_single"] = get(1, "cache_aware_kv", "high", "share_of_single")
    out["errors"] = sum(r["errors"] for r in results.values())
    out["rows"] = [
        {"gateways": g, "policy": p, "load": level}
        | {k: r[k] for k in ("hit_rate", "share_of_single", "max_over_mean_load", "ttft_p50_s", "ttft_p99_s")}
        for (g, p, level), r in results.items()
    ]
    if args.soak > 0:
        soak = await run_soak(SoakConfig(duration_s=args.soak, streams=args.soak_streams))
        print(f"soak: {json.dumps(soak)}", flush=True)
        out.update({k: v for k, v in soak.items() if k != "soak_failures_sample"})
    else:
        out["soak_failed"] = None
        out["soak_leaked_blocks"] = None
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes for CI (1 and 4 gateways, 3 policies)"
    )
    parser.add_argument("--sessions", type=int, default=160, help="sessions per run")
    parser.add_argument("--time-scale", type=float, default=0.04, help="real seconds per engine second")
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--loads", nargs="+", choices=sorted(LOADS), default=["low", "high"])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--no-faults", action="store_true", help="no replica joining, failing or restarting")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--capacity-tokens", type=int, default=8000, help="prefix cache tokens per replica")
    parser.add_argument("--load-factor", type=float, default=1.25, help="the ring's bound c")
    parser.add_argument(
        "--overlap-weight", type=float, default=1.0, help="cache-aware prefill weight (Dynamo)"
    )
    parser.add_argument("--soak", type=float, default=0.0, help="soak seconds after the matrix (0: none)")
    parser.add_argument("--soak-streams", type=int, default=64, help="concurrent streams of the soak")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions = min(args.sessions, 24)
        args.gateways = [1, 4]
        args.policies = ["round_robin", "cache_aware"]
        args.time_scale = min(args.time_scale, 0.02)
        args.soak = min(args.soak, 15.0) if args.soak else 15.0
        args.soak_streams = min(args.soak_streams, 16)
    out = asyncio.run(main_async(args))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
