"""Idle reply prefill in a tight pool: does it cost the next turns anything when the KV pool is smaller than the
conversations in flight? (``python -m bench.idle_tight_pool``)

Workload (SmolLM2-135M-Instruct by default, CPU, greedy): ``--convs`` conversations at once, each with its own
system prompt (~300 tokens, so nothing is shared between them) and ``--turns`` user questions, started
``--stagger-s`` apart. Each turn's prompt is the whole conversation so far with the model's replies resent as
text; after a reply the client waits ``--think-s`` seconds. When a reply ends the client queues
``AsyncEngine.prefill_next_turn`` for it, as the embedded backend does (a no-op with the setting off). The engine
has a pool of ``--blocks`` blocks of 16 tokens (64 = 1,024 tokens: about two conversations), so blocks are
evicted all the time and running requests are preempted now and then.

Each pair runs the workload on two fresh engines, ``idle_reply_prefill`` on and off, the order alternating pair by
pair so a noisy spell of the machine falls on both. Per run: the mean client TTFT over all turns (seconds), the
wall time, the prompt tokens the clients' requests computed (``prefill_tokens`` less the idle prefill's), cached
tokens, evictions, preemptions, and the idle prefill's tokens, drops and yields. Every turn's greedy text is
compared between the two runs of a pair (batched == alone and cache on == cache off: they must be equal).

Prints a row per run, then one JSON line (last): ``ttft_on_over_off`` (the median over pairs of the two runs'
mean-TTFT ratio, lower is better), ``pairs_on_slower``, ``pairs``, ``preemptions_on`` / ``preemptions_off``
(summed over pairs), ``idle_tokens`` (summed) and ``tokens_equal`` (every pair).

The mean TTFT here is dominated by queueing behind other conversations' prefills, so it moves with the order in
which requests meet (a preemption recomputes a whole prompt): read the ratio over several pairs, not one run.

``--min-residency-s`` sets ``idle_prefill_min_residency_s`` (default: the engine's, 5 s; 0: the rule off).

Run: ``python -m bench.idle_tight_pool [--pairs 4] [--convs 6] [--blocks 64] [--think-s 1.0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

from bench.next_turn import timed_turn
from engine.api import EngineConfig, GenerationRequest, SamplingParams
from engine.async_engine import AsyncEngine
from engine.checkpoint import default_model_path

TOPICS = ("gardening", "astronomy", "cooking", "sailing", "chess", "baking", "cycling", "pottery")
QUESTIONS = (
    "What should a beginner learn first?",
    "What tools do I need?",
    "What is a common mistake?",
    "How do I practise?",
    "What is an advanced technique?",
    "Summarise our talk in one sentence.",
)


def system_prompt(i: int) -> str:
    """Conversation ``i``'s system prompt (~300 SmolLM2 tokens; distinct per ``i`` from its first sentence)."""
    topic = TOPICS[i % len(TOPICS)]
    sentence = (
        f"You are an expert assistant on {topic}, for client {i}. Answer in a few sentences, plainly, and say "
        f"when you are not sure. Keep to {topic} and its history, tools, techniques, safety and common mistakes. "
    )
    return sentence * 4


@dataclass
class RunResult:
    """One run of the workload: per-turn TTFT (s) and text keyed by (conversation, turn), and engine counters."""

    idle: bool
    wall_s: float = 0.0
    ttft_s: dict[tuple[int, int], float] = field(default_factory=dict)
    texts: dict[tuple[int, int], str] = field(default_factory=dict)
    cached: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def mean_ttft_s(self) -> float:
        """Mean client TTFT over every turn, seconds."""
        return statistics.mean(self.ttft_s.values())


async def conversation(engine: AsyncEngine, i: int, args: argparse.Namespace, result: RunResult) -> None:
    """Play conversation ``i`` on ``engine``, recording each turn's TTFT, text and cached tokens."""
    await asyncio.sleep(i * args.stagger_s)
    messages: list[dict] = [{"role": "system", "content": system_prompt(i)}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    background: list[asyncio.Task] = []
    try:
        for turn, question in enumerate(QUESTIONS[: args.turns]):
            messages.append({"role": "user", "content": question})
            result.ttft_s[(i, turn)], finished = await timed_turn(engine, messages, params)
            result.texts[(i, turn)] = finished.text
            result.cached += finished.usage.cached_tokens
            messages.append({"role": "assistant", "content": finished.text})
            turn_request = GenerationRequest(messages=list(messages))
            background.append(asyncio.get_running_loop().create_task(engine.prefill_next_turn(turn_request)))
            await asyncio.sleep(args.think_s)
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


async def run_workload(path: str, idle: bool, args: argparse.Namespace) -> RunResult:
    """One run on a fresh engine with ``idle_reply_prefill=idle``."""
    config = EngineConfig(
        num_blocks=args.blocks,
        idle_reply_prefill=idle,
        idle_prefill_min_residency_s=args.min_residency_s,
        num_threads=args.threads,
    )
    engine = await asyncio.to_thread(AsyncEngine.from_config, None, path, config)
    await engine.start()
    result = RunResult(idle=idle)
    try:
        warm_up = [{"role": "user", "content": "Say hi."}]
        async for _ in engine.generate(
            GenerationRequest(messages=warm_up, params=SamplingParams(max_tokens=2))
        ):
            pass
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(engine, i, args, result) for i in range(args.convs)))
        result.wall_s = time.perf_counter() - t0
        stats = engine.stats()
        result.counters = {
            "client_prefill_tokens": stats.prefill_tokens - stats.idle_prefill_tokens,
            "evictions": stats.evictions,
            "preemptions": stats.preemptions,
            "idle_tokens": stats.idle_prefill_tokens,
            "idle_dropped": stats.idle_prefills_dropped,
            "idle_yielded": stats.idle_prefills_yielded,
        }
    finally:
        await engine.shutdown()
    return result


def main() -> None:
    """Run the pairs and print a row per run, then the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a .gguf file or HF folder (default: SmolLM2)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs of runs (idle on, idle off)")
    parser.add_argument("--convs", type=int, default=6, help="conversations at once")
    parser.add_argument(
        "--turns", type=int, default=6, help=f"turns per conversation (at most {len(QUESTIONS)})"
    )
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the KV pool (16 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per reply")
    parser.add_argument(
        "--think-s", type=float, default=1.0, help="seconds between a reply and the next turn"
    )
    parser.add_argument("--stagger-s", type=float, default=0.3, help="seconds between conversations' starts")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    parser.add_argument(
        "--min-residency-s",
        type=float,
        default=EngineConfig.idle_prefill_min_residency_s,
        help="engine.idle_prefill_min_residency_s of the idle-on runs (0: no residency bound)",
    )
    args = parser.parse_args()
    args.turns = max(1, min(args.turns, len(QUESTIONS)))
    path = default_model_path() if args.model == "default" else args.model
    header = (
        f"{'pair':>4} {'idle':>5} {'mean TTFT s':>11} {'wall s':>7} {'prefill':>8} {'cached':>7} "
        f"{'evict':>6} {'preempt':>7} {'idle tok':>8} {'dropped':>7} {'yielded':>7}"
    )
    print(
        f"{args.convs} conversations x {args.turns} turns, pool {args.blocks} blocks, think {args.think_s} s, "
        f"replies <= {args.max_tokens} tokens, idle_prefill_min_residency_s {args.min_residency_s}"
    )
    print(header)
    ratios: list[float] = []
    equal = True
    totals = {"preemptions_on": 0, "preemptions_off": 0, "idle_tokens": 0}
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        runs = {idle: asyncio.run(run_workload(path, idle, args)) for idle in order}
        for idle in order:
            r = runs[idle]
            c = r.counters
            print(
                f"{pair:>4} {'on' if idle else 'off':>5} {r.mean_ttft_s:>11.3f} {r.wall_s:>7.1f} "
                f"{c['client_prefill_tokens']:>8} {r.cached:>7} {c['evictions']:>6} {c['preemptions']:>7} "
                f"{c['idle_tokens']:>8} {c['idle_dropped']:>7} {c['idle_yielded']:>7}",
                flush=True,
            )
        ratios.append(runs[True].mean_ttft_s / runs[False].mean_ttft_s)
        equal = equal and runs[True].texts == runs[False].texts
        totals["preemptions_on"] += runs[True].counters["preemptions"]
        totals["preemptions_off"] += runs[False].counters["preemptions"]
        totals["idle_tokens"] += runs[True].counters["idle_tokens"]
    print(
        json.dumps(
            {
                "ttft_on_over_off": round(statistics.median(ratios), 3),
                "pairs_on_slower": sum(1 for r in ratios if r > 1.0),
                "pairs": args.pairs,
                **totals,
                "tokens_equal": equal,
            }
        )
    )


if __name__ == "__main__":
    main()
