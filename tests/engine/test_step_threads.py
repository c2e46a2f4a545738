"""Torch threads per step (``engine.step_threads``, ``engine.small_step_threads``): which count each step runs
with, and that tokens and logits do not depend on it (greedy tokens the same with the setting on and off,
batched == alone, cache on == cache off, at ``num_threads`` 1, 2 and 3). On the tiny checkpoints the logits are
bit-identical with the setting on and off: the decode split follows the configured count (with the live count
they differ); torch's bf16 flash kernel can round 1 ulp apart across thread counts on larger shapes
(``engine.step_threads``), not met on these shapes."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import torch

import engine.model_runner as runner_mod
from engine.api import EngineConfig, GenerationRequest
from engine.async_engine import AsyncEngine
from engine.step_threads import SMALL_STEP_MAX_ROWS, StepThreads, check_small_step_threads
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

N_NEW = 10


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The runner sets this (the calling) thread's count; give the next test back the count it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def forward_counts(monkeypatch) -> list[int]:
    """Torch's live thread count at each forward pass of the model (appended as they run)."""
    seen: list[int] = []
    real = runner_mod.ModelRunner.execute

    def spy(self, inp, return_logits=False):
        real_forward = self.model.forward

        def forward(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return real_forward(*args, **kwargs)

        self.model.forward = forward
        try:
            return real(self, inp, return_logits)
        finally:
            del self.model.forward

    monkeypatch.setattr(runner_mod.ModelRunner, "execute", spy)
    return seen


def test_each_step_runs_with_the_count_its_rows_ask_for(monkeypatch):
    assert SMALL_STEP_MAX_ROWS == 2
    torch.set_num_threads(2)
    seen = forward_counts(monkeypatch)
    eng = make_engine(num_threads=2, small_step_threads="auto", max_num_batched_tokens=512)
    eng.generate([random_tokens(40, 1)], greedy(4))  # prefill (2), then 3 one-row decodes (1)
    eng.generate([random_tokens(30, 2), random_tokens(35, 3)], greedy(3))  # prefill of 2 (2), 2 x 2 rows (1)
    eng.generate([random_tokens(20, s) for s in (4, 5, 6)], greedy(2))  # prefill of 3 (2), 1 x 3 rows (2)
    assert seen == [2, 1, 1, 1, 2, 1, 1, 2, 2]
    assert eng.runner.steps_by_threads == Counter({2: 4, 1: 5})
    assert eng.runner.thread_switches == 4  # 2 -> 1, 1 -> 2, 2 -> 1, 1 -> 2: never a set to the same count


def test_a_decode_joining_a_prefill_runs_with_every_thread(monkeypatch):
    torch.set_num_threads(2)
    seen = forward_counts(monkeypatch)
    eng = make_engine(num_threads=2, small_step_threads="auto", max_num_batched_tokens=512)
    eng.add_request(random_tokens(40, 1), greedy(6))
    eng.step()  # A's prefill
    eng.step()  # A decodes alone
    eng.add_request(random_tokens(30, 2), greedy(1))
    eng.step()  # A's decode row and B's prefill in one step: 31 rows
    eng.step()  # A alone again (B finished with its one token)
    assert seen == [2, 1, 2, 1]


@pytest.mark.parametrize(
    ("setting", "threads", "expected"),
    [
        ("off", 2, [2, 2, 2]),
        (1, 3, [3, 1, 1]),
        (3, 3, [3, 3, 3]),
        ("auto", 1, [1, 1, 1]),
        ("auto", 2, [2, 1, 1]),
        ("auto", 3, [3, 3, 3]),
    ],
)
def test_the_setting_picks_the_small_step_count(monkeypatch, setting, threads, expected):
    torch.set_num_threads(threads)
    seen = forward_counts(monkeypatch)
    eng = make_engine(num_threads=threads, small_step_threads=setting)
    eng.generate([random_tokens(40, 7)], greedy(3))
    assert seen == expected
    assert eng.runner.thread_switches == (1 if expected[0] != expected[-1] else 0)


def test_off_runs_every_step_with_num_threads_whatever_the_thread_had():
    torch.set_num_threads(1)  # e.g. left by another engine's small step in this thread
    eng = make_engine(num_threads=2, small_step_threads="off")
    eng.generate([random_tokens(40, 8)], greedy(3))
    assert torch.get_num_threads() == 2 and eng.runner.thread_switches == 1  # set once, never again
    assert eng.runner.steps_by_threads == Counter({2: 3})


@pytest.mark.parametrize("bad", ["fast", "", "1", 0, -2, True, 1.5, None])
def test_a_bad_setting_names_the_key(bad):
    with pytest.raises(ValueError, match=r"engine\.small_step_threads must be 'auto', 'off' or an integer"):
        make_engine(small_step_threads=bad)
    with pytest.raises(ValueError, match=r"engine\.small_step_threads"):
        check_small_step_threads(bad)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_thread_count_names_the_key(bad):
    with pytest.raises(ValueError, match=r"engine\.num_threads must be an integer >= 1"):
        make_engine(num_threads=bad)


def test_policy_from_setting():
    assert StepThreads.from_setting(None, "auto", 2) == StepThreads(2, 1, SMALL_STEP_MAX_ROWS)
    assert StepThreads.from_setting(None, "auto", 4) == StepThreads(4, 4, 0)  # not measured beyond 2: off
    assert StepThreads.from_setting(3, "auto", 1) == StepThreads(3, 3, 0)
    assert StepThreads.from_setting(4, 1, 2) == StepThreads(
        4, 1, SMALL_STEP_MAX_ROWS
    )  # an int always switches
    assert StepThreads.from_setting(2, "off", 4) == StepThreads(2, 2, 0)
    policy = StepThreads.from_setting(3, 2, 1)
    assert [policy.for_step(t, s) for t, s in [(1, 1), (2, 2), (3, 3), (2, 1), (40, 1)]] == [2, 2, 3, 3, 3]
    assert policy.switches and not StepThreads.from_setting(1, "auto", 1).switches
    assert EngineConfig().small_step_threads == "auto"


# ---- numerics: the per-step count never changes a token or a logit ----------------------------------------

PROMPTS = [random_tokens(200, 21), random_tokens(170, 22), random_tokens(150, 23)]
"""Decode contexts of 150-200 positions (``engine.chunked_decode``: one chunk each)."""


def run(ckpt, prompts, threads, setting, **kwargs):
    """Greedy tokens and logits ``[N_NEW, vocab]`` of each prompt, batched in one engine with a bf16 KV cache
    (the split decode path)."""
    torch.set_num_threads(threads)
    eng = make_engine(
        ckpt,
        num_threads=threads,
        small_step_threads=setting,
        kv_dtype="bfloat16",
        record_logits=True,
        **kwargs,
    )
    reqs = [eng.add_request(p, greedy(N_NEW)) for p in prompts]
    eng.run_to_completion()
    return [r.output_token_ids for r in reqs], [torch.stack(eng.logits_log[r.request_id]) for r in reqs], eng


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tokens_and_logits_do_not_depend_on_the_step_count(threads):
    ckpt = tiny_checkpoint()
    for prompt in PROMPTS:
        off_tokens, off_logits, _ = run(ckpt, [prompt], threads, "off", enable_prefix_caching=False)
        on_tokens, on_logits, eng = run(ckpt, [prompt], threads, 1, enable_prefix_caching=False)
        assert on_tokens == off_tokens
        assert torch.equal(on_logits[0], off_logits[0])  # bit for bit: same kernels, same parts
        if threads > 1:
            assert eng.runner.steps_by_threads == Counter({threads: 1, 1: N_NEW - 1})


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batched_and_cached_equal_alone_with_small_steps(threads):
    ckpt = tiny_checkpoint()
    alone = [run(ckpt, [p], threads, "off", enable_prefix_caching=False)[0][0] for p in PROMPTS]
    tokens, _, _ = run(ckpt, PROMPTS, threads, 1)  # batched: 3 rows, then 2, then 1 as they finish
    assert tokens == alone
    # cache on: a first request leaves the prompt's blocks cached; the second is served from them
    base = PROMPTS[0]
    torch.set_num_threads(threads)
    eng = make_engine(ckpt, num_threads=threads, small_step_threads=1, kv_dtype="bfloat16")
    eng.generate([base[:180]], greedy(2))
    again = eng.add_request(base, greedy(N_NEW))
    eng.run_to_completion()
    assert again.num_cached_tokens == 180
    assert again.output_token_ids == alone[0]


def test_the_async_engine_step_thread_sets_its_own_count(monkeypatch):
    torch.set_num_threads(2)
    ran: list[tuple[str, int]] = []
    real = runner_mod.ModelRunner.execute

    def spy(self, inp, return_logits=False):
        out = real(self, inp, return_logits)
        ran.append((threading.current_thread().name, torch.get_num_threads()))
        return out

    monkeypatch.setattr(runner_mod.ModelRunner, "execute", spy)
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt, num_threads=2, small_step_threads="auto"), ckpt.tokenizer)

    async def main() -> None:
        req = GenerationRequest(prompt_token_ids=random_tokens(40, 9), params=greedy(4))
        async for _ in eng.generate(req):
            pass
        await eng.shutdown()

    asyncio.run(main())
    assert ran == [("prefixgate-engine", 2)] + [("prefixgate-engine", 1)] * 3
    assert torch.get_num_threads() == 2  # this (the event loop's) thread kept its count


@pytest.mark.parametrize(("key", "bad"), [("small_step_threads", "fast"), ("num_threads", 0)])
def test_from_config_names_a_bad_thread_setting_before_loading(key, bad):
    config = EngineConfig(num_blocks=32, device="cpu", **{key: bad})
    with pytest.raises(ValueError, match=rf"engine\.{key}"):
        AsyncEngine.from_config(
            None, "/nonexistent/checkpoint.gguf", config
        )  # never read: the check is first
