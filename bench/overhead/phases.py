"""Where one request's CPU sits between its arrival and the next request's: ``python -m bench.overhead.phases``.

Starts the stub upstream and prefixgate as ``bench.overhead`` does, but prefixgate runs inside this module
(``--serve``), which first wraps a few functions of uvicorn, aiohttp and the gateway so that each call records
``(mark, time.thread_time_ns(), time.perf_counter_ns())`` before and after (``MARKS``). The driver warms the
gateway, clears the marks (SIGUSR2), sends ``--requests`` JSON requests over one keep-alive connection, has the
gateway write its marks (SIGUSR1), and prints, for the most common sequence of marks per request, the median
thread CPU and wall time between consecutive marks (µs): which step of the request costs what, and which of it
runs before the upstream call, while the upstream works, between its answer and the client's, or after the
answer (docs/overhead.md, session 9). Wall time well above CPU time between two marks is time the process
waited: for the stub, for the next request, or for a core.

A mark whose function is missing (another version of a library) is left out, named on stderr. Each mark costs
~1-2 µs of CPU, so the sum of the medians is above the CPU per request of ``bench.overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import importlib
import inspect
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARKS: tuple[tuple[str, str, str], ...] = (
    ("request in", "uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.data_received"),
    ("body read", "gateway.http.openai", "read_json_object"),
    ("parse", "gateway.http.openai", "parse_chat_request"),
    ("canonicalize", "gateway.service.pipeline", "canonicalize"),
    ("backend body", "gateway.backends.openai_upstream", "OpenAIUpstreamBackend.build_body"),
    ("upstream exchange", "gateway.transport.aiohttp_transport", "AiohttpTransport._exchange"),
    ("aiohttp request", "aiohttp.client_reqrep", "ClientRequest.__init__"),
    ("aiohttp send", "aiohttp.client_reqrep", "ClientRequest.send"),
    ("upstream write", "aiohttp.http_writer", "StreamWriter._writelines"),
    ("upstream bytes in", "aiohttp.client_proto", "ResponseHandler.data_received"),
    ("render (prepare)", "gateway.service.pipeline", "PromptPreparation.run"),
    ("collect", "gateway.http.openai", "_collect_chat"),
    ("explain", "gateway.service.pipeline", "OpenedStream._explain"),
    ("learn", "gateway.service.canonicalize", "Canonicalizer.learn"),
    ("answer write", "gateway.http.server_protocol", "_FirstWriteWith.write"),
    ("record prompt", "gateway.service.cache_explain", "CacheExplanations.record_prompt"),
    ("log line", "gateway.service.pipeline", "log_request"),
)
"""(mark name, module, attribute path): each call of the function records ``name<`` on entry and ``name>`` on
return (for a coroutine function: when the coroutine returns)."""

FIRST = "request in<"
"""The mark that starts a request (the server protocol's first read of its bytes)."""

_marks: list[tuple[str, int, int]] = []


def _record(name: str) -> None:
    _marks.append((name, time.thread_time_ns(), time.perf_counter_ns()))


def _wrap(name: str, module: str, path: str) -> bool:
    """Wrap ``module.path`` to record ``name<`` / ``name>``; False when it is missing."""
    try:
        owner: Any = importlib.import_module(module)
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        function = inspect.getattr_static(owner, attr)
    except (ImportError, AttributeError):
        return False
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            _record(name + "<")
            try:
                return await function(*args, **kwargs)
            finally:
                _record(name + ">")

        setattr(owner, attr, wrapped_async)
    else:

        @functools.wraps(function)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _record(name + "<")
            try:
                return function(*args, **kwargs)
            finally:
                _record(name + ">")

        setattr(owner, attr, wrapped)
    return True


def serve(argv: list[str], out: Path) -> int:
    """``prefixgate`` with ``argv`` (``serve --config ...``) and the marks in place: SIGUSR2 clears them, SIGUSR1 writes them to ``out``
    (one ``mark cpu_ns wall_ns`` line each) and exits."""
    for name, module, path in MARKS:
        if not _wrap(name, module, path):
            print(f"bench.overhead.phases: no {module}.{path}: mark {name!r} left out", file=sys.stderr)

    def dump(*_: Any) -> None:
        out.write_text("".join(f"{name} {cpu} {wall}\n" for name, cpu, wall in _marks))
        os._exit(0)

    signal.signal(signal.SIGUSR2, lambda *_: _marks.clear())
    signal.signal(signal.SIGUSR1, dump)
    from gateway.cli import main

    return main(argv)


def phases(lines: list[str]) -> tuple[list[tuple[str, str, float, float]], int, int]:
    """(rows of (mark, next mark, median CPU µs, median wall µs), requests with the most common sequence,
    requests) from a marks file's lines; the last step of a request runs to the next request's first mark."""
    marks = [
        (name, int(cpu), int(wall))
        for name, cpu, wall in (line.rsplit(" ", 2) for line in lines if line.strip())
    ]
    requests: list[list[tuple[str, int, int]]] = []
    for mark in marks:
        if mark[0] == FIRST and (not requests or any(m[0] != FIRST for m in requests[-1])):
            requests.append([])
        if requests:
            requests[-1].append(mark)
    pairs = list(zip(requests, requests[1:], strict=False))  # each request with the next one's first mark
    if not pairs:
        return [], 0, len(requests)
    sequences = collections.Counter(tuple(m[0] for m in request) for request, _ in pairs)
    sequence, count = sequences.most_common(1)[0]
    chosen = [(request, after[0]) for request, after in pairs if tuple(m[0] for m in request) == sequence]
    rows = []
    for i, name in enumerate(sequence):
        ends = [request[i + 1] if i + 1 < len(request) else nxt for request, nxt in chosen]
        cpu = statistics.median(
            (end[1] - request[i][1]) / 1e3 for (request, _), end in zip(chosen, ends, strict=True)
        )
        wall = statistics.median(
            (end[2] - request[i][2]) / 1e3 for (request, _), end in zip(chosen, ends, strict=True)
        )
        rows.append((name, sequence[i + 1] if i + 1 < len(sequence) else "next " + FIRST, cpu, wall))
    return rows, count, len(pairs)


async def _drive(port: int, requests: int, warmup: int, pid: int) -> float:
    from bench.overhead.load import build_request, run_batch
    from bench.overhead.run import AUTH, EXPECT, chat_body

    raw = [
        build_request("127.0.0.1", port, "/v1/chat/completions", chat_body(False, n), AUTH)
        for n in range(warmup + requests)
    ]
    await run_batch("127.0.0.1", port, raw[:warmup], 1, EXPECT)
    os.kill(pid, signal.SIGUSR2)
    await asyncio.sleep(0.2)
    batch = await run_batch("127.0.0.1", port, raw[warmup:], 1, EXPECT)
    return statistics.median(batch.latencies) * 1e3


def main(argv: list[str] | None = None) -> None:
    """Parse the options; run the instrumented server (``--serve``) or the driver, and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.phases", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="requests timed (default 3000)")
    parser.add_argument(
        "--warmup", type=int, default=300, help="requests before the marks count (default 300)"
    )
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        sys.exit(serve(args.serve, Path(os.environ["PREFIXGATE_PHASES_OUT"])))
    if args.requests < 2 or args.warmup < 1:
        parser.error("--requests must be at least 2 and --warmup at least 1")
    from bench.overhead import servers

    with tempfile.TemporaryDirectory(prefix="prefixgate-phases-") as tmp:
        workdir = Path(tmp)
        out = workdir / "marks.txt"
        started: list[servers.Server] = []
        try:
            stub = servers.start_stub(workdir)
            started.append(stub)
            launcher = [sys.executable, "-m", "bench.overhead.phases", "--serve"]
            env = {"PREFIXGATE_PHASES_OUT": str(out)}
            instrumented = servers.start_prefixgate(
                workdir, stub.port, name="phases", launcher=launcher, env=env
            )
            started.append(instrumented)
            p50 = asyncio.run(_drive(instrumented.port, args.requests, args.warmup, instrumented.process.pid))
            instrumented.process.send_signal(signal.SIGUSR1)
            instrumented.process.wait(30)
            rows, count, total = phases(out.read_text().splitlines())
        finally:
            for server in started:
                server.stop()
    print(
        f"{count} of {total} requests with the most common sequence of marks; p50 {p50:.3f} ms at 1 connection"
    )
    print(f"{'from':24s} {'to':24s} {'cpu us':>8s} {'wall us':>8s}")
    for name, nxt, cpu, wall in rows:
        print(f"{name:24s} {nxt:24s} {cpu:8.1f} {wall:8.1f}")
    print(f"{'sum of the medians':49s} {sum(r[2] for r in rows):8.1f} {sum(r[3] for r in rows):8.1f}")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
