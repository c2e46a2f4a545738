"""A key's spend through the real gateway to a priced upstream: input by cache class plus output tokens
(issue 14: "spend prices input only" was a gap), and the budget that spend exhausts (429 insufficient_quota)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

SPENDER = "sk-spender-0123456789"
# An output price that makes one request's 3 completion tokens cost 3 USD while its input costs micro-dollars:
# a budget of 2 USD is spent by the output alone.
PRICES = {"input": 1.0, "cached_input": 0.5, "output": 1_000_000.0}


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    state = StubState("OAI")
    stub = StubServer(openai_stub(state)).start()
    data = {
        "rules": ["default"],
        "models": [
            {
                "name": "oa",
                "backend": "openai",
                "base_url": f"{stub.base_url}/v1",
                "upstream_model": "gpt-upstream",
                "retries": 0,
                "prices": PRICES,
            }
        ],
        "keys": [{"name": "spender", "key": SPENDER, "tenant": "acme", "budget_usd": 2.0}],
        "admin": {"token": ADMIN_TOKEN},  # with client keys, the admin endpoints need one (else closed, 403)
    }
    config = write_config(tmp_path_factory.mktemp("spend") / "prefixgate.yaml", data)
    gateway = RunningServer(config).start()
    yield gateway
    gateway.stop()
    stub.stop()


def test_spend_counts_output_tokens_and_exhausts_the_budget(priced):
    with openai.OpenAI(base_url=f"{priced.base_url}/v1", api_key=SPENDER, max_retries=0, timeout=30) as sdk:
        done = sdk.chat.completions.create(
            model="oa", messages=[{"role": "user", "content": "how much?"}], max_tokens=3
        )
        usage = done.usage
        assert usage.completion_tokens == 3
        cached = usage.prompt_tokens_details.cached_tokens
        expected = (
            (usage.prompt_tokens - cached) * PRICES["input"]
            + cached * PRICES["cached_input"]
            + usage.completion_tokens * PRICES["output"]
        ) / 1e6
        doc = priced.stats()
        assert doc["keys"]["spender"]["spend_usd"] == pytest.approx(expected)
        assert doc["tenants"]["acme"]["spend_usd"] == pytest.approx(expected)
        assert doc["models"]["oa"]["output_cost_usd"] == pytest.approx(3.0)
        with pytest.raises(openai.RateLimitError) as caught:
            sdk.chat.completions.create(
                model="oa", messages=[{"role": "user", "content": "and now?"}], max_tokens=3
            )
    assert caught.value.body["code"] == "insufficient_quota"
    assert "retry-after" not in caught.value.response.headers
