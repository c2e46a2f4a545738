"""The fast stub OpenAI upstream of ``bench.overhead``: a bare ASGI app (no framework routing) answering every
``POST .../chat/completions`` with one fixed small completion, as JSON or, when the body asks for
``"stream": true``, as OpenAI's SSE chunks (role, two content chunks, finish, usage, ``[DONE]``); ``GET
/healthz`` answers 200. It reads and parses the body (so a broken forward fails), and nothing else.

Run in its own process: ``python -m bench.overhead.stub --port PORT`` (uvicorn, one worker, uvloop and
httptools when installed, no access log).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

REPLY = "The answer is forty-two."
USAGE = {
    "prompt_tokens": 320,
    "completion_tokens": 7,
    "total_tokens": 327,
    "prompt_tokens_details": {"cached_tokens": 256},
}
_BASE = {"id": "chatcmpl-stub", "created": 1767225600, "model": "stub-model", "system_fingerprint": "fp_stub"}

COMPLETION = json.dumps(
    {
        **_BASE,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": REPLY, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    },
    separators=(",", ":"),
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    body = {**_BASE, "object": "chat.completion.chunk", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


STREAM = b"".join(
    [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": REPLY[:10]}),
        _chunk({"content": REPLY[10:]}),
        _chunk({}, "stop"),
        _chunk({}, usage=USAGE),
        b"data: [DONE]\n\n",
    ]
)
"""The whole SSE answer, sent as one body chunk (a real server flushes per token; this stub is about cost)."""


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The ASGI app (HTTP only; lifespan messages are acknowledged)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    path = scope["path"]
    if scope["method"] == "GET" and path == "/healthz":
        await _answer(send, 200, b"application/json", b'{"status":"ok"}')
        return
    if scope["method"] != "POST" or not path.endswith("/chat/completions"):
        await _answer(send, 404, b"application/json", b'{"error":{"message":"not found"}}')
        return
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    try:
        body = json.loads(b"".join(chunks))
        stream = body.get("stream") is True
        if not isinstance(body.get("messages"), list):
            raise ValueError("no messages")
    except (ValueError, AttributeError):
        await _answer(send, 400, b"application/json", b'{"error":{"message":"bad body"}}')
        return
    if stream:
        await _answer(send, 200, b"text/event-stream", STREAM)
    else:
        await _answer(send, 200, b"application/json", COMPLETION)


async def _answer(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    """``python -m bench.overhead.stub --port PORT``: serve the stub on 127.0.0.1 until killed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, workers=1)


if __name__ == "__main__":
    main()
