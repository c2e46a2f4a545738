"""The gateway's own cost on the hot path, beside LiteLLM's proxy (issue 18, part 5).

One chat request (a 200-word system prompt and a short question, ``max_tokens`` 16) is sent to a fast stub
OpenAI upstream (``bench.overhead.stub``) three ways: directly, through prefixgate (``backend: openai`` on the
stub, default rules on) and through LiteLLM's proxy (one ``openai/`` model on the stub). Each server is its
own process with one worker. The rounds are interleaved (every round runs each target in turn, the order
rotating), at 1 and at 8 keep-alive connections, non-streamed and streamed answers, so load from other
processes on a shared machine falls on all of them alike.

Figures: p50 / p99 latency per request (client side, write to last byte), the latency added over the direct
path at p50 (the load client's own cost cancels in it), requests/s at each connection count, and each server
process's resident memory at the end.

Run: ``python -m bench.overhead`` (LiteLLM from ``--litellm PATH``, default the ``litellm`` script beside this
Python or in ``bench/.peers/litellm``; ``--no-litellm`` leaves it out). Prints a table, then one JSON line
(last) with ``overhead_p50_ms`` (prefixgate's added p50 at 1 connection, non-streamed) and ``rps_vs_litellm``
(prefixgate's requests/s over LiteLLM's at 8 connections; null without LiteLLM), and the rest.
Targets: ``overhead_p50_ms`` <= 1, ``rps_vs_litellm`` >= 5. Where the time goes: docs/overhead.md, and
``python -m bench.overhead.profile`` (py-spy on the gateway under this load, CPU per request by category) and
``python -m bench.overhead.phases`` (thread CPU between marks along one request at one connection). For an A/B
of two builds (``--baseline TREE``) at one connection, ``--requests-1 500`` makes each batch long enough for the
CPU per request (``/proc`` ticks of 10 ms) to separate builds a few percent apart.
"""
