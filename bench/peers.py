"""prefixgate beside llama.cpp's own ``llama-server``, over HTTP, in one run (``python -m bench.engine --peers``).

Both serve the same GGUF with the same thread count; llama-server with 8 parallel slots and the same total
context as our KV pool. Every request goes to one server and then the same request to the other (the order
alternates), so load from other processes on this shared machine falls on both. Figures are client-side,
from streamed OpenAI chat completions (``/v1/chat/completions``, greedy) sent through one keep-alive
``httpx.Client`` per server (``Server.http_client``, as an SDK client is reused; until session 8 each request
built its own client, whose set-up was inside every TTFT, both servers'):

- W1 cold TTFT: a new ~1,000-token system prompt (a fresh session line first, so no server has it cached) and
  a ~50-token question, ``max_tokens=1``.
- W2 warm TTFT: the same system prompt, sent once before, with a new question.
- W3 decode: one stream at ~1,000 tokens of context, 64 tokens; tokens/s after the first token.
- W4: four system prompts in turn (S1 q, S2 q, S3 q, S4 q, S1 q', ...), mean TTFT over every turn, the first
  (cold) round included; ``w4_alternating_median`` is the median, as reported until session 18.
- W5: 8 concurrent streams sharing the system prompt, aggregate tokens/s (all tokens over the makespan).
- peak RSS of each server process (``VmHWM``).

The other workloads report the median of their runs.

Ratios are prefixgate / llama-server (TTFT: lower is better; tokens/s: higher is better). ``w5_8streams_vs_peer_b1``
is our W5 aggregate over llama-server's W3 one-stream rate. ``cached_over_cold`` is our W2 over our W1.
``w5_shared_prefix_speedup`` is our W5 over a second prefixgate with shared-prefix decode attention switched off
(``engine.shared_prefix_attention: false``), run after the side-by-side part.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.engine import QUESTIONS, SYSTEM_SENTENCES

MODEL = "smollm2"
STORY = [
    "Write a long, detailed story about a night train crossing the mountains, with dialogue.",
    "Describe, step by step and at length, how the rail company plans its winter timetable.",
    "Write a long letter from a conductor to her brother about her first year on the job.",
    "Tell a long fairy tale about a bicycle that wanted to ride the train to the sea.",
    "Explain at length how ticket zones work, with many worked examples of prices.",
    "Write a long diary entry of a station master during a very busy holiday weekend.",
    "Describe in detail the journey from the central station to the airport, stop by stop.",
    "Write a long dialogue between two passengers who missed the last train of the night.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    """Peak resident set (``VmHWM``) of a process in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path
    _client: httpx.Client | None = None
    resends: int = 0  # requests sent again after a keep-alive connection closed before any response byte

    def wait_ready(self, timeout: float = 600.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log}")
            try:
                if (
                    httpx.get(
                        self.url + "/health" if self.name == "llama-server" else self.url + "/healthz",
                        timeout=2,
                    ).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; log: {self.log}")

    def http_client(self) -> httpx.Client:
        """The one keep-alive client of this server (made on first use), as an SDK client is reused: a new
        ``httpx.Client`` per request (what ``httpx.stream`` builds) costs tens of milliseconds of SSL context
        set-up on this machine, before the request is sent, inside every TTFT measured from the call."""
        if self._client is None:
            self._client = httpx.Client(timeout=600)
        return self._client

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prefixgate_engine_settings(threads: int, ctx_tokens: int, linear_kernel: str = "auto") -> dict:
    """The ``engine:`` mapping prefixgate is benchmarked with (``engine.api.EngineConfig`` fields): a KV pool
    of ``ctx_tokens`` in blocks of 16, bf16 KV, batches of up to 16 sequences and 2,048 tokens, no idle reply
    prefill (background work for next turns these workloads never send, which would fall on the peer's
    measurement; ``bench.next_turn`` measures it); ``linear_kernel``: ``engine.linear_kernel``
    (``--linear-kernel``)."""
    return {
        "linear_kernel": linear_kernel,
        "num_blocks": ctx_tokens // 16,
        "block_size": 16,
        "max_batch": 16,
        "max_num_batched_tokens": 2048,
        "num_threads": threads,
        "weights": "auto",
        "kv_dtype": "bfloat16",
        # no workload here sends a conversation's next turn, and the idle prefill of each reply would run in
        # the time the bench then gives llama-server (one A/B on a 2-core EPYC: its decode 80 vs 94 tok/s)
        "idle_reply_prefill": False,
    }


def start_prefixgate(
    gguf: str,
    threads: int,
    ctx_tokens: int,
    workdir: Path,
    shared_prefix: bool = True,
    linear_kernel: str = "auto",
) -> Server:
    port = free_port()
    engine = prefixgate_engine_settings(threads, ctx_tokens, linear_kernel)
    if not shared_prefix:
        engine["shared_prefix_attention"] = False
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "rules": [],
        "models": [{"name": MODEL, "backend": "embedded", "path": gguf, "engine": engine}],
    }
    path = workdir / f"prefixgate-{port}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    log = workdir / f"prefixgate-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-level", "warning"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return Server("prefixgate", proc, f"http://127.0.0.1:{port}", log)


def start_llama_server(binary: str, gguf: str, threads: int, ctx_tokens: int, workdir: Path) -> Server:
    port = free_port()
    log = workdir / f"llama-server-{port}.log"
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", "8", "-c", str(ctx_tokens)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "-a", MODEL, "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return Server("llama-server", proc, f"http://127.0.0.1:{port}", log)


@dataclass
class Result:
    ttft_s: float
    tokens: int
    seconds: float  # submit -> last token
    first_to_last_s: float


STALE_RESENDS = 2
"""Times ``chat`` sends a request again when its keep-alive connection was closed before any response byte."""


@contextlib.contextmanager
def open_stream(server: Server, client: httpx.Client, body: dict) -> Iterator[httpx.Response]:
    """``client.stream`` of a chat completion, sent again (up to ``STALE_RESENDS`` times, counted in
    ``server.resends``) when the server closed the reused connection before answering: llama-server (its
    cpp-httplib) dropped ~1 in 120 back-to-back keep-alive requests that way here, which the official SDKs
    retry by default (``max_retries=2``) and which stopped whole runs of this bench. An error after the
    response began is raised."""
    for attempt in range(STALE_RESENDS + 1):
        cm = client.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600)
        try:
            r = cm.__enter__()
        except httpx.RemoteProtocolError:
            if attempt == STALE_RESENDS:
                raise
            server.resends += 1
            continue
        try:
            yield r
        except BaseException as e:
            if not cm.__exit__(type(e), e, e.__traceback__):
                raise
        else:
            cm.__exit__(None, None, None)
        return


def chat(server: Server, system: str, question: str, max_tokens: int) -> Result:
    """One streamed greedy chat completion; client-side TTFT, tokens and timings."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    client = server.http_client()
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    with open_stream(server, client, body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage_tokens = ev["usage"].get("completion_tokens")
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    end = time.perf_counter()
    first = first or end
    last = last or end
    return Result(first - t0, usage_tokens if usage_tokens is not None else chunks, end - t0, last - first)


def decode_rate(r: Result) -> float:
    return (r.tokens - 1) / r.first_to_last_s if r.tokens > 1 and r.first_to_last_s > 0 else float("nan")


def system_text(words: int, session: str | None) -> str:
    text, i = "", 0
    while len(text.split()) < words:
        text += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] + " "
        i += 1
    return (f"Session {session}. " if session else "") + text.strip()


def concurrent(server: Server, system: str, questions: list[str], max_tokens: int) -> tuple[float, int]:
    """Aggregate tokens/s of ``questions`` sent at once (makespan from the first submit)."""
    results: list[Result | None] = [None] * len(questions)

    def run(i: int) -> None:
        results[i] = chat(server, system, questions[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results if r is not None)
    return tokens / span, tokens


def summary(key: str, values: list[float]) -> float:
    """One figure of a workload's runs: W4's is their mean, as the issue defines it (every turn counts: the first
    round of the four system prompts is cold on both servers, the later rounds show whether a server kept all four
    cached); the others take the median (robust to this shared machine's outliers). Until session 18 W4 took
    the median too, which with 12 turns of which 4 cold was a warm turn's TTFT."""
    return statistics.mean(values) if key == "w4_alternating" else statistics.median(values)


def run_peers(
    gguf: str,
    llama_server: str,
    threads: int,
    repeats: int,
    system_words: int = 590,
    linear_kernel: str = "auto",
) -> dict:
    """Start both servers, run W1..W5 alternated, stop them; return the figures (see the module docstring).
    ``linear_kernel``: prefixgate's ``engine.linear_kernel`` (``auto``; ``int8-activations`` for its int8 GEMVs)."""
    ctx = 16384  # tokens: 8 slots x 2048 for llama-server, 1,024 blocks of 16 for us
    workdir = Path(tempfile.mkdtemp(prefix="prefixgate-peers-"))
    ours = start_prefixgate(gguf, threads, ctx, workdir, linear_kernel=linear_kernel)
    peer = start_llama_server(llama_server, gguf, threads, ctx, workdir)
    try:
        ours.wait_ready()
        peer.wait_ready()
        servers = [ours, peer]
        figures: dict[str, dict[str, list[float]]] = {s.name: {} for s in servers}

        def record(key: str, server: Server, value: float) -> None:
            figures[server.name].setdefault(key, []).append(value)

        def pair(i: int, key: str | None, system: str, question: str, max_tokens: int, measure=None) -> None:
            """The same request to both servers (order alternating with ``i``), recording ``measure(result)``."""
            for s in servers if i % 2 == 0 else servers[::-1]:
                res = chat(s, system, question, max_tokens)
                if key is not None:
                    record(key, s, measure(res))

        ttft = lambda r: r.ttft_s  # noqa: E731
        pair(0, None, system_text(system_words, "warm-up"), QUESTIONS[0], 2)
        # W1 cold TTFT and W2 warm TTFT
        for i in range(repeats):
            system = system_text(system_words, f"{i}-{time.time_ns()}")
            pair(i, "w1_cold_ttft", system, QUESTIONS[i % 4], 1, ttft)
            for j in range(2):
                pair(i + j, "w2_warm_ttft", system, QUESTIONS[(i + j + 1) % 4] + f" (follow-up {j})", 1, ttft)
        # W3 decode, one stream
        system = system_text(system_words, "decode")
        for i in range(repeats):
            pair(i, "w3_decode_b1", system, STORY[i % 8], 64, decode_rate)
        # W4 four system prompts alternating
        prompts = [system_text(system_words, f"tenant-{k}-{time.time_ns()}") for k in range(4)]
        for i in range(4 * max(2, repeats)):
            pair(i, "w4_alternating", prompts[i % 4], QUESTIONS[i % 4] + f" (turn {i // 4})", 1, ttft)
        # W5 8 concurrent streams sharing the system prompt
        system = system_text(system_words, "shared")
        pair(0, None, system, QUESTIONS[0], 1)
        for i in range(repeats):
            for s in servers if i % 2 == 0 else servers[::-1]:
                record("w5_8streams", s, concurrent(s, system, STORY, 64)[0])
        rss = {s.name: peak_rss_mb(s.proc.pid) for s in servers}
    finally:
        ours.stop()
        peer.stop()
    fig = {n: {k: summary(k, v) for k, v in f.items()} for n, f in figures.items()}
    for n, f in figures.items():  # W4's median beside its mean, for runs before the mean (session 18)
        fig[n]["w4_alternating_median"] = statistics.median(f["w4_alternating"])
    a, b = fig["prefixgate"], fig["llama-server"]
    out = {
        "prefixgate": a | {"peak_rss_mb": rss["prefixgate"], "stale_resends": ours.resends},
        "llama_server": b | {"peak_rss_mb": rss["llama-server"], "stale_resends": peer.resends},
        "peer_ratios": {
            "w1_cold_ttft": a["w1_cold_ttft"] / b["w1_cold_ttft"],
            "w2_warm_ttft": a["w2_warm_ttft"] / b["w2_warm_ttft"],
            "w3_decode_b1": a["w3_decode_b1"] / b["w3_decode_b1"],
            "w4_alternating": a["w4_alternating"] / b["w4_alternating"],
            "w4_alternating_median": a["w4_alternating_median"] / b["w4_alternating_median"],
            "w5_8streams_vs_peer_b1": a["w5_8streams"] / b["w3_decode_b1"],
            "w5_8streams": a["w5_8streams"] / b["w5_8streams"],
            "peak_rss": rss["prefixgate"] / rss["llama-server"],
        },
        "cached_over_cold": a["w2_warm_ttft"] / a["w1_cold_ttft"],
        "linear_kernel": linear_kernel,
        "runs": figures,
    }
    # shared-prefix attention off: a second prefixgate, W5 only (after the side-by-side part)
    off = start_prefixgate(gguf, threads, ctx, workdir, shared_prefix=False, linear_kernel=linear_kernel)
    on = start_prefixgate(gguf, threads, ctx, workdir, linear_kernel=linear_kernel)
    try:
        off.wait_ready()
        on.wait_ready()
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for s in (on, off):
            chat(s, system, QUESTIONS[0], 1)
        for i in range(repeats):
            for key, s in (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on)):
                rates[key].append(concurrent(s, system, STORY, 64)[0])
    finally:
        off.stop()
        on.stop()
    out["w5_shared_prefix_on_tps"] = statistics.median(rates["on"])
    out["w5_shared_prefix_off_tps"] = statistics.median(rates["off"])
    out["w5_shared_prefix_speedup"] = out["w5_shared_prefix_on_tps"] / out["w5_shared_prefix_off_tps"]
    return out


TARGETS = {
    "w1_cold_ttft": ("<=", 0.15),
    "w2_warm_ttft": ("<=", 0.3),
    "w3_decode_b1": (">=", 2.0),
    "w4_alternating": ("<=", 0.25),
    "w5_8streams_vs_peer_b1": (">=", 6.0),
    "peak_rss": ("<=", 1.2),
}


def print_table(out: dict) -> None:
    a, b, r = out["prefixgate"], out["llama_server"], out["peer_ratios"]
    rows = [
        ("W1 cold TTFT (s)", "w1_cold_ttft", "w1_cold_ttft"),
        ("W2 warm TTFT (s)", "w2_warm_ttft", "w2_warm_ttft"),
        ("W3 decode b1 (tok/s)", "w3_decode_b1", "w3_decode_b1"),
        ("W4 alternating TTFT (s)", "w4_alternating", "w4_alternating"),
        ("W5 8 streams (tok/s)", "w5_8streams", "w5_8streams_vs_peer_b1"),
        ("peak RSS (MiB)", "peak_rss_mb", "peak_rss"),
    ]
    print(f"{'workload':<26}{'prefixgate':>12}{'llama-server':>14}{'ratio':>9}  target")
    for label, key, rkey in rows:
        op, target = TARGETS[rkey]
        ratio = r[rkey]
        met = ratio <= target if op == "<=" else ratio >= target
        note = " (vs peer b1)" if rkey == "w5_8streams_vs_peer_b1" else ""
        print(
            f"{label:<26}{a[key]:>12.3f}{b[key]:>14.3f}{ratio:>9.3f}  {op} {target}{note} {'met' if met else 'NOT met'}"
        )
    print(
        f"cached_over_cold {out['cached_over_cold']:.3f} (<= 0.08)   w5_shared_prefix_speedup "
        f"{out['w5_shared_prefix_speedup']:.2f} (>= 1.5; on {out['w5_shared_prefix_on_tps']:.1f} vs off "
        f"{out['w5_shared_prefix_off_tps']:.1f} tok/s)"
    )
