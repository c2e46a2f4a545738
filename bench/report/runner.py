"""The benchmarks a report runs: each one a subprocess (``python -m bench.X ...``) whose last stdout line is its
JSON line; the line goes to ``results.jsonl`` (one record per benchmark) and the whole output to ``raw/``.

Invariants: a record is written only for a benchmark that exited 0 with a JSON object as its last line; a
benchmark that failed or was not run leaves a ``Skipped`` (its reason) and no record. Records of an earlier
run (``--reuse``) are read back as they are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root (benchmarks run with it as working directory and on ``PYTHONPATH``)."""


class BenchError(RuntimeError):
    """A benchmark exited non-zero or did not end with a JSON object line."""


@dataclass(frozen=True)
class Bench:
    """One benchmark of the report.

    Attributes:
        name: the record's key (``note``, ``engine``, ``next_turn``, ``rules``, ``traces``, ``tiers``, ``tenants``,
            ``fleet``, ``peers``).
        module: ``python -m`` module; full / quick: its arguments for a full run and for ``--quick``.
        what: what it measures, one line (REPORT.md and the plots' titles).
    """

    name: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    what: str


@dataclass
class Record:
    """A benchmark's result: its JSON line (``result``), the command, seconds it took, and where and when
    (``provenance``: ``Provenance.as_dict`` of the run that measured it)."""

    name: str
    command: list[str]
    seconds: float
    result: dict[str, Any]
    provenance: dict[str, Any]

    def to_json(self) -> str:
        """One line of ``results.jsonl``."""
        return json.dumps(
            {
                "bench": self.name,
                "command": self.command,
                "seconds": round(self.seconds, 1),
                "provenance": self.provenance,
                "result": self.result,
            }
        )


def benches(llama_server: str | None) -> list[Bench]:
    """The report's benchmarks in run order; ``peers`` only with a ``llama_server`` binary."""
    out = [
        Bench(
            "note",
            "bench.note",
            (),
            ("--tiny",),
            "the note's workloads, prefix caching on vs off (embedded engine), API cost with vs without prefixgate",
        ),
        Bench(
            "engine",
            "bench.engine",
            ("--no-hf", "--repeats", "3"),
            ("--tiny", "--system-tokens", "200", "--repeats", "1", "--new", "8"),
            "embedded engine: cold vs cached TTFT, decode tokens/s at batch 1 and 8",
        ),
        Bench(
            "next_turn",
            "bench.next_turn",
            ("--repeats", "3"),
            ("--tiny",),
            "a chat's next turn: TTFT with the last reply prefilled while idle, computed in the turn, cached as "
            "generated, or with prefix caching off",
        ),
        Bench(
            "rules",
            "bench.rules",
            (),
            (),
            "prefix hit rate of the rendered prompt: as sent, after the default rules, ideal, per corpus kind",
        ),
        Bench(
            "traces",
            "bench.rules_traces",
            (),
            (),
            "multi-turn traces: cached prefix tokens per turn, rules on / off / ideal",
        ),
        Bench(
            "tiers",
            "bench.tiers",
            ("--sizes", "1000,4000", "--repeats", "1", "--ram-rounds", "2"),
            ("--tiny", "--sizes", "64,128", "--ram-rounds", "1"),
            "TTFT with the prefix recomputed, in RAM, or restored from the disk / Redis tier after a restart",
        ),
        Bench(
            "tenants",
            "bench.tenants",
            ("--pairs", "30"),
            (
                "--tiny",
                "--pairs",
                "30",
                "--prefix-tokens",
                "32",
                "--public-tokens",
                "48",
                "--tenant-counts",
                "1,16",
                "--unaligned-tenants",
                "16",
                "--num-blocks",
                "512",
            ),
            "tenant B's TTFT on tenant A's cached prefix vs a cold one (isolation), and A's own repeat",
        ),
        Bench(
            "fleet",
            "bench.fleet",
            (),  # the matrix in simulated time; the 10-minute soak is its own run (--soak 600, docs/routing.md)
            ("--sessions", "12", "--gateways", "1", "4", "--policies", "round_robin", "cache_aware"),
            "routing policies over 8 replicas in simulated time: hit rate, load spread and TTFT by gateways and load",
        ),
    ]
    if llama_server:
        out.append(
            Bench(
                "peers",
                "bench.engine",
                ("--peers", "--llama-server", llama_server, "--repeats", "3"),
                ("--peers", "--llama-server", llama_server, "--repeats", "1"),
                "prefixgate vs llama.cpp's llama-server over HTTP, same GGUF and threads, per workload",
            )
        )
    return out


def last_json(stdout: str) -> dict[str, Any]:
    """The last non-empty line of ``stdout`` parsed as a JSON object.

    Raises:
        BenchError: no line, or the last one is not a JSON object.
    """
    lines = [row for row in stdout.splitlines() if row.strip()]
    if not lines:
        raise BenchError("no output")
    try:
        value = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise BenchError(f"last line is not JSON: {lines[-1][:200]!r}") from exc
    if not isinstance(value, dict):
        raise BenchError(f"last line is not a JSON object: {lines[-1][:200]!r}")
    return value


def run_bench(
    bench: Bench, quick: bool, raw_dir: Path, timeout_s: float, provenance: dict[str, Any]
) -> Record:
    """Run ``bench`` (quick or full arguments), save its output in ``raw_dir/<name>.txt``, return its record.

    Raises:
        BenchError: it exited non-zero, timed out, or did not end with a JSON object line.
    """
    command = [sys.executable, "-m", bench.module, *(bench.quick if quick else bench.full)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TQDM_DISABLE", "1")
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"timed out after {timeout_s:.0f} s") from exc
    seconds = time.perf_counter() - t0
    raw_dir.mkdir(parents=True, exist_ok=True)
    (raw_dir / f"{bench.name}.txt").write_text(done.stdout + ("\n--- stderr ---\n" + done.stderr[-4000:]))
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise BenchError(f"exit status {done.returncode}: {tail[0][:300]}")
    shown = ["python", "-m", bench.module, *(bench.quick if quick else bench.full)]
    return Record(bench.name, shown, seconds, last_json(done.stdout), provenance)


def read_records(path: Path) -> dict[str, Record]:
    """Records of an earlier run (``results.jsonl``), by benchmark name; an absent file gives none.

    Raises:
        BenchError: a line that is not a record.
    """
    out: dict[str, Record] = {}
    if not path.is_file():
        return out
    for number, row in enumerate(path.read_text().splitlines(), 1):
        if not row.strip():
            continue
        try:
            data = json.loads(row)
            out[data["bench"]] = Record(
                data["bench"], data["command"], data["seconds"], data["result"], data["provenance"]
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BenchError(f"{path}:{number}: not a results record ({exc})") from exc
    return out
