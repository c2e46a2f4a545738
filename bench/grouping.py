"""Grouping by prefix (issue 5): a burst of requests bringing the same NEW prefix, with in-flight sharing on and off.

Workload (SmolLM2-135M-Instruct by default, fp32, CPU): 16 requests submitted at once, each a 1,000-token prefix
nobody has computed yet plus its own 50-token suffix, 16 greedy tokens each (EOS ignored). Both runs use the same
engine settings, including a step budget (``max_num_batched_tokens``) that holds the whole burst, as a GPU-sized
engine would; only in-flight sharing differs. With it, the first request prefills the prefix and the others wait
for its blocks, then prefill only their suffixes; without it, every request prefills the prefix itself.

``makespan_*_s``: seconds from submitting the burst to the last request's last token. ``prefill_tokens_*``: prompt
tokens computed. A second pair of rows uses the default step budget (512 tokens), where chunked prefill already
admits the followers after the leader's first chunks, so the plain engine shares part of the prefix by itself.

Target (2-core CPU): makespan_on_s <= 0.35 x makespan_off_s. Run: ``python -m bench.grouping``; prints a table,
then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch

from engine.api import EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine


def burst_prompts(vocab: int, n: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    """``n`` prompts sharing a random ``prefix_len``-token prefix, each with its own random suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(suffix_len)] for _ in range(n)]


def run_burst(ck, config: EngineConfig, prompts: list[list[int]], new_tokens: int, sharing: bool) -> dict:
    eng = LLMEngine(ck.model, replace(config, enable_inflight_sharing=sharing), ck.model_id, ck.tokenizer)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.run_to_completion()
    makespan = time.perf_counter() - t0
    s = eng.stats()
    return {
        "makespan_s": makespan,
        "prefill_tokens": s.prefill_tokens,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "inflight_shared_tokens": s.inflight_shared_tokens,
        "steps": eng.num_steps,
        "outputs": [r.output_token_ids for r in reqs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, a HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--suffix", type=int, default=50)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument(
        "--no-default-budget", action="store_true", help="skip the rows with the 512-token budget"
    )
    args = ap.parse_args()
    ck = load_checkpoint(default_model_path() if args.model == "default" else args.model)
    n, prompt_len = args.requests, args.prefix + args.suffix
    prompts = burst_prompts(ck.config.vocab_size, n, args.prefix, args.suffix, seed=0)
    blocks = n * (-(-(prompt_len + args.new) // 16)) + 64
    big = EngineConfig(num_blocks=blocks, max_batch=n, max_num_batched_tokens=n * prompt_len)
    rows = {"whole-burst budget": big}
    if not args.no_default_budget:
        rows["default budget (512)"] = EngineConfig(num_blocks=blocks, max_batch=n)
    # warm-up on a different prefix (allocator, thread pool)
    run_burst(ck, big, burst_prompts(ck.config.vocab_size, 2, 64, 8, seed=1), 2, True)
    results = {}
    for name, cfg in rows.items():
        results[name] = {
            "on": run_burst(ck, cfg, prompts, args.new, True),
            "off": run_burst(ck, cfg, prompts, args.new, False),
        }
    print(
        f"model {ck.model_id}  threads {torch.get_num_threads()}  burst {n} x ({args.prefix} shared + "
        f"{args.suffix} own) tokens, {args.new} new tokens each"
    )
    print(
        f"{'config':<22}{'sharing':>8}{'prefill tok':>12}{'hit tok':>9}{'in-flight':>10}{'steps':>7}"
        f"{'makespan s':>12}{'on/off':>8}"
    )
    for name, pair in results.items():
        for mode in ("on", "off"):
            r = pair[mode]
            ratio = pair["on"]["makespan_s"] / pair["off"]["makespan_s"]
            print(
                f"{name:<22}{mode:>8}{r['prefill_tokens']:>12}{r['prefix_hit_tokens']:>9}"
                f"{r['inflight_shared_tokens']:>10}{r['steps']:>7}{r['makespan_s']:>12.2f}"
                f"{(f'{ratio:.3f}' if mode == 'on' else ''):>8}"
            )
        same = pair["on"]["outputs"] == pair["off"]["outputs"]
        print(f"{'':<22}outputs identical with sharing on and off: {same}")
    main_pair = results["whole-burst budget"]
    out = {
        "model": ck.model_id,
        "requests": n,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "new_tokens": args.new,
        "max_num_batched_tokens": big.max_num_batched_tokens,
        "prefill_tokens_on": main_pair["on"]["prefill_tokens"],
        "prefill_tokens_off": main_pair["off"]["prefill_tokens"],
        "inflight_shared_tokens_on": main_pair["on"]["inflight_shared_tokens"],
        "makespan_on_s": main_pair["on"]["makespan_s"],
        "makespan_off_s": main_pair["off"]["makespan_s"],
        "outputs_identical": main_pair["on"]["outputs"] == main_pair["off"]["outputs"],
    }
    out["makespan_ratio"] = out["makespan_on_s"] / out["makespan_off_s"]
    out["target_met"] = out["makespan_ratio"] <= 0.35
    if "default budget (512)" in results:
        d = results["default budget (512)"]
        out["default_budget"] = {
            "prefill_tokens_on": d["on"]["prefill_tokens"],
            "prefill_tokens_off": d["off"]["prefill_tokens"],
            "makespan_on_s": d["on"]["makespan_s"],
            "makespan_off_s": d["off"]["makespan_s"],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
