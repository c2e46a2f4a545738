"""Cost of one log line with and without Python's documented LogRecord switches.

``logging.logThreads``, ``logging.logProcesses`` and ``logging.logMultiprocessing`` (documented in the ``logging``
module's reference, "LogRecord attributes" / module-level attributes) make every ``LogRecord`` look up the thread
name, the process id and the multiprocessing process name. prefixgate's log format
(``gateway.cli.LOG_FORMAT``) uses none of them, so ``gateway.cli.serve`` turns them off. This bench writes the
same INFO line through a logger whose handler formats with that format into a null stream, in interleaved rounds
with the switches on (Python's default) and off, and prints microseconds per line (median over rounds) and a JSON
line. Run it under ``flock /work/wt/bench.lock`` on a shared machine.

``python -m bench.logging_flags [--rounds N] [--lines N]``
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import time

from gateway.cli import LOG_FORMAT

SWITCHES = ("logThreads", "logProcesses", "logMultiprocessing")


def set_switches(on: bool) -> None:
    """Turn the three switches on (Python's default) or off."""
    for name in SWITCHES:
        setattr(logging, name, on)


def one_round(logger: logging.Logger, lines: int) -> float:
    """Microseconds per ``logger.info`` line (with arguments, like ``prefixgate.request``'s line)."""
    t0 = time.perf_counter()
    for i in range(lines):
        logger.info("request %s model=%s status=%d ms=%.1f", i, "m", 200, 1.5)
    return (time.perf_counter() - t0) / lines * 1e6


def main(argv: list[str] | None = None) -> None:
    """Print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--lines", type=int, default=20_000)
    args = parser.parse_args(argv)
    logger = logging.getLogger("bench.logging_flags")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    samples: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            set_switches(on)
            handler.stream = io.StringIO()
            samples[on].append(one_round(logger, args.lines))
    set_switches(True)
    result = {"on": statistics.median(samples[True]), "off": statistics.median(samples[False])}
    print(f"µs per log line (median of {args.rounds} rounds of {args.lines})")
    print(
        f"switches on (default) {result['on']:.2f}   off {result['off']:.2f}   saved {result['on'] - result['off']:.2f}"
    )
    print(json.dumps({"us_per_line": result}, sort_keys=True))


if __name__ == "__main__":
    main()
