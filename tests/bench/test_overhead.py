"""bench.overhead in its quick mode (direct and prefixgate only: LiteLLM is not in the test environment), and
its pieces: the stub upstream, the load client, the report."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.overhead import servers
from bench.overhead.load import AnswerError, Batch, build_request, percentile, run_batch
from bench.overhead.run import EXPECT, QUICK, chat_body, paired_rounds, report, summarize
from bench.overhead.stub import COMPLETION, STREAM, app

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_table_and_the_json_keys():
    out = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--quick", "--no-litellm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    doc = json.loads(lines[-1])
    assert {"overhead_p50_ms", "rps_vs_litellm", "prefixgate_rps_8", "prefixgate_rss_mb"} <= set(doc)
    assert doc["rps_vs_litellm"] is None and doc["litellm_rps_8"] is None  # LiteLLM was left out
    assert isinstance(doc["overhead_p50_ms"], float)
    assert doc["prefixgate_rps_8"] > 0 and doc["prefixgate_rss_mb"] > 0
    rows = [line.split() for line in lines if line.startswith(("json", "stream"))]
    assert len(rows) == 8  # 2 answer kinds x 2 connection counts x (direct, prefixgate)
    assert {row[2] for row in rows} == {"direct", "prefixgate"}


def test_batch_sizes_can_be_set_and_must_be_positive():
    base = [sys.executable, "-m", "bench.overhead", "--quick", "--no-litellm", "--no-stream", "--rounds", "1"]
    out = subprocess.run(
        [*base, "--requests-1", "3", "--requests-8", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["requests_per_batch"] == {"1": 3, "8": 8} and doc["rounds"] == 1
    refused = subprocess.run(
        [*base, "--requests-1", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "--requests-1 must be at least 1" in refused.stderr


def test_find_litellm_takes_a_script_or_a_venv(tmp_path):
    assert servers.find_litellm(str(tmp_path)) is None
    script = tmp_path / "bin" / "litellm"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert servers.find_litellm(str(tmp_path)) == str(script)
    assert servers.find_litellm(str(script)) == str(script)


async def _asgi(body: bytes, path: str = "/v1/chat/completions", method: str = "POST"):
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


async def test_stub_answers_json_sse_and_refuses_a_bad_body():
    status, headers, body = await _asgi(json.dumps(chat_body(False)).encode())
    assert (status, headers[b"content-type"], body) == (200, b"application/json", COMPLETION)
    assert json.loads(body)["choices"][0]["message"]["content"] == "The answer is forty-two."
    status, headers, body = await _asgi(json.dumps(chat_body(True)).encode())
    assert (status, headers[b"content-type"], body) == (200, b"text/event-stream", STREAM)
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 6
    assert json.loads(events[-2][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert (await _asgi(b"{not json"))[0] == 400
    assert (await _asgi(b"{}", path="/v1/embeddings"))[0] == 404


def test_chat_body_numbers_the_question_and_keeps_the_system_prompt():
    a, b = chat_body(False, 1), chat_body(True, 2)
    assert a["messages"][0] == b["messages"][0]
    assert a["messages"][1] != b["messages"][1]
    assert "stream" not in a and b["stream"] is True
    assert 190 <= len(a["messages"][0]["content"].split()) <= 210  # the 200-word system prompt


async def _serve_once(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_run_batch_times_every_request_over_its_connections():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\nsay forty-two!!"
    server, port = await _serve_once(ok)
    async with server:
        requests = [build_request("127.0.0.1", port, "/x", {"n": i}, {}) for i in range(7)]
        batch = await run_batch("127.0.0.1", port, requests, 3, EXPECT)
    assert len(batch.latencies) == 7 and batch.wall_s > 0


async def test_run_batch_fails_on_an_error_answer():
    bad = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom"
    server, port = await _serve_once(bad)
    async with server:
        with pytest.raises(AnswerError, match="answered 500"):
            await run_batch("127.0.0.1", port, [build_request("127.0.0.1", port, "/x", {}, {})], 1, EXPECT)


def test_percentile_and_report_use_the_direct_path_as_baseline():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0 and percentile([], 99) == 0.0
    results = {
        ("direct", 1, False): [Batch([0.001, 0.001], 0.002, 0.0)],
        ("prefixgate", 1, False): [Batch([0.003, 0.003], 0.006, 0.004)],
        ("direct", 8, False): [Batch([0.001] * 4, 0.001, 0.0)],
        ("prefixgate", 8, False): [Batch([0.002] * 4, 0.002, 0.004)],
        ("litellm", 8, False): [Batch([0.008] * 4, 0.008, 0.02)],
    }
    doc = report(summarize(results), {"prefixgate": 50.0}, QUICK, 1.0)
    assert doc["overhead_p50_ms"] == 2.0
    assert doc["prefixgate_rps_8"] == 2000.0 and doc["litellm_rps_8"] == 500.0
    assert doc["rps_vs_litellm"] == 4.0
    assert doc["prefixgate_cpu_ms_per_request"] == 1.5  # (2 ms + 1 ms) / 2 rows
    assert doc["baseline_overhead_p50_ms"] is None and doc["baseline_rps_8"] is None  # no --baseline
    results[("baseline", 1, False)] = [Batch([0.005, 0.005], 0.01, 0.002)]
    results[("baseline", 8, False)] = [Batch([0.004] * 4, 0.004, 0.004)]
    doc = report(summarize(results), {"prefixgate": 50.0}, QUICK, 1.0)
    assert doc["baseline_overhead_p50_ms"] == 4.0 and doc["baseline_rps_8"] == 1000.0
    assert doc["baseline_cpu_ms_per_request"] == 1.0  # (1 ms + 1 ms) / 2 rows


def test_profile_charges_each_sample_to_its_innermost_category_and_leaves_waits_out(tmp_path):
    from bench.overhead.profile import attribute, breakdown, read_collapsed

    raw = tmp_path / "spy.txt"
    raw.write_text(
        "run (uvicorn/main.py:1);apply (rules/canonicalize.py:9) 6\n"
        # httpx called from the backend: the innermost matching frame (httpx) wins over the backend's
        "stream (gateway/backends/openai_upstream.py:5);send (httpx/_client.py:3) 3\n"
        "send (httpx/_client.py:3);write (anyio/_backends/_asyncio.py:1);"
        "_SelectorSocketTransport.write (asyncio/selector_events.py:1057) 5\n"
        "main (somewhere.py:1) 1\n"
    )
    samples = read_collapsed(raw)
    assert samples[0] == (["run (uvicorn/main.py:1)", "apply (rules/canonicalize.py:9)"], 6)
    shares, waiting = attribute(samples)
    assert waiting == 5
    assert shares == {"rules (RuleSet.apply)": 6, "HTTP client (httpx, transport)": 3, "other": 1}
    assert breakdown(shares, 2.0) == {
        "rules (RuleSet.apply)": 1.2,
        "HTTP client (httpx, transport)": 0.6,
        "other": 0.2,
    }
    assert breakdown(Counter(), 2.0) == {}


def test_profile_leaves_out_socket_writes_under_uvloop_by_their_line():
    from bench.overhead.profile import attribute, socket_write_lines

    writes = socket_write_lines()
    line = next(w for w in writes if w.startswith("uvicorn/protocols/http/httptools_impl.py:"))
    head = "run (uvicorn/main.py:1);RequestResponseCycle.send (" + line
    other = "run (uvicorn/main.py:1);RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:1)"
    shares, waiting = attribute([(head.split(";"), 4), (other.split(";"), 2)])
    assert waiting == 4 and shares == {"uvicorn": 2}
    # the lean upstream path's write (AiohttpTransport._exchange) is one of them
    lean = [w for w in writes if w.startswith("gateway/transport/aiohttp_transport.py:")]
    source = (ROOT / "gateway/transport/aiohttp_transport.py").read_text().splitlines()
    assert [source[int(w.rsplit(":", 1)[1][:-1]) - 1].strip() for w in lean] == [
        "transport.writelines((data, body))"
    ]


def test_profile_puts_samples_in_the_loops_own_frame_in_their_own_category():
    """Under uvloop a sample whose innermost frame is ``Runner.run`` is the loop's C code or a wait for a core:
    it is counted apart, not as the loop's Python work."""
    from bench.overhead.profile import LOOP_OR_WAITING, attribute

    loop = "run (uvicorn/main.py:1);Runner.run (asyncio/runners.py:118)"
    callback = loop + ";_run (asyncio/events.py:80)"
    shares, waiting = attribute([(loop.split(";"), 3), (callback.split(";"), 2)])
    assert waiting == 0 and shares == {LOOP_OR_WAITING: 3, "asyncio event loop": 2}


def test_phases_table_from_marks():
    """Each request runs from its first mark to the next request's; the rows follow the most common sequence."""
    from bench.overhead.phases import FIRST, phases

    lines = []
    for n in range(3):
        at = 1_000_000 * n
        lines += [
            f"{FIRST} {at} {at}",
            f"step one< {at + 2000} {at + 2000}",
            f"step one> {at + 5000} {at + 9000}",
        ]
    rows, count, total = phases(lines)
    assert (count, total) == (2, 2)  # the last request has no next one to end it
    assert rows == [
        (FIRST, "step one<", 2.0, 2.0),
        ("step one<", "step one>", 3.0, 7.0),
        ("step one>", "next " + FIRST, 995.0, 991.0),
    ]
    assert phases([]) == ([], 0, 0)


def test_phases_run_finds_every_mark_and_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "bench.overhead.phases", "--requests", "20", "--warmup", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "left out" not in out.stderr, out.stderr[-3000:]
    assert "most common sequence" in out.stdout and "canonicalize<" in out.stdout and "explain<" in out.stdout


def test_client_comparison_prints_both_paths():
    out = subprocess.run(
        [sys.executable, "-m", "bench.overhead.client", "--rounds", "1", "--calls", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["lean", "session"]
    assert all("µs of thread CPU per call" in line and "median" in line for line in lines[:2])
    assert lines[2].startswith("load average (1 min): ")


def test_paired_rounds_reads_each_rounds_ratio():
    def batch(cpu_s: float, requests: int = 100) -> Batch:
        return Batch(latencies=[0.001] * requests, wall_s=1.0, cpu_s=cpu_s)

    results = {
        ("prefixgate", 1, False): [batch(0.2), batch(0.3), batch(0.1)],
        ("baseline", 1, False): [batch(0.4), batch(0.2), batch(0.2)],
    }
    text = paired_rounds(results, (False,))
    assert text == (
        "json 1 conns: CPU ms/req prefixgate/baseline by round 2.00/4.00 3.00/2.00 1.00/2.00; median ratio 0.500 "
        "(rounds below 1: 2 of 3)"
    )
    assert paired_rounds({}, (False, True)) == ""
