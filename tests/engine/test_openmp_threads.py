"""One OpenMP team per served process (``engine.openmp_threads``): start-up work runs in a passing thread, the
engine's other torch-calling threads run torch on one thread, and the native weight kernel splits its GEMVs
over the engine's ``num_threads`` even in a one-thread small step."""

from __future__ import annotations

import threading

import pytest
import torch

import engine.checkpoint as checkpoint_mod
import engine.model_runner as runner_mod
import engine.native_linear as native_linear
from engine.api import EngineConfig
from engine.async_engine import AsyncEngine
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.writeback import WriteBackQueue
from engine.native_linear import kernel_threads, resolve_linear_kernel, set_kernel_threads
from engine.openmp_threads import in_passing_thread, serial_torch_thread
from tests.engine.checkpoints import make_tiny_gguf_llama
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    set_kernel_threads(None)


def test_a_passing_thread_returns_the_value_and_ends():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 41 + 1

    assert in_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_a_passing_thread_raises_its_error_in_the_caller():
    boom = ValueError("bad checkpoint")

    def work() -> None:
        raise boom

    with pytest.raises(ValueError) as info:
        in_passing_thread(work)
    assert info.value is boom


def test_a_serial_thread_keeps_one_thread_when_the_process_count_changes():
    """The step thread sets torch's process-wide count step by step; a serial thread's first big op after
    such a change must not take it (torch initializes a thread's count lazily)."""
    torch.set_num_threads(2)
    ready, changed = threading.Event(), threading.Event()
    got: list[int] = []

    def tier() -> None:
        serial_torch_thread()
        ready.set()
        changed.wait()
        _ = torch.randn(1 << 20) * 2  # big enough for a parallel region
        got.append(torch.get_num_threads())

    t = threading.Thread(target=tier)
    t.start()
    ready.wait()
    torch.set_num_threads(2)
    changed.set()
    t.join()
    assert got == [1]


def test_from_config_loads_in_a_thread_that_has_ended(monkeypatch):
    ckpt = tiny_checkpoint()
    loaders: list[threading.Thread] = []
    real = checkpoint_mod.load_checkpoint

    def spy(*args, **kwargs):
        loaders.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_mod, "load_checkpoint", spy)
    eng = AsyncEngine.from_config(None, ckpt.path, EngineConfig(num_blocks=32, device="cpu"))
    assert eng.model_id.startswith(ckpt.model_id)
    assert len(loaders) == 1 and loaders[0] is not threading.current_thread()
    assert not loaders[0].is_alive()


def test_from_config_raises_a_load_error_in_the_caller(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(Exception, match="broken.gguf|GGUF|gguf"):
        AsyncEngine.from_config(None, str(bad), EngineConfig(num_blocks=32, device="cpu"))


def test_the_write_back_thread_runs_torch_on_one_thread():
    torch.set_num_threads(2)
    got: list[int] = []
    done = threading.Event()

    def handler(item: int) -> None:
        got.append(torch.get_num_threads())
        done.set()

    q: WriteBackQueue[int] = WriteBackQueue(4, handler, TierCounters())
    try:
        assert q.offer(1)
        assert done.wait(10)
    finally:
        q.close()
    assert got == [1]


def test_the_grammar_mask_worker_runs_torch_on_one_thread():
    torch.set_num_threads(2)
    eng = make_engine()
    assert eng.constraints is not None
    assert eng.constraints.executor.submit(torch.get_num_threads).result() == 1


def test_kernel_threads_default_to_torchs_count_and_refuse_zero():
    torch.set_num_threads(2)
    set_kernel_threads(None)
    assert kernel_threads() == 2
    set_kernel_threads(3)
    assert kernel_threads() == 3
    with pytest.raises(ValueError, match="kernel threads"):
        set_kernel_threads(0)


@pytest.mark.skipif(resolve_linear_kernel("auto", "cpu") is None, reason="needs the native linear kernel")
def test_one_thread_small_steps_split_the_weight_gemvs_over_num_threads(tmp_path, monkeypatch):
    """Decode steps of one row run torch on one thread (engine.step_threads) but every native GEMV of the step
    (the int4 layers and the Q8_0 head) on the engine's two; the tokens equal a run on one kernel thread."""
    from engine.checkpoint import load_checkpoint

    torch.set_num_threads(2)
    path = make_tiny_gguf_llama(tmp_path / "q4.gguf", tensor_type="Q4_1")
    ck = load_checkpoint(str(path), weights="native", linear_kernel="auto")
    calls: list[tuple[int, int]] = []  # (torch's count, the kernel's) per native call
    real_mm = native_linear.NativeLinearKernel.mm

    def spy(self, w, x, threads=None, fp32=False):
        calls.append((torch.get_num_threads(), kernel_threads() if threads is None else threads))
        return real_mm(self, w, x, threads, fp32)

    monkeypatch.setattr(native_linear.NativeLinearKernel, "mm", spy)
    eng = make_engine(ck, num_threads=2, small_step_threads="auto")
    tokens = eng.generate([random_tokens(40, 3)], greedy(4))
    assert eng.runner.steps_by_threads[1] == 3  # three one-row decode steps on one torch thread
    assert {t for t, _ in calls} == {1, 2} and {k for _, k in calls} == {2}

    monkeypatch.setattr(runner_mod, "set_kernel_threads", lambda n: set_kernel_threads(1))
    again = make_engine(ck, num_threads=2, small_step_threads="auto").generate(
        [random_tokens(40, 3)], greedy(4)
    )
    assert again == tokens


def test_an_engine_built_after_another_ran_gets_torchs_own_count_not_the_last_steps(tmp_path):
    """Before: ``from_config`` took the live ``torch.get_num_threads()`` as torch's default, and an engine's step
    thread sets that count step by step (one-row decodes run on 1 thread), so the second engine of a process (a
    second model, a benchmark's next arm) was built on 1 of 2 threads: measured 1.6x slower."""
    import asyncio

    from engine.api import GenerationRequest, SamplingParams
    from engine.cpu_quota import available_cpus, engine_threads
    from engine.openmp_threads import default_threads

    ckpt = tiny_checkpoint()
    config = EngineConfig(num_blocks=32, device="cpu", small_step_threads=1)

    async def build_and_serve() -> int:
        eng = await asyncio.to_thread(AsyncEngine.from_config, None, ckpt.path, config)
        await eng.start()
        try:
            request = GenerationRequest(
                prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4, temperature=0)
            )
            async for _ in eng.generate(request):
                pass
            return eng.core.runner.step_threads.num_threads
        finally:
            await eng.shutdown()

    expected = engine_threads(None, default_threads(), available_cpus())
    assert [asyncio.run(build_and_serve()) for _ in range(3)] == [expected] * 3


def test_an_llm_engine_built_after_another_ran_takes_torchs_own_count_and_the_same_kernels():
    """The same for an ``LLMEngine`` built directly (benchmarks, tests, an embedding application): it took the live
    count as its default, so after one engine's one-row decodes had left it at 1, the next engine ran every step
    on 1 thread and, on an AVX2 CPU, chose torch's prefill over the native kernel (which needs 2 threads there):
    another engine's logits differed from the first's for the same prompts (found on a 2-core AMD EPYC Zen 3)."""
    from engine.openmp_threads import default_threads

    torch.set_num_threads(default_threads())
    first = make_engine()
    torch.set_num_threads(1)  # what the first engine's last one-row step leaves on this thread
    second = make_engine()
    assert (
        second.runner.step_threads.num_threads == first.runner.step_threads.num_threads == default_threads()
    )
    assert second.model_id == first.model_id  # the same kernels, named in the model id
    assert make_engine(num_threads=1).runner.step_threads.num_threads == 1  # a configured count is kept
