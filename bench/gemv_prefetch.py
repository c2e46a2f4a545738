"""The weight stream's prefetch hint: one decode step's GEMVs built at each ``GEMV_PREFETCH_LOCALITY``
(``engine.native_linear.prefetch_flags``; 0 ``prefetchnta`` .. 3 ``prefetcht0``), timed in one run.

A step of SmolLM2-135M's shapes on random packed weights, laid out as the engine holds them: 30 layers of int4
q/k/v (960 x 576), o (576 x 576), gate/up (3,072 x 576) and down (576 x 1,536), then the int8 LM head (49,152 x
576): ~96 MB read once per step, so each call reads its weights from wherever the last step left them (L3 or
memory), as in serving. Each locality's build of the kernel ``auto`` serves (``Int8ActivationKernel`` where it
builds, else ``NativeLinearKernel``) runs the whole step at ``--rows`` rows on ``--threads`` threads, the builds
taking turns every round (``bench.decode_compile.interleaved_ms``), median ms per step. The calls go straight to
the library's functions with preallocated outputs, so Python's share is a few microseconds per call.

Run: ``python -m bench.gemv_prefetch --rows 1,8``. Results: docs/engine-step.md, "The weight stream's prefetch
hint". The last line is JSON: ``{"cpu_vendor", "default_locality", "rows": {rows: {locality: ms}}}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.decode_compile import interleaved_ms
from engine.native_linear import (
    default_prefetch_locality,
    pack_int4,
    pack_int8,
    random_groups,
    resolve_linear_kernel,
)
from engine.weight_format import cpu_vendor

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""SmolLM2-135M's four int4 linears per layer, ``(out_features, in_features)``."""
HEAD_SHAPE = (49152, 576)
"""Its Q8_0 LM head."""


def step_weights(layers: int, seed: int = 0) -> list:
    """Packed random weights of one step: ``layers`` x ``LAYER_SHAPES`` (int4), then the head (int8)."""
    gen = torch.Generator().manual_seed(seed)
    out = [pack_int4(random_groups(4, n, k, gen)) for _ in range(layers) for n, k in LAYER_SHAPES]
    return [*out, pack_int8(random_groups(8, *HEAD_SHAPE, gen))]


def step_fn(kernel, weights: list, rows: int, threads: int):
    """One step's GEMVs on ``kernel``'s library: each weight times ``rows`` random rows into its own output.

    Returns:
        ``(run, io)``: ``run()`` makes every call once (and holds the buffers its calls point into); ``io`` the
        ``(x, y)`` fp32 input and output of each weight.
    """
    calls = []
    for w in weights:
        x = torch.randn(rows, w.in_features)
        y = torch.empty(rows, w.out_features)
        fn = kernel._fns[w.bits]  # the library function mm() calls, without mm()'s checks and allocation
        args = (w.data.data_ptr(), w.out_features, w.in_features, x.data_ptr(), rows, y.data_ptr(), threads)
        calls.append((fn, args, x, y))

    def run() -> None:
        for fn, args, _x, _y in calls:
            if fn(*args) != 0:
                raise RuntimeError("the kernel refused its arguments")

    return run, [(x, y) for _fn, _args, x, y in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8", help="comma-separated rows per GEMV (sequences in the step)")
    ap.add_argument("--localities", default="0,1,2,3", help="comma-separated prefetch localities to build")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    auto = resolve_linear_kernel("auto", "cpu")  # the kernel engine.linear_kernel: auto serves here
    if auto is None:
        raise SystemExit("no native linear kernel builds on this machine")
    cls = type(auto)
    localities = [int(v) for v in args.localities.split(",")]
    kernels = {loc: cls.build(prefetch_locality=loc) for loc in localities}
    weights = step_weights(args.layers)
    mb = sum(w.nbytes for w in weights) / 2**20
    vendor, default = cpu_vendor(), default_prefetch_locality()
    print(
        f"{cls.__name__}, {vendor or 'unknown vendor'} (default locality {default}), {args.threads} threads, "
        f"{mb:.1f} MiB of weights per step"
    )
    result: dict[str, dict[str, float]] = {}
    print(f"{'rows':>4}  " + "  ".join(f"loc {loc} ms" for loc in localities) + "  best/default")
    for rows in (int(v) for v in args.rows.split(",")):
        fns = {str(loc): step_fn(k, weights, rows, args.threads)[0] for loc, k in kernels.items()}
        ms = interleaved_ms(fns, args.rounds, 1, time.perf_counter)
        result[str(rows)] = ms
        base = ms.get(str(default))
        ratio = f"{min(ms.values()) / base:.3f}" if base else "-"
        print(f"{rows:>4}  " + "  ".join(f"{ms[str(loc)]:>11.3f}" for loc in localities) + f"  {ratio:>12}")
    print(json.dumps({"cpu_vendor": vendor, "default_locality": default, "rows": result}))


if __name__ == "__main__":
    main()
