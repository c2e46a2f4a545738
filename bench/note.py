"""The user's note's table, measured: its four workloads with prefix caching on vs off, and their API cost.

The note (``seed-prefix-caching.ko.txt``, "성능 지표", for a 1,000-token system prompt) promises: prefill time
-90 %, end-to-end latency -30-50 %, throughput 2-3x, API cost -80-90 %. Its workloads, built here from text
rendered by the model's chat template (token counts are the model's tokenizer's):

- ``chatbot``: a ~1,000-token system prompt + ~50-token questions (one request per question);
- ``rag``: a ~5,000-token document (system message) + several questions about it;
- ``few_shot``: ~2,000 tokens of worked examples + new inputs;
- ``agent``: a multi-turn agent: ~1,500 tokens of tools + instructions, then turns that each append the
  previous answer and a ~250-token tool result to the conversation (each prompt extends the previous one).

Engine figures (``engine.llm_engine.LLMEngine``, greedy, ``EOS`` ignored), each workload on a fresh engine with
``EngineConfig.enable_prefix_caching`` on, then on another with it off:

- ``prefill_s``: TTFT (seconds from ``add_request`` to the first token, each request alone) median over the
  requests after the first (the first one finds an empty cache either way);
- ``e2e_s``: seconds from ``add_request`` to the last of ``--new`` tokens, same requests, median;
- ``throughput_tps``: generated tokens per second of a serving pass after those: the independent requests
  (new questions) submitted together as one wave (agent: ``--sessions`` sessions advanced turn by turn in
  lockstep, one wave per turn), all tokens over the pass's wall time;
- ``cached_tokens``: prompt tokens served from the prefix cache in the sequential pass.

Reductions are ``1 - on / off``; the throughput gain is ``on / off``.

API cost: the same requests (prompt token counts of this tokenizer, the note's pacing: requests seconds apart)
against ``bench.providers.SimulatedProvider`` (Anthropic-style prompt cache billed by the shipped price table,
``--price-model``) without prefixgate (a plain client: no cache breakpoints, every token billed as input) and
with prefixgate's breakpoints (end of the stable prefix; for the agent also the conversation so far) and its
retention choice (``ReuseTracker``, as in ``bench.providers``). ``cost_reduction = 1 - with / without``.
Prefixes under the model's minimum cacheable length are not cached by the provider (its rule, not ours).

Run: ``python -m bench.note`` (SmolLM2-135M-Instruct); ``--tiny`` runs the tests' tiny random checkpoint on
small sizes (a smoke run). Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.providers import Breakpoint, Request, SimulatedProvider, prefixgate
from engine.api import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from gateway.config.price_table import load_price_table

NOTE_CLAIMS = {
    "prefill_reduction": (0.90, 0.90),
    "e2e_reduction": (0.30, 0.50),
    "throughput_gain": (2.0, 3.0),
    "cost_reduction": (0.80, 0.90),
}
"""The note's table (for a 1,000-token system prompt): metric -> (low, high) of the promised improvement."""

SYSTEM = [
    "You are the support assistant of Northwind Rail, a regional train operator with 41 stations.",
    "Answer questions about timetables, tickets, refunds, luggage, bicycles, pets and accessibility.",
    "Be concise and friendly, quote prices in euros, and never invent a connection that does not exist.",
    "Trains run from 05:30 to 23:45 on weekdays and from 07:00 to 22:30 on weekends and holidays.",
    "A single ticket costs 4.20 euros within a zone and 2.10 euros for each further zone crossed.",
    "Day passes cost 11.50 euros, weekly passes 38 euros and monthly passes 129 euros for all zones.",
]
DOCUMENT = [
    "Section {n}. The winter timetable of line {n} starts on the second Sunday of December.",
    "Between the depot and the harbour, trains of line {n} stop at every station except on holidays.",
    "Maintenance on the viaduct of line {n} closes the track on the first Tuesday of each month at night.",
    "Replacement buses for line {n} leave from the forecourt, bay {n}, and take about twenty minutes longer.",
    "Passengers of line {n} with a reduced mobility pass can book assistance up to two hours before travel.",
]
EXAMPLES = [
    "Input: my train {n} was 25 minutes late and I missed my connection.\nLabel: delay_compensation\n",
    "Input: can I take my folding bicycle on train {n} at eight in the morning?\nLabel: bicycles\n",
    "Input: I bought a day pass for zone {n} by mistake, can I exchange it?\nLabel: refund\n",
    "Input: is there a lift at station {n} for a wheelchair user?\nLabel: accessibility\n",
]
QUESTIONS = [
    "I travel with two children aged five and nine and a folding bicycle from the central station to the "
    "airport on a Saturday morning. Which tickets do we need, and what is the total? Thanks. (#{i})",
    "My train this morning was cancelled and I took a taxi instead. I still have the unused day pass I "
    "bought yesterday. Can I get a refund for it, and where do I go? Thank you. (#{i})",
    "We are four adults with a large dog and two suitcases crossing three zones on a weekday at half past "
    "five in the evening. What is the cheapest way to do it and are there limits? (#{i})",
    "Is there a monthly pass that also covers night buses, and what happens if I lose it halfway through "
    "the month? Is there a student discount for people over twenty-five? (#{i})",
]
TOOLS = [
    "Tool search_timetable(from, to, date): returns the departures between two stations on a date.",
    "Tool ticket_price(zones, passengers, bicycles): returns the total price in euros for a journey.",
    "Tool refund_status(ticket_id): returns whether a ticket can be refunded and how much.",
    "Rules: call one tool per step, read its result, then either call another tool or answer the user.",
]
TOOL_RESULT = "Departure {h}:{m:02d} from platform {p}, arrival {h2}:{m:02d}, {z} zones, train {t}, on time. "


def _fill(sentences: Sequence[str], tok: Any, target: int) -> str:
    """Text of ``sentences`` (``{n}`` numbered) repeated until it encodes to at least ``target`` tokens."""
    text, i = "", 0
    while len(tok.encode(text)) < target:
        text += sentences[i % len(sentences)].format(n=i // len(sentences) + 1) + " "
        i += 1
    return text.strip()


@dataclass
class Workload:
    """One of the note's workloads: a sequence of requests (message lists) and the serving pass's waves.

    Attributes:
        name: ``chatbot`` / ``rag`` / ``few_shot`` / ``agent``.
        describe: what it is, with its token counts.
        sequential: the requests of the latency pass, in order (chat messages).
        waves: the serving pass: each wave's requests are submitted together.
        stable_chars: the stable head's message count (the system message, 1); the agent's history grows.
        gap_s: seconds between requests for the provider's clock (the note's pacing).
    """

    name: str
    describe: str
    sequential: list[list[dict[str, str]]]
    waves: list[list[list[dict[str, str]]]]
    gap_s: float = 10.0
    agent: bool = False
    stable_tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _ask(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def build_workloads(tok: Any, scale: float, requests: int, sessions: int) -> list[Workload]:
    """The note's four workloads at ``scale`` x their token sizes (1.0: 1,000 / 5,000 / 2,000 / 1,500 tokens),
    ``requests`` requests (agent: turns) each, ``sessions`` agent sessions in the serving pass."""

    def size(n: int) -> int:
        return max(32, int(n * scale))

    def question(i: int) -> str:
        return QUESTIONS[i % len(QUESTIONS)].format(i=i)

    def shared_head(name: str, describe: str, head: str, ask: Callable[[int], str], gap_s: float) -> Workload:
        """A workload of one shared head + a new question per request (latency pass: questions 0..n-1;
        serving pass: one wave of questions 100..100+n-1)."""
        return Workload(
            name,
            describe.format(tokens=len(tok.encode(head))),
            [_ask(head, ask(i)) for i in range(requests)],
            [[_ask(head, ask(100 + i)) for i in range(requests)]],
            gap_s=gap_s,
        )

    system = _fill(SYSTEM, tok, size(1000))
    document = "Answer from this document only.\n" + _fill(DOCUMENT, tok, size(5000))
    shots = "Classify each input with one label.\n" + _fill(EXAMPLES, tok, size(2000))
    out = [
        shared_head("chatbot", "{tokens}-token system prompt + ~50-token questions", system, question, 10.0),
        shared_head("rag", "{tokens}-token document + questions", document, question, 20.0),
        shared_head(
            "few_shot",
            "{tokens} tokens of examples + new inputs",
            shots,
            lambda i: f"Input: {question(i)}\nLabel:",
            5.0,
        ),
    ]
    tools = _fill(TOOLS, tok, size(1500))
    result_tokens = size(250)

    def session(s: int) -> list[list[dict[str, str]]]:
        messages = _ask(tools, f"Session {s}: plan my trip from the harbour to the airport next Friday.")
        turns = []
        for t in range(requests):
            turns.append([dict(m) for m in messages])
            result = _fill(
                [
                    TOOL_RESULT.format(
                        h=6 + t, h2=7 + t, m=(7 * t + s) % 60, p=t % 9 + 1, z=t % 4 + 1, t=900 + t
                    )
                ],
                tok,
                result_tokens,
            )
            messages += [
                {"role": "assistant", "content": f"Calling search_timetable for step {t + 1}."},
                {"role": "user", "content": f"Tool result {t + 1}: {result}"},
            ]
        return turns

    turns = [session(s) for s in range(sessions + 1)]
    out.append(
        Workload(
            "agent",
            f"{len(tok.encode(tools))}-token tools + instructions, {requests} turns adding ~{result_tokens} tokens",
            turns[0],
            [[turns[1 + s][t] for s in range(sessions)] for t in range(requests)],
            gap_s=8.0,
            agent=True,
        )
    )
    return out


def _run_one(eng: LLMEngine, prompt: list[int], new: int) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, cached prompt tokens) of one request alone on ``eng``."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    req = eng.add_request(prompt, params)
    while req.num_output_tokens == 0:
        eng.step()
    first = time.perf_counter() - t0
    eng.run_to_completion()
    return first, time.perf_counter() - t0, req.num_cached_tokens or 0


def _wave_pass(eng: LLMEngine, waves: list[list[list[int]]], new: int) -> float:
    """Generated tokens per second over the serving pass (each wave submitted together, run to the end)."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    generated = 0
    t0 = time.perf_counter()
    for wave in waves:
        reqs = [eng.add_request(p, params) for p in wave]
        eng.run_to_completion()
        generated += sum(r.num_output_tokens for r in reqs)
    return generated / (time.perf_counter() - t0)


def measure_engine(model: Any, tok: Any, model_id: str, wl: Workload, caching: bool, new: int) -> dict:
    """Prefill / end-to-end / throughput figures of ``wl`` on a fresh engine with prefix caching ``caching``."""
    seq = [tok.render_chat(m) for m in wl.sequential]
    waves = [[tok.render_chat(m) for m in wave] for wave in wl.waves]
    longest = max(len(p) for p in seq + [p for w in waves for p in w])
    batch = max(len(w) for w in waves)
    config = EngineConfig(
        num_blocks=(longest + new) // 16 * (batch + 2) + 64,
        max_num_batched_tokens=2048,
        max_batch=max(batch, 8),
        enable_prefix_caching=caching,
    )
    eng = LLMEngine(model, config, model_id, tok)
    try:
        runs = [_run_one(eng, p, new) for p in seq]
        tps = _wave_pass(eng, waves, new)
    finally:
        eng.close()
    later = runs[1:] or runs
    return {
        "cold_ttft_s": runs[0][0],
        "prefill_s": statistics.median(r[0] for r in later),
        "e2e_s": statistics.median(r[1] for r in later),
        "throughput_tps": tps,
        "cached_tokens": sum(r[2] for r in runs),
        "prompt_tokens": sum(len(p) for p in seq),
        "ttft_samples_s": [r[0] for r in runs],
        "e2e_samples_s": [r[1] for r in runs],
    }


def _head_tokens(tok: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` rendered as the head of a longer chat (no generation prompt)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    return len(tok.encode(text, add_special_tokens=False))


def provider_requests(tok: Any, wl: Workload) -> list[Request]:
    """The sequential requests as ``bench.providers.Request``: token counts of this tokenizer, ``gap_s`` apart,
    breakpoints where prefixgate puts them (end of the system message; agent: also the history so far)."""
    out: list[Request] = []
    previous: tuple[str, int] | None = None
    for i, messages in enumerate(wl.sequential):
        prompt = len(tok.render_chat(messages))
        stable = _head_tokens(tok, messages[:1])
        bps = [Breakpoint(f"{wl.name}:stable", stable, f"{wl.name}:stable", f"{wl.name}/stable")]
        reads = [(f"{wl.name}:stable", stable)]
        if wl.agent and len(messages) > 2:
            history = _head_tokens(tok, messages[:-1])
            bps.append(Breakpoint(f"{wl.name}:h{i}", history, f"{wl.name}:history", f"{wl.name}/history"))
            if previous is not None:
                reads.append(previous)
            previous = (f"{wl.name}:h{i}", history)
        out.append(Request(i * wl.gap_s, wl.name, prompt, tuple(bps), tuple(reads)))
    return out


def measure_cost(tok: Any, wl: Workload, model: str) -> dict:
    """USD without prefixgate (no breakpoints) and with prefixgate's breakpoints and TTL choice."""
    prices = load_price_table().lookup(model, "anthropic")
    if prices is None:
        raise SystemExit(f"--price-model {model!r}: not an Anthropic model of the price table")
    requests = provider_requests(tok, wl)
    minimum = prices.min_cacheable_tokens or 1024
    bills = {}
    for name, policy in (("without", lambda r: [None] * len(r.breakpoints)), ("with", None)):
        provider = SimulatedProvider(prices, minimum)
        choose = policy or prefixgate(prices, allow_none=True)()
        for request in requests:
            provider.send(request, choose(request))
        bills[name] = provider.close()
    without, with_ = bills["without"].paid, bills["with"].paid
    return {
        "price_model": model,
        "min_cacheable_tokens": minimum,
        "cost_without_usd": without,
        "cost_with_usd": with_,
        "cost_reduction": 1 - with_ / without if without else 0.0,
        "provider_read_tokens": bills["with"].read_tokens,
        "stable_prefix_tokens": requests[0].breakpoints[0].tokens,
    }


def run(
    model: Any,
    tok: Any,
    model_id: str,
    *,
    scale: float,
    requests: int,
    sessions: int,
    new: int,
    price_model: str,
) -> dict:
    """Every workload, caching on and off, and its cost; the JSON line's content (see the module docstring)."""
    out: dict[str, Any] = {"bench": "note", "model": model_id, "new_tokens": new, "workloads": {}}
    # warm-up (allocator, thread pool): one short request
    warm = LLMEngine(model, EngineConfig(num_blocks=64), model_id, tok)
    _run_one(warm, tok.render_chat(_ask("Hi.", "Hello?")), 2)
    warm.close()
    for wl in build_workloads(tok, scale, requests, sessions):
        on = measure_engine(model, tok, model_id, wl, True, new)
        off = measure_engine(model, tok, model_id, wl, False, new)
        cost = measure_cost(tok, wl, price_model)
        out["workloads"][wl.name] = {
            "describe": wl.describe,
            "requests": len(wl.sequential),
            "on": on,
            "off": off,
            "prefill_reduction": 1 - on["prefill_s"] / off["prefill_s"],
            "e2e_reduction": 1 - on["e2e_s"] / off["e2e_s"],
            "throughput_gain": on["throughput_tps"] / off["throughput_tps"],
            **cost,
        }
    out["note_claims"] = {k: list(v) for k, v in NOTE_CLAIMS.items()}
    return out


def format_table(out: dict) -> str:
    """The note's row beside ours, per workload."""
    note = "-90 %", "-30-50 %", "2-3x", "-80-90 %"
    lines = [
        f"{'workload':<10}{'':<6}{'prefill time':>14}{'end-to-end':>12}{'throughput':>12}{'API cost':>10}",
        f"{'(note)':<16}{note[0]:>14}{note[1]:>12}{note[2]:>12}{note[3]:>10}",
    ]
    for name, w in out["workloads"].items():
        lines.append(
            f"{name:<10}{'ours':<6}{-w['prefill_reduction']:>+14.0%}{-w['e2e_reduction']:>+12.0%}"
            f"{w['throughput_gain']:>11.2f}x{-w['cost_reduction']:>+10.0%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, measure, print the table and the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, a HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random checkpoint, small sizes")
    ap.add_argument("--scale", type=float, default=1.0, help="x the note's token sizes")
    ap.add_argument("--requests", type=int, default=6, help="requests (agent: turns) per workload")
    ap.add_argument("--sessions", type=int, default=4, help="agent sessions in the serving pass")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--price-model", default="claude-sonnet-4-5", help="Anthropic model of the price table")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        from tests.engine.engine_helpers import tiny_checkpoint

        ck = tiny_checkpoint(max_position_embeddings=8192)
        args.scale = min(args.scale, 0.1)
        args.requests = min(args.requests, 3)
        args.sessions = min(args.sessions, 2)
        args.new = min(args.new, 4)
    else:
        from engine.checkpoint import default_model_path, load_checkpoint

        ck = load_checkpoint(default_model_path() if args.model == "default" else args.model)
    with torch.inference_mode():
        out = run(
            ck.model,
            ck.tokenizer,
            ck.model_id,
            scale=args.scale,
            requests=args.requests,
            sessions=args.sessions,
            new=args.new,
            price_model=args.price_model,
        )
    out["threads"] = torch.get_num_threads()
    print(format_table(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
