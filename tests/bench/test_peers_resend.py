"""``bench.peers.open_stream``: a request whose keep-alive connection was closed before any response byte is
sent again (counted), as the official SDKs retry it; other failures and a third drop are raised."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import respx

from bench.peers import STALE_RESENDS, Server, open_stream

URL = "http://peer.test"


def server() -> Server:
    return Server("llama-server", subprocess.Popen(["true"]), URL, Path("/dev/null"))


def chunks(route_effects: list) -> tuple[Server, list[str]]:
    s = server()
    with respx.mock(assert_all_called=True) as mock:
        mock.post(URL + "/v1/chat/completions").mock(side_effect=route_effects)
        with open_stream(s, s.http_client(), {"model": "m"}) as r:
            lines = list(r.iter_lines())
    return s, lines


def test_resends_after_a_stale_connection_and_counts_it() -> None:
    drop = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    ok = httpx.Response(200, text="data: one\n\ndata: [DONE]\n\n")
    s, lines = chunks([drop, ok])
    assert s.resends == 1
    assert [ln for ln in lines if ln] == ["data: one", "data: [DONE]"]


def test_gives_up_after_the_resends() -> None:
    drop = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    s = server()
    with respx.mock() as mock:
        route = mock.post(URL + "/v1/chat/completions").mock(side_effect=[drop] * (STALE_RESENDS + 1))
        with pytest.raises(httpx.RemoteProtocolError), open_stream(s, s.http_client(), {}):
            pass
    assert route.call_count == STALE_RESENDS + 1
    assert s.resends == STALE_RESENDS


def test_other_errors_are_not_resent() -> None:
    s = server()
    with respx.mock() as mock:
        route = mock.post(URL + "/v1/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
        with pytest.raises(httpx.ConnectError), open_stream(s, s.http_client(), {}):
            pass
    assert route.call_count == 1
    assert s.resends == 0


def test_an_error_inside_the_body_is_raised_once() -> None:
    s = server()
    with respx.mock() as mock:
        route = mock.post(URL + "/v1/chat/completions").mock(return_value=httpx.Response(200, text="x"))
        with pytest.raises(ValueError, match="client"), open_stream(s, s.http_client(), {}):
            raise ValueError("client side")
    assert route.call_count == 1
    assert s.resends == 0
