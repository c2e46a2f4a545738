"""The bf16 decode attention (``NativeDecodeKernel.bf16_decoder``, ``paged_decode_attention_bf16`` in
``engine/kernels/paged_decode.c``) and ``engine.decode_kernel: avx512-bf16``.

On CPUs with AVX512-BF16: each sequence's output equals, bit for bit, the AVX512-BF16 prefill's row at its last
position (every length class: 1, odd, a tile's edge, long; group 1-4, head_dim 32-128; scattered blocks); batched
== alone, a shared prefix read once == each sequence alone, any thread count; a stated shared prefix whose blocks
the tables do not hold still gives each sequence its own blocks' result; nothing past a sequence's length is read
into it; what it cannot take refused by name; the engine's greedy tokens with it, cache on == off, batched ==
alone, the one-call decode step == the layer loop. Everywhere: the setting's checks, ``auto``'s choice and the
``model_id`` part.
"""

from __future__ import annotations

import pytest
import torch

from engine import native_decode
from engine.attention_kernels import decode_kernel_variant, resolve_decode_kernel
from engine.native_decode import NativeDecodeKernel, reference_decode, scratch_size
from tests.engine.engine_helpers import (
    checked_greedy_tokens,
    greedy,
    make_engine,
    random_tokens,
    tiny_checkpoint,
)
from tests.engine.test_native_prefill import random_case

BUILD = native_decode._shared_kernel(3, 64, "avx512-bf16")
AVAILABLE = not isinstance(BUILD, str)
needs_bf16 = pytest.mark.skipif(not AVAILABLE, reason=f"needs AVX512-BF16: {BUILD if not AVAILABLE else ''}")
DEC = BUILD.bf16_decoder() if AVAILABLE else None
CPU = torch.device("cpu")


def last_rows(q, cache, tables, lens, scale):
    """The AVX512-BF16 prefill's row at each sequence's last position (its whole prompt ``q[b, :lens[b]]``)."""
    return torch.stack(
        [
            BUILD.prefill(q[b, : int(n)].contiguous(), cache, tables[b], 0, scale, threads=1)[-1]
            for b, n in enumerate(lens)
        ]
    )


def shared_case(gen, group, kvh, d, lens, shared_blocks, num_blocks=64):
    """Sequences of ``lens`` whose tables start with the same ``shared_blocks`` blocks, the rest scattered:
    queries ``[B, max(lens), H, D]``, a bf16 cache, int32 tables ``[B, n]``, int32 lens."""
    cache = torch.randn(2, num_blocks, 16, kvh, d, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = -(-max(lens) // 16)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = shared_blocks
    for b, n in enumerate(lens):
        own = -(-n // 16) - shared_blocks
        tables[b, : shared_blocks + own] = torch.cat([order[:shared_blocks], order[used : used + own]])
        used += own
    q = torch.randn(len(lens), max(lens), group * kvh, d, generator=gen)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_bf16
@pytest.mark.parametrize(("group", "kvh", "d"), [(3, 3, 64), (1, 2, 32), (4, 1, 128), (2, 2, 96)])
def test_each_sequence_is_the_bf16_prefills_row_at_its_last_position(group, kvh, d):
    gen = torch.Generator().manual_seed(group * 100 + d)
    lens = [1, 2, 15, 16, 17, 33, 47, 300]
    q, cache, tables, lens_t = shared_case(gen, group, kvh, d, lens, 0, num_blocks=96)
    qs = torch.stack([q[b, n - 1] for b, n in enumerate(lens)])
    want = last_rows(q, cache, tables, lens, d**-0.5)
    got = DEC.attend(qs, cache, tables, lens_t, 300, d**-0.5)
    assert torch.equal(got, want)
    exact = reference_decode(qs, cache, tables, lens_t, d**-0.5)  # within bf16's rounding of q and p
    assert (
        (got.double() - exact).abs().max() / exact.abs().max()
    ).item() < native_decode.BF16_PREFILL_TOLERANCE


@needs_bf16
@pytest.mark.parametrize(("group", "d"), [(3, 64), (4, 32)])
def test_batched_shared_prefix_alone_and_threads_give_the_same_bits(group, d):
    gen = torch.Generator().manual_seed(7)
    lens = [
        70,
        64,
        97,
        129,
        71,
        65,
        100,
        160,
        90,
    ]  # 9 sequences: runs of 4, 4 and 1 share the prefix's V pairs
    q, cache, tables, lens_t = shared_case(gen, group, 2, d, lens, 4)
    qs = torch.stack([q[b, n - 1] for b, n in enumerate(lens)])
    want = last_rows(q, cache, tables, lens, d**-0.5)
    for shared_len in (0, 16, 48, 64):
        assert torch.equal(DEC.attend(qs, cache, tables, lens_t, 160, d**-0.5, shared_len=shared_len), want)
    for b in range(len(lens)):
        for threads in (1, 2, 3):
            alone = DEC.attend(
                qs[b : b + 1], cache, tables[b : b + 1], lens_t[b : b + 1], lens[b], d**-0.5, threads=threads
            )
            assert torch.equal(alone[0], want[b])


@needs_bf16
def test_a_stated_shared_prefix_the_tables_do_not_hold_reads_each_sequences_own_blocks():
    gen = torch.Generator().manual_seed(8)
    lens = [40, 50, 60]
    q, cache, tables, lens_t = shared_case(gen, 3, 3, 64, lens, 0)  # nothing shared
    qs = torch.stack([q[b, n - 1] for b, n in enumerate(lens)])
    want = last_rows(q, cache, tables, lens, 0.125)
    assert torch.equal(DEC.attend(qs, cache, tables, lens_t, 60, 0.125, shared_len=32), want)


@needs_bf16
@pytest.mark.parametrize("length", [37, 48])
def test_nothing_past_a_sequences_length_reaches_it(length):
    """The positions after a sequence's last (the rest of its last block, and an odd length's last pair) hold
    other values, infinities included: its result stays."""
    gen = torch.Generator().manual_seed(length)
    q, cache, table = random_case(gen, 3, 3, 64, 64, torch.bfloat16)
    tables, lens = table.view(1, -1).contiguous(), torch.tensor([length], dtype=torch.int32)
    got = DEC.attend(q[length - 1 : length], cache, tables, lens, 64, 0.125)
    changed = cache.clone()
    for pos in range(length, 64):
        changed[:, int(table[pos // 16]), pos % 16] = float("inf")
    assert torch.equal(DEC.attend(q[length - 1 : length], changed, tables, lens, 64, 0.125), got)


@needs_bf16
def test_bf16_queries_are_taken_as_they_are():
    gen = torch.Generator().manual_seed(9)
    q, cache, tables, lens = shared_case(gen, 3, 3, 64, [50, 80], 1)
    qb = torch.stack([q[0, 49], q[1, 79]]).to(torch.bfloat16)
    assert torch.equal(
        DEC.attend(qb, cache, tables, lens, 80, 0.125), DEC.attend(qb.float(), cache, tables, lens, 80, 0.125)
    )


@needs_bf16
def test_what_the_bf16_decode_cannot_take_is_refused_by_name():
    gen = torch.Generator().manual_seed(11)
    name = "bf16 decode attention takes a bf16 cache, head_dim a multiple of 32 up to 128"
    for group, kvh, d, dtype in (
        (3, 3, 64, torch.float32),
        (3, 3, 48, torch.bfloat16),
        (9, 1, 64, torch.bfloat16),
    ):
        q, cache, table = random_case(gen, group, kvh, d, 40, dtype)
        with pytest.raises(ValueError, match=name):
            DEC.attend(
                q[39:],
                cache,
                table.view(1, -1).contiguous(),
                torch.tensor([40], dtype=torch.int32),
                40,
                0.125,
            )
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.bfloat16)
    tables, lens = table.view(1, -1).contiguous(), torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="refused its arguments"):
        DEC.attend(q[39:], cache, tables[:, :1].contiguous(), lens, 40, 0.125)  # a table too short
    bad = tables.clone()
    bad[0, 1] = 10_000
    with pytest.raises(ValueError, match="refused its arguments"):
        DEC.attend(q[39:], cache, bad, lens, 40, 0.125)  # a block id outside the pool
    with pytest.raises(ValueError, match="refused its arguments"):
        DEC.attend(q[39:], cache, tables, lens, 40, 0.125, shared_len=8)  # not a multiple of 16
    with pytest.raises(ValueError, match="scratch"):
        DEC.attend(
            q[39:], cache, tables, lens, 40, 0.125, scratch=torch.empty(scratch_size(1, 9, 64, 40) - 1)
        )
    with pytest.raises(ValueError, match="avx512-bf16 build's"):
        NativeDecodeKernel(BUILD.path, "avx512", bf16_decode=True)


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="engine.decode_kernel: avx512-bf16 needs engine.kv_dtype bfloat16"):
        resolve_decode_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="got bfloat16, 48 and 3"):
        resolve_decode_kernel("avx512-bf16", CPU, 3, 48, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="avx512-bf16 runs on CPU only"):
        resolve_decode_kernel("avx512-bf16", torch.device("cuda"), 3, 64, kv_dtype=torch.bfloat16)
    assert resolve_decode_kernel("auto", torch.device("cuda"), 3, 64, kv_dtype=torch.bfloat16) is None


def test_a_cpu_avx512_only_is_a_named_error_and_auto_takes_the_fp32_decode(cpu_avx512_only):
    with pytest.raises(
        ValueError, match="engine.decode_kernel: avx512-bf16 is not available here: no avx512_bf16"
    ):
        resolve_decode_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.bfloat16)
    if cpu_avx512_only:
        kernel = resolve_decode_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16)
        assert kernel is not None and kernel.isa == "avx512" and not kernel.bf16_decode


@needs_bf16
@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_auto_takes_the_bf16_decode_where_auto_takes_the_bf16_prefill(monkeypatch, vendor):
    """On AMD (a Zen 4: measured faster) ``auto`` takes the bf16 decode, over a bf16 cache and a shape it takes;
    elsewhere, and over an fp32 cache, the fp32 decode; by name it runs on either vendor."""
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx512")
    monkeypatch.setattr("engine.attention_kernels.cpu_vendor", lambda: vendor)
    amd = vendor == "AuthenticAMD"
    assert resolve_decode_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16).bf16_decode is amd
    assert resolve_decode_kernel("auto", CPU, 2, 128, kv_dtype=torch.bfloat16).bf16_decode is amd
    assert not resolve_decode_kernel("auto", CPU, 3, 64, kv_dtype=torch.float32).bf16_decode
    assert not resolve_decode_kernel("auto", CPU, 4, 16, kv_dtype=torch.bfloat16).bf16_decode
    assert resolve_decode_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.bfloat16).bf16_decode
    assert not resolve_decode_kernel("native", CPU, 3, 64, kv_dtype=torch.bfloat16).bf16_decode


@needs_bf16
def test_the_build_checks_its_bf16_decode_and_the_model_id_names_it():
    assert BUILD.self_check() is None
    assert decode_kernel_variant(DEC) == "/native-decode-bf16-dot"
    ck = tiny_checkpoint("hf-d64")
    engine = make_engine(ck, kv_dtype="bfloat16", decode_kernel="avx512-bf16", num_threads=2)
    assert engine.runner.decode_kernel.bf16_decode
    fp32 = make_engine(ck, kv_dtype="bfloat16", decode_kernel="native", num_threads=2)
    assert "/native-decode-bf16-dot" in engine.model_id
    assert engine.model_id.replace("/native-decode-bf16-dot", "/native-decode") == fp32.model_id


@needs_bf16
def test_engine_tokens_cache_on_equal_off_batched_equal_alone():
    ck = tiny_checkpoint("hf-d64")
    system = random_tokens(150, 7)  # whole blocks shared by the batch: the shared walk
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(5)]
    settings = dict(
        kv_dtype="bfloat16", prefill_kernel="avx512-bf16", decode_kernel="avx512-bf16", num_threads=2
    )
    batched, got = checked_greedy_tokens(ck, settings, system, prompts, new=12)
    assert batched.runner.decode_kernel.bf16_decode


@needs_bf16
def test_the_one_call_decode_step_gives_the_layer_loops_tokens_and_logits():
    ck = tiny_checkpoint("hf-d64", weights="int4")
    settings = dict(kv_dtype="bfloat16", decode_kernel="avx512-bf16", record_logits=True, num_threads=2)
    on, off = make_engine(ck, **settings), make_engine(ck, **settings)
    off.runner.decode_step = None
    assert on.runner.decode_step is not None
    system = random_tokens(48, 1)
    prompts = [system + random_tokens(5 + 7 * i, 10 + i) for i in range(3)]
    for batch in (prompts, prompts[:1]):  # runs of sequences, and a lone sequence over the threads
        assert on.generate(batch, greedy(6)) == off.generate(batch, greedy(6))
    for a, b in zip(sorted(on.logits_log), sorted(off.logits_log), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(on.logits_log[a], off.logits_log[b], strict=True))
