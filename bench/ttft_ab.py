"""A/B of two checkouts' TTFT over HTTP, interleaved (``python -m bench.ttft_ab --a DIR --b DIR``).

Serves the default model from two ``prefixgate serve`` processes, one per checkout (``PYTHONPATH`` set to each),
with the peers bench's engine settings (``bench.peers.prefixgate_engine_settings``), and sends the peers bench's
W1 (cold ~1,000-token system prompt), W2 (that prompt cached, a new question) and W4 (four system prompts in
turn) requests to one and then the same request to the other, the order alternating, so the machine's other
load falls on both alike. Prints the mean and median client TTFT per workload and checkout, the ratio b/a, the
load average before and after, then one JSON line. Streamed greedy chat completions, ``max_tokens=1``
(``bench.peers.chat``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.engine import QUESTIONS
from bench.peers import MODEL, Server, chat, free_port, prefixgate_engine_settings, system_text


def start(checkout: str, name: str, threads: int, workdir: Path) -> Server:
    """``prefixgate serve`` of ``checkout`` on a free port (its code first on ``PYTHONPATH``)."""
    from engine.checkpoint import default_model_path

    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "rules": [],
        "models": [
            {
                "name": MODEL,
                "backend": "embedded",
                "path": default_model_path(),
                "engine": prefixgate_engine_settings(threads, 16384),
            }
        ],
    }
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    log = workdir / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(Path(checkout).resolve()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-level", "warning"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=checkout,
    )
    return Server(name, proc, f"http://127.0.0.1:{port}", log)


def run(a: str, b: str, threads: int, repeats: int, system_words: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="prefixgate-ttft-ab-"))
    servers = [start(a, "a", threads, workdir), start(b, "b", threads, workdir)]
    load_before = os.getloadavg()
    figures: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    try:
        for s in servers:
            s.wait_ready()

        def pair(i: int, key: str | None, system: str, question: str) -> None:
            for s in servers if i % 2 == 0 else servers[::-1]:
                res = chat(s, system, question, 1)
                if key is not None:
                    figures[s.name].setdefault(key, []).append(res.ttft_s)

        pair(0, None, system_text(system_words, "warm-up"), QUESTIONS[0])
        for i in range(repeats):
            system = system_text(system_words, f"{i}-{time.time_ns()}")
            pair(i, "w1_cold_ttft", system, QUESTIONS[i % 4])
            for j in range(2):
                pair(i + j, "w2_warm_ttft", system, QUESTIONS[(i + j + 1) % 4] + f" (follow-up {j})")
        prompts = [system_text(system_words, f"tenant-{k}-{time.time_ns()}") for k in range(4)]
        for i in range(4 * max(2, repeats)):
            pair(
                i,
                "w4_alternating" if i >= 4 else None,
                prompts[i % 4],
                QUESTIONS[i % 4] + f" (turn {i // 4})",
            )
    finally:
        for s in servers:
            s.stop()
    out: dict = {"load_before": load_before, "load_after": os.getloadavg(), "a": a, "b": b}
    for key in ("w1_cold_ttft", "w2_warm_ttft", "w4_alternating"):
        va, vb = figures["a"][key], figures["b"][key]
        out[key] = {
            "a_mean": statistics.mean(va),
            "b_mean": statistics.mean(vb),
            "a_median": statistics.median(va),
            "b_median": statistics.median(vb),
            "b_over_a_mean": statistics.mean(vb) / statistics.mean(va),
            "b_over_a_median": statistics.median(vb) / statistics.median(va),
            "n": len(va),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (e.g. /work/main)")
    ap.add_argument("--b", required=True, help="checkout B (e.g. this worktree)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=590)
    args = ap.parse_args()
    out = run(args.a, args.b, args.threads, args.repeats, args.system_words)
    print(f"A = {args.a}   B = {args.b}   load {out['load_before']} -> {out['load_after']}")
    print(f"{'workload':<18}{'A mean':>9}{'B mean':>9}{'A med':>9}{'B med':>9}{'B/A mean':>10}{'B/A med':>9}")
    for key in ("w1_cold_ttft", "w2_warm_ttft", "w4_alternating"):
        r = out[key]
        print(
            f"{key:<18}{r['a_mean']:>9.4f}{r['b_mean']:>9.4f}{r['a_median']:>9.4f}{r['b_median']:>9.4f}"
            f"{r['b_over_a_mean']:>10.3f}{r['b_over_a_median']:>9.3f}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
