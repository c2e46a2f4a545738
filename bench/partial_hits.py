"""Token-granular prefix hits on vs off, in process, on the W4 and W2 shapes of ``bench.peers`` (issue 12).

Two engines on the same loaded checkpoint (the default SmolLM2 GGUF unless ``--model``), configured as
``bench.peers`` configures prefixgate, differing only in ``enable_partial_prefix_hits``. Every request goes to one
engine and then the same request to the other (the order alternates), so load from other processes on this shared
machine falls on both:

- W4: four ~1,000-token system prompts in turn, each with a question that differs from that prompt's previous
  turn only in its last tokens (``"... (turn N)"``), ``max_tokens=1``; TTFT of the turns after the first round.
- W2: a fresh system prompt with a question (cold, W1), then the same system prompt with two other questions
  (warm); ``cached_over_cold`` = median warm TTFT / median cold TTFT.

TTFT is seconds from ``add_request`` to the first generated token (``bench.engine.ttft``). Prints a table, then
one JSON line. Run: ``python -m bench.partial_hits [--repeats N]`` (under ``flock /work/wt/bench.lock`` on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from bench.engine import QUESTIONS, chat, ttft
from bench.peers import prefixgate_engine_settings, system_text
from engine.api import EngineConfig
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, a HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--repeats", type=int, default=3, help="W4 rounds after the first, and W2 cold/warm sets")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-words", type=int, default=590)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path() if args.model == "default" else args.model
    settings = prefixgate_engine_settings(args.threads, 16384)
    base = replace(EngineConfig(), **settings)
    ck = load_checkpoint(path, weights=base.weights)
    tok = ck.tokenizer
    engines = {
        on: LLMEngine(ck.model, replace(base, enable_partial_prefix_hits=on), ck.model_id, tok)
        for on in (True, False)
    }
    runs: dict[bool, dict[str, list[float]]] = {on: {"w4": [], "w1": [], "w2": []} for on in engines}
    cached: dict[bool, dict[str, list[int]]] = {on: {"w4": [], "w2": []} for on in engines}

    def pair(i: int, key: str | None, prompt: list[int]) -> None:
        for on in (True, False) if i % 2 == 0 else (False, True):
            seconds, hit = ttft(engines[on], prompt)
            if key is not None:
                runs[on][key].append(seconds)
                if key in cached[on]:
                    cached[on][key].append(hit)

    pair(0, None, chat(tok, system_text(args.system_words, "warm-up"), QUESTIONS[0]))
    prompts = [system_text(args.system_words, f"tenant-{k}-{time.time_ns()}") for k in range(4)]
    for i in range(4 * (1 + args.repeats)):
        prompt = chat(tok, prompts[i % 4], QUESTIONS[i % 4] + f" (turn {i // 4})")
        pair(i, "w4" if i >= 4 else None, prompt)
    prompt_tokens = len(prompt)
    for i in range(args.repeats):
        system = system_text(args.system_words, f"{i}-{time.time_ns()}")
        pair(i, "w1", chat(tok, system, QUESTIONS[i % 4]))
        for j in range(2):
            pair(i + j, "w2", chat(tok, system, QUESTIONS[(i + j + 1) % 4] + f" (follow-up {j})"))
    med = {on: {k: statistics.median(v) for k, v in r.items()} for on, r in runs.items()}
    out = {
        "model": ck.model_id,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "partial_on": med[True] | {"cached_over_cold": med[True]["w2"] / med[True]["w1"]},
        "partial_off": med[False] | {"cached_over_cold": med[False]["w2"] / med[False]["w1"]},
        "w4_on_over_off": med[True]["w4"] / med[False]["w4"],
        "w2_on_over_off": med[True]["w2"] / med[False]["w2"],
        "cached_tokens": {("on" if on else "off"): c for on, c in cached.items()},
        "prefill_tokens": {("on" if on else "off"): e.stats().prefill_tokens for on, e in engines.items()},
        "runs": {("on" if on else "off"): r for on, r in runs.items()},
    }
    print(f"model {ck.model_id}  threads {out['threads']}  W4 prompt ~{prompt_tokens} tokens")
    print(f"{'metric (median s)':<22}{'partial on':>12}{'partial off':>13}{'on/off':>9}")
    for key, name in (("w4", "W4 alternating TTFT"), ("w1", "W1 cold TTFT"), ("w2", "W2 warm TTFT")):
        a, b = med[True][key], med[False][key]
        print(f"{name:<22}{a:>12.4f}{b:>13.4f}{a / b:>9.3f}")
    print(
        f"{'cached_over_cold':<22}{out['partial_on']['cached_over_cold']:>12.4f}"
        f"{out['partial_off']['cached_over_cold']:>13.4f}"
    )
    print(f"W4 cached tokens on {cached[True]['w4']}  off {cached[False]['w4']}")
    print(f"W2 cached tokens on {cached[True]['w2']}  off {cached[False]['w2']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
