"""The AVX2 int8-activation kernel on many rows: its panel path beside its per-row path and its fp32 functions,
timed in one run (``python -m bench.int8_panel``).

Three builds or functions of ``engine/kernels/quant_gemv.c`` run SmolLM2-135M's 30 layers of int4 linears (q/k/v
960 x 576, o 576 x 576, gate/up 3,072 x 576, down 576 x 1,536: random packed weights, ~66 MB) at each of
``--rows`` rows on ``--threads`` threads:

- ``panel``: ``q4_gemv_i8`` as the engine builds it (``Int8ActivationKernel``, AVX2): from ``I8_PANEL_MIN_ROWS``
  rows each tile's codes are widened once per call and two rows run against both halves of the tile at a time;
- ``per_row``: the same source built with ``-DI8_PANEL_MIN_ROWS`` past any row count (the path every call took
  before session 28: a half tile's codes decoded again for every 4 rows);
- ``fp32``: the library's fp32-activation ``q4_gemv`` (its panel path from 16 rows), what the AVX2 build ran
  prompt rows on before session 28.

The three take turns every round (``bench.decode_compile.interleaved_ms``), median ms per pass over the 120
linears; the calls go straight to the library functions with preallocated outputs. ``panel`` and ``per_row``
give the same bits (checked here on the first layer at every row count); ``fp32`` is another function.

Prints a table, then one JSON line: ``{"cpu", "threads", "rows": {rows: {"panel", "per_row", "fp32"}}}``.
Results: docs/engine-step.md, "The AVX2 int8 kernel on many rows".
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.decode_compile import interleaved_ms
from bench.gemv_prefetch import step_weights
from engine import native_build
from engine.native_linear import (
    FLAGS,
    INT8_ACTIVATION_FLAGS,
    INT8_ACTIVATION_REQUIRED,
    LIBS,
    SOURCE,
    Int8ActivationKernel,
    prefetch_flags,
)
from engine.weight_format import cpu_vendor


def per_row_build() -> Int8ActivationKernel:
    """The AVX2 int8-activation build with its panel path switched off (``-DI8_PANEL_MIN_ROWS`` past any call)."""
    return native_build.build_checked(
        lambda path: Int8ActivationKernel(path, "avx2"),
        SOURCE,
        native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx2"]),
        native_build.compiler(),
        (*FLAGS, *INT8_ACTIVATION_FLAGS["avx2"], *prefetch_flags(), "-DI8_PANEL_MIN_ROWS=2147483647"),
        LIBS,
        None,
    )


def pass_fn(fn, weights: list, rows: int, threads: int):
    """One pass of ``fn`` (a library function: ``q4_gemv_i8`` or ``q4_gemv``) over ``weights`` at ``rows``
    random rows, each weight into its own output. Returns ``(run, outputs)``."""
    gen = torch.Generator().manual_seed(rows)
    calls = []
    for w in weights:
        x = torch.randn(rows, w.in_features, generator=gen)
        y = torch.empty(rows, w.out_features)
        calls.append(
            (x, y, (w.data.data_ptr(), w.out_features, w.in_features, x.data_ptr(), rows, y.data_ptr()))
        )

    def run() -> None:
        for _x, _y, args in calls:
            if fn(*args, threads) != 0:
                raise RuntimeError("the kernel refused its arguments")

    return run, [y for _x, y, _a in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,8,16,64,512", help="comma-separated rows per call")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    ok, why = native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx2"])
    if not ok:
        raise SystemExit(f"the AVX2 int8-activation build does not run here: {why}")
    panel, per_row = Int8ActivationKernel.build(isa="avx2"), per_row_build()
    weights = step_weights(args.layers)[:-1]  # the int4 layers, without the int8 LM head
    cpu = f"{cpu_vendor() or 'unknown vendor'}"
    print(
        f"{cpu}, {args.threads} threads, {args.layers} layers of int4 linears ({len(weights)} calls per pass)"
    )
    print(
        f"{'rows':>5} {'panel ms':>10} {'per-row ms':>11} {'fp32 ms':>9} {'per-row/panel':>14} {'fp32/panel':>11}"
    )
    result: dict[str, dict[str, float]] = {}
    for rows in (int(v) for v in args.rows.split(",")):
        runs = {
            "panel": pass_fn(panel._fns[4], weights, rows, args.threads),
            "per_row": pass_fn(per_row._fns[4], weights, rows, args.threads),
            "fp32": pass_fn(panel._fp32_fns[4], weights, rows, args.threads),
        }
        ms = interleaved_ms({k: v[0] for k, v in runs.items()}, args.rounds, 1, time.perf_counter)
        if not all(torch.equal(a, b) for a, b in zip(runs["panel"][1], runs["per_row"][1], strict=True)):
            raise SystemExit(f"{rows} rows: the panel path's outputs differ from the per-row path's")
        result[str(rows)] = ms
        print(
            f"{rows:>5} {ms['panel']:>10.2f} {ms['per_row']:>11.2f} {ms['fp32']:>9.2f} "
            f"{ms['per_row'] / ms['panel']:>14.2f} {ms['fp32'] / ms['panel']:>11.2f}"
        )
    print(json.dumps({"cpu": cpu, "threads": args.threads, "rows": result}))


if __name__ == "__main__":
    main()
