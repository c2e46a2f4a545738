"""The native prefill attention (``NativeDecodeKernel.prefill``, ``engine/kernels/paged_decode.c``): every row equal
bit for bit to the native decode kernel at that position, whatever the chunking, row tile or thread count;
against float64 attention; bad arguments refused; ``engine.prefill_kernel`` and its part in ``model_id``; the
engine's greedy tokens with it, cache on == off, batched == alone, chunked == whole.

On a CPU without AVX-512 the kernel is built for AVX2 (``isa="avx2"``, ``PREFIXGATE_ATTENTION_ISA``): the same C
operations on 256-bit registers, so these checks of its arithmetic run there too."""

from __future__ import annotations

import pytest
import torch

from engine import native_decode
from engine.attention import AttentionMetadata, plan_attention
from engine.attention_kernels import resolve_prefill_kernel
from engine.native_decode import NativeDecodeKernel, reference_decode
from tests.engine.engine_helpers import (
    checked_greedy_tokens,
    greedy,
    make_engine,
    random_tokens,
    tiny_checkpoint,
)

ISA = next((isa for isa in ("avx512", "avx2") if native_decode._cpu_ok(isa)[0]), None)
AVAILABLE = ISA is not None and native_decode._compiler() is not None
needs_kernel = pytest.mark.skipif(
    not AVAILABLE, reason="needs an AVX-512 or AVX2 x86-64 CPU and a C compiler"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> NativeDecodeKernel:
    return NativeDecodeKernel.build(tmp_path_factory.mktemp("kernels"), group=3, head_dim=64, isa=ISA)


@pytest.fixture
def engine_isa(monkeypatch):
    """The engine's kernel built for this CPU (``PREFIXGATE_ATTENTION_ISA``)."""
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", ISA)


def random_case(gen, group, kvh, d, seq_len, dtype, block_size=16, num_blocks=96):
    """A cache of scattered blocks, one sequence's table (int32) and fp32 queries of its ``seq_len`` positions."""
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)].to(torch.int32)
    q = torch.randn(seq_len, group * kvh, d, generator=gen)
    return q, cache, table


def decode_each(kernel, q, cache, table, scale):
    """Every position of ``q`` decoded alone by the decode kernel (its length = position + 1)."""
    n = q.shape[0]
    tables = table.repeat(n, 1).contiguous()
    lens = torch.arange(1, n + 1, dtype=torch.int32)
    return kernel.attend(q, cache, tables, lens, n, scale), tables, lens


SHAPES = [
    (3, 3, 64, torch.bfloat16),  # SmolLM2's shapes (compiled with constants), bf16 cache
    (3, 3, 64, torch.float32),
    (4, 2, 128, torch.bfloat16),  # Llama-style head_dim, runtime sizes
    (1, 4, 32, torch.float32),
    (2, 1, 24, torch.bfloat16),  # head_dim not a multiple of 16: the decode kernel's scalar loops
    (9, 1, 64, torch.float32),  # more query heads per KV head than the vector path holds
]


@needs_kernel
@pytest.mark.parametrize("group, kvh, d, dtype", SHAPES)
def test_every_row_equals_the_decode_kernel_at_its_position_bit_for_bit(kernel, group, kvh, d, dtype):
    gen = torch.Generator().manual_seed(group * 10 + d)
    q, cache, table = random_case(gen, group, kvh, d, 333, dtype)
    want, tables, lens = decode_each(kernel, q, cache, table, d**-0.5)
    got = kernel.prefill(q, cache, table, 0, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert torch.equal(got, want)
    ref = reference_decode(q, cache, tables, lens, d**-0.5)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_does_not_depend_on_chunking_tiles_or_threads(kernel, dtype):
    gen = torch.Generator().manual_seed(5)
    q, cache, table = random_case(gen, 3, 3, 64, 700, dtype)
    whole = kernel.prefill(q, cache, table, 0, 0.125, threads=1)
    for cuts, threads in (
        ([0, 1, 2, 17, 300, 301, 700], 2),
        ([0, 255, 256, 512, 700], 3),
        ([0, 699, 700], 1),
    ):
        parts = [
            kernel.prefill(q[a:b].contiguous(), cache, table, a, 0.125, threads=threads)
            for a, b in zip(cuts, cuts[1:], strict=False)
        ]
        assert torch.equal(torch.cat(parts), whole)
    # a table longer than needed (a chunk of a longer sequence) reads only its own positions
    assert torch.equal(kernel.prefill(q[:40].contiguous(), cache, table, 0, 0.125), whole[:40])


@needs_kernel
def test_bf16_queries_are_widened_exactly(kernel):
    gen = torch.Generator().manual_seed(2)
    q, cache, table = random_case(gen, 3, 3, 64, 90, torch.bfloat16)
    qb = q.to(torch.bfloat16)
    assert torch.equal(
        kernel.prefill(qb, cache, table, 0, 0.125), kernel.prefill(qb.float(), cache, table, 0, 0.125)
    )


@needs_kernel
def test_bad_arguments_are_refused_before_any_read(kernel):
    gen = torch.Generator().manual_seed(3)
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.float32, num_blocks=8)
    bad_id = table.clone()
    bad_id[1] = 8  # outside the pool of 8 blocks
    with pytest.raises(ValueError, match="block ids outside"):
        kernel.prefill(q, cache, bad_id, 0, 0.125)
    with pytest.raises(ValueError, match="too short"):
        kernel.prefill(q, cache, table[:2], 0, 0.125)  # 40 positions need 3 blocks
    with pytest.raises(ValueError, match="too short"):
        kernel.prefill(q[:30].contiguous(), cache, table, 20, 0.125)  # positions 20..49: 4 blocks
    with pytest.raises(ValueError, match="start must be >= 0"):
        kernel.prefill(q, cache, table, -1, 0.125)
    with pytest.raises(ValueError, match="threads"):
        kernel.prefill(q, cache, table, 0, 0.125, threads=0)
    with pytest.raises(ValueError, match="scratch"):
        kernel.prefill(q, cache, table, 0, 0.125, scratch=torch.empty(10))
    with pytest.raises(ValueError, match="table"):
        kernel.prefill(q, cache, table.long(), 0, 0.125)
    with pytest.raises(ValueError, match="does not match"):
        kernel.prefill(q[:, :, :32].contiguous(), cache, table, 0, 0.125)


def test_the_setting_is_checked_and_torch_or_another_device_keeps_torch():
    with pytest.raises(
        ValueError, match="engine.prefill_kernel must be one of auto, native, amx, avx512-bf16, torch"
    ):
        resolve_prefill_kernel("fast", torch.device("cpu"))
    assert resolve_prefill_kernel("auto", torch.device("cuda"), 3, 64) is None
    assert resolve_prefill_kernel("torch", torch.device("cpu"), 3, 64) is None
    with pytest.raises(ValueError, match="native runs on CPU only"):
        resolve_prefill_kernel("native", torch.device("cuda"), 3, 64)


def test_an_unknown_isa_is_a_named_error(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "sse2")
    with pytest.raises(ValueError, match="PREFIXGATE_ATTENTION_ISA must be one of"):
        resolve_prefill_kernel("native", torch.device("cpu"), 3, 64)
    with pytest.raises(ValueError, match="isa must be one of"):
        NativeDecodeKernel.build(isa="sse2")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_auto_takes_the_kernel_where_it_was_measured_faster(monkeypatch, isa):
    """``auto`` takes the kernel where it was measured faster than torch's chunked prefill: the AVX-512 build at
    any thread count, the AVX2 build (CPUs without AVX-512) at 2 or more threads; else torch's path. The build is
    forced (``PREFIXGATE_ATTENTION_ISA``) so that every CPU checks both rules."""
    runs = native_decode._cpu_ok(isa)[0] and native_decode._compiler() is not None
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", isa)
    cpu = torch.device("cpu")
    for threads in (1, 2):
        measured_faster = isa == "avx512" or threads >= 2
        kernel = resolve_prefill_kernel("auto", cpu, 3, 64, threads=threads)
        # where the build does not run here, auto falls back to torch's path (logged)
        assert (kernel is not None) == (measured_faster and runs), threads
        if kernel is not None:
            assert kernel.isa == isa
            assert kernel is resolve_prefill_kernel("native", cpu, 3, 64)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_the_prefill_kernel_is_part_of_the_engines_model_id(engine_isa, kv_dtype):
    ck = tiny_checkpoint("hf")
    ids = {
        # glue_kernel torch: its part comes after the prefill kernel's (engine.native_glue)
        s: make_engine(ck, kv_dtype=kv_dtype, prefill_kernel=s, glue_kernel="torch", num_threads=2).model_id
        for s in ("auto", "torch", "native")
    }
    suffix = "/native-prefill" if ISA == "avx512" else f"/native-prefill-{ISA}"
    assert ids["native"] == ids["torch"] + suffix
    # at 2 threads, either build and any cache (resolve_prefill_kernel); the AMX build takes head_dim 64 only
    # and the AVX512-BF16 build a multiple of 32: this model's is 16
    assert ids["auto"] == ids["native"]
    one_thread = make_engine(ck, kv_dtype=kv_dtype, prefill_kernel="auto", glue_kernel="torch", num_threads=1)
    assert one_thread.model_id == (ids["native"] if ISA == "avx512" else ids["torch"])
    assert make_engine(ck, prefill_kernel="native").model_id.startswith(
        ck.model_id
    )  # the checkpoint's id + kernels


@needs_kernel
def test_prompt_chunks_and_a_lone_prompt_token_go_to_the_kernel(kernel):
    # a prefill chunk, and a one-token query that is still a prompt token, are the prefill kernel's; a generated
    # token is the decode path's
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    meta = AttentionMetadata(
        torch.tensor([0, 1, 2, 3 * 16 + 20, 6 * 16 + 30]), [0, 3, 4, 5], [35, 37, 47], torch.tensor(tables), 16,
        prompt_lens=[40, 37, 40], prefill_kernel=kernel,
    )  # fmt: skip
    plan = plan_attention(meta, torch.device("cpu"), 16, cache_dtype=torch.float32)
    assert [(p.start, p.native.start) for p in plan.prefills] == [(0, 32), (3, 36)]
    assert plan.prefills[1].native.table.tolist() == [3, 4, 5]
    assert plan.decode is not None and plan.decode.num_seqs == 1 and plan.decode.rows.tolist() == [4]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_engine_tokens_cache_on_equal_off_batched_equal_alone_chunked_equal_whole(
    engine_isa, kv_dtype, monkeypatch
):
    ck = tiny_checkpoint("hf")
    system = random_tokens(150, 7)
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(4)]
    settings = dict(kv_dtype=kv_dtype, prefill_kernel="native", decode_kernel="native")
    batched, got = checked_greedy_tokens(ck, settings, system, prompts)
    assert batched.runner.prefill_kernel is not None
    # and on this tiny model the greedy tokens equal torch's paths', computing in fp32 as the kernel does (a
    # CPU with bf16 kernels would otherwise attend a bf16 cache in bf16: other roundings, other near-ties)
    monkeypatch.setattr("engine.attention._bf16_fast", lambda device: False)
    torch_paths = make_engine(ck, kv_dtype=kv_dtype, prefill_kernel="torch", decode_kernel="torch")
    assert torch_paths.generate(prompts, greedy(10)) == got
