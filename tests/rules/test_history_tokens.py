"""History at the token level: after SmolLM2's chat template is rendered and tokenized (no torch), the
previous request's prompt tokens are a prefix of the next one's; a template that rewrites history shows up.
Also the traces bench end to end: targets met on the shipped corpus, a broken line reported and skipped."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.rules_traces import CORPUS, history_kept, read_trace, run_traces, smollm2_tokenizer
from engine.tokenizer import Tokenizer
from rules import load_ruleset
from rules.transcript import TranscriptMemory

DEFAULT = load_ruleset(["default"])
STRIPS_REASONING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if tools %}{% endif %}"  # reads ``tools``: tool turns reach it as they are (no generic tool rendering)
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return smollm2_tokenizer()


def test_smollm2_tokenizer_loads_without_torch() -> None:
    code = (
        "import sys; from bench.rules_traces import smollm2_tokenizer; t = smollm2_tokenizer(); "
        "assert t.encode('hi') and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr


def conversation() -> list[list[dict]]:
    """An agent loop (time changing every request) as the client resends it, request by request."""
    history = [{"role": "user", "content": "Fix the failing test."}]
    out = []
    for turn in range(5):
        system = {
            "role": "system",
            "content": f"You are an agent.\nCurrent time: 2026-12-01 10:{turn:02d}:30\nBe careful.",
        }
        out.append([system, *history])
        history += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{turn}",
                        "type": "function",
                        "function": {"name": "read", "arguments": json.dumps({"turn": turn})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{turn}", "content": f"result {turn}\n" * 200},
        ]
    return out


def test_previous_prompt_tokens_are_a_prefix_of_the_next(tokenizer: Tokenizer) -> None:
    memory = TranscriptMemory()
    previous = previous_raw = None
    for messages in conversation():
        canon = DEFAULT.apply(messages, memory=memory, scope="m")
        if previous is not None and previous_raw is not None:
            assert history_kept(tokenizer, previous, canon.messages)
            assert not history_kept(tokenizer, previous_raw, messages)  # rules off: the time line moved
        previous, previous_raw = canon.messages, messages


def test_a_template_that_strips_reasoning_shows_up(tokenizer: Tokenizer) -> None:
    meta_tokenizer = copy.copy(tokenizer)
    meta_tokenizer.chat_template = STRIPS_REASONING
    assert meta_tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>user"
    )
    first = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>plan</think>a1"},
        {"role": "user", "content": "q2"},
    ]
    agent = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>plan</think>call"},
        {"role": "tool", "content": "out"},
    ]
    after_user = [*agent, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    assert history_kept(tokenizer, agent, after_user)  # SmolLM2's template keeps history
    assert not history_kept(meta_tokenizer, agent, after_user)  # this one strips the earlier reasoning
    assert history_kept(meta_tokenizer, first[:1], first)


def test_traces_bench_meets_its_targets(tokenizer: Tokenizer) -> None:
    report = run_traces(tokenizer=tokenizer)
    summary = report.summary
    assert summary["requests"] == sum(len(read_trace(p)[0]) for p in sorted(CORPUS.glob("*.jsonl")))
    assert summary["turns_worse_than_off"] == 0
    assert summary["turns_worse_than_off_stateless"] == 0
    assert summary["share_of_ideal_traces"] >= 0.95
    assert summary["bad_lines"] == 0
    assert summary["cached_tokens"]["on"] > 5 * summary["cached_tokens"]["off"]


def test_a_broken_trace_line_is_reported_by_number_and_the_rest_runs(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    trace = tmp_path / "broken.jsonl"
    good = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Current date: 2026-12-01"},
            {"role": "user", "content": "hi"},
        ],
    }
    trace.write_text(
        json.dumps(good) + "\n{not json\n" + json.dumps({"messages": 3}) + "\n" + json.dumps(good) + "\n"
    )
    report = run_traces([trace], tokenizer=tokenizer)
    assert [(e.line, e.reason.split(":")[0]) for e in report.errors] == [
        (2, "JSONDecodeError"),
        (3, "ValueError"),
    ]
    assert [r.line for r in report.rows] == [1, 4]
    assert report.rows[1].tokens["on"] > 0
