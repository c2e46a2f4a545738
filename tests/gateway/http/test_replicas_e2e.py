"""Two OpenAI-compatible replicas behind the real gateway, with the official SDK: a turn the router sends to the
replica that never held its prefix is explained ``other_replica``, not ``evicted``; a non-streamed answer a
replica broke off is asked again on the other replica; ``away`` is null under ``round_robin``."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from gateway.core.headers import INSTANCE_HEADER
from tests.gateway.server import ADMIN_TOKEN, RunningServer, write_config
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

SYSTEM = (
    "You are the catalogue assistant. Answer every question about the catalogue in one short sentence. " * 16
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    states = [StubState("A"), StubState("B")]
    stubs = [StubServer(openai_stub(state)).start() for state in states]
    data = {
        "admin": {"token": ADMIN_TOKEN},
        "models": [
            {
                "name": "rr",
                "backend": "openai",
                "base_url": [f"{stub.base_url}/v1" for stub in stubs],
                "api_key": "k",
                "routing": "round_robin",
            }
        ],
    }
    server = RunningServer(
        write_config(tmp_path_factory.mktemp("replicas") / "prefixgate.yaml", data)
    ).start()
    yield server, states, stubs
    server.stop()
    for stub in stubs:
        stub.stop()


def fields(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


def test_a_turn_sent_to_a_replica_that_never_held_the_prefix_is_other_replica(fleet):
    """A trial: round-robin sent a conversation's second turn to the replica that had not served the first,
    and the explanation said ``evicted``: that replica's cache never held the prefix."""
    server, states, _ = fleet
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is in stock ?"}]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        seen = []
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model="rr", messages=messages)
            seen.append((raw.parse().choices[0].message.content, fields(raw.headers["x-prefixgate-cache"])))
    (first_by, first), (second_by, second), (third_by, third) = seen
    assert first_by != second_by and third_by == first_by  # round robin over the two
    assert (first["miss"], first["cached"]) == ("cold", "0")
    assert (second["miss"], second["cached"]) == ("other_replica", "0"), second
    # back where it was cached (the stub counts its own tokens, so its granules may fall short of the target)
    assert int(third["cached"]) > 0 and third["miss"] != "other_replica"
    causes = server.stats()["cache_misses"]["models"]["rr"]["by_cause"]
    assert (causes["other_replica"], causes["evicted"]) == (1, 0)


def test_a_non_streamed_answer_a_replica_broke_off_is_asked_again(fleet):
    """A trial: a replica killed mid-answer was a 502 for a non-streamed request, though the other was up."""
    server, states, _ = fleet
    before = [len(state.requests) for state in states]
    for state in states:
        state.cut_next = 1  # each replica breaks off its next answer: the third attempt is served
    messages = [{"role": "user", "content": "a question nobody asked before"}]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        answer = client.chat.completions.create(model="rr", messages=messages)
    asked = {state.name: len(state.requests) - b for state, b in zip(states, before, strict=True)}
    served_by = answer.choices[0].message.content.removeprefix("served by ")
    assert asked[served_by] == 2 and sum(asked.values()) == 3  # cut, cut on the other, served
    assert all(state.cut_next == 0 for state in states)
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        for state in states:
            state.cut_next = 1
        stream = client.chat.completions.create(model="rr", messages=messages, stream=True)
        with pytest.raises(openai.APIError):  # a streamed answer's cut reaches its client: not asked again
            list(stream)
    assert sum(len(state.requests) - b for state, b in zip(states, before, strict=True)) == 4
    for state in states:
        state.cut_next = 0
    replicas = server.stats()["models"]["rr"]["replicas"]
    assert all(row["away"] is None for row in replicas.values())  # round robin has no home replica
    assert all(row["restarts"] == 0 for row in replicas.values())  # the stubs name no instance


def test_every_model_answer_names_the_gateway_instance(fleet):
    """A front gateway sees a prefixgate replica that restarted (its RAM cache empty) by the instance name in
    its answers (``x-prefixgate-instance``): every face, streamed or not, sends this gateway's one name."""
    server, _, _ = fleet
    messages = [{"role": "user", "content": "which instance?"}]
    names = set()
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for stream in (False, True):
            for path, body in (
                ("/v1/chat/completions", {"model": "rr", "messages": messages, "stream": stream}),
                ("/v1/messages", {"model": "rr", "messages": messages, "max_tokens": 8, "stream": stream}),
                ("/v1/responses", {"model": "rr", "input": "which instance?", "stream": stream}),
            ):
                answer = http.post(path, json=body)
                assert answer.status_code == 200, answer.text
                names.add(answer.headers.get(INSTANCE_HEADER))
        refused = http.post("/v1/chat/completions", json={"model": "rr", "messages": "not a list"})
    assert refused.status_code == 400
    assert len(names) == 1 and re.fullmatch(r"[0-9a-f]{12}", names.pop() or "")
