"""Stats aggregation, Prometheus rendering and request log lines (no server)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import EngineStats, Histogram
from gateway.config.loader import parse_config
from gateway.config.price_table import shipped_price_table
from gateway.core.events import BackendUsage
from gateway.http.app import create_app
from gateway.service.metrics import build_registry, render
from gateway.service.request_log import RequestRecord, format_record, log_request
from gateway.service.stats import GatewayStats, PrefixGroups


def engine_stats(**overrides) -> EngineStats:
    fields = dict(
        requests=2,
        prompt_tokens=100,
        prefix_query_tokens=100,
        prefix_hit_tokens=32,
        prefill_tokens=68,
        prefill_seconds=0.34,
        prefill_seconds_saved=0.16,
        inflight_shared_tokens=16,
        decode_tokens=10,
        decode_seconds=0.5,
        blocks_total=64,
        blocks_used=0,
        blocks_cached=6,
        blocks_free=58,
        evictions=1,
        preemptions=0,
        running=0,
        waiting=0,
        ttft=Histogram(buckets=(0.1, 1.0, float("inf")), counts=(1, 2, 2), count=2, sum=0.6),
        tpot=Histogram(buckets=(0.1, float("inf")), counts=(10, 10), count=10, sum=0.5),
    )
    fields.update(overrides)
    return EngineStats(**fields)


def test_record_finish_returns_the_spend_a_key_is_charged():
    """The pipeline charges a key ``RequestCost.spend``: input by cache class plus output (issue 14)."""
    stats = GatewayStats({"remote": shipped_price_table().lookup("claude-haiku-4-5")})
    cost = stats.record_finish(
        "remote", BackendUsage(1000, 200, 800, cache_creation_tokens=100, counted_by="upstream"), None, "k"
    )
    # 100 plain x $1 + 800 read x $0.1 + 100 5m-write x $1.25 + 200 out x $5, per MTok
    assert cost.spend == pytest.approx((100 * 1.0 + 800 * 0.1 + 100 * 1.25 + 200 * 5.0) / 1e6)


def test_prefill_seconds_saved_is_the_engines_running_sum_not_a_recomputation():
    """The snapshot reports the engine's monotonic sum; a lower mean rate later (a large, fast prefill) does
    not revise it, as ``prefix_hit_tokens * prefill_seconds / prefill_tokens`` did (68.1 s fell to 38.3 s)."""
    stats = GatewayStats({"local": None})
    before = stats.snapshot({"local": engine_stats(prefill_seconds_saved=0.16)})
    after = stats.snapshot(
        {"local": engine_stats(prefill_tokens=10_068, prefill_seconds=0.5, prefill_seconds_saved=0.16)}
    )
    assert before["models"]["local"]["prefill_seconds_saved"] == 0.16
    assert after["models"]["local"]["prefill_seconds_saved"] == 0.16
    assert after["prefill_seconds_saved"] == 0.16


def test_snapshot_per_model_and_totals():
    stats = GatewayStats(
        {"local": None, "remote": shipped_price_table().lookup("claude-haiku-4-5")}  # input 1, read 0.1
    )
    stats.record_rules("local", {"time.hoist": 1, "normalize": 0})
    stats.record_finish("local", BackendUsage(50, 5, 0), 0.2, "k1")
    stats.record_finish("local", BackendUsage(50, 5, 32), 0.1, "k1")
    stats.record_finish(
        "remote", BackendUsage(1000, 10, 800, cache_creation_tokens=0, counted_by="upstream"), None, "k2"
    )
    stats.record_abort("local")
    stats.record_error("local", 400)
    stats.record_error(None, 404)
    doc = stats.snapshot({"local": engine_stats(), "remote": None})

    local, remote = doc["models"]["local"], doc["models"]["remote"]
    assert (local["requests"], local["aborted"], local["prompt_tokens"], local["cached_tokens"]) == (
        2,
        1,
        100,
        32,
    )
    assert local["hit_rate"] == pytest.approx(0.32)
    assert (local["prefill_tokens"], local["prefill_tokens_saved"]) == (68, 32)
    assert local["prefill_seconds_saved"] == pytest.approx(0.16)
    assert local["blocks"] == {"total": 64, "used": 0, "cached": 6, "free": 58}
    assert (local["evictions"], local["inflight_shared_tokens"]) == (1, 16)
    assert local["rules"] == {"time.hoist": 1}
    assert local["errors"] == {"400": 1}
    assert (remote["prefill_tokens"], remote["prefill_tokens_saved"], remote["prefill_seconds_saved"]) == (
        200,
        800,
        None,
    )
    assert remote["cost_usd"] == pytest.approx((200 * 1.0 + 800 * 0.1) / 1e6)
    assert remote["cost_saved_usd"] == pytest.approx(800 * 0.9 / 1e6)
    assert remote["output_cost_usd"] == pytest.approx(10 * 5.0 / 1e6)  # Haiku 4.5 output: $5 / MTok
    assert doc["output_cost_usd"] == remote["output_cost_usd"]

    assert (doc["requests"], doc["prompt_tokens"], doc["cached_tokens"]) == (3, 1100, 832)
    assert doc["hit_rate"] == pytest.approx(832 / 1100)
    assert doc["prefill_tokens"] == 268 and doc["prefill_seconds_saved"] == pytest.approx(0.16)
    assert doc["errors"] == {"400": 1, "404": 1}
    assert doc["rules"] == {"time.hoist": 1}
    assert [(p["prefix_key"], p["requests"], p["cached_tokens"]) for p in doc["prefixes"]] == [
        ("k1", 2, 32),
        ("k2", 1, 800),
    ]
    assert all("text" not in p and "prompt" not in p for p in doc["prefixes"])


def test_prefix_groups_space_saving_keeps_heavy_hitters():
    groups = PrefixGroups(capacity=2)
    for _ in range(5):
        groups.record("hot", "m", 10, 8)
    groups.record("a", "m", 10, 0)
    groups.record("b", "m", 10, 0)  # evicts "a" (fewest requests), inherits its count
    top = groups.top(10)
    assert [(g["prefix_key"], g["requests"], g["overcount"]) for g in top] == [("hot", 5, 0), ("b", 2, 1)]


def test_metrics_render_the_same_counters():
    stats = GatewayStats({"local": None})
    stats.record_rules("local", {"time.hoist": 2})
    stats.record_finish("local", BackendUsage(50, 5, 32), 0.1, "k")
    stats.record_error("local", 413)
    registry = build_registry(
        lambda: stats.snapshot({"local": engine_stats()}), lambda: {"local": engine_stats()}
    )
    samples = {}
    for family in text_string_to_metric_families(render(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("prefixgate_requests_total", (("model", "local"),))] == 1
    assert samples[("prefixgate_cached_tokens_total", (("model", "local"),))] == 32
    assert samples[("prefixgate_prefill_tokens_total", (("model", "local"),))] == 68
    assert samples[("prefixgate_blocks", (("model", "local"), ("state", "cached")))] == 6
    assert samples[("prefixgate_rule_applications_total", (("model", "local"), ("rule", "time.hoist")))] == 2
    assert samples[("prefixgate_errors_total", (("status", "413"),))] == 1
    assert samples[("prefixgate_engine_ttft_seconds_count", (("model", "local"),))] == 2
    assert samples[("prefixgate_engine_ttft_seconds_bucket", (("le", "+Inf"), ("model", "local")))] == 2


def test_two_registries_do_not_collide():
    a = build_registry(lambda: GatewayStats({"m": None}).snapshot({"m": None}), lambda: {"m": None})
    b = build_registry(lambda: GatewayStats({"m": None}).snapshot({"m": None}), lambda: {"m": None})
    assert render(a) == render(b)


def test_request_log_line_has_counts_and_never_text(caplog):
    record = RequestRecord(
        request_id="r1",
        path="/v1/chat/completions",
        status=200,
        model="m",
        stream=True,
        prompt_tokens=40,
        cached_tokens=32,
        completion_tokens=5,
        ttft_s=0.0123,
        duration_s=0.5,
        finish_reason="stop",
        prefix_key="ab12",
    )
    line = format_record(record)
    assert line == (
        "request_id=r1 path=/v1/chat/completions status=200 model=m stream=true prompt_tokens=40 "
        "cached_tokens=32 completion_tokens=5 ttft_ms=12.3 duration_ms=500.0 finish_reason=stop "
        "prefix_key=ab12"
    )
    with caplog.at_level(logging.INFO, logger="prefixgate.request"):
        log_request(RequestRecord(request_id="r2", path="/x", status=400, model='we"ird name'))
    assert caplog.records[-1].levelno == logging.WARNING
    assert 'model="we\\"ird name"' in caplog.records[-1].getMessage()
    # the key's name and the tenant; a client-chosen value with a line break stays on one line
    line = format_record(
        RequestRecord(
            request_id="r3", path="/x", status=200, model="m", key="alice", tenant="acme\nstatus=500"
        )
    )
    assert (
        line == 'request_id=r3 path=/x status=200 model=m key=alice tenant="acme\\nstatus=500" stream=false'
    )
    assert format_record(RequestRecord("r4", "/x", 200, tenant="t\u2028x")).endswith(
        'tenant="t\\u2028x" stream=false'
    )
    # the upstream's own id for its answer, for a provider ticket
    assert format_record(RequestRecord("r5", "/x", 502, upstream_request_id="req_9 x")).endswith(
        'upstream_request_id="req_9 x"'
    )


def test_upstream_models_report_replicas_without_credentials(monkeypatch):
    key = "sk-stats-test-key-0123456789abcdef"
    monkeypatch.setenv("PG_STATS_KEY", key)
    config = parse_config(
        {
            "rules": [],
            "models": [
                {"name": "local", "backend": "embedded"},
                {
                    "name": "gpt",
                    "backend": "openai",
                    "api_key": "env:PG_STATS_KEY",
                    "base_url": ["https://a.example/v1?api_key=" + key, "https://b.example/v1"],
                },
                {
                    "name": "claude",
                    "backend": "anthropic",
                    "api_key": "env:PG_STATS_KEY",
                    "base_url": "https://api.anthropic.test",
                },
            ],
        }
    )
    gateway = create_app(config).state.gateway
    lease = gateway.registry.get("gpt").upstream.ring.acquire("some prefix key")
    doc = gateway.stats_snapshot()
    replicas = doc["models"]["gpt"]["replicas"]
    assert set(replicas) == {"https://a.example/v1", "https://b.example/v1"}
    assert sorted(r["inflight"] for r in replicas.values()) == [0, 1]
    assert all((r["state"], r["failures"]) == ("up", 0) for r in replicas.values())
    assert doc["models"]["claude"]["replicas"] == {
        "https://api.anthropic.test": {
            "state": "up",
            "inflight": 0,
            "failures": 0,
            "requests": 0,
            "away": 0,
            "restarts": 0,
        }
    }
    assert "replicas" not in doc["models"]["local"]  # the embedded engine has none
    lease.release()
    text = json.dumps(doc) + render(gateway.metrics).decode()
    assert key not in text and "pa55word" not in text and "user:" not in text


def test_rules_requests_and_ttft_split_by_hit_and_miss():
    stats = GatewayStats({"m": None})
    stats.record_rules("m", {"a": 2, "b": 0})
    stats.record_rules("m", {"b": 0})
    stats.record_finish("m", BackendUsage(prompt_tokens=10, completion_tokens=1, cached_tokens=4), 0.03, "k")
    stats.record_finish("m", BackendUsage(prompt_tokens=10, completion_tokens=1, cached_tokens=0), 0.3, "k")
    stats.record_finish("m", BackendUsage(prompt_tokens=10, completion_tokens=1, cached_tokens=0), None, "k")
    assert stats.snapshot({"m": None})["models"]["m"]["rules_requests"] == 1
    split = stats.ttft_histograms()["m"]
    assert (split["hit"].count, split["hit"].sum) == (1, 0.03)
    assert (split["miss"].count, split["miss"].sum) == (1, 0.3)


def test_request_log_line_is_built_only_when_written(caplog, monkeypatch):
    import gateway.service.request_log as request_log

    built: list[str] = []
    real = request_log.format_record
    monkeypatch.setattr(
        request_log, "format_record", lambda record: built.append(record.request_id) or real(record)
    )
    with caplog.at_level(logging.WARNING, logger="prefixgate.request"):
        log_request(RequestRecord(request_id="quiet", path="/x", status=200))  # INFO: not written
        log_request(RequestRecord(request_id="loud", path="/x", status=500))
    assert built == ["loud"]
    assert [r.getMessage().split()[0] for r in caplog.records] == ["request_id=loud"]


def test_top_level_ttft_mean_weighs_every_request_the_same():
    """``ttft_mean_s`` (README's /admin/stats table) is at the top level too: the mean over all models'
    requests that measured a TTFT (0.2, 0.1 and 0.9 s: 0.4), not the mean of the models' means (0.525);
    requests without one (None) count in neither; None before any."""
    stats = GatewayStats({"a": None, "b": None, "idle": None})
    assert stats.snapshot({"a": None, "b": None, "idle": None})["ttft_mean_s"] is None
    stats.record_finish("a", BackendUsage(10, 1, 0), 0.2, "k")
    stats.record_finish("a", BackendUsage(10, 1, 0), 0.1, "k")
    stats.record_finish("a", BackendUsage(10, 1, 0), None, "k")
    stats.record_finish("b", BackendUsage(10, 1, 0), 0.9, "k")
    doc = stats.snapshot({"a": None, "b": None, "idle": None})
    assert doc["models"]["a"]["ttft_mean_s"] == pytest.approx(0.15)
    assert doc["models"]["idle"]["ttft_mean_s"] is None
    assert doc["ttft_mean_s"] == pytest.approx(0.4)
