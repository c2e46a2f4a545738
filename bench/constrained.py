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
interleaved.

The library choice (``engine/constrained.py``'s docstring): ``llguidance_mask_us_*`` is the per-token cost of
computing a mask and advancing by one token, alone, on a fixed 48-token JSON document of a nested schema with the
checkpoint's tokenizer (p50 / mean / p99 over 5 passes); ``xgrammar_mask_us_*`` the same with xgrammar when it is
importable (it is not a dependency: it requires torch and triton; install it with ``pip install --no-deps
--target DIR xgrammar apache-tvm-ffi pydantic`` and put DIR on ``PYTHONPATH`` to compare).

Run: ``python -m bench.constrained``. Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
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


MASK_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
MASK_DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
}


def _percentiles(samples: list[float], prefix: str) -> dict[str, float]:
    us = sorted(1e6 * t for t in samples)
    return {
        f"{prefix}_p50": statistics.median(us),
        f"{prefix}_mean": statistics.fmean(us),
        f"{prefix}_p99": us[min(len(us) - 1, int(0.99 * len(us)))],
    }


def llguidance_mask_cost(tok, vocab_size: int, passes: int = 5) -> dict[str, float]:
    """Per-token mask + advance cost of llguidance on ``MASK_DOC`` (microseconds)."""
    import llguidance  # noqa: PLC0415

    from engine.constrained import JSON_OPTIONS  # noqa: PLC0415

    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=tok.eos_token_ids[0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema({**MASK_SCHEMA, "x-guidance": JSON_OPTIONS})
    ids = tok.encode(json.dumps(MASK_DOC))
    samples = []
    for _ in range(passes):
        matcher = llguidance.LLMatcher(lltok, grammar)
        for t in ids:
            t0 = time.perf_counter()
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            if not bits[t] or not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
            samples.append(time.perf_counter() - t0)
    return _percentiles(samples, "llguidance_mask_us")


def xgrammar_mask_cost(tok, vocab_size: int, passes: int = 5) -> dict[str, float]:
    """The same with xgrammar, when it is importable (else ``{}``)."""
    try:
        import xgrammar  # noqa: PLC0415
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    except ImportError:
        return {}
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok.backend), vocab_size=vocab_size
    )
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(MASK_SCHEMA), any_whitespace=False
    )
    ids = tok.encode(json.dumps(MASK_DOC))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    samples = []
    for _ in range(passes):
        matcher = xgrammar.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
            if not bits[t] or not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
            samples.append(time.perf_counter() - t0)
    return _percentiles(samples, "xgrammar_mask_us")


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
    result.update(llguidance_mask_cost(tok, ck.model.config.vocab_size))
    result.update(xgrammar_mask_cost(tok, ck.model.config.vocab_size))
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
