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
2. Layered sharing. N tenants (1, 16, 256) each send the public system prompt (``--public-tokens``) and a
   question of their own, in bursts of 16, under three policies: ``isolated`` (salt = tenant, vLLM's single
   ``cache_salt``), ``layered`` (the public prompt's full blocks under a shared salt, ``LayeredKeys``) and
   ``open`` (one namespace, no isolation). Public-prompt prefill tokens = the sum over requests of the
   public prompt's tokens not served by the prefix cache (``public length - min(cached, public length)``),
   including the partial last block every tenant recomputes (a block is cached only whole, and that one
   ends in the tenant's own tokens); ``public_full_block_prefill_ratio_256`` leaves that block out.
   ``shared_prefill_ratio_256`` = layered public-prompt prefill tokens with 256 tenants / with 1. The
   baselines run up to ``--baseline-max`` tenants (16 by default: isolated at 256 prefills the whole
   prompt 256 times, which takes long on a CPU and tells nothing new). ``--tenant-counts`` changes N (the
   ``_256`` ratios then use the largest count, ``largest_tenant_count``); ``--tiny`` runs the tests' tiny
   random checkpoint (a smoke run). The JSON line also holds every side-channel TTFT (``ttft_samples_s``) and
   the layered-sharing rows (``layered_rows``).

Run: ``python -m bench.tenants`` (a few minutes on 2 cores). Prints tables, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.api import EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine

TENANT_COUNTS = (1, 16, 256)
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


def layered_prefill(make_engine, tok, public_tokens: int, policy: str, tenants: int) -> dict:
    """Public-prompt prefill tokens for ``tenants`` tenants under ``policy``."""
    eng = make_engine()
    block = eng.kv.block_size
    system = public_system_prompt(tok, public_tokens)
    public = tok.encode(
        tok.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False),
        add_special_tokens=False,
    )
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


def public_system_prompt(tok, target_tokens: int) -> str:
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
    return text.strip()


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
    config = EngineConfig(num_blocks=2048, max_batch=BURST, max_num_batched_tokens=2048)

    def make_engine() -> LLMEngine:
        return LLMEngine(ck.model, config, ck.model_id, tok)

    eng = make_engine()
    vocab = eng.input.vocab_size
    ttft(eng, list(range(100, 100 + args.prefix_tokens)), "warm-up")
    channel = side_channel(eng, args.pairs, args.prefix_tokens, vocab, args.seed)

    print(
        f"side channel ({channel['pairs']} pairs, {channel['prefix_tokens']}-token prefixes, {channel['test']})"
    )
    print(f"{'measurement':<44} {'median TTFT s':>14}")
    for label, key in (
        ("B on a prefix A cached (isolated)", "b_on_a_prefix_ttft_s"),
        ("B on a cold prefix of the same length", "b_cold_ttft_s"),
        ("A's own repeat (hit)", "a_repeat_ttft_s"),
    ):
        print(f"{label:<44} {channel[key]:>14.4f}")
    print(
        f"p-value isolated: {channel['side_channel_p_value']:.4f}   open namespace: "
        f"{channel['open_namespace_p_value']:.2g}   B's cached tokens on A's prefixes: "
        f"{channel['b_cached_tokens_on_a_prefix']}"
    )

    rows = [
        layered_prefill(make_engine, tok, args.public_tokens, policy, n)
        for n in counts
        for policy in ("isolated", "layered", "open")
        if policy == "layered" or n <= args.baseline_max
    ]
    print()
    print(f"layered sharing (public prompt {rows[0]['public_tokens']} tokens, block {rows[0]['block_size']})")
    print(
        f"{'tenants':>8} {'policy':>9} {'public prefill tok':>19} {'of full blocks':>15} "
        f"{'total prefill tok':>18} {'inflight shared':>16} {'preemptions':>12}"
    )
    for r in rows:
        print(
            f"{r['tenants']:>8} {r['policy']:>9} {r['public_prefill_tokens']:>19} "
            f"{r['public_full_block_prefill_tokens']:>15} {r['prefill_tokens']:>18} "
            f"{r['inflight_shared_tokens']:>16} {r['preemptions']:>12}"
        )
    top = max(counts)
    by = {(r["policy"], r["tenants"]): r["public_prefill_tokens"] for r in rows}
    full = {(r["policy"], r["tenants"]): r["public_full_block_prefill_tokens"] for r in rows}
    result = {
        "side_channel_p_value": round(channel["side_channel_p_value"], 6),
        "open_namespace_p_value": channel["open_namespace_p_value"],
        "side_channel_test": channel["test"],
        "pairs": channel["pairs"],
        "b_cached_tokens_on_a_prefix": channel["b_cached_tokens_on_a_prefix"],
        "b_on_a_prefix_ttft_s": round(channel["b_on_a_prefix_ttft_s"], 6),
        "b_cold_ttft_s": round(channel["b_cold_ttft_s"], 6),
        "a_repeat_ttft_s": round(channel["a_repeat_ttft_s"], 6),
        "shared_prefill_ratio_256": by[("layered", top)] / by[("layered", 1)],
        "public_full_block_prefill_ratio_256": full[("layered", top)] / full[("layered", 1)],
        "largest_tenant_count": top,
        "isolated_prefill_ratio_16": by[("isolated", 16)] / by[("isolated", 1)],
        "open_prefill_ratio_16": by[("open", 16)] / by[("open", 1)],
        "public_tokens": rows[0]["public_tokens"],
        "ttft_samples_s": {k: [round(v, 6) for v in vs] for k, vs in channel["samples_s"].items()},
        "layered_rows": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
