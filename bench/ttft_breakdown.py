"""Where the time to first token of one embedded-engine request over HTTP goes (``python -m bench.ttft_breakdown``).

Starts ``prefixgate serve`` on the default model (the peers bench's engine settings, ``bench.peers``) in a child
process that wraps a fixed list of functions on the request's path with timers (``PROBES``: the function, its
start and end on the system's monotonic clock, its thread), then sends the peers bench's W2 and W4 requests
(``bench.peers.chat``: streamed greedy chat completions, ``max_tokens=1``) from this process. Client and server
read the same clock (``time.monotonic``, ``CLOCK_MONOTONIC`` on Linux), so each probe is placed in its request's
window [client send, client's first content chunk]. Prints, per workload, the mean milliseconds of each probe
inside that window and the TTFT the client saw, then one JSON line. Nothing of the server's code is changed:
the probes are wrappers installed by this module's child entry point (``--serve``).

The wrappers cost a few microseconds each; the figures are for finding where the fixed cost is, not for the
headline TTFT (``bench.peers`` measures that, beside llama-server).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROBES = (
    "gateway.service.pipeline:canonicalize",
    "gateway.backends.embedded_request:generation_request",
    "engine.async_engine:AsyncEngine.generate",
    "engine.tokenizer:Tokenizer.render_chat",
    "engine.tokenizer:Tokenizer.apply_chat_template",
    "engine.tokenizer:Tokenizer.encode",
    "engine.piece_memo:PieceMemo.encode_ids",
    "engine.piece_memo:PieceMemo.encode",
    "engine.llm_engine:LLMEngine.check_prompt",
    "engine.async_engine:AsyncEngine.shared_prefix_tokens",
    "engine.llm_engine:LLMEngine.add_checked_request",
    "engine.input_processor:InputProcessor.make_request",
    "engine.llm_engine:LLMEngine.schedule_step",
    "engine.scheduler:Scheduler.schedule",
    "engine.kv_cache_manager:KVCacheManager.find_cached_prefix",
    "engine.kv_cache_manager:KVCacheManager.allocate",
    "engine.model_runner:ModelRunner.copy_slots",
    "engine.model_runner:ModelRunner.prepare",
    "engine.llm_engine:LLMEngine.run_step",
    "engine.model:LlamaModel.forward",
    "engine.sampling:sample_sequences",
    "engine.llm_engine:LLMEngine.finish_step",
    "engine.output_processor:OutputProcessor.process_token",
    "engine.async_engine:AsyncEngine._post",
    "gateway.service.pipeline:OpenedStream._explain",
    "gateway.service.cache_explain:CacheExplanations.explain",
    "gateway.service.cache_explain:CacheExplanations.prepare",
    "gateway.backends.embedded:EnginePromptTokenizer.encode",
    "gateway.backends.embedded:EnginePromptTokenizer.encode_in_scope",
    "gateway.service.miss_explain:MissExplainer.explain",
)

_EVENTS: list[tuple[str, float, float, str]] = []


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            _EVENTS.append((name, t0, time.monotonic(), threading.current_thread().name))

    if asyncio_iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def atimed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                _EVENTS.append((name, t0, time.monotonic(), threading.current_thread().name))

        setattr(owner, attr, atimed)
    else:
        setattr(owner, attr, timed)


def asyncio_iscoroutinefunction(fn) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def install_probes(probes: tuple[str, ...] = PROBES) -> list[str]:
    """Wrap each ``module:Qual.name`` of ``probes`` (where it exists); return the ones installed. A
    module-level function is wrapped in its module and in every loaded module that imported it by name."""
    installed = []
    for spec in probes:
        module_name, qual = spec.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        parts = qual.split(".")
        owner = module
        for p in parts[:-1]:
            owner = getattr(owner, p, None)
        if owner is None or not hasattr(owner, parts[-1]):
            continue
        original = getattr(owner, parts[-1])
        _wrap(owner, parts[-1], qual)
        if owner is module:  # rebind names imported with ``from module import fn``
            for other in list(sys.modules.values()):
                if other is not None and getattr(other, parts[-1], None) is original:
                    setattr(other, parts[-1], getattr(module, parts[-1]))
        installed.append(qual)
    return installed


def serve_with_probes(config: str, events_path: str) -> int:
    """Child entry: install the probes, serve, write the events as JSON at exit."""
    import gateway.backends.embedded  # noqa: F401 - load the modules the probes patch
    import gateway.cli
    import gateway.http.openai  # noqa: F401
    import gateway.service.cache_explain  # noqa: F401

    installed = install_probes()
    trigger = Path(events_path + ".dump")

    def dump_when_asked() -> None:  # the parent creates ``trigger``; the events go out before it stops us
        while not trigger.exists():
            time.sleep(0.05)
        tmp = Path(events_path + ".tmp")
        tmp.write_text(json.dumps({"probes": installed, "events": list(_EVENTS)}))
        tmp.rename(events_path)

    threading.Thread(target=dump_when_asked, daemon=True).start()
    return gateway.cli.main(["serve", "--config", config, "--log-level", "warning"])


def run(threads: int, repeats: int, system_words: int, checkout: str | None = None) -> dict:
    from bench.engine import QUESTIONS
    from bench.peers import Server, chat, free_port, prefixgate_engine_settings, system_text
    from engine.checkpoint import default_model_path

    workdir = Path(tempfile.mkdtemp(prefix="prefixgate-ttft-"))
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "rules": [],
        "models": [
            {
                "name": "smollm2",
                "backend": "embedded",
                "path": default_model_path(),
                "engine": prefixgate_engine_settings(threads, 16384),
            }
        ],
    }
    config = workdir / "prefixgate.yaml"
    config.write_text(json.dumps(cfg))
    events_path = workdir / "events.json"
    log = workdir / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if checkout is not None:  # that checkout's gateway and engine, this file's probes
        env["PYTHONPATH"] = str(Path(checkout).resolve())
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", str(config), str(events_path)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    server = Server("prefixgate", proc, f"http://127.0.0.1:{port}", log)
    windows: dict[str, list[tuple[float, float]]] = {"w2": [], "w4": [], "w1": []}
    try:
        server.wait_ready()

        def timed(key: str | None, system: str, question: str) -> None:
            t0 = time.monotonic()
            res = chat(server, system, question, 1)
            if key is not None:
                windows[key].append((t0, t0 + res.ttft_s))

        timed(None, system_text(system_words, "warm-up"), QUESTIONS[0])
        for i in range(repeats):
            system = system_text(system_words, f"{i}-{time.time_ns()}")
            timed("w1", system, QUESTIONS[i % 4])
            for j in range(2):
                timed("w2", system, QUESTIONS[(i + j + 1) % 4] + f" (follow-up {j})")
        prompts = [system_text(system_words, f"tenant-{k}-{time.time_ns()}") for k in range(4)]
        for i in range(4 * max(2, repeats)):
            timed("w4" if i >= 4 else None, prompts[i % 4], QUESTIONS[i % 4] + f" (turn {i // 4})")
        Path(str(events_path) + ".dump").touch()
        deadline = time.monotonic() + 30
        while not events_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    data = json.loads(events_path.read_text())
    out: dict = {"probes": data["probes"]}
    for key, wins in windows.items():
        per_probe: dict[str, list[float]] = {}
        for t0, t1 in wins:
            sums: dict[str, float] = {}
            for name, a, b, _thread in data["events"]:
                if a >= t0 and b <= t1:
                    sums[name] = sums.get(name, 0.0) + (b - a)
            for name in data["probes"]:
                per_probe.setdefault(name, []).append(sums.get(name, 0.0))
            for name, value in gaps(data["events"], t0, t1).items():
                per_probe.setdefault(name, []).append(value)
        out[key] = {
            "ttft_ms": statistics.mean((t1 - t0) * 1e3 for t0, t1 in wins),
            "probes_ms": {k: statistics.mean(v) * 1e3 for k, v in per_probe.items()},
            "requests": len(wins),
        }
    return out


GAPS = (
    "gap: client send -> canonicalize",
    "gap: enqueue -> step picks it up",
    "gap: last step's end -> client's first chunk",
)


def gaps(events: list, t0: float, t1: float) -> dict[str, float]:
    """Seconds between probes in the window [t0, t1]: HTTP receive + parse + routing (client send to the
    rules), the step loop's wake-up (the request queued to the first ``schedule_step`` after it), and what
    follows the last step (outputs, delivery to the event loop, the cache explanation, SSE write, client)."""
    inside = sorted((e for e in events if e[1] >= t0 and e[2] <= t1), key=lambda e: e[1])
    first = lambda name: next((e for e in inside if e[0] == name), None)  # noqa: E731
    out = dict.fromkeys(GAPS, 0.0)
    canon = first("canonicalize")
    if canon is not None:
        out[GAPS[0]] = canon[1] - t0
    queued = first("LLMEngine.add_checked_request")
    if queued is not None:
        step = next((e for e in inside if e[0] == "LLMEngine.schedule_step" and e[1] >= queued[2]), None)
        if step is not None:
            out[GAPS[1]] = step[1] - queued[2]
    steps = [e for e in inside if e[0] == "LLMEngine.finish_step"]
    if steps:
        out[GAPS[2]] = t1 - steps[-1][2]
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        here = (
            Path(__file__).resolve().parent
        )  # run as a file: its folder (bench/, with engine.py) goes first
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        raise SystemExit(serve_with_probes(sys.argv[2], sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=590)
    ap.add_argument("--checkout", default=None, help="serve this checkout's code (default: this one)")
    args = ap.parse_args()
    out = run(args.threads, args.repeats, args.system_words, args.checkout)
    print(f"load average {os.getloadavg()}")
    print(f"{'probe (mean ms inside the TTFT window)':<48}{'W1':>9}{'W2':>9}{'W4':>9}")
    for name in [*out["probes"], *GAPS]:
        row = [out[k]["probes_ms"][name] for k in ("w1", "w2", "w4")]
        print(f"{name:<48}" + "".join(f"{v:>9.2f}" for v in row))
    print(f"{'client TTFT':<48}" + "".join(f"{out[k]['ttft_ms']:>9.2f}" for k in ("w1", "w2", "w4")))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
