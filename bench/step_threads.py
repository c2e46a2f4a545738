"""How many torch threads a step should run with: one decode step of B sequences, and a prefill chunk, at 1
thread against ``--threads``, and what switching the count between steps costs (``engine.step_threads``).

SmolLM2-135M (``--weights``, default ``auto``: Q4_1 as int4), bf16 KV cache, each sequence ``--context`` tokens
of context in its own blocks (no shared prefix). Each case runs the model's forward and its LM head over the
sampled rows (what ``ModelRunner.execute`` runs, less sampling), at every thread count in turn, the order
rotated every round, median ms per step; the attention plan is the same at every count (decode contexts are
cut at fixed positions, ``engine.chunked_decode``). ``switch`` times ``torch.set_num_threads`` alternating 1 and
``--threads`` with a parallel op between (so OpenMP's team really changes size) against the op alone.

Run: ``python -m bench.step_threads --threads 2 --lock /work/wt/bench.lock``. Results: docs/engine-step.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.decode_compile import BLOCK, bench_lock, decode_meta, interleaved_ms
from engine.attention import AttentionMetadata
from engine.checkpoint import default_model_path, load_checkpoint
from engine.model import LlamaModel, allocate_kv_cache


def step_fn(model: LlamaModel, kv: torch.Tensor, meta: AttentionMetadata, ids, positions, rows, threads: int):
    """One step's forward + LM head of ``rows``, run with ``threads`` torch threads."""

    def run() -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        hidden = model(ids, positions, kv, meta)
        model.compute_logits(hidden.index_select(0, rows))

    return run


def max_diff_across_counts(model, kv, meta, ids, positions, rows, counts: list[int]) -> float:
    """Largest |logit difference| of one step's sampled rows run at each of ``counts`` threads against the
    last count (0.0: bit-identical, as ``engine.step_threads`` promises). The step's K/V write is the same at
    every count, so rerunning it is harmless."""
    out = []
    for n in counts:
        torch.set_num_threads(n)
        out.append(model.compute_logits(model(ids, positions, kv, meta).index_select(0, rows)).float())
    return max(float((o - out[-1]).abs().max()) for o in out)


def switch_cost(threads: int, rounds: int) -> dict[str, float]:
    """Microseconds (best of ``rounds`` loops of 2,000) of a ``torch.set_num_threads`` call alternating 1 and
    ``threads``, of ``torch.get_num_threads``, and what a change adds to the next small parallel op (OpenMP's
    team resized): the op with a change before each call, less the mean of the op at each fixed count."""
    x = torch.randn(1 << 17)
    y = torch.empty_like(x)
    n = 2000

    def best(body) -> float:
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            body()
            times.append(time.perf_counter() - t)
        return min(times) * 1e6 / n

    def sets() -> None:
        for i in range(n):
            torch.set_num_threads(1 if i % 2 else threads)

    def gets() -> None:
        for _ in range(n):
            torch.get_num_threads()

    def op_at(count: int):
        def body() -> None:
            torch.set_num_threads(count)
            for _ in range(n):
                torch.mul(x, 2.0, out=y)

        return body

    def op_switching() -> None:
        for i in range(n):
            torch.set_num_threads(1 if i % 2 else threads)
            torch.mul(x, 2.0, out=y)

    fixed = (best(op_at(1)) + best(op_at(threads))) / 2
    out = {"set_num_threads_us": best(sets), "get_num_threads_us": best(gets)}
    out["switch_before_op_us"] = best(op_switching) - fixed
    torch.set_num_threads(threads)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="the configured engine.num_threads")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--context", type=int, default=968)
    ap.add_argument("--batches", default="1,2,3,4,8", help="decode steps of this many sequences")
    ap.add_argument("--prefill", default="16,128", help="prefill chunks of this many tokens (no context)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="steps per timed call")
    ap.add_argument("--lock", default=None, help="flock this file around timed loops (/work/wt/bench.lock)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = load_checkpoint(default_model_path(), weights=args.weights).model
    batches = [int(b) for b in args.batches.split(",") if b]
    chunks = [int(c) for c in args.prefill.split(",") if c]
    per_seq = -(-(args.context + 1) // BLOCK)
    blocks = max(max(batches, default=1) * per_seq, -(-max(chunks, default=1) // BLOCK)) + 1
    kv = allocate_kv_cache(model.config, blocks, BLOCK, torch.bfloat16, model.device)
    kv.normal_()
    cases: dict[str, tuple] = {}
    for b in batches:
        meta, positions = decode_meta(b, args.context, per_seq)
        ids = torch.randint(0, model.config.vocab_size, (b,))
        cases[f"decode b{b}"] = (meta, ids, positions, torch.arange(b))
    for c in chunks:
        nb = -(-c // BLOCK)
        meta = AttentionMetadata(torch.arange(c), [0, c], [c], torch.arange(nb).view(1, nb), BLOCK)
        ids = torch.randint(0, model.config.vocab_size, (c,))
        cases[f"prefill {c}"] = (meta, ids, torch.arange(c), torch.tensor([c - 1]))
    counts = sorted({1, args.threads})
    res: dict[str, dict[str, float]] = {}
    with torch.inference_mode(), bench_lock(args.lock):
        load = os.getloadavg()
        switch = switch_cost(args.threads, args.rounds)
        print(f"load {load[0]:.2f}  switch {switch}", flush=True)
        for name, (meta, ids, positions, rows) in cases.items():
            fns = {f"t{n}": step_fn(model, kv, meta, ids, positions, rows, n) for n in counts}
            res[name] = interleaved_ms(fns, args.rounds, args.calls, time.perf_counter)
            res[name]["max_logit_diff"] = max_diff_across_counts(
                model, kv, meta, ids, positions, rows, counts
            )
            print(name, res[name], f"load {os.getloadavg()[0]:.2f}", flush=True)
        load_end = os.getloadavg()
    torch.set_num_threads(args.threads)
    hi = f"t{args.threads}"
    print(f"context {args.context}  load {load[0]:.2f} -> {load_end[0]:.2f}  switch {switch}")
    print(f"{'case':<14}" + "".join(f"{f't{n} ms':>10}" for n in counts) + f"{'t1/' + hi:>10}  max |dlogit|")
    for name, row in res.items():
        ratio = row["t1"] / row[hi]
        cells = "".join(f"{row[f't{n}']:>10.2f}" for n in counts)
        print(f"{name:<14}{cells}{ratio:>10.2f}  {row['max_logit_diff']:.3g}")
    info = {"threads": args.threads, "context": args.context, "load1": [load[0], load_end[0]], **switch}
    print(json.dumps({"result": res, **info}))


if __name__ == "__main__":
    main()
