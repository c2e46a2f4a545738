"""Next-turn benchmark: the time to first token of a chat's next turn, whose prompt holds the previous reply, with
the engine's three ways of serving that reply.

Workload (SmolLM2-135M-Instruct by default, CPU, greedy): a system prompt and ``--turns`` user questions; each
turn's prompt is the whole conversation so far, the model's own replies resent as text (as every chat client
does), each reply up to ``--max-tokens`` tokens. After a reply the client "reads" for ``--think-s`` seconds before
sending the next turn (0 = at once). Arms, each on its own engine over the same weights, run one after another,
``--repeats`` times interleaved (each run starts with a warm-up request on another prompt):

- ``idle``: the default (``cache_generated_kv: false``, ``idle_reply_prefill: true``): the reply is prefilled as
  prompt while the engine is idle (``AsyncEngine.prefill_next_turn``, queued when the reply ends, as the
  embedded backend does);
- ``exact``: ``idle_reply_prefill: false``: the next turn computes the reply itself;
- ``generated``: ``cache_generated_kv: true`` (vLLM's behaviour): the reply's decode KV is cached as generated;
- ``cold``: prefix caching off: the reference every other arm's tokens are compared with.

Per arm: the mean TTFT of the turns after the first (ms; the median over the runs), their mean prompt and cached
tokens, and whether every turn's greedy text equals the cold arm's in every run (cache on == cache off). Prints a table, then one JSON line (last) with
``next_turn_ttft_ms`` per arm, ``cached_tokens`` per arm (the mean of the same turns, first run),
``idle_over_exact`` (TTFT ratio, lower is better) and ``tokens_equal_cold`` per arm.

Run: ``python -m bench.next_turn [--turns 6] [--think-s 1.0] [--max-tokens 96]``; ``--tiny`` plays 3 short turns
on the tests' tiny random checkpoint (a smoke run of the report's ``--quick``: it measures nothing about SmolLM2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.api import EngineConfig, Finished, GenerationRequest, SamplingParams, TextDelta
from engine.async_engine import AsyncEngine
from engine.checkpoint import default_model_path

SYSTEM = (
    "You are a concise assistant for a team that runs a prompt-prefix-caching gateway. Answer in a few "
    "sentences, plainly, and say when you are not sure. The team serves many tenants, keeps each tenant's cache "
    "apart, and measures time to first token and time per output token on every release."
)
QUESTIONS = (
    "What is a KV cache, in two sentences?",
    "Why does resending the whole conversation every turn not cost a full prefill?",
    "What is a block table?",
    "How would you evict cached blocks when memory runs out?",
    "What does time to first token measure?",
    "Give one risk of caching across tenants.",
    "What is chunked prefill for?",
    "Summarise our conversation in one sentence.",
)
ARMS: dict[str, dict] = {
    "idle": {},
    "exact": {"idle_reply_prefill": False},
    "generated": {"cache_generated_kv": True},
    "cold": {"enable_prefix_caching": False},
}


@dataclass
class ArmResult:
    """One arm's turns: TTFT seconds, prompt and cached tokens, and the generated ids, per turn."""

    ttft_s: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    idle_prefill_tokens: int = 0


async def timed_turn(
    engine: AsyncEngine, messages: list[dict], params: SamplingParams
) -> tuple[float, Finished]:
    """Send one chat turn (``messages`` as they are now) and read it to its end.

    Returns:
        (seconds from the send to the first text delta, or to the end when there was none; the ``Finished``).
    """
    t0 = time.perf_counter()
    first = None
    finished = None
    async for event in engine.generate(GenerationRequest(messages=list(messages), params=params)):
        if first is None and isinstance(event, TextDelta):
            first = time.perf_counter() - t0
        if isinstance(event, Finished):
            finished = event
    assert finished is not None
    return (first if first is not None else time.perf_counter() - t0), finished


async def run_arm(path: str, settings: dict, args: argparse.Namespace) -> ArmResult:
    """Load an engine with ``settings`` and play the conversation on it."""
    config = EngineConfig(num_threads=args.threads, **settings)
    engine = await asyncio.to_thread(AsyncEngine.from_config, None, path, config)
    await engine.start()
    result = ArmResult()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # warm-up (first-call costs of each shape path), on a prompt the conversation never shares
    warm_up = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hi."}]
    async for _ in engine.generate(GenerationRequest(messages=warm_up, params=SamplingParams(max_tokens=4))):
        pass
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    background: list[asyncio.Task] = []
    try:
        for question in QUESTIONS[: args.turns]:
            messages.append({"role": "user", "content": question})
            first, finished = await timed_turn(engine, messages, params)
            result.ttft_s.append(first)
            result.prompt.append(finished.usage.prompt_tokens)
            result.cached.append(finished.usage.cached_tokens)
            result.replies.append(finished.text)
            messages.append({"role": "assistant", "content": finished.text})
            # what the embedded backend does when a reply ends (a no-op where the arm turns it off)
            turn = GenerationRequest(messages=list(messages))
            background.append(asyncio.get_running_loop().create_task(engine.prefill_next_turn(turn)))
            await asyncio.sleep(args.think_s)
        result.idle_prefill_tokens = engine.stats().idle_prefill_tokens
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await engine.shutdown()
    return result


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_arms(path: str, args: argparse.Namespace) -> dict[str, list[ArmResult]]:
    """Every arm ``args.repeats`` times, interleaved (a noisy spell of the machine hits every arm alike)."""
    runs: dict[str, list[ArmResult]] = {name: [] for name in ARMS}
    for _ in range(args.repeats):
        for name, settings in ARMS.items():
            runs[name].append(asyncio.run(run_arm(path, settings, args)))
    return runs


def main() -> None:
    """Run every arm and print the table and the final JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a .gguf file or HF folder (default: SmolLM2)")
    parser.add_argument("--turns", type=int, default=6, help=f"turns (at most {len(QUESTIONS)})")
    parser.add_argument(
        "--think-s", type=float, default=1.0, help="seconds between a reply and the next turn"
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens per reply")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arm (the median is reported)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the tests' tiny random checkpoint, 3 short turns, one run (a smoke run)",
    )
    args = parser.parse_args()
    args.turns = max(2, min(args.turns, len(QUESTIONS)))
    if args.tiny:
        args.turns, args.max_tokens = min(args.turns, 3), min(args.max_tokens, 8)
        args.think_s, args.repeats = min(args.think_s, 0.2), 1
        with tempfile.TemporaryDirectory(prefix="prefixgate-next-turn-") as tmp:
            from tests.engine.checkpoints import make_tiny_hf_llama

            runs = run_arms(str(make_tiny_hf_llama(Path(tmp) / "tiny-hf")), args)
    else:
        runs = run_arms(default_model_path() if args.model == "default" else args.model, args)
    cold = runs["cold"][0].replies
    print(
        f"next turns 2..{args.turns}, think {args.think_s} s, replies <= {args.max_tokens} tokens, "
        f"median of {args.repeats} runs"
    )
    print(f"{'arm':<10} {'TTFT ms':>9} {'prompt':>8} {'cached':>8} {'idle pf tok':>12} {'== cold':>8}")
    summary: dict[str, dict] = {}
    for name, arm_runs in runs.items():
        ttft_ms = 1000 * statistics.median(mean(r.ttft_s[1:]) for r in arm_runs)
        r = arm_runs[0]
        equal = all(run.replies == cold for run in arm_runs)
        summary[name] = {"ttft_ms": round(ttft_ms, 2), "equal": equal, "cached": round(mean(r.cached[1:]), 1)}
        print(
            f"{name:<10} {ttft_ms:>9.1f} {mean(r.prompt[1:]):>8.1f} {mean(r.cached[1:]):>8.1f} "
            f"{r.idle_prefill_tokens:>12} {str(equal):>8}"
        )
    print(
        json.dumps(
            {
                "next_turn_ttft_ms": {name: s["ttft_ms"] for name, s in summary.items()},
                "cached_tokens": {name: s["cached"] for name, s in summary.items()},
                "idle_over_exact": round(summary["idle"]["ttft_ms"] / summary["exact"]["ttft_ms"], 3),
                "tokens_equal_cold": {name: s["equal"] for name, s in summary.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
