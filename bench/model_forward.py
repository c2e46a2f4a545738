"""One forward of our paged ``LlamaModel`` vs transformers on the same weights (SmolLM2-135M, fp32, CPU).

Measures (best of ``--repeats`` timed calls, seconds): a 1,000-token prefill (logits of the last position only, as both
engines need), one decode step of 1 sequence and of 8 sequences, each at ``--context`` tokens of context.
transformers runs ``LlamaForCausalLM`` loaded from the same GGUF with its own KV cache (``logits_to_keep=1``
on prefill). Run: ``python -m bench.model_forward``. Prints a table, then one JSON line.

``--step-profile`` instead profiles whole engine decode steps (``LLMEngine``, weights ``--weights``) of 1 and
of 8 sequences at ``--context`` tokens (8 private contexts, and 8 sharing one system prompt): median
milliseconds per step of each phase (schedule + flatten the input, forward + sample, finish) and the aten ops
one step dispatches (``torch.profiler``), then one JSON line.

``--glue-prefill-ab`` instead times a whole prompt's prefill (``--ab-lengths``, ``--ab-chunk``, ``--kv-dtype``,
``--weights``, at each of ``--ab-threads``) with torch's layer glue and with the native glue kernel
(``engine.native_glue``), interleaved in one run: medians and bests of ``--repeats`` rounds, then one JSON line.

``--prefill-ab`` instead times a whole prompt's prefill (``--ab-lengths`` tokens, cut into the engine's
``--ab-chunk``-token chunks, over a ``--kv-dtype`` cache, weights ``--weights``) with torch's chunked prefill
attention and with the native prefill kernel (``engine.prefill_kernel: native``; built for ``--isa``, default
this CPU's best), interleaved in one run, at each of ``--ab-threads`` thread counts: wall seconds per prefill and
the part inside attention (``paged_attention``), best of ``--repeats`` rounds; a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.hf_reference import load_transformers
from engine.attention import AttentionMetadata
from engine.checkpoint import default_model_path, load_checkpoint
from engine.model import allocate_kv_cache

BLOCK = 16


CLOCK = time.perf_counter


def best_time(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up (seconds): the least disturbed by other processes."""
    fn()
    times = []
    for _ in range(repeats):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    return min(times)


def ours(ck, prompt_len: int, context: int, repeats: int) -> dict[str, float]:
    model, cfg = ck.model, ck.config
    blocks_per_seq = -(-(max(prompt_len, context) + 64) // BLOCK)
    kv = allocate_kv_cache(cfg, blocks_per_seq * 8, BLOCK, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, cfg.vocab_size, (prompt_len,), generator=g)

    def meta_for(lens_before: list[int], qlens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        slots, pos, qsl, tables = [], [], [0], []
        for i, (before, q) in enumerate(zip(lens_before, qlens, strict=True)):
            base = i * blocks_per_seq
            for p in range(before, before + q):
                slots.append((base + p // BLOCK) * BLOCK + p % BLOCK)
                pos.append(p)
            qsl.append(qsl[-1] + q)
            tables.append(list(range(base, base + blocks_per_seq)))
        lens = [b + q for b, q in zip(lens_before, qlens, strict=True)]
        return AttentionMetadata(torch.tensor(slots), qsl, lens, torch.tensor(tables), BLOCK), torch.tensor(
            pos
        )

    pm, ppos = meta_for([0], [prompt_len])

    def prefill():
        h = model(ids, ppos, kv, pm)
        model.compute_logits(h[-1:])

    out = {"prefill_s": best_time(prefill, repeats)}
    for b in (1, 8):
        dm, dpos = meta_for([context] * b, [1] * b)
        tok = ids[:b]

        def decode(dm=dm, dpos=dpos, tok=tok):
            model.compute_logits(model(tok, dpos, kv, dm))

        out[f"decode_b{b}_s"] = best_time(decode, repeats * 3)
    return out


def transformers_times(
    path: str, vocab: int, prompt_len: int, context: int, repeats: int
) -> dict[str, float]:
    hf, key = load_transformers(path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab, (1, prompt_len), generator=g)
    out = {}
    with torch.inference_mode():
        out["prefill_s"] = best_time(lambda: hf(ids, use_cache=True, logits_to_keep=1), repeats)
        for b in (1, 8):
            ctx = torch.randint(100, vocab, (b, context), generator=g)
            res = hf(ctx, use_cache=True, logits_to_keep=1)
            cache = res[key]
            tok = ctx[:, -1:]

            def decode(cache=cache, tok=tok, b=b):
                hf(tok, use_cache=True, **{key: cache})
                cache.crop(-1)  # drop the token just added: the context stays fixed between repeats

            out[f"decode_b{b}_s"] = best_time(decode, repeats * 3)
    return out


def step_profile(
    ck, context: int, steps: int, kv_dtype: str = "float32", top_ops: int = 0
) -> dict[str, dict[str, float]]:
    """Per-phase milliseconds (median over ``steps``, ``CLOCK``) and aten ops per engine decode step, for
    ``b1``, ``b8`` (private contexts) and ``b8_shared`` (one shared ~``context``-token prefix), over a KV cache
    of ``kv_dtype``; ``top_ops > 0`` also prints, per case, the ``top_ops`` aten ops of most self CPU time
    per step (``torch.profiler``, milliseconds per step and calls per step)."""
    from engine.api import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    g = torch.Generator().manual_seed(1)
    shared = torch.randint(100, ck.config.vocab_size, (context,), generator=g).tolist()
    out: dict[str, dict[str, float]] = {}
    for name, n, share in (("b1", 1, True), ("b8", 8, False), ("b8_shared", 8, True)):
        eng = LLMEngine(
            ck.model,
            EngineConfig(num_blocks=80 * n + 16, max_num_batched_tokens=2048, kv_dtype=kv_dtype),
            ck.model_id,
        )
        for _ in range(n):
            own = torch.randint(100, ck.config.vocab_size, (context if not share else 40,), generator=g)
            prompt = (shared if share else []) + own.tolist()
            eng.add_request(
                prompt, SamplingParams(max_tokens=steps * 2 + 8, temperature=0.0, ignore_eos=True)
            )
        while eng.num_steps < 2 or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.requests.values()
        ):
            eng.step()
        eng.step()
        phases: dict[str, list[float]] = {"schedule_ms": [], "forward_sample_ms": [], "finish_ms": []}
        for _ in range(steps):
            t0 = CLOCK()
            plan = eng.schedule_step()
            t1 = CLOCK()
            res = eng.run_step(plan)
            t2 = CLOCK()
            eng.finish_step(plan, res)
            t3 = CLOCK()
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[k].append(dt * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                eng.step()
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        ops = sum(e.count for e in events) / 2
        if top_ops:
            print(f"{name}: top aten ops per step (self CPU ms, calls)")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top_ops]:
                print(f"  {e.key:<52}{e.self_cpu_time_total / 2e3:>9.3f}{e.count / 2:>8.0f}")
        row = {k: statistics.median(v) for k, v in phases.items()}
        row["step_ms"] = sum(row.values())
        row["aten_ops_per_step"] = ops
        out[name] = row
    return out


def prefill_ab(
    ck, lengths: list[int], threads: list[int], chunk: int, kv_dtype: str, repeats: int, isa: str
) -> list[dict[str, float]]:
    """Prefill seconds (wall) and the attention part of each, torch's chunked prefill against the native kernel
    (module docstring): one row per (length, threads), best of ``repeats`` interleaved rounds."""
    import engine.model as model_module
    from engine.native_decode import NativeDecodeKernel

    model, cfg = ck.model, ck.config
    kernel = NativeDecodeKernel.build(group=cfg.num_heads // cfg.num_kv_heads, head_dim=cfg.head_dim, isa=isa)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kv_dtype]
    attn = [0.0]
    inner = model_module.paged_attention

    def timed(*a, **k):
        t = CLOCK()
        try:
            return inner(*a, **k)
        finally:
            attn[0] += CLOCK() - t

    model_module.paged_attention = timed
    rows = []
    try:
        for n in lengths:
            nb = -(-n // BLOCK)
            kv = allocate_kv_cache(cfg, nb, BLOCK, dtype, "cpu")
            ids = torch.randint(100, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            table = torch.arange(nb).view(1, nb)

            def prefill(k, n=n, table=table, ids=ids, kv=kv):
                for s in range(0, n, chunk):
                    e = min(n, s + chunk)
                    meta = AttentionMetadata(
                        torch.arange(s, e), [0, e - s], [e], table, BLOCK, prompt_lens=[n], prefill_kernel=k
                    )
                    model(ids[s:e], torch.arange(s, e), kv, meta)

            for t in threads:
                torch.set_num_threads(t)
                best = {"torch": (float("inf"), 0.0), "native": (float("inf"), 0.0)}
                for _ in range(repeats):
                    for name, k in (("torch", None), ("native", kernel)):
                        attn[0] = 0.0
                        t0 = CLOCK()
                        prefill(k)
                        total = CLOCK() - t0
                        if total < best[name][0]:
                            best[name] = (total, attn[0])
                rows.append(
                    {
                        "tokens": n,
                        "threads": t,
                        "torch_s": best["torch"][0],
                        "torch_attention_s": best["torch"][1],
                        "native_s": best["native"][0],
                        "native_attention_s": best["native"][1],
                    }
                )
                print(
                    f"{n:>7}{t:>8}{best['torch'][0]:>10.2f}{best['torch'][1]:>12.2f}"
                    f"{best['native'][0]:>10.2f}{best['native'][1]:>12.2f}"
                    f"{best['torch'][1] / best['native'][1]:>16.2f}",
                    flush=True,
                )
    finally:
        model_module.paged_attention = inner
    return rows


def glue_prefill_ab(
    ck, lengths: list[int], threads: list[int], chunk: int, kv_dtype: str, repeats: int
) -> list[dict[str, float]]:
    """Whole-prefill seconds (``CLOCK``) with torch's layer glue against the native glue kernel
    (``engine.native_glue``), interleaved, the order alternating every round; the prefill attention kernel as
    ``engine.prefill_kernel: auto`` picks it. One row per (length, threads): the median and the
    best of ``repeats`` rounds of each, and ``glue_over_torch`` of the medians."""
    from engine.attention_kernels import resolve_prefill_kernel
    from engine.native_glue import resolve_glue_kernel

    model, cfg = ck.model, ck.config
    glue = resolve_glue_kernel("native", model.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kv_dtype]
    pk = resolve_prefill_kernel("auto", model.device, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    rows = []
    for n in lengths:
        nb = -(-n // BLOCK)
        kv = allocate_kv_cache(cfg, nb, BLOCK, dtype, "cpu")
        ids = torch.randint(100, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        table = torch.arange(nb).view(1, nb)

        def prefill(g, n=n, table=table, ids=ids, kv=kv):
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                meta = AttentionMetadata(
                    torch.arange(s, e), [0, e - s], [e], table, BLOCK, prompt_lens=[n], prefill_kernel=pk
                )
                model(ids[s:e], torch.arange(s, e), kv, meta, glue=g)

        for t in threads:
            torch.set_num_threads(t)
            times: dict[str, list[float]] = {"torch": [], "glue": []}
            order = [("torch", None), ("glue", glue)]
            prefill(None)
            for r in range(repeats):
                for name, g in order if r % 2 == 0 else order[::-1]:
                    t0 = CLOCK()
                    prefill(g)
                    times[name].append(CLOCK() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {
                "tokens": n,
                "threads": t,
                "torch_s": med["torch"],
                "glue_s": med["glue"],
                "torch_best_s": min(times["torch"]),
                "glue_best_s": min(times["glue"]),
                "glue_over_torch": med["glue"] / med["torch"],
            }
            rows.append(row)
            print(
                "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=1000, help="prefill length in tokens")
    ap.add_argument("--context", type=int, default=256, help="context length of decode steps in tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--weights", default="float32", help="engine.weights (float32 reference by default)")
    ap.add_argument("--step-profile", action="store_true", help="profile engine decode steps (docstring)")
    ap.add_argument(
        "--kv-dtype", default="float32", help="--step-profile: engine.kv_dtype float32 | bfloat16"
    )
    ap.add_argument("--top-ops", type=int, default=0, help="--step-profile: print this many top aten ops")
    ap.add_argument("--prefill-ab", action="store_true", help="torch against native prefill (docstring)")
    ap.add_argument(
        "--glue-prefill-ab",
        action="store_true",
        help="whole prefill, torch's layer glue against the native glue kernel, interleaved (docstring)",
    )
    ap.add_argument("--ab-lengths", default="1024,4096", help="--prefill-ab: prompt lengths, comma-separated")
    ap.add_argument("--ab-threads", default="1,2", help="--prefill-ab: thread counts, comma-separated")
    ap.add_argument("--ab-chunk", type=int, default=512, help="--prefill-ab: prefill chunk (token budget)")
    ap.add_argument(
        "--isa", default=None, help="--prefill-ab: the kernel's build, avx512 | avx2 (default: best)"
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one torch thread, timed by this thread's CPU time: immune to other processes on a shared machine",
    )
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)
    torch.manual_seed(0)
    path = default_model_path() if args.model == "default" else args.model
    ck = load_checkpoint(path, weights=args.weights)
    if args.glue_prefill_ab:
        import os

        lengths = [int(x) for x in args.ab_lengths.split(",")]
        threads = [int(x) for x in args.ab_threads.split(",")]
        load = os.getloadavg()[0]
        with torch.inference_mode():
            rows = glue_prefill_ab(ck, lengths, threads, args.ab_chunk, args.kv_dtype, args.repeats)
        info = {"weights": args.weights, "kv_dtype": args.kv_dtype, "chunk": args.ab_chunk}
        info |= {
            "clock": "thread" if args.cpu_time else "wall",
            "load1_start": load,
            "load1_end": os.getloadavg()[0],
        }
        print(json.dumps({"glue_prefill_ab": rows, **info}))
        return
    if args.prefill_ab:
        from engine.native_decode import _cpu_ok

        isa = args.isa or ("avx512" if _cpu_ok("avx512")[0] else "avx2")
        lengths = [int(x) for x in args.ab_lengths.split(",")]
        threads = [int(x) for x in args.ab_threads.split(",")]
        print(
            f"weights={ck.model.weight_formats}  kv_dtype={args.kv_dtype}  chunk={args.ab_chunk}  isa={isa}"
        )
        print(f"{'tokens':>7}{'threads':>8}{'torch s':>10}{'attention':>12}{'native s':>10}{'attention':>12}"
              f"{'attn speedup':>16}")  # fmt: skip
        rows = prefill_ab(ck, lengths, threads, args.ab_chunk, args.kv_dtype, args.repeats, isa)
        info = {"weights": args.weights, "kv_dtype": args.kv_dtype, "chunk": args.ab_chunk, "isa": isa}
        print(json.dumps({"prefill_ab": rows, **info}))
        return
    if args.step_profile:
        prof = step_profile(ck, args.context, args.repeats * 4, args.kv_dtype, args.top_ops)
        print(f"threads={torch.get_num_threads()}  weights={ck.model.weight_formats}  context={args.context}")
        print(f"{'step':<12}" + "".join(f"{k:>20}" for k in next(iter(prof.values()))))
        for name, row in prof.items():
            print(f"{name:<12}" + "".join(f"{v:>20.2f}" for v in row.values()))
        print(
            json.dumps(
                {
                    "step_profile": prof,
                    "weights": args.weights,
                    "kv_dtype": args.kv_dtype,
                    "context": args.context,
                    "threads": torch.get_num_threads(),
                }
            )
        )
        return
    with torch.inference_mode():
        mine = ours(ck, args.prompt, args.context, args.repeats)
    ref = (
        {}
        if args.no_hf
        else transformers_times(path, ck.config.vocab_size, args.prompt, args.context, args.repeats)
    )
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"threads={torch.get_num_threads()}  clock={clock}  prompt={args.prompt}  context={args.context}")
    print(f"{'step':<22}{'ours (s)':>12}{'transformers (s)':>18}{'speedup':>10}")
    for k in mine:
        r = ref.get(k)
        print(
            f"{k:<22}{mine[k]:>12.4f}{(r if r else float('nan')):>18.4f}{(r / mine[k] if r else float('nan')):>10.2f}"
        )
    tps = {f"tps_b{b}": b / mine[f"decode_b{b}_s"] for b in (1, 8)}
    print(
        f"decode tokens/s: b1 {tps['tps_b1']:.1f}, b8 {tps['tps_b8']:.1f} (x{tps['tps_b8'] / tps['tps_b1']:.2f})"
    )
    print(
        json.dumps(
            {
                "ours": mine,
                "transformers": ref,
                **tps,
                "prompt": args.prompt,
                "context": args.context,
                "threads": torch.get_num_threads(),
                "clock": "thread" if args.cpu_time else "wall",
            }
        )
    )


if __name__ == "__main__":
    main()
