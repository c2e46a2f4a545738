"""README's rows for ``GET /admin/cache`` and ``POST /admin/cache/warm`` against the running gateway (no KV
tiers configured, as ``make run``): the fields the warm row says it answers are exactly the answer's, and what
the cache row says ``level`` is without tiers is what a request's prefix lists."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai

from tests.gateway.conftest import TINY_MODEL
from tests.gateway.server import ADMIN_HEADERS

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_row(endpoint: str) -> str:
    """The meaning column of README's endpoint-table row for ``endpoint`` (e.g. ``POST /admin/cache/warm``)."""
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| `{endpoint}` |"):
            return line.split("|", 2)[2]
    raise AssertionError(f"README has no endpoint row for {endpoint}")


def test_the_warm_row_lists_exactly_the_fields_a_warm_answers(server):
    """Before: the row listed 5 of the answer's 8 fields (no ``model``, ``tenant``, ``reusable_tokens``)."""
    row = readme_row("POST /admin/cache/warm")
    answers = row[row.index("answers") :]
    listed = set(re.findall(r"`([a-z_]+)`", answers.split("(`DELETE")[0]))
    response = httpx.post(
        f"{server.base_url}/admin/cache/warm",
        json={"system": "You are a warm test assistant."},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert listed == set(response.json()), (listed, response.json())


def test_without_tiers_a_requests_prefix_lists_the_default_level_as_readme_says(server):
    """Before: README said ``level`` is the segments' level (``system`` for a system prompt), ``default_level``
    only "when the prompt had no segments"; without tiers the request path never locates segments."""
    row = readme_row("GET /admin/cache")
    assert "without `engine.tiers` a prefix a request cached lists `default_level` (`history`)" in row
    system = "You are the level test assistant. " * 8

    def listed() -> dict[str, str]:
        response = httpx.get(f"{server.base_url}/admin/cache", headers=ADMIN_HEADERS, timeout=30)
        return {entry["prefix_key"]: entry["level"] for entry in response.json()["data"]}

    before = listed()
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        client.chat.completions.create(
            model=TINY_MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            max_tokens=2,
        )
    new = {key: level for key, level in listed().items() if key not in before}
    assert list(new.values()) == ["history"], new


def test_an_unknown_model_on_the_cache_endpoints_is_a_404_as_warm_answers_it(server):
    """Before: ``DELETE /admin/cache?model=nope`` answered 200 ``{"dropped": {"prefixes": 0, ...}}`` and ``GET``
    an empty list, so a typo in a model name looked like an empty cache; ``POST /admin/cache/warm`` was a 404."""
    url = f"{server.base_url}/admin/cache"
    for response in (
        httpx.delete(url, params={"model": "nope"}, headers=ADMIN_HEADERS, timeout=30),
        httpx.get(url, params={"model": "nope"}, headers=ADMIN_HEADERS, timeout=30),
        httpx.post(f"{url}/warm", json={"model": "nope", "system": "x"}, headers=ADMIN_HEADERS, timeout=30),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
    known = httpx.delete(url, params={"model": TINY_MODEL}, headers=ADMIN_HEADERS, timeout=30)
    assert known.status_code == 200 and set(known.json()["dropped"]) == {"prefixes", "ram", "disk", "redis"}
