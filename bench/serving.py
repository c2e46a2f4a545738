"""Decode speed of the embedded engine in-process and over HTTP, interleaved in one run (issue 12).

``python -m bench.serving`` loads the model here and starts ``prefixgate serve`` on it (``bench.peers``' engine
settings: bf16 KV, 1,024 blocks, batch 16), then runs the same greedy requests, in turn, through:

- ``engine``: ``LLMEngine.step()`` in a loop in this process (what ``bench.engine`` times);
- ``async`` (only when ``--modes`` names it): ``AsyncEngine`` in this process, its streams consumed on an
  asyncio loop (the step thread and the hand-off to the loop; no gateway, no HTTP);
- ``engine-off`` / ``async-off`` (only when ``--modes`` names them): the same with ``engine.small_step_threads:
  off`` (every step on ``--threads`` threads; ``engine.step_threads``), for an interleaved A/B of that setting;
- ``http`` (one per ``--server NAME=DIR``, default ``http=.``): ``prefixgate serve`` run from checkout ``DIR``
  in a subprocess, streamed OpenAI chat completions (``/v1/chat/completions``) read by httpx client threads in
  this process. Several servers compare checkouts (``--server main=/work/main --server new=.``) in one run.

Workloads: ``b1``, one request at ~1,070 tokens of context (a ~1,000-token system prompt, cached, and a story
question), ``--new`` tokens; ``b8``, 8 such requests at once sharing the system prompt. Decode rate: text
events (one per token with text, the same events in every mode: ``RequestOutput.text``, ``TextDelta.text``,
an SSE chunk with ``delta.content``) that arrive inside the window in which every stream of the run has had its
first event and none its last, over that window. The greedy texts must be equal in every mode (checked).

CPU: for each run, the CPU seconds of this process (in ``http`` runs: the client) and of the server process
(its event-loop thread, i.e. the main thread, apart), over the run's wall time, and the engine's forward time
(``decode_seconds`` + ``prefill_seconds`` of its counters: ``run_step``, the forward pass and sampling) over the
same wall time: ``forward_share`` near 1 means the steps run back to back; the per-token forward time says
whether the forward pass itself slowed down (CPU contention) or time went between steps.

In-process modes share this process's OpenMP runtime: each engine's stepping thread keeps its own OpenMP team, and
with more teams than cores libgomp stops spinning between parallel regions (``engine.openmp_threads``), so two
in-process modes in one run slow each other down (session 14: ``engine`` b1 47-54 tokens/s beside ``async``,
106 alone; the ``http`` servers are processes of their own). Compare in-process modes one per run, or against
``http`` servers; the run warns when it holds more than one.

Every figure is the median of ``--repeats`` runs; modes rotate inside each repeat, so load from other processes
on this shared machine falls on all of them. The figures to read are the ratios ``http / engine`` (and
``async / engine``) of the same run. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import torch

from bench.peers import MODEL, STORY, Server, free_port, prefixgate_engine_settings, system_text
from engine.api import EngineConfig, GenerationRequest, SamplingParams, TextDelta
from engine.async_engine import AsyncEngine
from engine.checkpoint import default_model_path, load_checkpoint
from engine.llm_engine import LLMEngine

CTX_TOKENS = 16384
"""KV pool of every engine here, in tokens (``bench.peers``' figure)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One run of one mode: the event times of each stream (seconds, ``time.perf_counter``), their texts and
    the CPU and forward-pass seconds spent during it."""

    events: list[list[float]]
    texts: list[str]
    wall_s: float
    own_cpu_s: float
    server_cpu_s: float = 0.0
    server_loop_cpu_s: float = 0.0
    forward_s: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def decode_rate(self) -> float:
        """Aggregate text events per second inside the window where every stream is decoding."""
        start = max(e[0] for e in self.events)
        end = min(e[-1] for e in self.events)
        if len(self.events) == 1:
            return (len(self.events[0]) - 1) / (end - start)
        inside = sum(1 for e in self.events for t in e if start < t <= end)
        return inside / (end - start) if end > start else float("nan")


@dataclass
class Workload:
    name: str
    prompts: list[list[dict]]  # chat messages per stream
    max_tokens: int
    runs: dict[str, list[Run]] = field(default_factory=dict)


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid`` (``/proc/PID/task/TID/stat`` fields 14 and 15)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- the modes -------------------------------------------------------------------------------------------


def run_engine(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Run:
    """The prompts submitted at once to a synchronous engine, stepped in a loop here."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    c0, f0 = own_cpu(), eng.counters.decode_seconds + eng.counters.prefill_seconds
    d0 = (eng.counters.decode_tokens, eng.counters.decode_seconds)
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, params).request_id for p in prompts]
    slot = {rid: i for i, rid in enumerate(reqs)}
    events: list[list[float]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.text:
                events[slot[o.request_id]].append(now)
                texts[slot[o.request_id]] += o.text
    wall = time.perf_counter() - t0
    c = eng.counters
    return Run(
        events,
        texts,
        wall,
        own_cpu() - c0,
        forward_s=c.decode_seconds + c.prefill_seconds - f0,
        decode_tokens=c.decode_tokens - d0[0],
        decode_seconds=c.decode_seconds - d0[1],
    )


def run_async(aeng: AsyncEngine, chats: list[list[dict]], max_tokens: int) -> Run:
    """The chats submitted at once to an ``AsyncEngine`` and consumed on a fresh asyncio loop here."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    c = aeng.core.counters
    c0, f0 = own_cpu(), c.decode_seconds + c.prefill_seconds
    d0 = (c.decode_tokens, c.decode_seconds)
    events: list[list[float]] = [[] for _ in chats]
    texts = [""] * len(chats)

    async def one(i: int) -> None:
        async for event in aeng.generate(GenerationRequest(messages=chats[i], params=params)):
            if isinstance(event, TextDelta) and event.text:
                events[i].append(time.perf_counter())
                texts[i] += event.text

    async def all_of() -> None:
        await asyncio.gather(*(one(i) for i in range(len(chats))))

    t0 = time.perf_counter()
    asyncio.run(all_of())
    wall = time.perf_counter() - t0
    with aeng._cond:  # the engine lock: its counters are written by the step thread
        fwd = c.decode_seconds + c.prefill_seconds - f0
        dt, ds = c.decode_tokens - d0[0], c.decode_seconds - d0[1]
    return Run(events, texts, wall, own_cpu() - c0, forward_s=fwd, decode_tokens=dt, decode_seconds=ds)


def stream_chat(url: str, chat: list[dict], max_tokens: int, events: list[float], text: list[str]) -> None:
    """One streamed greedy chat completion; appends the arrival time of each content chunk."""
    body = {"model": MODEL, "messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    events.append(time.perf_counter())
                    text.append(content)


def engine_counters(server: Server) -> tuple[float, int, float]:
    """(forward seconds, decode tokens, decode seconds) of the server's engine (``GET /admin/stats``)."""
    stats = httpx.get(server.url + "/admin/stats", timeout=30).json()
    model = stats["models"][MODEL]
    eng = model["engine"]
    return model["prefill_seconds"] + eng["decode_seconds"], eng["decode_tokens"], eng["decode_seconds"]


def run_http(server: Server, chats: list[list[dict]], max_tokens: int) -> Run:
    """The chats sent at once, one client thread each, to a ``prefixgate serve``."""
    events: list[list[float]] = [[] for _ in chats]
    texts: list[list[str]] = [[] for _ in chats]
    threads = [
        threading.Thread(target=stream_chat, args=(server.url, chats[i], max_tokens, events[i], texts[i]))
        for i in range(len(chats))
    ]
    f0, dt0, ds0 = engine_counters(server)
    pid = server.proc.pid
    s0, c0 = thread_cpu(pid), own_cpu()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    own, s1 = own_cpu() - c0, thread_cpu(pid)
    f1, dt1, ds1 = engine_counters(server)
    server_cpu = sum(v - s0.get(tid, 0.0) for tid, v in s1.items())
    return Run(
        events,
        ["".join(t) for t in texts],
        wall,
        own,
        server_cpu_s=server_cpu,
        server_loop_cpu_s=s1.get(pid, 0.0) - s0.get(pid, 0.0),
        forward_s=f1 - f0,
        decode_tokens=dt1 - dt0,
        decode_seconds=ds1 - ds0,
    )


def start_server(name: str, root: Path, gguf: str, threads: int, workdir: Path) -> Server:
    """``prefixgate serve`` from checkout ``root`` (its own ``PYTHONPATH``), with ``bench.peers``' settings."""
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "rules": [],
        "models": [
            {
                "name": MODEL,
                "backend": "embedded",
                "path": gguf,
                "engine": prefixgate_engine_settings(threads, CTX_TOKENS),
            }
        ],
    }
    path = workdir / f"{name}-{port}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    log = workdir / f"{name}-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(root.resolve()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-level", "warning"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
    )
    return Server(name, proc, f"http://127.0.0.1:{port}", log)


# ---- the run ---------------------------------------------------------------------------------------------


def summarize(runs: list[Run]) -> dict[str, float]:
    """Medians over runs: decode rate, CPU shares of the wall time, forward share and ms per decode token."""

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "decode_tps": med([r.decode_rate() for r in runs]),
        "wall_s": med([r.wall_s for r in runs]),
        "own_cpu_share": med([r.own_cpu_s / r.wall_s for r in runs]),
        "server_cpu_share": med([r.server_cpu_s / r.wall_s for r in runs]),
        "server_loop_cpu_share": med([r.server_loop_cpu_s / r.wall_s for r in runs]),
        "forward_share": med([r.forward_s / r.wall_s for r in runs]),
        "forward_ms_per_decode_token": med(
            [1e3 * r.decode_seconds / r.decode_tokens for r in runs if r.decode_tokens]
        ),
        "events": med([sum(len(e) for e in r.events) for r in runs]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file, or 'default' (SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, here and in the servers")
    ap.add_argument("--new", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8, help="concurrent requests of the second workload")
    ap.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="NAME=DIR",
        help="an HTTP mode: prefixgate serve run from checkout DIR (repeatable; default http=.)",
    )
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes to run (default: engine and the servers; async, engine-off, async-off on request)",
    )
    ap.add_argument("--workloads", default="b1,b8", help="b1, b8 or both")
    args = ap.parse_args()
    from gateway.cli import limit_malloc_arenas

    limit_malloc_arenas()  # as the server does
    torch.set_num_threads(args.threads)
    gguf = default_model_path() if args.model == "default" else args.model
    servers_spec = [s.split("=", 1) for s in (args.server or ["http=."])]
    workdir = Path(tempfile.mkdtemp(prefix="prefixgate-serving-"))
    modes = ["engine", *(name for name, _ in servers_spec)]  # one in-process mode by default (see above)
    if args.modes:
        known = ["engine", "engine-off", "async", "async-off", *(name for name, _ in servers_spec)]
        modes = [m for m in args.modes.split(",") if m in known]
    in_process = [m for m in modes if m.startswith(("engine", "async"))]
    if len(in_process) > 1:
        print(
            f"warning: {len(in_process)} in-process modes ({', '.join(in_process)}) share this process's OpenMP "
            "runtime and slow each other down (engine.openmp_threads); run them one per process to compare",
            file=sys.stderr,
        )
    servers = {
        name: start_server(name, Path(root), gguf, args.threads, workdir)
        for name, root in servers_spec
        if name in modes
    }
    try:
        config = EngineConfig(**prefixgate_engine_settings(args.threads, CTX_TOKENS))
        ck = load_checkpoint(gguf, weights=config.weights)
        engines = {}
        for mode in ("engine", "engine-off", "async", "async-off"):
            if mode in modes:
                cfg = replace(config, small_step_threads="off") if mode.endswith("-off") else config
                core = LLMEngine(ck.model, cfg, ck.model_id, ck.tokenizer)
                engines[mode] = AsyncEngine(core, ck.tokenizer) if mode.startswith("async") else core
        for s in servers.values():
            s.wait_ready()
        system = system_text(590, "serving")
        workloads = []
        if "b1" in args.workloads:
            workloads.append(Workload("b1", [messages(system, STORY[0])], args.new))
        if "b8" in args.workloads:
            n = args.streams
            workloads.append(Workload(f"b{n}", [messages(system, STORY[i % 8]) for i in range(n)], args.new))

        def run(mode: str, w: Workload) -> Run:
            if mode.startswith("engine"):
                prompts = [ck.tokenizer.render_chat(m) for m in w.prompts]
                return run_engine(engines[mode], prompts, w.max_tokens)
            if mode.startswith("async"):
                return run_async(engines[mode], w.prompts, w.max_tokens)
            return run_http(servers[mode], w.prompts, w.max_tokens)

        for mode in modes:  # warm-up: the system prompt cached everywhere, allocators and pools warm
            for w in workloads:
                run(mode, w)
        for i in range(args.repeats):
            for w in workloads:
                order = modes[i % len(modes) :] + modes[: i % len(modes)]
                for mode in order:
                    result = run(mode, w)
                    w.runs.setdefault(mode, []).append(result)
                    print(
                        f"repeat {i} {w.name} {mode}: {result.decode_rate():.1f} tok/s, "
                        f"load {os.getloadavg()[0]:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
        prompt_tokens = len(ck.tokenizer.render_chat(workloads[0].prompts[0]))
    finally:
        for s in servers.values():
            s.stop()
    out: dict = {
        "model": ck.model_id,
        "threads": args.threads,
        "prompt_tokens": prompt_tokens,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "servers": dict(servers_spec),
    }
    for w in workloads:
        texts = {mode: [r.texts for r in runs] for mode, runs in w.runs.items()}
        reference = texts[modes[0]][0]
        same = all(t == reference for per_mode in texts.values() for t in per_mode)
        summary = {mode: summarize(runs) for mode, runs in w.runs.items()}
        base = summary.get("engine", summary[modes[0]])["decode_tps"]
        for mode in summary:
            summary[mode]["over_engine"] = summary[mode]["decode_tps"] / base
        out[w.name] = {"same_text_every_mode": same, "modes": summary}
        out[w.name]["runs"] = {
            mode: [round(r.decode_rate(), 2) for r in runs] for mode, runs in w.runs.items()
        }
    print(f"model {out['model']}  threads {args.threads}  prompt {prompt_tokens} tokens  new {args.new}")
    cols = ("decode_tps", "over_engine", "forward_ms_per_decode_token", "forward_share")
    cols += ("own_cpu_share", "server_cpu_share", "server_loop_cpu_share")
    print(f"{'workload':<9}{'mode':<10}" + "".join(f"{c[:18]:>20}" for c in cols))
    for w in workloads:
        for mode, row in out[w.name]["modes"].items():
            print(f"{w.name:<9}{mode:<10}" + "".join(f"{row[c]:>20.3f}" for c in cols))
        print(f"{w.name:<9}same greedy text in every mode: {out[w.name]['same_text_every_mode']}")
    print(f"load average after: {out['loadavg_after']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
