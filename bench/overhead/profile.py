"""Where prefixgate's CPU goes per request under ``bench.overhead``'s load: ``python -m bench.overhead.profile``.

Starts the stub upstream and prefixgate as ``bench.overhead`` does (``backend: openai``, default rules), warms
them, then sends ``--requests`` chat requests over ``--connections`` keep-alive connections while ``py-spy
record`` samples the gateway process (``--rate`` Hz, raw collapsed stacks). The gateway's CPU time over the
batch (user + system, ``/proc``) divided by the requests is the CPU per request; each sample is charged to the
innermost frame of its stack that belongs to one of the ``CATEGORIES`` (rules, cache explanation, tokenizer,
HTTP client, ...), and a category's milliseconds per request are its share of the samples times that CPU.

py-spy counts a thread as active while it is runnable, also when another process holds the core: on a
shared machine a socket write that wakes the peer often shows up as a long sample although the process uses
little CPU there. So samples whose innermost frame is a socket write (asyncio's transport write; under uvloop,
whose write is C, the line of uvicorn, aiohttp or ``gateway.http.server_protocol`` that calls
``transport.write``) or the event loop's ``select`` are left out before the shares are taken (their count is
printed); the rest approximates the CPU profile. Under uvloop a sample whose innermost frame is the loop's
``Runner.run`` itself is in the loop's C code, or runnable but waiting for a core (it was woken from the loop's
wait and another process holds the core): those go to their own category, ``event loop (C) or waiting``, whose
share grows with the machine's load (docs/overhead.md, session 7); the Python frames of the loop and its
callbacks stay in ``asyncio event loop``.

Needs py-spy (the ``bench`` extra; ``--py-spy PATH`` otherwise) and the right to trace a child process.
Prints the table, then one JSON line (``cpu_ms_per_request``, ``categories`` in ms per request, ``samples``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.overhead import servers
from bench.overhead.load import build_request, run_batch
from bench.overhead.run import AUTH, EXPECT, chat_body

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("rules (RuleSet.apply)", r"\(rules/"),
    (
        "canonicalize, prefix key",
        r"canonicalize \(gateway/service/pipeline|Canonicalizer\.|prefix_key|mark_public",
    ),
    (
        "cache explanation",
        r"_explain \(gateway/service/pipeline|cache_explain|miss_explain|miss_segments|rendered_prompt",
    ),
    ("tokenizer", r"\(tiktoken/|prompt_tokenizers"),
    (
        "HTTP client (httpx, transport)",
        r"\((httpx|httpcore|anyio|h11|sniffio|aiohttp|yarl|multidict)/|aiohttp_transport",
    ),
    ("upstream call (ours)", r"gateway/transport/|gateway/backends/upstream\.py"),
    ("OpenAI backend (body, events)", r"gateway/backends/openai_upstream"),
    ("JSON", r"\(json/|jiter"),
    (
        "parse, body checks",
        r"gateway/protocols/openai/parse|gateway/http/body|json_body|gateway/core/request",
    ),
    ("stats, ledger, limits", r"gateway/service/(stats|cost_ledger|limits|metrics|timeseries)"),
    ("request log, logging", r"\(logging/|request_log"),
    ("Starlette", r"\(starlette/"),
    ("uvicorn", r"\(uvicorn/"),
    ("asyncio event loop", r"\(asyncio/|\(selectors"),
)
"""(category, regular expression on a py-spy frame ``function (file:line)``); the innermost matching frame of a
sample names its category, ``other`` when none matches."""

_WAITING = re.compile(r"(_SelectorSocketTransport\.write \(asyncio/|\.select \(selectors\.py)")
"""Innermost frames left out: a socket write (the kernel hands the bytes to the peer and wakes it) and the
loop's wait for events."""

_IN_LOOP = re.compile(r"^Runner\.run \(asyncio/runners\.py")
"""An innermost frame that is the event loop's run call itself (uvloop's loop is C: nothing of it shows)."""
LOOP_OR_WAITING = "event loop (C) or waiting"

_WRITERS = (
    "uvicorn.protocols.http.httptools_impl",
    "aiohttp.http_writer",
    "gateway.http.server_protocol",
    "gateway.transport.aiohttp_transport",
)
"""Modules whose ``transport.write`` calls are socket writes: under uvloop the write is C code, so py-spy's
innermost frame is the Python line that calls it."""


def socket_write_lines() -> set[str]:
    """``file:line`` (as py-spy shows them, from the package folder on) of every line in ``_WRITERS`` that
    calls ``transport.write`` / ``writelines``: samples ending there are socket writes, left out as waiting."""
    import importlib

    found: set[str] = set()
    for name in _WRITERS:
        try:
            path = Path(importlib.import_module(name).__file__ or "")
        except ImportError:
            continue
        short = "/".join(path.parts[-(name.count(".") + 1) :])
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"transport\.write(lines)?\(", line):
                found.add(f"{short}:{number})")
    return found


def read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output (``frame;frame;... count`` per line, outermost first) as (frames, count)."""
    samples = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            samples.append((stack.split(";"), int(count)))
    return samples


def attribute(samples: list[tuple[list[str], int]]) -> tuple[Counter[str], int]:
    """(samples per category, samples left out as waiting): each sample goes to the category of its innermost
    frame that matches one (``CATEGORIES``), else ``other``."""
    compiled = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]
    writes = socket_write_lines()
    shares: Counter[str] = Counter()
    waiting = 0
    for frames, count in samples:
        if frames and (_WAITING.search(frames[-1]) or frames[-1].endswith(tuple(writes))):
            waiting += count
            continue
        if frames and _IN_LOOP.search(frames[-1]):
            shares[LOOP_OR_WAITING] += count
            continue
        category = "other"
        for frame in reversed(frames):
            found = next((name for name, pattern in compiled if pattern.search(frame)), None)
            if found is not None:
                category = found
                break
        shares[category] += count
    return shares, waiting


def breakdown(shares: Counter[str], cpu_ms: float) -> dict[str, float]:
    """Category -> ms of CPU per request (its share of the samples times ``cpu_ms``), largest first."""
    total = sum(shares.values())
    if not total:
        return {}
    return {name: round(count / total * cpu_ms, 3) for name, count in shares.most_common()}


def main(argv: list[str] | None = None) -> None:
    """Parse the options, profile, print the table and the JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.profile", description=__doc__)
    parser.add_argument("--requests", type=int, default=1500, help="requests profiled (default 1500)")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections (default 8)")
    parser.add_argument("--stream", action="store_true", help="streamed answers (default JSON)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    parser.add_argument(
        "--py-spy", default=None, help="the py-spy executable (default: on PATH or beside Python)"
    )
    parser.add_argument("--raw", default=None, help="also copy py-spy's raw stacks to this file")
    args = parser.parse_args(argv)
    spy = args.py_spy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():
        parser.error("py-spy not found: install the bench extra or pass --py-spy PATH")
    numbers = itertools.count()
    with tempfile.TemporaryDirectory(prefix="prefixgate-profile-") as tmp:
        workdir = Path(tmp)
        stub = servers.start_stub(workdir)
        gate = None
        try:
            gate = servers.start_prefixgate(workdir, stub.port, "info")

            def load(count: int) -> list[bytes]:
                path = "/v1/chat/completions"
                return [
                    build_request("127.0.0.1", gate.port, path, chat_body(args.stream, next(numbers)), AUTH)
                    for _ in range(count)
                ]

            asyncio.run(run_batch("127.0.0.1", gate.port, load(200), args.connections, EXPECT))
            out = workdir / "spy.txt"
            command = [
                spy,
                "record",
                "-p",
                str(gate.process.pid),
                "-r",
                str(args.rate),
                "-f",
                "raw",
                "-o",
                str(out),
            ]
            recorder = subprocess.Popen(
                [*command, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            time.sleep(1.0)  # py-spy attaches
            requests = load(args.requests)
            cpu = gate.cpu_s()
            batch = asyncio.run(run_batch("127.0.0.1", gate.port, requests, args.connections, EXPECT))
            cpu_ms = (gate.cpu_s() - cpu) / len(batch.latencies) * 1000
            recorder.send_signal(signal.SIGINT)
            _, err = recorder.communicate(timeout=60)
            if not out.is_file():
                raise SystemExit(f"py-spy wrote nothing: {err.decode(errors='replace')[-2000:]}")
            shares, waiting = attribute(read_collapsed(out))
            if args.raw:
                shutil.copyfile(out, args.raw)
        finally:
            if gate is not None:
                gate.stop()
            stub.stop()
    table = breakdown(shares, cpu_ms)
    total = sum(shares.values())
    print(f"{'where':<34}{'share':>8}{'ms/req':>9}")
    for name, ms in table.items():
        print(f"{name:<34}{shares[name] / total * 100:7.1f}%{ms:9.3f}")
    load_avg = os.getloadavg()[0]
    print(
        f"CPU {cpu_ms:.3f} ms per request over {len(batch.latencies)} requests at {args.connections} connections; "
        f"{total} samples kept, {waiting} waiting left out; load average {load_avg:.2f}"
    )
    doc = {
        "cpu_ms_per_request": round(cpu_ms, 3),
        "categories": table,
        "samples": total,
        "waiting_samples_left_out": waiting,
        "connections": args.connections,
        "stream": args.stream,
        "load_avg_1m": round(load_avg, 2),
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
