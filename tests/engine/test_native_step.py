"""The one-call layer step (``engine.native_step``), for decode steps and for one sequence's prompt chunks on the AMX
dense copies: the same bits as the layer loop (tokens, logits, KV cache), taken only by the steps it can run
(exact counts), and a refused argument named by layer and stage with nothing written."""

from __future__ import annotations

import pytest
import torch

from engine import amx_gemm
from engine.llm_engine import LLMEngine
from engine.native_step import DecodeStepError, NativeDecodeStep, resolve_decode_step, step_kernels
from engine.native_step_check import check_decode_against_python, check_prompt_against_python
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

KERNELS = step_kernels()
"""The kernels the step calls, each the build this CPU runs (a str where one does not build)."""
step_kernel = resolve_decode_step()
pytestmark = pytest.mark.skipif(
    any(isinstance(k, str) for k in KERNELS), reason="needs the native linear, glue and decode kernels"
)


def test_the_step_builds_wherever_its_kernels_do():
    """On an AVX2-only CPU the step's check once built the AVX-512 decode kernel, failed, and left every decode
    step on the Python layer loop: it checks itself with the builds the engine uses."""
    assert step_kernel is not None


def engine_pair(ckpt, **kwargs) -> tuple[LLMEngine, LLMEngine]:
    """Two engines on one checkpoint: the one-call decode step on, and off (the layer loop)."""
    on = make_engine(ckpt, record_logits=True, **kwargs)
    off = make_engine(ckpt, record_logits=True, **kwargs)
    off.runner.decode_step = None
    assert on.runner.decode_step is step_kernel
    return on, off


def test_the_build_checks_itself_against_the_kernels_called_one_by_one():
    assert step_kernel.self_check() is None


def test_the_check_fails_a_step_that_skips_the_layers():
    class Skips(NativeDecodeStep):
        def __init__(self) -> None:
            self.steps = 0

        def run(self, model, h, x, *args, **kwargs):
            return x  # nothing computed

    assert (
        check_decode_against_python(Skips(), *KERNELS)
        == "output differs from the kernels called one by one (sequences=3, threads=1)"
    )


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_one_call_steps_give_the_layer_loops_tokens_and_logits(kv_dtype):
    ckpt = tiny_checkpoint(weights="int4")
    on, off = engine_pair(ckpt, kv_dtype=kv_dtype)
    system = random_tokens(48, 1)  # three streams sharing whole blocks: the decode kernel's shared walk
    prompts = [system + random_tokens(5 + 7 * i, 10 + i) for i in range(3)]
    before = step_kernel.steps
    got = on.generate(prompts, greedy(6))
    assert step_kernel.steps - before == 5  # 6 tokens: the first from the prefill step, then 5 decode steps
    assert got == off.generate(prompts, greedy(6))
    for a, b in zip(sorted(on.logits_log), sorted(off.logits_log), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(on.logits_log[a], off.logits_log[b], strict=True))


def test_a_prompt_token_computed_alone_takes_the_layer_loop():
    """A prefix hit that leaves one prompt token makes a one-row step of a prompt row (the dense copy's):
    not the one-call path, whose linears are the generated rows' kernel."""
    ckpt = tiny_checkpoint(weights="int4")
    eng = make_engine(ckpt)
    prompt = random_tokens(33, 4)  # two whole blocks and one token
    eng.generate([prompt], greedy(1))
    before = step_kernel.steps
    eng.add_request(prompt, greedy(2))
    eng.step()  # the last prompt token, alone (32 cached)
    assert step_kernel.steps == before
    eng.step()  # the generated token's row
    assert step_kernel.steps == before + 1


def test_a_model_with_a_bias_runs_the_layer_loop():
    ckpt = tiny_checkpoint("qwen2", weights="int4")
    eng = make_engine(ckpt)
    before = step_kernel.steps
    eng.generate([random_tokens(20, 5)], greedy(4))
    assert step_kernel.steps == before


def test_a_slot_outside_the_cache_is_refused_by_layer_and_stage():
    from dataclasses import replace

    from engine.attention import plan_attention
    from engine.row_kernels import RowKernels
    from tests.engine.engine_helpers import decode_meta

    eng = make_engine(tiny_checkpoint(weights="int4"))
    model, runner = eng.model, eng.runner
    meta = replace(
        decode_meta([[0, 1]], [18]), decode_kernel=runner.decode_kernel, slot_mapping=torch.tensor([10**6])
    )
    plan = plan_attention(meta, model.device, runner.kv_cache.shape[2], True, runner.kv_cache.dtype)
    h = torch.randn(1, model.config.hidden_size)
    x = runner.glue_kernel.rmsnorm(h, model.layers[0].input_norm, model.config.rms_norm_eps)
    cos_sin = torch.zeros(1, model.config.head_dim // 2, 2)
    kv_before = runner.kv_cache.clone()
    rows = RowKernels(None, torch.arange(1))
    with pytest.raises(DecodeStepError, match="rope_store kernel refused its arguments in layer 0"):
        step_kernel.run(model, h, x, cos_sin, plan, runner.kv_cache, rows, runner.glue_kernel)
    assert torch.equal(runner.kv_cache, kv_before)  # nothing written


# --- prompt chunks of one sequence on the AMX dense copies (``NativeDecodeStep.run_prompt``) ---------------------

AMX = amx_gemm._shared_kernel()
needs_amx = pytest.mark.skipif(isinstance(AMX, str), reason=f"needs the AMX GEMM: {AMX}")


def test_the_prompt_check_fails_a_step_that_skips_the_layers():
    class Skips(NativeDecodeStep):
        def __init__(self) -> None:
            self.prompt_steps = 0

        def run_prompt(self, model, h, x, *args, **kwargs):
            return x  # nothing computed

    got = check_prompt_against_python(Skips(), *KERNELS[1:])
    if isinstance(AMX, str):
        assert got is None  # never taken where the AMX GEMM does not build
    else:
        assert got == (
            "the prompt step's output differs from the kernels called one by one "
            "(chunks [(0, 1)], layers=2, cache torch.float32)"
        )


@needs_amx
@pytest.mark.parametrize(("kind", "kv_dtype"), [("hf", "float32"), ("hf-d64", "bfloat16")])
def test_prompt_chunks_in_one_call_give_the_layer_loops_tokens_and_logits(kind, kv_dtype):
    """A cold prompt in chunks of 16 rows, then a prefix hit's tail, each request alone: every prompt step
    takes the one-call path (the last layer for the output rows alone in Python), with the layer loop's bits."""
    ckpt = tiny_checkpoint(kind, weights="int4")
    on, off = engine_pair(ckpt, kv_dtype=kv_dtype, max_num_batched_tokens=16)
    assert isinstance(on.model.layers[0].qkv.dense, amx_gemm.AmxDenseWeight)
    system = random_tokens(48, 3)  # three whole blocks
    prompts = [system + random_tokens(9, 30), system + random_tokens(21, 31)]
    got = []
    before = step_kernel.prompt_steps
    for p in prompts:
        got += on.generate([p], greedy(4))
    # 57 rows in chunks of 16 (4 steps); then 48 cached, 21 new rows (2 steps: 16 and 5)
    assert step_kernel.prompt_steps - before == 6
    want = []
    for p in prompts:
        want += off.generate([p], greedy(4))
    assert got == want
    for a, b in zip(sorted(on.logits_log), sorted(off.logits_log), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(on.logits_log[a], off.logits_log[b], strict=True))
    assert torch.equal(on.runner.kv_cache, off.runner.kv_cache)


@needs_amx
def test_several_sequences_prompts_and_mixed_steps_take_one_call_with_the_layer_loops_bits():
    ckpt = tiny_checkpoint(weights="int4")
    on, off = engine_pair(ckpt)
    system = random_tokens(32, 44)  # two whole blocks: the later prompts' tails over a cached prefix
    prompts = [
        random_tokens(30, 40),
        random_tokens(25, 41),
        system + random_tokens(7, 45),
        system + random_tokens(19, 46),
    ]
    before, mixed = step_kernel.prompt_steps, step_kernel.mixed_steps
    assert on.generate(prompts[:2], greedy(3)) == off.generate(prompts[:2], greedy(3))
    assert step_kernel.prompt_steps == before + 1  # both prompts in one step, one call
    on.generate([system], greedy(1))
    off.generate([system], greedy(1))
    assert on.generate(prompts[2:], greedy(3)) == off.generate(prompts[2:], greedy(3))
    assert step_kernel.prompt_steps == before + 3  # the system prompt; then both tails over it in one step
    assert step_kernel.mixed_steps == mixed
    # a mixed step: two sequences' generated rows, then a new prompt's rows (the scheduler puts decodes first)
    for eng in (on, off):
        reqs = [eng.add_request(random_tokens(20, 42 + i), greedy(6)) for i in range(2)]
        eng.step()  # both prompts
        eng.add_request(system + random_tokens(11, 47), greedy(3))
        eng.step()  # the two generated rows and the new prompt's 11 rows over the cached system prompt
        eng.run_to_completion()
        assert [r.num_output_tokens for r in reqs] == [6, 6]
    assert step_kernel.mixed_steps == mixed + 1
    for a, b in zip(sorted(on.logits_log), sorted(off.logits_log), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(on.logits_log[a], off.logits_log[b], strict=True))
    assert torch.equal(on.runner.kv_cache, off.runner.kv_cache)


@needs_amx
def test_a_prompt_slot_outside_the_cache_is_refused_by_layer_and_stage():
    from engine.attention import AttentionMetadata, plan_attention
    from engine.row_kernels import RowKernels

    eng = make_engine(tiny_checkpoint(weights="int4"))
    model, runner = eng.model, eng.runner
    t = 20
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([10**6] * t),
        query_start_loc=[0, t],
        seq_lens=[t],
        block_tables=torch.tensor([[0, 1]]),
        block_size=runner.kv_cache.shape[3],
        prompt_lens=[t],
        prefill_kernel=runner.prefill_kernel,
    )
    plan = plan_attention(meta, model.device, runner.kv_cache.shape[2], True, runner.kv_cache.dtype)
    h = torch.randn(t, model.config.hidden_size)
    x = runner.glue_kernel.rmsnorm(h, model.layers[0].input_norm, model.config.rms_norm_eps)
    cos_sin = torch.zeros(t, model.config.head_dim // 2, 2)
    kv_before = runner.kv_cache.clone()
    rows = RowKernels(torch.arange(t), None)
    with pytest.raises(
        DecodeStepError, match="prompt step's prompt rows' rope_store kernel refused its arguments in layer 0"
    ):
        step_kernel.run_prompt(model, h, x, cos_sin, plan, runner.kv_cache, rows, runner.glue_kernel, 1)
    assert torch.equal(runner.kv_cache, kv_before)  # nothing written


@needs_amx
def test_a_bad_slot_in_a_mixed_step_is_refused_before_anything_is_written():
    """The generated rows' part would run first: every slot of both parts is checked before it does."""
    from types import SimpleNamespace

    from engine.attention import NativePrefill
    from engine.decode_attention import NativeDecode
    from engine.row_kernels import RowKernels

    eng = make_engine(tiny_checkpoint(weights="int4"))
    model, runner = eng.model, eng.runner
    g, t = 2, 22
    decode = NativeDecode(
        runner.decode_kernel,
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([18, 9], dtype=torch.int32),
        18,
    )
    prefill = NativePrefill(runner.prefill_kernel, torch.tensor([4, 5], dtype=torch.int32), 0)
    slots = torch.cat([torch.tensor([17, 40]), torch.arange(64, 64 + t - g)])
    slots[-1] = 10**6
    plan = SimpleNamespace(
        decode=SimpleNamespace(rows=torch.arange(g), native=decode),
        prefills=[SimpleNamespace(start=g, end=t, native=prefill)],
        slot_mapping=slots,
    )
    h = torch.randn(t, model.config.hidden_size)
    x = runner.glue_kernel.rmsnorm(h, model.layers[0].input_norm, model.config.rms_norm_eps)
    cos_sin = torch.zeros(t, model.config.head_dim // 2, 2)
    kv_before, h_before, x_before = runner.kv_cache.clone(), h.clone(), x.clone()
    rows = RowKernels(torch.arange(g, t), torch.arange(g))
    before = step_kernel.mixed_steps
    with pytest.raises(
        DecodeStepError, match="mixed step's prompt rows' rope_store kernel refused its arguments in layer 0"
    ):
        step_kernel.run_prompt(model, h, x, cos_sin, plan, runner.kv_cache, rows, runner.glue_kernel, 1)
    assert step_kernel.mixed_steps == before + 1  # it was taken, and refused
    assert torch.equal(runner.kv_cache, kv_before) and torch.equal(h, h_before) and torch.equal(x, x_before)
