"""Agent-loop cache benchmark: cached tokens per turn of a tool-calling conversation resent turn after turn, with
and without the engine's served turns (``engine.served_turns``), both with ``engine.cache_generated_kv: true``
(by default a reply's KV is not cached, and the next turn computes it again: docs/prefix-cache.md).

Workload (SmolLM2-135M-Instruct by default, fp32, CPU, greedy or seeded sampling with ``--temperature``): a system prompt, two tools in the generic format,
a user question; then ``--turns`` turns, each a forced call (``tool_choice: required``, one call) answered by a
tool result; every turn's prompt is the whole conversation so far, rendered and tokenized again, as a client that
resends its history sends it. Two arms, interleaved turn by turn, each on its own engine and tokenizer memo over
the same weights:

- ``served``: the engine keeps the ids it served for a reply that does not re-tokenize to them;
- ``canonical``: the same with served turns off (the behaviour before): every prompt is the canonical encoding.

Per turn: ``prompt`` tokens, ``cached`` tokens the prefix cache served, ``computed`` = the previous turn's prompt +
reply - 1 (the KV the previous turn left: all of it but its last token), ``lost`` = ``computed - cached`` (KV
computed again), and whether the previous reply re-tokenizes to its ids. Totals over the turns after the first.

Run: ``python -m bench.agent_turns [--turns 8]``. Prints a table per arm, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from engine.api import Constraint, EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine
from engine.tokenizer import Tokenizer
from engine.tool_calls import parse_tool_calls

TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the travel guide",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 40}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
)
QUESTION = "What is the weather in Lisbon, Paris, Seoul and Tokyo right now? Check each city."
RESULTS = [
    "Lisbon: 22C, clear. Now check Paris.",
    "Paris: 15C, cloudy. Now check Seoul.",
    "Seoul: 9C, rain. Now check Tokyo.",
    "Tokyo: 12C, windy. Now search the guide for museums in Lisbon.",
    "Museums open 9:00-18:00, closed on Mondays. Now check Berlin.",
    "Berlin: 7C, fog. Now search the guide for trains from Paris.",
    "Trains leave every 20 minutes from the central station. Now check New York.",
    "New York: 5C, snow. Now check Madrid.",
]


class Arm:
    """One conversation on its own engine and tokenizer memo."""

    def __init__(self, name: str, ckpt, served: bool, temperature: float) -> None:
        base = ckpt.tokenizer
        self.name = name
        self.temperature = temperature
        self.tok = Tokenizer(base.backend, base.chat_template, base.special_tokens, base.eos_token_ids)
        self.tok.served.enabled = served
        # served turns keep replies' ids only where replies' KV is cached (``cache_generated_kv``)
        config = replace(EngineConfig(num_blocks=1024, cache_generated_kv=True), dtype="float32")
        self.engine = LLMEngine(ckpt.model, config, ckpt.model_id, self.tok)
        self.messages = [
            {"role": "system", "content": "You are an assistant."},
            {"role": "user", "content": QUESTION},
        ]
        self.rows: list[dict] = []
        self.computed: int | None = None
        self.canonical: bool | None = None

    def turn(self, index: int) -> None:
        prompt = self.tok.render_chat(self.messages, list(TOOLS), scope="bench")
        constraint = Constraint("tool_calls", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        req = self.engine.add_request(
            prompt,
            SamplingParams(max_tokens=96, temperature=self.temperature, seed=index, constraint=constraint),
            cache_salt="bench",
        )
        out = self.engine.run_to_completion()[req.request_id]
        cached = out.usage.cached_tokens
        self.rows.append(
            {
                "turn": index,
                "prompt": len(prompt),
                "cached": cached,
                "computed": self.computed,
                "lost": None if self.computed is None else self.computed - cached,
                "previous_reply_canonical": self.canonical,
            }
        )
        reply = req.output_token_ids
        if reply and reply[-1] in req.stop_token_ids:
            reply = reply[:-1]
        self.canonical = self.tok.encode(self.tok.decode(reply, skip_special_tokens=False)) == reply
        self.computed = len(prompt) + len(req.output_token_ids) - 1
        _, calls = parse_tool_calls(out.full_text, cut=out.finish_reason == "length")
        self.rows[-1]["reply"] = out.full_text
        self.messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments_json},
                    }
                    for c in calls
                ],
            }
        )
        for c in calls:
            self.messages.append(
                {"role": "tool", "tool_call_id": c.id, "content": RESULTS[index % len(RESULTS)]}
            )
        if not calls:
            self.messages.append({"role": "user", "content": RESULTS[index % len(RESULTS)]})

    def totals(self) -> dict:
        later = [r for r in self.rows if r["computed"] is not None]
        return {
            "cached": sum(r["cached"] for r in later),
            "computed": sum(r["computed"] for r in later),
            "lost": sum(r["lost"] for r in later),
            "non_canonical_replies": sum(1 for r in later if r["previous_reply_canonical"] is False),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded by the turn")
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: bundled SmolLM2)")
    args = parser.parse_args()
    ckpt = load_checkpoint(args.model or default_model_path())
    arms = [Arm("served", ckpt, True, args.temperature), Arm("canonical", ckpt, False, args.temperature)]
    for index in range(args.turns):
        for arm in arms:
            arm.turn(index)
    for arm in arms:
        print(f"\n{arm.name}: turn | prompt | cached | computed before | lost | previous reply canonical")
        for r in arm.rows:
            print(
                f"  {r['turn']:>2} | {r['prompt']:>5} | {r['cached']:>5} | {r['computed'] or '-':>5} | "
                f"{'-' if r['lost'] is None else r['lost']:>3} | {r['previous_reply_canonical']}"
            )
        print(f"  totals after turn 0: {arm.totals()}")
    print(json.dumps({arm.name: {"totals": arm.totals(), "rows": arm.rows} for arm in arms}))


if __name__ == "__main__":
    main()
