"""Tier benchmark: TTFT of a prompt whose prefix is served from RAM, disk, Redis, or recomputed; restart hits.

Workload (SmolLM2-135M-Instruct by default, fp32, CPU; ``--tiny`` for the tests' random checkpoint): for a
1,000- and a 4,000-token prefix (block-aligned, random ordinary tokens) followed by a 16-token question,
the seconds from ``add_request`` to the first token of:

- ``recompute``: a fresh engine without tiers (the whole prompt is prefilled);
- ``ram_off`` / ``ram_on``: the prefix cached in the pool by an earlier request, engine without / with
  a disk tier (``ram_hit_overhead = ram_on / ram_off``: what the tiers cost the hot path), measured
  ``--ram-rounds`` times each, interleaved, so load from other processes hits both alike;
- ``disk`` / ``redis``: a *new* engine (a restart) on the tier the first engine wrote its cached blocks to
  at shutdown, with only that tier: the prefix is read, checked and loaded into the pool, then the
  question is prefilled.

``disk_over_recompute`` / ``redis_over_recompute`` are the larger of the two prefix sizes' ratios (the
worse case). ``restart_hit_share``: 20 prefixes of 512 tokens served by one engine (disk + Redis), the
engine closed, a new one started on the same disk directory and Redis prefix, and the same 20 prefixes
with new questions sent again: prompt tokens served from a cache over prefix tokens (``--restart-prefixes``
changes the 20).

Targets (issue 13): disk <= 0.3x recompute, Redis <= 0.4x, RAM hit unchanged by tiers, restart >= 95%.
Every TTFT is the median of its runs (``--repeats`` cold prefills and restarts, ``--ram-rounds`` RAM
hits). Run: ``python -m bench.tiers``. Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from engine.api import EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig
from engine.llm_engine import LLMEngine

QUESTION_TOKENS = 16
SECRET = "bench-tiers-deployment-secret-0123456789"
GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def ttft(eng: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first token, and the prompt tokens served from a cache."""
    t0 = time.perf_counter()
    req = eng.add_request(prompt, GREEDY_1)
    while not req.output_token_ids:
        eng.step()
    seconds = time.perf_counter() - t0
    eng.run_to_completion()
    return seconds, req.num_cached_tokens or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random checkpoint (a smoke run)")
    ap.add_argument("--sizes", default="1000,4000", help="prefix lengths in tokens")
    ap.add_argument("--repeats", type=int, default=1, help="cold prefills and restarts per prefix size")
    ap.add_argument("--ram-rounds", type=int, default=5, help="RAM-hit measurements per engine and repeat")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--restart-prefixes", type=int, default=20, help="prefixes of the restart_hit_share run")
    args = ap.parse_args()

    if args.tiny:
        from tests.engine.engine_helpers import tiny_checkpoint

        ckpt = tiny_checkpoint(max_position_embeddings=8192)
    else:
        ckpt = load_checkpoint(args.model or default_model_path())
    vocab = ckpt.config.vocab_size
    sizes = [int(s) for s in args.sizes.split(",")]
    bs = 16
    work = Path(tempfile.mkdtemp(prefix="prefixgate-bench-tiers-"))
    prefix_key = f"pgbench-{uuid.uuid4().hex[:10]}"
    num_blocks = max(sizes) // bs * 2 + 64

    def engine(tiers: tuple[str, ...], name: str) -> LLMEngine:
        cfg = EngineConfig(
            block_size=bs,
            num_blocks=num_blocks,
            max_num_batched_tokens=8192,
            max_model_len=max(sizes) + 64,
            device="cpu",
            tiers=tiers,
            tier_disk=DiskTierConfig(str(work / name), budget_bytes=8 << 30),
            tier_redis=RedisTierConfig(
                url=args.redis_url, prefix=f"{prefix_key}-{name}", budget_bytes=4 << 30
            ),
            deployment_secret=SECRET if tiers else None,
            tier_writeback_capacity=4096,
        )
        return LLMEngine(ckpt.model, cfg, ckpt.model_id, None)

    rows: list[tuple[int, str, float, int]] = []
    results: dict[str, float] = {}
    try:
        for n in sizes:
            timings: dict[str, list[float]] = {
                k: [] for k in ("recompute", "ram_off", "ram_on", "disk", "redis")
            }
            cached: dict[str, int] = {}
            for rep in range(args.repeats):
                prefix = tokens(n, 1000 * n + rep, vocab)
                q = [tokens(QUESTION_TOKENS, 7 * rep + k, vocab) for k in range(3 + args.ram_rounds)]
                off = engine((), f"off-{n}-{rep}")
                t, cached["recompute"] = ttft(off, prefix + q[0])
                timings["recompute"].append(t)
                on = engine(("disk",), f"disk-{n}-{rep}")
                ttft(on, prefix + q[0])
                for r in range(args.ram_rounds):  # RAM hits, tiers off and on, interleaved (shared machine)
                    pair = [("ram_off", off), ("ram_on", on)]
                    for key, eng in pair if r % 2 == 0 else reversed(pair):
                        t, cached[key] = ttft(eng, prefix + q[3 + r])
                        timings[key].append(t)
                off.close()
                on.close()  # writes its cached blocks down
                for tier in ("disk", "redis"):
                    name = f"{tier}-{n}-{rep}"
                    if tier == "redis":
                        first = engine((tier,), name)
                        ttft(first, prefix + q[0])
                        first.close()  # writes its cached blocks down
                    second = engine((tier,), name)  # a restart on the same tier
                    t, cached[tier] = ttft(second, prefix + q[2])
                    timings[tier].append(t)
                    second.close()
                    drop_deployment(args.redis_url, f"{prefix_key}-{name}")
                    shutil.rmtree(work / name, ignore_errors=True)
                print(
                    f"prefix {n}, run {rep + 1}: "
                    + ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in timings.items()),
                    file=sys.stderr,
                    flush=True,
                )
            for k, v in timings.items():
                med = statistics.median(v)
                rows.append((n, k, med, cached[k]))
                results[f"{k}_ttft_s_{n}"] = round(med, 4)
            rec = statistics.median(timings["recompute"])
            results[f"disk_over_recompute_{n}"] = round(statistics.median(timings["disk"]) / rec, 4)
            results[f"redis_over_recompute_{n}"] = round(statistics.median(timings["redis"]) / rec, 4)
            results[f"ram_hit_overhead_{n}"] = round(
                statistics.median(timings["ram_on"]) / statistics.median(timings["ram_off"]), 4
            )
        results["disk_over_recompute"] = max(results[f"disk_over_recompute_{n}"] for n in sizes)
        results["redis_over_recompute"] = max(results[f"redis_over_recompute_{n}"] for n in sizes)
        results["ram_hit_overhead"] = max(results[f"ram_hit_overhead_{n}"] for n in sizes)
        results["restart_hit_share"] = restart_hit_share(
            engine, vocab, num_prefixes=args.restart_prefixes, prefix_tokens=min(512, max(sizes))
        )
    finally:
        drop_deployment(args.redis_url, f"{prefix_key}-*")
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'prefix':>7} {'served from':<12} {'TTFT s':>9} {'cached tokens':>14}")
    for n, k, med, c in rows:
        print(f"{n:>7} {k:<12} {med:>9.4f} {c:>14}")
    for k in ("disk_over_recompute", "redis_over_recompute", "ram_hit_overhead", "restart_hit_share"):
        print(f"{k}: {results[k]}")
    print(json.dumps(results))


def drop_deployment(url: str, prefix: str) -> None:
    """Delete every Redis key under ``prefix`` (a glob)."""
    client = redis.Redis.from_url(url)
    for k in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(k)
    client.close()


def restart_hit_share(engine, vocab: int, num_prefixes: int = 20, prefix_tokens: int = 512) -> float:
    """Share of prefix tokens served from a cache when 20 prefixes come back after a restart."""
    prefixes = [tokens(prefix_tokens, 50_000 + i, vocab) for i in range(num_prefixes)]
    first = engine(("disk", "redis"), "restart")
    for i, p in enumerate(prefixes):
        ttft(first, p + tokens(QUESTION_TOKENS, 60_000 + i, vocab))
    first.close()
    second = engine(("disk", "redis"), "restart")
    hit = sum(ttft(second, p + tokens(QUESTION_TOKENS, 70_000 + i, vocab))[1] for i, p in enumerate(prefixes))
    second.close()
    return round(hit / (num_prefixes * prefix_tokens), 4)


if __name__ == "__main__":
    main()
