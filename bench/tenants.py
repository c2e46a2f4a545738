"""Tenant isolation benchmark: the prompt-cache timing side channel, and layered sharing's prefill savings.

Engine: ``engine.llm_engine.LLMEngine`` over SmolLM2-135M-Instruct (``--model default``) or any checkpoint
(``--model PATH``), fp32, CPU.

1. Side channel (Gu et al., "Auditing Prompt Caching in Language Model APIs", ICML 2025). For each of
   ``--pairs`` pairs: tenant A runs a fresh random prefix P (``--prefix-tokens`` random token ids: no pair
   shares a token prefix with another); then tenant B's TTFT is measured on P (``x``) and on a cold prefix C of
   the same length (``y``), in random order. With isolation (salt = tenant) ``x`` and ``y`` come from the same
   distribution: ``side_channel_p_value`` is a paired two-sided Wilcoxon signed-rank test of ``x - y``
   (scipy's when scipy is installed, else ours with its null distribution from 20,000 random sign flips,
   ``permutation_p_value`` below). Control, in the same pairs: A's own repeat of P, a hit, which is what B
   would get on P in one shared cache namespace; ``open_namespace_p_value`` (the same test of that repeat
   against ``y``) shows the test can see the channel at this sample size. A large isolated p-value is the goal; it is not a
   proof of indistinguishability, only the absence of a detectable difference at ``--pairs`` pairs.
1b. The same through the tiers below the block pool (``engine.kv_tiers``): an engine with only a disk tier, then
   one with only a Redis tier (``--redis-url``). After A's request every cached block is written down to the
   tier and dropped from the pool (``flush_tiers`` then ``reset_prefix_cache``: A's prefix now lives only in
   that tier), then B probes P and C as above (``side_channel_p_value_disk`` / ``_redis``), the pool is
   emptied again, and A repeats P: a tier hit, counted by the tier's own counter (``{tier}.hit_tokens``:
   ``a_tier_hit_tokens_*``, and the repeat's cached tokens). ``b_tier_hit_tokens_*`` (tier hits during B's
   probes) and ``b_cached_tokens_*`` must be 0. ``open_namespace_p_value_*``: A's tier-served repeat vs the
   cold prefix, the channel a shared namespace would open.
2. Layered sharing. N tenants (1, 16, 256) each send the public system prompt (``--public-tokens``) and a
   question of their own, in bursts of 16, under three policies: ``isolated`` (salt = tenant, vLLM's single
   ``cache_salt``), ``layered`` (the public prompt's full blocks under a shared salt, ``LayeredKeys``) and
   ``open`` (one namespace, no isolation). Public-prompt prefill tokens = the sum over requests of the
   public prompt's tokens not served by the prefix cache (``public length - min(cached, public length)``),
   including the partial last block every tenant recomputes (a block is cached only whole, and that one
   ends in the tenant's own tokens); ``public_full_block_prefill_ratio_256`` leaves that block out.
   The public prompt is sized to end on a block boundary (``--public-tokens`` rounded up by padding the system
   text with short words until its rendering is a whole number of blocks), as an operator who declares a
   public prompt can size it, so nothing public shares a block with a tenant's own tokens:
   ``shared_prefill_ratio_256`` = layered public-prompt prefill tokens with 256 tenants / with 1 on that
   prompt. The same prompt without the padding (``shared_prefill_ratio_256_unaligned``, layered only) shows
   the cost of a boundary inside a block: each further tenant recomputes ``public % block_size`` tokens. The
   baselines run up to ``--baseline-max`` tenants (16 by default: isolated at 256 prefills the whole
   prompt 256 times, which takes long on a CPU and tells nothing new). ``--tenant-counts`` changes N (the
   ``_256`` ratios then use the largest count, ``largest_tenant_count``); ``--tiny`` runs the tests' tiny
   random checkpoint (a smoke run). The JSON line also holds every side-channel TTFT (``ttft_samples_s``) and
   the layered-sharing rows (``layered_rows``).

Run: ``python -m bench.tenants`` (a few minutes on 2 idle cores; much longer on a loaded machine, where
``--parts side`` and ``--parts layered`` can run as two processes and ``--prefix-tokens`` /
``--public-tokens`` / ``--unaligned-tenants`` shrink the work). Prints tables, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from engine.api import EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig
from engine.llm_engine import LLMEngine

TENANT_COUNTS = (1, 16, 256)
TIER_SECRET = "bench-tenants-deployment-secret-0123456789"
FILLERS = (" Thanks.", " Be brief.", " Be kind.", " Yes.", " OK.", " Always.")
BURST = 16
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)


def permutation_p_value(differences: list[float], rounds: int = 20_000, seed: int = 0) -> float:
    """Two-sided Wilcoxon signed-rank test of paired differences, its null distribution by sign flips.

    Under the null each pair's difference is symmetric about 0, so its sign is as likely + as -. The
    statistic is the sum of signed ranks of ``|d|`` (Wilcoxon, "Individual Comparisons by Ranking Methods",
    1945; ranks resist the scheduling spikes of a shared machine, which a mean does not); the p-value is the
    share of ``rounds`` random sign assignments whose |statistic| reaches the observed one, with the +1
    correction of Phipson and Smyth ("Permutation P-values Should Never Be Zero", 2010). Zero differences
    are dropped, tied ``|d|`` get their mean rank.

    Raises:
        ValueError: no non-zero differences.
    """
    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        raise ValueError("no non-zero differences to test")
    order = sorted(range(len(nonzero)), key=lambda i: abs(nonzero[i]))
    ranks = [0.0] * len(nonzero)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(nonzero[order[j + 1]]) == abs(nonzero[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    observed = abs(sum(r if d > 0 else -r for r, d in zip(ranks, nonzero, strict=True)))
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        if abs(sum(r if rng.random() < 0.5 else -r for r in ranks)) >= observed - 1e-9:
            hits += 1
    return (hits + 1) / (rounds + 1)


def paired_p_value(x: list[float], y: list[float]) -> tuple[float, str]:
    """p-value of a paired two-sided test that ``x`` and ``y`` have the same distribution, and its name."""
    differences = [a - b for a, b in zip(x, y, strict=True)]
    try:
        from scipy.stats import wilcoxon
    except ImportError:
        return permutation_p_value(differences), "Wilcoxon signed-rank, sign-flip permutation"
    return float(wilcoxon(x, y).pvalue), "scipy wilcoxon signed-rank"


def ttft(eng: LLMEngine, prompt: list[int], salt: str) -> tuple[float, int]:
    """Seconds from submit to the first token of one request, and its cached prompt tokens."""
    t0 = time.perf_counter()
    req = eng.add_request(prompt, GREEDY_ONE, cache_salt=salt)
    while req.num_output_tokens == 0:
        eng.step()
    seconds = time.perf_counter() - t0
    eng.run_to_completion()
    return seconds, req.num_cached_tokens or 0


def side_channel(eng: LLMEngine, pairs: int, length: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)

    def fresh() -> list[int]:
        return [rng.randrange(64, vocab - 64) for _ in range(length)]

    x, y, own = [], [], []
    leaked = 0
    for _ in range(pairs):
        secret, cold = fresh(), fresh()
        ttft(eng, secret, "tenant-a")
        probes = [("x", secret), ("y", cold)]
        rng.shuffle(probes)
        for name, prompt in probes:
            seconds, cached = ttft(eng, prompt, "tenant-b")
            (x if name == "x" else y).append(seconds)
            leaked += cached
        own.append(ttft(eng, secret, "tenant-a")[0])  # what B would see in one shared namespace: a hit
    p_isolated, test = paired_p_value(x, y)
    p_open, _ = paired_p_value(own, y)
    return {
        "pairs": pairs,
        "prefix_tokens": length,
        "test": test,
        "b_on_a_prefix_ttft_s": statistics.median(x),
        "b_cold_ttft_s": statistics.median(y),
        "a_repeat_ttft_s": statistics.median(own),
        "side_channel_p_value": p_isolated,
        "open_namespace_p_value": p_open,
        "b_cached_tokens_on_a_prefix": leaked,
        "samples_s": {"b_on_a_prefix": x, "b_cold": y, "a_repeat": own},
    }


def warm_up_prompt(length: int, vocab: int) -> list[int]:
    """``length`` ordinary token ids shared by no measured prompt (the measured ones are random)."""
    return [64 + i % (vocab - 128) for i in range(length)]


def demote_to_tier(eng: LLMEngine) -> None:
    """Write every cached block of the pool down to the engine's tiers, then drop them all from the pool, so
    what was cached now lives only in the tiers."""
    if not eng.flush_tiers(write_cached=True):
        raise RuntimeError("the tier write-back did not drain")
    if not eng.kv.reset_prefix_cache():
        raise RuntimeError("blocks still referenced after the requests finished")


def tier_side_channel(eng: LLMEngine, tier: str, pairs: int, length: int, vocab: int, seed: int) -> dict:
    """Side channel when A's prefix lives only in ``tier`` (the engine's only tier); see the module docstring."""
    rng = random.Random(seed)
    hits = f"{tier}.hit_tokens"

    def fresh() -> list[int]:
        return [rng.randrange(64, vocab - 64) for _ in range(length)]

    def tier_hits() -> int:
        return eng.tier_stats().get(hits, 0)

    x, y, own = [], [], []
    b_cached = b_tier = a_cached = a_tier = 0
    for _ in range(pairs):
        eng.kv.reset_prefix_cache()
        secret, cold = fresh(), fresh()
        ttft(eng, secret, "tenant-a")
        demote_to_tier(eng)
        before = tier_hits()
        probes = [("x", secret), ("y", cold)]
        rng.shuffle(probes)
        for name, prompt in probes:
            seconds, cached = ttft(eng, prompt, "tenant-b")
            (x if name == "x" else y).append(seconds)
            b_cached += cached
        b_tier += tier_hits() - before
        eng.kv.reset_prefix_cache()  # B's blocks leave (unwritten); A's prefix is still only in the tier
        before = tier_hits()
        seconds, cached = ttft(eng, secret, "tenant-a")
        own.append(seconds)
        a_cached += cached
        a_tier += tier_hits() - before
    p_isolated, test = paired_p_value(x, y)
    p_open, _ = paired_p_value(own, y)
    return {
        "tier": tier,
        "test": test,
        "b_on_a_prefix_ttft_s": statistics.median(x),
        "b_cold_ttft_s": statistics.median(y),
        "a_repeat_ttft_s": statistics.median(own),
        "side_channel_p_value": p_isolated,
        "open_namespace_p_value": p_open,
        "b_cached_tokens": b_cached,
        "b_tier_hit_tokens": b_tier,
        "a_cached_tokens": a_cached,
        "a_tier_hit_tokens": a_tier,
        "a_usable_tokens": pairs * ((length - 1) // eng.kv.block_size * eng.kv.block_size),
    }


def tier_engine(
    ck, config: EngineConfig, tier: str, work: Path, redis_url: str, redis_prefix: str
) -> LLMEngine:
    """An engine whose only tier below the pool is ``tier`` (a fresh directory or Redis key prefix)."""
    from dataclasses import replace

    tiered = replace(
        config,
        tiers=(tier,),
        tier_disk=DiskTierConfig(str(work / tier), budget_bytes=8 << 30),
        tier_redis=RedisTierConfig(url=redis_url, prefix=redis_prefix, budget_bytes=2 << 30, timeout_s=5.0),
        deployment_secret=TIER_SECRET,
        tier_writeback_capacity=4096,
        tier_flush_on_close=False,
    )
    return LLMEngine(ck.model, tiered, ck.model_id, ck.tokenizer)


def public_prompt_tokens(tok, system: str) -> list[int]:
    """The rendered public part (the system message alone) of a layered request."""
    return tok.encode(
        tok.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False),
        add_special_tokens=False,
    )


def layered_prefill(
    make_engine, tok, public_tokens: int, policy: str, tenants: int, align: bool = False
) -> dict:
    """Public-prompt prefill tokens for ``tenants`` tenants under ``policy`` (``align``: the public prompt
    padded to end on a block boundary)."""
    eng = make_engine()
    block = eng.kv.block_size
    system = public_system_prompt(tok, public_tokens, block if align else None)
    public = public_prompt_tokens(tok, system)
    prompts = []
    for t in range(tenants):
        question = f"Tenant {t} asks: how many seats are left on train {1000 + t} on day {t % 28 + 1}?"
        prompt = tok.render_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        assert prompt[: len(public)] == public, "the system message must render as a prefix"
        prompts.append((t, prompt))
    before = eng.stats()
    requests = []
    for start in range(0, tenants, BURST):
        for t, prompt in prompts[start : start + BURST]:
            salt = "" if policy == "open" else f"tenant-{t}"
            shared = len(public) if policy == "layered" else 0
            eng.check_prompt(prompt, GREEDY_ONE)
            requests.append(
                eng.add_checked_request(
                    prompt, GREEDY_ONE, cache_salt=salt, shared_prefix_tokens=shared, shared_salt="public"
                )
            )
        eng.run_to_completion()
    after = eng.stats()
    full = len(public) // block * block
    return {
        "policy": policy,
        "aligned": align,
        "tenants": tenants,
        "public_tokens": len(public),
        "block_size": block,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "public_prefill_tokens": sum(
            len(public) - min(r.num_cached_tokens or 0, len(public)) for r in requests
        ),
        "public_full_block_prefill_tokens": sum(full - min(r.num_cached_tokens or 0, full) for r in requests),
        "inflight_shared_tokens": after.inflight_shared_tokens - before.inflight_shared_tokens,
        "preemptions": after.preemptions - before.preemptions,
    }


def public_system_prompt(tok, target_tokens: int, align_to: int | None = None) -> str:
    """A booking assistant's system prompt of at least ``target_tokens`` tokens; with ``align_to``, padded with
    short filler sentences until its rendered system message is a multiple of ``align_to`` tokens.

    Raises:
        RuntimeError: no padding within 64 fillers reaches a multiple (a tokenizer that merges them all).
    """
    sentences = [
        "You are the booking assistant of Northwind Rail.",
        "Answer questions about seats, tickets, refunds and timetables in one or two sentences.",
        "Quote prices in euros and never invent a connection that does not exist.",
        "Trains run from 05:30 to 23:45 on weekdays and from 07:00 to 22:30 on weekends.",
    ]
    text, i = "", 0
    while len(tok.encode(text)) < target_tokens:
        text += sentences[i % len(sentences)] + " "
        i += 1
    text = text.strip()
    if align_to is None:
        return text
    rng = random.Random(0)
    for _ in range(64):
        if len(public_prompt_tokens(tok, text)) % align_to == 0:
            return text
        text += rng.choice(FILLERS)
    raise RuntimeError(f"could not pad the public prompt to a multiple of {align_to} tokens")


def run_side_channels(args, ck, config: EngineConfig, make_engine, pool: bool = True) -> dict:
    """Part 1 (``pool``) and 1b (the tiers in ``args.tiers``) of the module docstring: print their table,
    return their JSON fields."""
    eng = make_engine()
    vocab = eng.input.vocab_size
    channel = None
    if pool:
        ttft(eng, warm_up_prompt(args.prefix_tokens, vocab), "warm-up")
        channel = side_channel(eng, args.pairs, args.prefix_tokens, vocab, args.seed)
    eng.close()

    tiered: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="prefixgate-bench-tenants-"))
    redis_prefix = f"pgbench-tenants-{uuid.uuid4().hex[:10]}"
    try:
        for tier in [t for t in args.tiers.split(",") if t]:
            teng = tier_engine(ck, config, tier, work, args.redis_url, redis_prefix)
            ttft(teng, warm_up_prompt(args.prefix_tokens, vocab), "warm-up")
            tiered[tier] = tier_side_channel(teng, tier, args.pairs, args.prefix_tokens, vocab, args.seed + 1)
            teng.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if "redis" in args.tiers:
            from bench.tiers import drop_deployment

            drop_deployment(args.redis_url, redis_prefix)

    test = (channel or next(iter(tiered.values()), {})).get("test", "")
    print(f"side channel ({args.pairs} pairs, {args.prefix_tokens}-token prefixes, {test})")
    print(f"{'where A prefix lives':<20} {'measurement':<40} {'median TTFT s':>14}")
    for where, r in ([("pool", channel)] if channel else []) + list(tiered.items()):
        for label, key in (
            ("B on a prefix A cached (isolated)", "b_on_a_prefix_ttft_s"),
            ("B on a cold prefix of the same length", "b_cold_ttft_s"),
            ("A's own repeat (hit)", "a_repeat_ttft_s"),
        ):
            print(f"{where:<20} {label:<40} {r[key]:>14.4f}")
    print(
        f"{'where':<8} {'p isolated':>11} {'p open':>9} {'B cached tok':>13} {'B tier hit tok':>15} "
        f"{'A tier hit tok':>15}"
    )
    if channel:
        print(
            f"{'pool':<8} {channel['side_channel_p_value']:>11.4f} {channel['open_namespace_p_value']:>9.2g} "
            f"{channel['b_cached_tokens_on_a_prefix']:>13} {'-':>15} {'-':>15}"
        )
    for tier, r in tiered.items():
        hit = f"{r['a_tier_hit_tokens']}/{r['a_usable_tokens']}"
        print(
            f"{tier:<8} {r['side_channel_p_value']:>11.4f} {r['open_namespace_p_value']:>9.2g} "
            f"{r['b_cached_tokens']:>13} {r['b_tier_hit_tokens']:>15} {hit:>15}"
        )
    result: dict = {"side_channel_test": test, "pairs": args.pairs, "prefix_tokens": args.prefix_tokens}
    if channel:
        result |= {
            "side_channel_p_value": round(channel["side_channel_p_value"], 6),
            "open_namespace_p_value": channel["open_namespace_p_value"],
            "b_cached_tokens_on_a_prefix": channel["b_cached_tokens_on_a_prefix"],
            "b_on_a_prefix_ttft_s": round(channel["b_on_a_prefix_ttft_s"], 6),
            "b_cold_ttft_s": round(channel["b_cold_ttft_s"], 6),
            "a_repeat_ttft_s": round(channel["a_repeat_ttft_s"], 6),
            "ttft_samples_s": {k: [round(v, 6) for v in vs] for k, vs in channel["samples_s"].items()},
        }
    for tier, r in tiered.items():
        result |= {
            f"side_channel_p_value_{tier}": round(r["side_channel_p_value"], 6),
            f"open_namespace_p_value_{tier}": r["open_namespace_p_value"],
            f"b_cached_tokens_{tier}": r["b_cached_tokens"],
            f"b_tier_hit_tokens_{tier}": r["b_tier_hit_tokens"],
            f"a_tier_hit_tokens_{tier}": r["a_tier_hit_tokens"],
            f"a_repeat_cached_tokens_{tier}": r["a_cached_tokens"],
            f"a_usable_tokens_{tier}": r["a_usable_tokens"],
            f"b_on_a_prefix_ttft_s_{tier}": round(r["b_on_a_prefix_ttft_s"], 6),
            f"b_cold_ttft_s_{tier}": round(r["b_cold_ttft_s"], 6),
            f"a_repeat_ttft_s_{tier}": round(r["a_repeat_ttft_s"], 6),
        }
    return result


def run_layered(args, tok, make_engine, counts: list[int]) -> dict:
    """Part 2 of the module docstring over ``counts`` tenants (must include 1 and 16): print its table, return
    its JSON fields (the ``_256`` ratio uses the largest count, named in ``largest_tenant_count``)."""
    rows = [
        layered_prefill(make_engine, tok, args.public_tokens, policy, n, align=True)
        for n in counts
        for policy in ("isolated", "layered", "open")
        if policy == "layered" or n <= args.baseline_max
    ]
    m = args.unaligned_tenants
    rows += [layered_prefill(make_engine, tok, args.public_tokens, "layered", k, align=False) for k in (1, m)]
    print()
    aligned = next(r for r in rows if r["aligned"])
    unaligned = next(r for r in rows if not r["aligned"])
    print(
        f"layered sharing (public prompt {aligned['public_tokens']} tokens block-aligned, "
        f"{unaligned['public_tokens']} unaligned; block {aligned['block_size']})"
    )
    print(
        f"{'tenants':>8} {'policy':>9} {'aligned':>8} {'public prefill tok':>19} {'of full blocks':>15} "
        f"{'total prefill tok':>18} {'inflight shared':>16} {'preemptions':>12}"
    )
    for r in rows:
        print(
            f"{r['tenants']:>8} {r['policy']:>9} {'yes' if r['aligned'] else 'no':>8} "
            f"{r['public_prefill_tokens']:>19} {r['public_full_block_prefill_tokens']:>15} "
            f"{r['prefill_tokens']:>18} {r['inflight_shared_tokens']:>16} {r['preemptions']:>12}"
        )
    by = {(r["policy"], r["tenants"], r["aligned"]): r["public_prefill_tokens"] for r in rows}
    full = {(r["policy"], r["tenants"], r["aligned"]): r["public_full_block_prefill_tokens"] for r in rows}
    n = max(counts)
    result = {
        "shared_prefill_ratio_256": by[("layered", n, True)] / by[("layered", 1, True)],
        "largest_tenant_count": n,
        "layered_rows": rows,
        f"shared_prefill_ratio_{m}_unaligned": by[("layered", m, False)] / by[("layered", 1, False)],
        f"public_full_block_prefill_ratio_{m}_unaligned": full[("layered", m, False)]
        / full[("layered", 1, False)],
        "public_tokens": aligned["public_tokens"],
        "public_tokens_unaligned": unaligned["public_tokens"],
    }
    for policy in ("isolated", "open"):
        if (policy, 16, True) in by:
            result[f"{policy}_prefill_ratio_16"] = by[(policy, 16, True)] / by[(policy, 1, True)]
    return result


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, a HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument(
        "--prefix-tokens", type=int, default=256, help="side channel: secret / cold prefix length"
    )
    ap.add_argument("--public-tokens", type=int, default=256, help="layered sharing: public system prompt")
    ap.add_argument(
        "--baseline-max",
        type=int,
        default=16,
        help="largest tenant count the isolated / open baselines run at (256 isolated prefills 256 prompts)",
    )
    ap.add_argument(
        "--tiers", default="disk,redis", help="tiers to measure the side channel through ('' none)"
    )
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument(
        "--parts",
        default="side,layered",
        help="what to run: 'side' (= 'pool' and 'tiers': the side channels), 'layered', or a list",
    )
    ap.add_argument(
        "--unaligned-tenants", type=int, default=256, help="tenant count of the unaligned layered run"
    )
    ap.add_argument("--num-blocks", type=int, default=2048, help="block pool size of every engine")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random checkpoint (a smoke run)")
    ap.add_argument(
        "--tenant-counts",
        default=",".join(map(str, TENANT_COUNTS)),
        help="layered sharing: tenant counts (must include 1 and 16)",
    )
    args = ap.parse_args()
    if args.pairs < 30:
        ap.error("--pairs must be >= 30")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        from tests.engine.engine_helpers import tiny_checkpoint

        ck = tiny_checkpoint()
    else:
        ck = load_checkpoint(default_model_path() if args.model == "default" else args.model)
    counts = sorted({int(n) for n in args.tenant_counts.split(",")})
    if 1 not in counts or 16 not in counts:
        ap.error("--tenant-counts must include 1 and 16 (the ratios' baselines)")
    tok = ck.tokenizer
    config = EngineConfig(num_blocks=args.num_blocks, max_batch=BURST, max_num_batched_tokens=2048)

    def make_engine() -> LLMEngine:
        return LLMEngine(ck.model, config, ck.model_id, tok)

    parts = set(args.parts.split(","))
    result: dict = {}
    if parts & {"side", "pool", "tiers"}:
        pool = bool(parts & {"side", "pool"})
        if not parts & {"side", "tiers"}:
            args.tiers = ""
        result |= run_side_channels(args, ck, config, make_engine, pool=pool)
    if "layered" in parts:
        result |= run_layered(args, tok, make_engine, counts)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
