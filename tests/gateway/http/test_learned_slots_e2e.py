"""Learned volatile slots through the real server: the gateway learns a per-customer value no rule knows from
system prompts (mode ``suggest`` by default), lists it in ``/admin/stats`` as shape and counts only,
``prefixgate rules learned`` exports it from the running gateway as a rule file, and in mode ``apply`` the
slot is hoisted like a rule's match."""

from __future__ import annotations

import json
import uuid

import openai
import yaml

from gateway.cli import main
from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config

TEMPLATE = (
    "You are the support assistant of the prefix cache shop. The customer's favourite colour is {value} and "
    "every answer mentions it once. Answer briefly about orders, returns and the block table."
)
VALUES = ("teal", "amber", "olive", "coral", "ivory")


def ask(client: openai.OpenAI, value: str, who: str):
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL,
        messages=[
            {"role": "system", "content": TEMPLATE.format(value=value)},
            {"role": "user", "content": "where is my order ?"},
        ],
        max_tokens=2,
        temperature=0,
        extra_headers={"x-prefixgate-tenant": who},
    )
    return raw.parse().usage, raw.headers["x-prefixgate-cache"]


def learned_rows(doc: dict, who: str) -> list[dict]:
    return [row for row in doc["learned"]["slots"] if row["tenant"] == who]


def test_a_slot_is_learned_listed_without_values_and_exported(server, client, capsys):
    who = f"t-{uuid.uuid4().hex[:8]}"
    for value in VALUES[:4]:
        ask(client, value, who)
    doc = server.stats()
    assert doc["learned"]["mode"] == "suggest"
    rows = learned_rows(doc, who)
    assert len(rows) == 1 and rows[0]["state"] == "slot" and rows[0]["distinct_values"] >= 3
    text = json.dumps(doc)
    assert not any(value in text for value in VALUES)  # shape and counts, never a value

    assert main(["rules", "learned", "--url", server.base_url, "--token", ADMIN_TOKEN, "--tenant", who]) == 0
    exported = capsys.readouterr().out
    rules = yaml.safe_load(exported)["rules"]
    assert [r["id"] for r in rules] == [rows[0]["id"]]
    assert rules[0]["action"] == "hoist" and "favourite colour is " in rules[0]["match"]["pattern"]
    assert not any(value in exported for value in VALUES)
    # in mode suggest nothing is rewritten by the slot
    assert rows[0]["id"] not in doc["models"][TINY_MODEL]["rules"]

    assert main(["rules", "learned", "--url", server.base_url, "--token", "wrong"]) == 1
    assert "401" in capsys.readouterr().err


def test_in_mode_apply_a_learned_slot_is_hoisted(tiny_checkpoint, tmp_path):
    data = tiny_config_data(tiny_checkpoint)
    data["rules_learning"] = {"mode": "apply", "min_distinct": 3}
    server = RunningServer(write_config(tmp_path / "apply.yaml", data)).start()
    who = f"t-{uuid.uuid4().hex[:8]}"
    try:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
            for value in VALUES[:4]:
                ask(client, value, who)
            slot = learned_rows(server.stats(), who)[0]["id"]
            before = ask(client, "ivory", who)
            after = ask(client, "sable", who)
        doc = server.stats()
    finally:
        server.stop()
    assert doc["models"][TINY_MODEL]["rules"].get(slot, 0) >= 2
    # the value sits behind the stable prefix now: a new value misses nothing stable
    assert after[1].startswith(f"cached={after[0].prompt_tokens_details.cached_tokens}; miss=none")
    assert after[0].prompt_tokens_details.cached_tokens >= before[0].prompt_tokens_details.cached_tokens - 16
