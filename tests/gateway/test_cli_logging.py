"""The gateway's log set-up: the LogRecord switches ``serve`` turns off name no field its format uses."""

from __future__ import annotations

import logging

from gateway.cli import LOG_FORMAT, quiet_log_records

SWITCHES = ("logThreads", "logProcesses", "logMultiprocessing")
FIELDS = ("thread", "threadName", "process", "processName")


def test_quiet_log_records_turns_off_what_the_format_does_not_use() -> None:
    saved = {name: getattr(logging, name) for name in SWITCHES}
    try:
        quiet_log_records()
        assert all(getattr(logging, name) is False for name in SWITCHES)
        assert not any(f"%({field})" in LOG_FORMAT for field in FIELDS)
        record = logging.LogRecord("prefixgate.request", logging.INFO, __file__, 1, "done %s", ("x",), None)
        assert (record.thread, record.threadName, record.process, record.processName) == (
            None,
            None,
            None,
            None,
        )
        line = logging.Formatter(LOG_FORMAT).format(record)
        assert line.endswith(" INFO prefixgate.request: done x")
    finally:
        for name, value in saved.items():
            setattr(logging, name, value)
