"""A gateway with data on every dashboard panel: the tiny embedded model with a disk KV tier and learned slots,
and an OpenAI-compatible upstream model on two stub replicas (with prices), plus traffic for both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

UPSTREAM_MODEL = "oa"
SECRET = "dashboard-test-secret-0123456789"
SYSTEM = (
    "You are the support assistant of the dashboard shop. The customer's favourite colour is {value} and "
    "every answer mentions it once. Answer briefly about orders, returns and the block table."
)
VALUES = ("teal", "amber", "olive", "coral", "ivory")
"""Learned-slot values: they must never reach the dashboard's data."""
UPSTREAM_SYSTEM = " ".join(f"Catalogue rule {i}: answer in one short sentence." for i in range(150))


@contextlib.contextmanager
def dashboard_gateway(checkpoint: Path, tmp_path: Path) -> Iterator[RunningServer]:
    """Two stub replicas and a gateway serving ``tiny`` (embedded, disk tier) and ``oa`` (upstream)."""
    stubs = [StubServer(openai_stub(StubState(f"R{i}"))).start() for i in range(2)]
    data = tiny_config_data(
        checkpoint, tiers=["disk"], tier_disk={"directory": str(tmp_path / "kv")}, deployment_secret=SECRET
    )
    data["rules_learning"] = {"mode": "suggest", "min_distinct": 3}
    data["models"].append(
        {
            "name": UPSTREAM_MODEL,
            "backend": "openai",
            "base_url": [f"{stub.base_url}/v1" for stub in stubs],
            "api_key": "sk-dashboard-test",
            "upstream_model": "gpt-upstream",
            "retries": 1,
            "prices": {"input": 2.5, "cached_input": 1.25},
        }
    )
    server = RunningServer(write_config(tmp_path / "dashboard.yaml", data)).start()
    try:
        yield server
    finally:
        server.stop()
        for stub in stubs:
            stub.stop()


def send_traffic(server: RunningServer) -> None:
    """Chat requests that hit and miss on both models and teach the learner one volatile slot."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for round_ in range(2):
            for value in VALUES[:4]:
                body = {
                    "model": TINY_MODEL,
                    "messages": [
                        {"role": "system", "content": SYSTEM.format(value=value)},
                        {"role": "user", "content": f"where is my order {round_}?"},
                    ],
                    "max_tokens": 3,
                    "temperature": 0,
                }
                response = http.post(
                    "/v1/chat/completions", json=body, headers={"x-prefixgate-tenant": "acme"}
                )
                assert response.status_code == 200, response.text
            for question in ("q1", "q2", "q3"):
                body = {
                    "model": UPSTREAM_MODEL,
                    "messages": [
                        {"role": "system", "content": UPSTREAM_SYSTEM},
                        {"role": "user", "content": question},
                    ],
                }
                response = http.post(
                    "/v1/chat/completions", json=body, headers={"x-prefixgate-tenant": "acme"}
                )
                assert response.status_code == 200, response.text
