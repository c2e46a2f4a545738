"""The cost of finding the configured rules' volatile values in a rules-off request's system prompt for the
cache explanation (``Canonicalizer.rule_value_spans``): a new text (scanned by every hoist/drop/round pattern)
and a repeated one (memoized). Prints a table and a final JSON line; no assertion (docs/cache-explanations.md).

    flock /work/wt/bench.lock python -m bench.explain_rule_spans
"""

from __future__ import annotations

import json
import time
import uuid

from gateway.service.canonicalize import Canonicalizer


def main(texts: int = 200, repeats: int = 5) -> dict[str, float]:
    """Mean microseconds per call for new and for repeated texts (``texts`` distinct ~3.9 KB prompts)."""
    canonicalizer = Canonicalizer(["default"])
    base = "You are the support assistant of ACME. Current date: 2026-12-01. " + (
        "Answer politely about orders and returns. " * 90
    )
    prompts = [f"{uuid.uuid4().hex} " + base for _ in range(texts)]
    start = time.perf_counter()
    for text in prompts:
        canonicalizer.rule_value_spans(text)
    new_us = (time.perf_counter() - start) / texts * 1e6
    start = time.perf_counter()
    for _ in range(repeats):
        for text in prompts:
            canonicalizer.rule_value_spans(text)
    memo_us = (time.perf_counter() - start) / (texts * repeats) * 1e6
    print("| system text chars | new text (scan) µs | repeated text (memo) µs |")
    print("|---|---|---|")
    print(f"| {len(prompts[0])} | {new_us:.1f} | {memo_us:.2f} |")
    result = {"chars": len(prompts[0]), "new_us": round(new_us, 1), "memo_us": round(memo_us, 2)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
