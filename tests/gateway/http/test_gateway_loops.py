"""Loops between gateways (``gateway.core.gateway_loops``): the chain header on upstream calls, and a request
that comes back to a gateway it passed through refused with 508 in the protocol's error JSON before any work.
Found by a trial: a front whose ``base_url`` named itself turned one request into 588 nested ones in 5 s."""

from __future__ import annotations

import httpx
import pytest

from gateway.config.loader import load_config
from gateway.core import gateway_loops
from gateway.core.gateway_loops import MAX_HOPS, LoopDetected, enter, incoming_chain, leave, outgoing_via
from tests.gateway.server import RunningServer, bound_socket


def test_the_chain_is_read_checked_and_extended():
    headers = [
        (b"x-prefixgate-via", b"aaa, bbb"),
        (b"content-type", b"application/json"),
        (b"x-prefixgate-via", b"ccc"),
    ]
    assert incoming_chain(headers, "own") == ("aaa", "bbb", "ccc")
    assert incoming_chain([], "own") == ()
    with pytest.raises(LoopDetected, match="already passed through this gateway") as caught:
        incoming_chain([(b"x-prefixgate-via", b"aaa,own")], "own")
    assert (caught.value.status_code, caught.value.code) == (508, "loop_detected")
    long = ",".join(f"g{i}" for i in range(MAX_HOPS + 1)).encode()
    with pytest.raises(LoopDetected, match=f"passed through {MAX_HOPS + 1} gateways"):
        incoming_chain([(b"x-prefixgate-via", long)], "own")
    assert outgoing_via() == gateway_loops.PROCESS_ID  # outside a request
    token = enter(("aaa", "bbb"), "own")
    try:
        assert outgoing_via() == "aaa,bbb,own"
    finally:
        leave(token)
    assert outgoing_via() == gateway_loops.PROCESS_ID


def test_a_gateway_whose_upstream_is_itself_answers_at_once(tmp_path, monkeypatch):
    refused = []

    def counted(headers, own_id):
        try:
            return incoming_chain(headers, own_id)
        except LoopDetected:
            refused.append(own_id)
            raise

    monkeypatch.setattr("gateway.http.app.incoming_chain", counted)
    sock = bound_socket()
    port = sock.getsockname()[1]
    path = tmp_path / "loop.yaml"
    path.write_text(
        "models:\n"
        f"  - {{name: loop, backend: openai, base_url: 'http://127.0.0.1:{port}/v1', retries: 0}}\n"
        f"  - {{name: loop-claude, backend: anthropic, base_url: 'http://127.0.0.1:{port}', retries: 0}}\n"
    )
    server = RunningServer(load_config(path), sock=sock).start()
    try:
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "loop", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert refused == [server.app.instance_id]  # one nested call, refused: no storm
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert "508" in error["message"] and "passed through this gateway" in error["message"]
        claude = httpx.post(
            f"{server.base_url}/v1/messages",
            json={"model": "loop-claude", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert claude.status_code == 502 and claude.json()["type"] == "error", claude.text
        assert len(refused) == 2
        assert "passed through this gateway" in claude.json()["error"]["message"]
        # the inner request itself: refused in the path's own error shape, before anything else
        inner = httpx.post(
            f"{server.base_url}/v1/messages",
            headers={"x-prefixgate-via": f"other,{server.app.instance_id}"},
            json={"model": "loop-claude", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert inner.status_code == 508
        assert inner.json()["type"] == "error" and inner.json()["error"]["type"] == "api_error"
        health = httpx.get(f"{server.base_url}/healthz", headers={"x-prefixgate-via": "a,b"}, timeout=30)
        assert health.status_code == 200  # another gateway's chain is no loop
    finally:
        server.stop()
