"""The AMX build of the prefill attention (``NativeDecodeKernel.prefill`` with ``isa="amx"``,
``paged_prefill_attention_amx`` in ``engine/kernels/paged_decode.c``) and ``engine.prefill_kernel: amx``.

On CPUs with AMX: against float64 attention (rows at every offset, scattered blocks, group 1-4); every row
bit-identical whatever the chunking, row tile and thread count; bf16 queries widened exactly; what it cannot take
refused by name; the engine's greedy tokens with it, cache on == off, batched == alone, chunked == whole, on a
tiny model with SmolLM2's attention shape. Everywhere: the setting's checks and ``auto``'s choice.
"""

from __future__ import annotations

import pytest
import torch

from engine import native_decode
from engine.attention_kernels import resolve_prefill_kernel
from engine.native_decode import NativeDecodeKernel, reference_decode
from tests.engine.engine_helpers import (
    checked_greedy_tokens,
    greedy,
    make_engine,
    random_tokens,
    tiny_checkpoint,
)
from tests.engine.test_native_prefill import random_case

AMX = native_decode._shared_kernel(3, 64, "amx")
AVAILABLE = not isinstance(AMX, str)
needs_amx = pytest.mark.skipif(not AVAILABLE, reason=f"needs AMX: {AMX if not AVAILABLE else ''}")
CPU = torch.device("cpu")
SCALE = 64**-0.5


@pytest.fixture(scope="module")
def kernel() -> NativeDecodeKernel:
    return AMX


def peaked_queries(gen, cache, table, start, rows, group, magnitude):
    """fp32 ``[rows, H, D]``: query head ``g`` of row ``r`` is ``magnitude`` times the key (KV head ``g // group``)
    of a random position of the row's prefix ``0 .. start + r``."""
    block_size, kvh, d = cache.shape[2], cache.shape[3], cache.shape[4]
    q = torch.empty(rows, group * kvh, d)
    for r in range(rows):
        for head in range(group * kvh):
            pos = int(torch.randint(0, start + r + 1, (1,), generator=gen))
            key = cache[0, int(table[pos // block_size]), pos % block_size, head // group].float()
            q[r, head] = key * magnitude
    return q


def reference_rows(q, cache, table, start, scale=SCALE):
    """float64 attention of rows at positions ``start ..`` (each attending its own prefix)."""
    n = q.shape[0]
    tables = table.repeat(n, 1).contiguous()
    lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
    return reference_decode(q, cache, tables, lens, scale)


CHUNKINGS = (
    ([0, 1, 700], 2),
    ([0, 5, 37, 300, 301, 700], 3),
    ([0, 699, 700], 2),
    ([0, 350, 700], 1),
    ([0, 16, 33, 700], 2),  # odd and even row counts (the AVX512-BF16 build runs rows in pairs)
)
"""Cuts of a 700-row prompt into chunks, and the thread count each chunking runs at."""


def assert_rows_do_not_depend_on_chunking(kernel):
    """A 700-row prompt attended whole on one thread equals, bit for bit, its chunks (``CHUNKINGS``: each chunk
    after the rows before it, at other thread counts) and itself on 5 threads: a row's result depends on its
    own query and positions only, not on its row tile, chunk, offset or thread."""
    gen = torch.Generator().manual_seed(9)
    q, cache, table = random_case(gen, 3, 3, 64, 700, torch.bfloat16)
    whole = kernel.prefill(q, cache, table, 0, SCALE, threads=1)
    for cuts, threads in CHUNKINGS:
        parts = [
            kernel.prefill(q[a:b].contiguous(), cache, table, a, SCALE, threads=threads)
            for a, b in zip(cuts, cuts[1:], strict=False)
        ]
        assert torch.equal(torch.cat(parts), whole), cuts
    assert torch.equal(kernel.prefill(q, cache, table, 0, SCALE, threads=5), whole)


@needs_amx
@pytest.mark.parametrize(("group", "kvh"), [(3, 3), (1, 2), (4, 1)])
@pytest.mark.parametrize(("start", "rows"), [(0, 1), (0, 77), (31, 40), (200, 133)])
def test_rows_are_float64_attention_within_the_split_queries_precision(kernel, group, kvh, start, rows):
    gen = torch.Generator().manual_seed(group * 100 + start + rows)
    q, cache, table = random_case(gen, group, kvh, 64, start + rows, torch.bfloat16)
    q = q[start:].contiguous() * 3  # larger scores: a sharper softmax
    got = kernel.prefill(q, cache, table, start, SCALE)
    assert got.dtype == torch.float32 and got.shape == q.shape
    ref = reference_rows(q, cache, table, start)
    # queries and numerators keep ~16 bits each (two bf16 parts); K and V are exact bf16
    torch.testing.assert_close(got.double(), ref, rtol=2e-4, atol=2e-5)


@needs_amx
@pytest.mark.parametrize("magnitude", [30.0, 1e29])
def test_peaked_rows_far_past_the_exp_clamp_are_float64_attention(kernel, magnitude):
    """Each query head a multiple of one key of its row's prefix: score gaps far beyond the numerators' clamp at
    e^-87 (near 1e30 at 1e29), one-hot softmaxes, finite rows equal to float64 attention (that key's value)."""
    gen = torch.Generator().manual_seed(17)
    start, rows = 40, 50
    q, cache, table = random_case(gen, 3, 3, 64, start + rows, torch.bfloat16)
    q = peaked_queries(gen, cache, table, start, rows, 3, magnitude)
    got = kernel.prefill(q, cache, table, start, SCALE)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.double(), reference_rows(q, cache, table, start), rtol=2e-4, atol=2e-5)


@needs_amx
def test_a_row_does_not_depend_on_chunking_tiles_offsets_or_threads(kernel):
    assert_rows_do_not_depend_on_chunking(kernel)


@needs_amx
def test_bf16_queries_are_widened_exactly(kernel):
    gen = torch.Generator().manual_seed(10)
    q, cache, table = random_case(gen, 3, 3, 64, 90, torch.bfloat16)
    qb = q.to(torch.bfloat16)
    assert torch.equal(
        kernel.prefill(qb, cache, table, 0, SCALE), kernel.prefill(qb.float(), cache, table, 0, SCALE)
    )


@needs_amx
def test_what_the_amx_build_cannot_take_is_refused_by_name(kernel):
    gen = torch.Generator().manual_seed(11)
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.float32)
    with pytest.raises(ValueError, match="the AMX build's prefill takes a bf16 cache and head_dim 64"):
        kernel.prefill(q, cache, table, 0, SCALE)
    q, cache, table = random_case(gen, 3, 3, 32, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="the AMX build's prefill takes a bf16 cache and head_dim 64"):
        kernel.prefill(q, cache, table, 0, SCALE)
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="refused its arguments"):
        kernel.prefill(q, cache, table[:1].contiguous(), 0, SCALE)  # a table too short
    bad = table.clone()
    bad[1] = 10_000
    with pytest.raises(ValueError, match="refused its arguments"):
        kernel.prefill(q, cache, bad, 0, SCALE)  # a block id outside the pool


def test_the_setting_is_checked():
    with pytest.raises(
        ValueError, match="engine.prefill_kernel: amx needs engine.kv_dtype bfloat16 and head_dim 64"
    ):
        resolve_prefill_kernel("amx", CPU, 3, 64, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="got bfloat16 and 32"):
        resolve_prefill_kernel("amx", CPU, 3, 32, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amx runs on CPU only"):
        resolve_prefill_kernel("amx", torch.device("cuda"), 3, 64, kv_dtype=torch.bfloat16)


def test_a_cpu_without_amx_is_a_named_error_and_auto_takes_the_avx512_build(cpu_avx512_only):
    """An AVX-512 CPU without AMX (its flags faked): ``amx`` is refused by name, ``auto`` takes the AVX-512
    build. That build is loaded and self-checked only where the CPU really runs AVX-512: elsewhere its check
    would execute AVX-512 instructions (SIGILL on the AVX2-only Zen 3 of session 28)."""
    with pytest.raises(ValueError, match="engine.prefill_kernel: amx is not available here: no amx_bf16"):
        resolve_prefill_kernel("amx", CPU, 3, 64, kv_dtype=torch.bfloat16)
    if cpu_avx512_only:
        kernel = resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16)
        assert kernel is not None and kernel.isa == "avx512"


@needs_amx
def test_auto_takes_the_amx_build_for_a_bf16_cache_and_head_dim_64_only(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx512")
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16).isa == "amx"
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.float32).isa == "avx512"
    assert resolve_prefill_kernel("auto", CPU, 4, 16, kv_dtype=torch.bfloat16).isa == "avx512"
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx2")  # another build asked for: no AMX
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16, threads=2).isa == "avx2"


@needs_amx
def test_engine_tokens_cache_on_equal_off_batched_equal_alone_chunked_equal_whole():
    ck = tiny_checkpoint("hf-d64")
    system = random_tokens(150, 7)
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(4)]
    settings = dict(kv_dtype="bfloat16", prefill_kernel="amx", decode_kernel="native", num_threads=2)
    batched, got = checked_greedy_tokens(ck, settings, system, prompts)
    assert batched.runner.prefill_kernel.isa == "amx"
    assert batched.model_id.endswith("/native-prefill-amx") or "/native-prefill-amx/" in batched.model_id
    auto = make_engine(ck, kv_dtype="bfloat16", num_threads=2)
    assert auto.runner.prefill_kernel.isa == "amx" and auto.generate(prompts, greedy(10)) == got
