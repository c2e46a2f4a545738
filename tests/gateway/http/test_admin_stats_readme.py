"""README's ``GET /admin/stats`` field table against a real ``/admin/stats`` answer of the running gateway:
every field the table's first column names is in the document at the top level, and per model where the table
says so (``models``: "all of the above per model", bar the gateway-wide fields below); the sub-fields the
table's meaning column spells out are there too. The table is read from README.md, so a row added there
without the field (``ttft_mean_s`` was listed but only kept per model) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import openai

from tests.gateway.conftest import TINY_MODEL

README = Path(__file__).resolve().parents[3] / "README.md"

GATEWAY_WIDE = {
    "keys",
    "tenants",
    "costs",
    "prices_checked",
    "provider_cache_misses",
    "rule_packs",
    "transcript",
    "learned",
    "cache_misses",
    "models",
}
"""Table fields kept once for the gateway, not per model (the ``models`` row's exceptions, as README says)."""

SUB_FIELDS = {
    "blocks": ("total", "used", "cached", "free"),
    "transcript": ("memory", "store", "redis"),
    "learned": ("mode", "footprint", "slots"),
}
"""Sub-fields a row's meaning column names (checked to be named there, and present in the document)."""

PREFIX_FIELDS = ("prefix_key", "model", "requests", "prompt_tokens", "cached_tokens", "hit_rate", "overcount")
MEMORY_FIELDS = ("lookups", "hits", "reused_messages", "rejected", "stored")
MISS_FIELDS = ("requests", "hits", "misses", "by_cause", "missed_tokens_by_cause", "by_segment")


def readme_stats_rows() -> dict[str, str]:
    """Field name -> its row's meaning, for every field named in the first column of README's
    ``/admin/stats`` table (a row may name several: ``requests``, ``aborted``)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("`GET /admin/stats` (with") :]
    rows = {}
    for line in section.splitlines()[2:]:
        if line.startswith("| field") or line.startswith("|---"):
            continue
        if not line.startswith("|"):
            if rows:
                break
            continue
        first, meaning = line.strip("|").split("|", 1)
        for name in re.findall(r"`([a-z_]+)`", first):
            rows[name] = meaning
    return rows


def test_every_field_of_readmes_stats_table_is_in_a_real_stats_answer(server):
    rows = readme_stats_rows()
    assert {"requests", "ttft_mean_s", "blocks", "cache_misses", "models"} <= set(rows)  # the table was read
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        client.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
    doc = server.stats()
    missing = [name for name in rows if name not in doc]
    assert missing == [], f"README lists at the top level of /admin/stats, absent: {missing}"
    assert doc["ttft_mean_s"] > 0 and doc["requests"] >= 1
    model = doc["models"][TINY_MODEL]
    per_model = [name for name in rows if name not in GATEWAY_WIDE and name not in model]
    assert per_model == [], f"README says per model too, absent under models.{TINY_MODEL}: {per_model}"
    assert "gateway-wide" in rows["models"] and all(
        f"`{name}`" in rows["models"] for name in GATEWAY_WIDE - {"models"}
    )
    for name, fields in SUB_FIELDS.items():
        assert all(field in rows[name] for field in fields), name
        assert set(fields) <= set(doc[name]), (name, doc[name])
        if name == "blocks":
            assert set(fields) <= set(model[name])
    assert all(f"`{field}`" in rows["prefixes"] for field in PREFIX_FIELDS)
    assert doc["prefixes"] and all(set(PREFIX_FIELDS) <= set(entry) for entry in doc["prefixes"])
    assert all(f"`{field}`" in rows["transcript"] for field in MEMORY_FIELDS)
    assert set(MEMORY_FIELDS) <= set(doc["transcript"]["memory"])
    assert all(f"`{field}`" in rows["cache_misses"] for field in (*MISS_FIELDS, "errors"))
    assert (
        set(MISS_FIELDS) <= set(doc["cache_misses"]["models"][TINY_MODEL]) and "errors" in doc["cache_misses"]
    )


def test_readmes_replicas_fields_are_a_replica_snapshots():
    """Before: README listed ``{state, inflight, failures}``; a replica's row also has ``requests``, ``away``
    and ``restarts``."""
    from gateway.backends.openai_upstream import OpenAIUpstreamBackend

    row = readme_stats_rows()["models"]
    listed = row[row.index("`replicas`") :].split("}`", 1)[0]
    fields = set(re.findall(r"\b([a-z_]+)\b", listed.split("{", 1)[1].replace("up\\|down\\|half_open", "")))
    snapshot = OpenAIUpstreamBackend("m", ["http://a.test/v1", "http://b.test/v1"]).replicas()
    assert snapshot is not None
    assert fields == set(snapshot["http://a.test/v1"]), (fields, snapshot)
