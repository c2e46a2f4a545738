"""A gateway started with ``routing_share`` but no shared transcript memory says so (a trial: two sharing
gateways rendered one conversation differently, so their shared placements never matched)."""

from __future__ import annotations

import logging

from gateway.config.loader import load_config
from tests.gateway.server import RunningServer

UPSTREAM = (
    "  - {name: fleet, backend: openai, base_url: 'http://127.0.0.1:9/v1', routing: cache_aware,\n"
    "     routing_share: {redis_url: 'redis://127.0.0.1:1/0'}}\n"
)


def started_warnings(tmp_path, caplog, extra: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n" + UPSTREAM + extra)
    with caplog.at_level(logging.WARNING, logger="prefixgate.app"):
        RunningServer(load_config(path)).start().stop()
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "prefixgate.app" and "routing_share" in r.getMessage()
    ]


def test_routing_share_without_a_shared_transcript_is_a_warning(tmp_path, caplog):
    warned = started_warnings(tmp_path, caplog, "")
    assert len(warned) == 1 and "fleet" in warned[0] and "transcript.redis_url" in warned[0]


def test_a_shared_transcript_or_no_rules_need_no_warning(tmp_path, caplog):
    assert started_warnings(tmp_path, caplog, "transcript: {redis_url: 'redis://127.0.0.1:1/0'}\n") == []
    caplog.clear()
    assert started_warnings(tmp_path, caplog, "rules: []\n") == []
