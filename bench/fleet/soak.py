"""The fleet soak: many concurrent streams through real gateway processes to the embedded engine and to the stub
fleet, with client disconnects, replicas killed and restarted, and Redis cut and restored.

``G`` prefixgate processes (``python -m gateway.cli serve``, each its own process as in production) serve
two models: ``tiny`` (the embedded engine over a tiny random checkpoint, ``tests/engine/checkpoints.py``) and
``fleet`` (``backend: openai`` over the stub replicas with ``routing: cache_aware`` and ``routing_share``
through a cuttable proxy to the machine's Redis, ``bench.fleet.netfault``). ``streams`` clients loop until
the deadline, each a conversation that grows for a few turns and then starts again, on a random gateway;
a share of them disconnect after the first chunk. Faults: every sixth of the run one replica is killed and
restarted empty a twelfth later; Redis is cut from 40 % to 50 % of the run.

A request is *ok* when its stream ends with ``[DONE]``, a *disconnect* when the client left on purpose,
*upstream-failed* when its stream broke (after the replica's first byte) on the fleet while a replica was being killed
(the failure was already upstream's: the gateway must not retry after the first byte), and *failed*
otherwise. Leaked blocks: KV blocks of the embedded engines still in use once every stream has ended
(``/admin/stats``). RSS: the gateway processes' resident memory summed, sampled every 2 s; the slope is a
least-squares fit after the first quarter (warm-up), in MB per minute, also over the second half alone (a
growth that levels off, a cache filling up to its bound, shows a lower second-half slope than the overall
one; an unbounded one does not), summed and per gateway, with the mean RSS of each quarter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from bench.fleet.netfault import TcpProxy
from bench.fleet.replica import EngineTiming, StubReplica
from bench.fleet.workload import prefix_text

ADMIN_TOKEN = "soak-admin-token"
T = TypeVar("T")


@dataclass(frozen=True)
class SoakConfig:
    """Sizes of one soak."""

    duration_s: float = 600.0
    streams: int = 64
    gateways: int = 2
    n_replicas: int = 4
    time_scale: float = 0.02
    embedded_share: float = 0.25
    disconnect_share: float = 0.05
    seed: int = 18
    first_gateway_env: tuple[tuple[str, str], ...] = ()
    """Extra environment of gateway 0 only: an A/B of a process setting under the same traffic (e.g.
    ``(("MALLOC_ARENA_MAX", "2"),)``); the RSS slope is reported per gateway too."""


class _Gateway:
    """One prefixgate process (``python -m gateway.cli serve``) on a free loopback port."""

    def __init__(self, config_path: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        trace_dir = os.environ.get("SOAK_MEMTRACE_DIR")  # leak diagnosis: bench.fleet.memtrace
        trace = ["-m", "bench.fleet.memtrace", trace_dir] if trace_dir else ["-m"]
        self._args = [
            sys.executable, *trace, "gateway.cli", "serve", "--config", str(config_path),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error",
        ]  # fmt: skip
        self._log_path = log_path
        self._env = env or {}
        self.proc: subprocess.Popen | None = None

    async def start(self, timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **self._env}
        self.proc = subprocess.Popen(
            self._args,
            stdout=subprocess.DEVNULL,
            stderr=self._log_path.open("w"),
            env=env,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as probe:
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"a soak gateway failed to start (log: {self._log_path})")
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"{self.base_url}/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.2)

    def rss_mb(self) -> float:
        """Resident memory of the gateway process, MB."""
        assert self.proc is not None
        return _rss_mb(self.proc.pid)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the bench process dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) in MB per minute; 0.0 with fewer than 3 samples."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else 60 * sum((t - mt) * (v - mv) for t, v in samples) / var


def _by_quarter(samples: list[tuple[float, float]], duration_s: float) -> list[float]:
    """Mean of the (seconds, MB) samples in each quarter of the run, MB (a plateau shows as equal quarters;
    a quarter without samples is left out)."""
    out = []
    for q in range(4):
        values = [v for t, v in samples if q * duration_s / 4 <= t < (q + 1) * duration_s / 4]
        if values:
            out.append(round(sum(values) / len(values), 1))
    return out


async def until_signal(work: Coroutine[Any, Any, T]) -> T | None:
    """Await ``work`` in a task that SIGTERM or SIGINT cancels (its ``finally`` blocks run, so children are
    stopped); returns None when a signal stopped it."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    stopped: list[int] = []

    def stop(signum: int) -> None:
        stopped.append(signum)
        task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if not stopped:
            raise
        return None
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def run_soak(cfg: SoakConfig) -> dict:
    """Run one soak (see the module docstring); returns its counts and the RSS slope."""
    from tests.engine.checkpoints import make_tiny_hf_llama

    rng = random.Random(cfg.seed)
    tmp = Path(tempfile.mkdtemp(prefix="prefixgate-soak-"))
    checkpoint = make_tiny_hf_llama(tmp / "tiny-llama", seed=0)
    timing = EngineTiming(time_scale=cfg.time_scale)
    replicas = [StubReplica(f"r{i}", 20_000, timing) for i in range(cfg.n_replicas)]
    proxy = TcpProxy(6379)
    gateways: list[_Gateway] = []
    restarts: list[asyncio.TimerHandle] = []
    try:
        return await _soak_body(cfg, rng, tmp, checkpoint, timing, replicas, proxy, gateways, restarts)
    finally:
        # Also on cancellation (SIGTERM, SIGINT): no gateway process, replica or proxy outlives the soak.
        for handle in restarts:
            handle.cancel()
        for g in gateways:
            with contextlib.suppress(Exception):
                await g.stop()
        for r in replicas:
            with contextlib.suppress(Exception):
                await r.kill()
        with contextlib.suppress(Exception):
            await proxy.cut()


async def _soak_body(
    cfg: SoakConfig,
    rng: random.Random,
    tmp: Path,
    checkpoint: Path,
    timing: EngineTiming,
    replicas: list[StubReplica],
    proxy: TcpProxy,
    gateways: list[_Gateway],
    restarts: list[asyncio.TimerHandle],
) -> dict:
    for r in replicas:
        await r.start()
    await proxy.start()
    config = {
        "admin": {"token": ADMIN_TOKEN},
        "rules": ["default"],
        "models": [
            {
                "name": "tiny",
                "backend": "embedded",
                "path": str(checkpoint),
                "engine": {"block_size": 16, "num_blocks": 512, "max_batch": 16, "device": "cpu"},
            },
            {
                "name": "fleet",
                "backend": "openai",
                "base_url": [r.base_url for r in replicas],
                "retries": 3,
                "timeout_s": 30,
                "ring": {"cooldown_s": 0.5, "max_cooldown_s": 2},
                "routing": "cache_aware",
                "routing_share": {
                    "redis_url": f"redis://127.0.0.1:{proxy.port}/0",
                    "interval_s": 0.2,
                    "timeout_s": 0.2,
                    "retry_after_s": 1.0,
                },
            },
        ],
    }
    config_path = tmp / "prefixgate.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    gateways.extend(
        _Gateway(config_path, tmp / f"gateway{i}.log", dict(cfg.first_gateway_env) if i == 0 else None)
        for i in range(cfg.gateways)
    )
    for g in gateways:
        await g.start()

    counts = {"ok": 0, "disconnect": 0, "upstream_failed": 0, "failed": 0}
    failures: list[str] = []
    killing: list[tuple[float, float]] = []  # (start, end) of each replica kill, monotonic seconds
    rss: list[tuple[float, float]] = []  # (seconds, MB summed over the gateway processes)
    rss_each: list[list[tuple[float, float]]] = [[] for _ in gateways]  # per gateway process
    t0 = time.monotonic()
    deadline = t0 + cfg.duration_s
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(60.0, connect=5.0), limits=httpx.Limits(max_connections=500)
    )

    def during_kill(start: float, end: float) -> bool:
        return any(k0 <= end and start <= k1 + 1.0 for k0, k1 in killing)

    async def one(srng: random.Random, model: str, messages: list[dict]) -> str | None:
        gateway = gateways[srng.randrange(len(gateways))]
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        leave_early = srng.random() < cfg.disconnect_share
        started = time.monotonic()
        got_content = False
        text: list[str] = []
        try:
            async with client.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    counts["failed"] += 1
                    failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    return None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        counts["ok"] += 1
                        return "".join(text)
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        # A stream cut after the replica's first byte while a replica was being killed: the
                        # failure was already upstream's (nothing may be retried after the first byte).
                        if model == "fleet" and during_kill(started, time.monotonic()):
                            counts["upstream_failed"] += 1
                        else:
                            counts["failed"] += 1
                            failures.append(f"error event: {json.dumps(obj)[:200]}")
                        return None
                    for choice in obj.get("choices") or []:
                        delta = (choice.get("delta") or {}).get("content")
                        if delta:
                            got_content = True
                            text.append(delta)
                    if leave_early and got_content:
                        counts["disconnect"] += 1
                        return None  # leaving the block closes the connection mid-stream
        except (httpx.HTTPError, ValueError) as exc:
            counts["failed"] += 1
            failures.append(f"{type(exc).__name__}: {exc}")
            return None
        counts["failed"] += 1
        failures.append("stream ended without [DONE]")
        return None

    async def stream_loop(i: int) -> None:
        srng = random.Random(rng.random())
        while time.monotonic() < deadline:
            model = "tiny" if srng.random() < cfg.embedded_share else "fleet"
            words = 40 if model == "tiny" else 300
            system = prefix_text(srng.randrange(8), cfg.seed, words)
            messages = [{"role": "system", "content": system}]
            for turn in range(srng.randint(1, 3 if model == "tiny" else 5)):
                if time.monotonic() >= deadline:
                    return
                messages.append({"role": "user", "content": f"turn {turn} of stream {i}: tell me more"})
                reply = await one(srng, model, messages)
                if reply is None:
                    break
                messages.append({"role": "assistant", "content": reply})

    async def faults() -> None:
        step = cfg.duration_s / 6
        redis_cut = redis_back = False
        next_kill = t0 + step / 2
        while time.monotonic() < deadline:
            now = time.monotonic()
            frac = (now - t0) / cfg.duration_s
            if not redis_cut and frac >= 0.4:
                await proxy.cut()
                redis_cut = True
            if redis_cut and not redis_back and frac >= 0.5:
                await proxy.start()
                redis_back = True
            if now >= next_kill:
                victim = rng.choice([r for r in replicas if r.up])
                k0 = time.monotonic()
                killing.append((k0, k0 + step / 2))  # before the kill: its streams break while it runs
                await victim.kill()
                restarts.append(
                    asyncio.get_running_loop().call_later(
                        step / 2, lambda v=victim: asyncio.ensure_future(v.start())
                    )
                )
                next_kill += step
            if not rss or now - rss[-1][0] - t0 >= 2.0:
                each = [g.rss_mb() for g in gateways]
                rss.append((now - t0, sum(each)))
                for samples, mb in zip(rss_each, each, strict=True):
                    samples.append((now - t0, mb))
            await asyncio.sleep(0.1)

    fault_task = asyncio.create_task(faults())
    try:
        await asyncio.gather(*(stream_loop(i) for i in range(cfg.streams)))
        await fault_task
    finally:
        fault_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await fault_task
        await client.aclose()

    leaked = 0
    async with httpx.AsyncClient(timeout=120) as admin:
        for g in gateways:
            for _ in range(200):
                r = await admin.get(
                    f"{g.base_url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                )
                m = r.json()["models"]["tiny"]
                if m["blocks"]["used"] == 0 and m["engine"]["running"] == 0 and m["engine"]["waiting"] == 0:
                    break
                await asyncio.sleep(0.05)
            leaked += m["blocks"]["used"]
    warm = [s for s in rss if s[0] >= cfg.duration_s / 4]
    second_half = [s for s in rss if s[0] >= cfg.duration_s / 2]
    return {
        "soak_duration_s": round(time.monotonic() - t0, 1),
        "soak_requests": sum(counts.values()),
        "soak_ok": counts["ok"],
        "soak_disconnects": counts["disconnect"],
        "soak_upstream_failed": counts["upstream_failed"],
        "soak_failed": counts["failed"],
        "soak_leaked_blocks": leaked,
        "soak_rss_mb": round(rss[-1][1], 1) if rss else None,
        "soak_rss_slope_mb_per_min": round(_slope_per_min(warm), 3),
        "soak_rss_slope_per_gateway": [
            round(_slope_per_min([x for x in samples if x[0] >= cfg.duration_s / 4]), 3)
            for samples in rss_each
        ],
        "soak_rss_slope_second_half_mb_per_min": round(_slope_per_min(second_half), 3),
        "soak_rss_slope_second_half_per_gateway": [
            round(_slope_per_min([x for x in samples if x[0] >= cfg.duration_s / 2]), 3)
            for samples in rss_each
        ],
        "soak_rss_mb_by_quarter": _by_quarter(rss, cfg.duration_s),
        "soak_first_gateway_env": dict(cfg.first_gateway_env),
        "soak_failures_sample": failures[:5],
        "soak_kills": len(killing),
    }


if __name__ == "__main__":  # python -m bench.fleet.soak [SECONDS]
    import sys

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    # SOAK_FIRST_GATEWAY_ENV="NAME=VALUE,...": gateway 0's extra environment (an A/B, see SoakConfig).
    extra = tuple(
        tuple(item.split("=", 1))
        for item in os.environ.get("SOAK_FIRST_GATEWAY_ENV", "").split(",")
        if "=" in item
    )
    result = asyncio.run(until_signal(run_soak(SoakConfig(duration_s=seconds, first_gateway_env=extra))))
    if result is None:
        print("bench.fleet.soak: stopped by a signal", file=sys.stderr)
        sys.exit(130)
    print(json.dumps(result))
