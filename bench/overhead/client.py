"""Thread CPU per upstream call of the gateway's HTTP client: ``python -m bench.overhead.client``.

Starts ``bench.overhead``'s stub upstream, then, in this process (uvloop), sends the OpenAI request the gateway
sends for ``bench.overhead``'s chat request (its JSON body, the header list ``UpstreamClient.send_direct``
builds) through ``AiohttpTransport.open`` and reads the answer to its end, as the OpenAI backend does, over
one kept connection. Two paths, interleaved in rounds: ``lean`` (the default: a bytes POST over aiohttp's
connector and ``ResponseHandler``) and ``session`` (``AiohttpTransport.lean = False``: every request through
``ClientSession.request``). Prints, per path, ``time.thread_time`` per call in µs for each round and their
median (docs/overhead.md, session 10). The time includes this process's socket system calls, not the stub's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

from bench.overhead import servers
from bench.overhead.run import chat_body
from gateway.transport.aiohttp_transport import AiohttpTransport, DirectResponse
from gateway.transport.upstream_http import make_client


async def _calls(port: int, rounds: int, calls: int) -> dict[str, list[float]]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = json.dumps(chat_body(False), ensure_ascii=False, separators=(",", ":")).encode()
    client = make_client()
    head = client.build_request(
        "POST",
        url,
        headers={"authorization": "Bearer sk-bench", "content-type": "application/json"},
        content=body,
    ).headers.raw
    headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in head]
    await client.aclose()
    timeout = httpx.Timeout(30.0).as_dict()
    results: dict[str, list[float]] = {"lean": [], "session": []}
    transports = {name: AiohttpTransport() for name in results}
    transports["session"].lean = False
    try:
        for round_ in range(rounds + 1):
            for name, transport in transports.items():
                start = time.thread_time()
                for _ in range(calls):
                    response = DirectResponse(await transport.open("POST", url, headers, body, timeout))
                    async for _chunk in response.aiter_bytes():
                        pass
                if round_:  # the first round warms both
                    results[name].append((time.thread_time() - start) / calls * 1e6)
    finally:
        for transport in transports.values():
            await transport.aclose()
    return results


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds after a warm-up (default 5)"
    )
    parser.add_argument("--calls", type=int, default=2000, help="calls per path per round (default 2000)")
    args = parser.parse_args(argv)
    stub = servers.start_stub(Path(tempfile.mkdtemp()))
    try:
        results = uvloop.run(_calls(stub.port, args.rounds, args.calls))
    finally:
        stub.stop()
    for name, values in results.items():
        rounds = " ".join(f"{value:6.1f}" for value in values)
        print(f"{name:8s} µs of thread CPU per call: {rounds}   median {statistics.median(values):.1f}")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
