"""The prefill attention's builds side by side: one layer of SmolLM2's attention shape (9 query heads over 3 KV
heads of 64, a bf16 cache, random values in scattered blocks), each build of ``engine.native_decode`` this CPU
runs (``avx512`` / ``avx2``: fp32 arithmetic; ``avx512-bf16``: ``VDPBF16PS``; ``amx``: AMX tiles), called in turn
every round so the machine's noise falls on all alike.

Cases (``--cases``, ``start+rows`` each): a cold ~1,070-token prompt, W2's 56-row tail over 1,028 cached tokens,
and two chunks of a prompt cut at 512. Prints per case the median (and best) milliseconds of each build over
``--rounds`` rounds at ``--threads`` threads and each build's time over the first's, then one JSON line.

Run: ``python -m bench.prefill_kernels [--threads 2 --rounds 15]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import native_decode

CASES = "0+1070,1028+56,0+512,512+570"
BUILDS = ("avx512", "avx2", "avx512-bf16", "amx")


def available_builds(group: int, head_dim: int) -> dict[str, native_decode.NativeDecodeKernel]:
    """Each build in ``BUILDS`` that this CPU runs and this machine compiles, by name; a build that fails is
    left out with a ``#`` line saying why."""
    out = {}
    for isa in BUILDS:
        if not native_decode._cpu_ok(isa)[0]:
            continue
        kernel = native_decode._shared_kernel(group, head_dim, isa)
        if isinstance(kernel, str):
            print(f"# {isa}: not built ({kernel})")
            continue
        out[isa] = kernel
    return out


def time_case(
    kernels: dict[str, native_decode.NativeDecodeKernel], start: int, rows: int, threads: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds of each kernel's prefill of ``rows`` rows after ``start`` cached positions, ``rounds`` calls each,
    the kernels alternated every round."""
    gen = torch.Generator().manual_seed(start + rows)
    group, kvh, d, bs = 3, 3, 64, 16
    nb = -(-(start + rows) // bs) + 8
    cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(torch.bfloat16)
    table = torch.randperm(nb, generator=gen)[: -(-(start + rows) // bs)].to(torch.int32)
    q = torch.randn(rows, group * kvh, d, generator=gen)
    scratch = {
        isa: torch.empty(k.prefill_scratch_size(rows, group * kvh, kvh, d, start + rows, threads))
        for isa, k in kernels.items()
    }
    times: dict[str, list[float]] = {isa: [] for isa in kernels}
    for r in range(rounds + 1):
        for isa, k in kernels.items():
            t = time.perf_counter()
            k.prefill(q, cache, table, start, d**-0.5, scratch[isa], threads=threads)
            if r:  # the first round warms each build
                times[isa].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cases", default=CASES, help="comma-separated start+rows")
    args = ap.parse_args()
    kernels = available_builds(3, 64)
    names = list(kernels)
    print(f"one layer, 9 heads / 3 KV heads of 64, bf16 cache, {args.threads} threads; ms median (best)")
    print(
        f"{'case':>12}"
        + "".join(f"{n:>22}" for n in names)
        + "".join(f"{n + '/' + names[0]:>26}" for n in names[1:])
    )
    result = []
    for case in args.cases.split(","):
        start, rows = (int(x) for x in case.split("+"))
        times = time_case(kernels, start, rows, args.threads, args.rounds)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        best = {n: min(v) * 1e3 for n, v in times.items()}
        row = f"{case:>12}" + "".join(f"{med[n]:>14.3f} ({best[n]:.3f})" for n in names)
        row += "".join(f"{med[n] / med[names[0]]:>26.3f}" for n in names[1:])
        print(row)
        result.append({"start": start, "rows": rows, "median_ms": med, "best_ms": best})
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "cases": result}))


if __name__ == "__main__":
    main()
