"""A key's spend through the real gateway to a priced upstream: input by cache class plus output tokens
(issue 14: "spend prices input only" was a gap), and the budget that spend exhausts (429 insufficient_quota,
OpenAI's quota error shape on the OpenAI face, Anthropic's rate_limit_error on the Anthropic face): a request
is refused when its reserved estimate (prompt at the input price + max_tokens at the output price) would pass
the budget left."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

SPENDER = "sk-spender-0123456789"
# An output price that makes one request's 3 completion tokens cost 3 USD while its input costs micro-dollars:
# a budget of 5 USD admits one request of max_tokens 3 (it reserves 3 USD and some micro-dollars), not two.
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
        "keys": [{"name": "spender", "key": SPENDER, "tenant": "acme", "budget_usd": 5.0}],
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
    # OpenAI's answer for an exhausted quota: type and code insufficient_quota, no Retry-After
    assert caught.value.body["type"] == caught.value.body["code"] == "insufficient_quota"
    assert "may cost up to 3.0000" in caught.value.body["message"]
    assert "retry-after" not in caught.value.response.headers
    anthropic = httpx.post(
        f"{priced.base_url}/v1/messages",
        headers={"x-api-key": SPENDER},
        json={"model": "oa", "max_tokens": 3, "messages": [{"role": "user", "content": "and now?"}]},
        timeout=30,
    )
    assert anthropic.status_code == 429 and "retry-after" not in anthropic.headers
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "rate_limit_error"
    doc = priced.stats()
    assert doc["keys"]["spender"]["rate_limited"] == 2 and doc["keys"]["spender"]["reserved_usd"] == 0.0
    assert doc["keys"]["spender"]["spend_usd"] == pytest.approx(expected)  # the refusals cost nothing
