"""The gateway's log set-up: the LogRecord switches ``serve`` turns off name no field its format uses."""

from __future__ import annotations

import logging

from gateway.cli import LOG_FORMAT, quiet_log_records

SWITCHES = ("logThreads", "logProcesses", "logMultiprocessing")
FIELDS = ("thread", "threadName", "process", "processName")
CALLER_FIELDS = ("pathname", "filename", "module", "lineno", "funcName")


def test_quiet_log_records_turns_off_what_the_format_does_not_use() -> None:
    saved = {name: getattr(logging, name) for name in (*SWITCHES, "_srcfile")}
    try:
        quiet_log_records()
        assert all(getattr(logging, name) is False for name in SWITCHES)
        assert logging._srcfile is None  # no caller look-up: the format names no caller field
        assert not any(f"%({field})" in LOG_FORMAT for field in (*FIELDS, *CALLER_FIELDS))
        caught: list[logging.LogRecord] = []
        logger = logging.getLogger("prefixgate.test_cli_logging")
        handler = logging.Handler()
        handler.emit = caught.append  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:
            logger.warning("seen")
        finally:
            logger.removeHandler(handler)
        assert caught[0].funcName == "(unknown function)" and caught[0].getMessage() == "seen"
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
