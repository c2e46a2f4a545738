"""Constrained-decoding benchmark: decode tokens/s at batch 1 with and without a JSON schema (issue 16).

Workload (SmolLM2-135M-Instruct by default, fp32, CPU): a chat prompt asking for a list of people as JSON;
greedy decoding of up to ``--new`` tokens at batch 1,

- ``unconstrained_tps``: EOS ignored, so every run decodes ``--new`` tokens;
- ``constrained_tps``: the same prompt with ``Constraint("json_schema")`` over a schema of an array of at least
  ``--items`` person objects, so the JSON is long enough to decode about ``--new`` tokens (it ends at
  ``max_tokens`` or when the document is complete);

both counted after the first token (tokens / seconds between the first and the last token). Also reported:
the constrained run's mean time per token the worker spent computing masks (``mask_compute_us``) and the mean
time sampling waited for them (``mask_wait_us``; near zero when the mask is computed off the critical path).
``constrained_slowdown`` = unconstrained_tps / constrained_tps; target <= 1.15. Medians of ``--repeats`` runs,
interleaved. The library choice and its per-token mask cost (llguidance vs xgrammar) are measured in
``engine/constrained.py``'s docstring.

Run: ``python -m bench.constrained``. Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from engine.api import Constraint, EngineConfig, SamplingParams
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def people_schema(min_items: int) -> dict:
    """An object with a ``people`` array of at least ``min_items`` persons."""
    return {
        "type": "object",
        "properties": {"people": {"type": "array", "items": PERSON, "minItems": min_items}},
        "required": ["people"],
        "additionalProperties": False,
    }


def decode_run(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, int, dict]:
    """Decode tokens/s of one request after its first token, its output tokens, and its mask timings (us/token)."""
    req = eng.add_request(prompt, params)
    eng.run_to_completion()
    n = req.num_output_tokens
    seconds = req.last_token_time - req.first_token_time
    state = req.sampler.constraint
    timings = {}
    if state is not None:
        timings = {
            "mask_compute_us": 1e6 * state.mask_compute_s / max(1, state.num_tokens),
            "mask_wait_us": 1e6 * state.mask_wait_s / max(1, n),
        }
    return (n - 1) / seconds, n, timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, a HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--new", type=int, default=96, help="most tokens decoded per run")
    ap.add_argument("--items", type=int, default=8, help="minItems of the schema's array")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path() if args.model == "default" else args.model
    ck = load_checkpoint(path)
    tok = ck.tokenizer
    prompt = tok.render_chat(
        [
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": "List eight people with their name, age, city and hobbies as JSON."},
        ]
    )
    config = EngineConfig(num_blocks=256, max_num_batched_tokens=1024)
    eng = LLMEngine(ck.model, config, ck.model_id, tok)
    constraint = Constraint("json_schema", json_schema=people_schema(args.items))
    free = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.new, temperature=0.0, constraint=constraint)
    decode_run(eng, prompt, free)  # warm-up: allocator, thread pool
    decode_run(eng, prompt, bound)  # warm-up: the llguidance tokenizer and grammar
    runs: dict[str, list[float]] = {k: [] for k in ("free", "bound", "tokens", "compute", "wait")}
    for _ in range(args.repeats):
        runs["free"].append(decode_run(eng, prompt, free)[0])
        tps, n, timings = decode_run(eng, prompt, bound)
        runs["bound"].append(tps)
        runs["tokens"].append(n)
        runs["compute"].append(timings["mask_compute_us"])
        runs["wait"].append(timings["mask_wait_us"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "model": ck.model_id,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt),
        "max_new_tokens": args.new,
        "constrained_tokens": int(med["tokens"]),
        "unconstrained_tps": med["free"],
        "constrained_tps": med["bound"],
        "mask_compute_us": med["compute"],
        "mask_wait_us": med["wait"],
        "constrained_slowdown": med["free"] / med["bound"],
    }
    result["targets_met"] = {"constrained_slowdown_le_1.15": result["constrained_slowdown"] <= 1.15}
    print(f"{'metric (batch 1, greedy)':<28}{'value':>12}  target")
    print(f"{'unconstrained decode (tok/s)':<28}{result['unconstrained_tps']:>12.1f}")
    print(f"{'JSON-schema decode (tok/s)':<28}{result['constrained_tps']:>12.1f}")
    print(f"{'constrained slowdown':<28}{result['constrained_slowdown']:>12.3f}  <= 1.15")
    print(f"{'mask compute (us/token)':<28}{result['mask_compute_us']:>12.1f}  (worker thread)")
    print(f"{'mask wait (us/token)':<28}{result['mask_wait_us']:>12.1f}  (on the critical path)")
    print(
        f"(median of {args.repeats} interleaved runs; {result['constrained_tokens']} constrained tokens per run)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
