"""The AVX512-BF16 build of the prefill attention (``NativeDecodeKernel.prefill`` with ``isa="avx512-bf16"``,
``paged_prefill_attention_bf16`` in ``engine/kernels/paged_decode.c``) and ``engine.prefill_kernel: avx512-bf16``.

On CPUs with AVX512-BF16: against float64 attention of the same rounded queries and numerators (the kernel's
stated arithmetic) and against exact float64 attention within bf16's precision (rows at every offset, scattered
blocks, group 1-4, head_dim 32-128); every row bit-identical whatever the chunking, row tile and thread count;
bf16 queries taken as they are; what it cannot take refused by name; the engine's greedy tokens with it, cache on
== off, batched == alone, chunked == whole, on a tiny model with SmolLM2's attention shape. Everywhere: the
setting's checks and ``auto``'s choice.
"""

from __future__ import annotations

import pytest
import torch

from engine import native_decode
from engine.attention_kernels import resolve_prefill_kernel
from engine.native_decode import BF16_PREFILL_TOLERANCE, NativeDecodeKernel
from tests.engine.engine_helpers import (
    checked_greedy_tokens,
    make_engine,
    random_tokens,
    tiny_checkpoint,
)
from tests.engine.test_amx_prefill import (
    assert_rows_do_not_depend_on_chunking,
    peaked_queries,
    reference_rows,
)
from tests.engine.test_native_prefill import random_case

BF16 = native_decode._shared_kernel(3, 64, "avx512-bf16")
AVAILABLE = not isinstance(BF16, str)
needs_bf16 = pytest.mark.skipif(not AVAILABLE, reason=f"needs AVX512-BF16: {BF16 if not AVAILABLE else ''}")
CPU = torch.device("cpu")


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (to nearest, ties to even) and back, as float64."""
    return x.to(torch.bfloat16).double()


def rounded_reference(q, cache, table, start, scale):
    """float64 attention of rows at positions ``start ..`` with the kernel's roundings: each query rounded to
    bf16, each softmax numerator ``e^(s - max s)`` rounded to bf16, the output ``sum p v / sum p`` over the
    rounded numerators."""
    n, h, d = q.shape
    kvh = cache.shape[3]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for r in range(n):
        length = start + r + 1
        kv = cache[:, table.long()].reshape(2, -1, kvh, d)[:, :length].double()
        qr = bf16_round(q[r]).view(kvh, h // kvh, d)
        s = torch.einsum("hgd,lhd->hgl", qr, kv[0]) * scale
        p = bf16_round((s - s.amax(-1, keepdim=True)).exp())
        out[r] = (torch.einsum("hgl,lhd->hgd", p, kv[1]) / p.sum(-1, keepdim=True)).reshape(h, d)
    return out


@needs_bf16
@pytest.mark.parametrize(("group", "kvh", "d"), [(3, 3, 64), (1, 2, 32), (4, 1, 128), (2, 2, 96)])
@pytest.mark.parametrize(("start", "rows"), [(0, 1), (0, 77), (31, 40), (200, 133)])
def test_rows_are_float64_attention_of_the_rounded_queries_and_numerators(group, kvh, d, start, rows):
    kernel = native_decode._shared_kernel(group, d, "avx512-bf16")
    gen = torch.Generator().manual_seed(group * 100 + d + start + rows)
    q, cache, table = random_case(gen, group, kvh, d, start + rows, torch.bfloat16)
    q = q[start:].contiguous() * 3  # larger scores: a sharper softmax
    scale = d**-0.5
    got = kernel.prefill(q, cache, table, start, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    # the stated arithmetic: what is left is fp32 sums and exp16 (~2 ulp), and a numerator's rounding that
    # those move across a bf16 rounding boundary (one bf16 ulp of one weight)
    torch.testing.assert_close(
        got.double(), rounded_reference(q, cache, table, start, scale), rtol=1e-2, atol=4e-3
    )
    # and exact attention within what 8 bits of each query and numerator allow
    ref = reference_rows(q, cache, table, start, scale)
    assert (got.double() - ref).abs().max() <= BF16_PREFILL_TOLERANCE * ref.abs().max()


@needs_bf16
def test_the_rounding_is_the_kernels_own_not_the_exact_attentions():
    """The rounded reference is a closer match than exact attention: the kernel rounds queries and numerators
    (a kernel computing in fp32 would match exact attention ~100x closer)."""
    gen = torch.Generator().manual_seed(3)
    q, cache, table = random_case(gen, 3, 3, 64, 300, torch.bfloat16)
    got = BF16.prefill(q, cache, table, 0, 0.125).double()
    to_rounded = (got - rounded_reference(q, cache, table, 0, 0.125)).abs().mean()
    to_exact = (got - reference_rows(q, cache, table, 0, 0.125)).abs().mean()
    assert to_rounded * 5 < to_exact


@needs_bf16
@pytest.mark.parametrize("magnitude", [30.0, 1e29])
def test_peaked_rows_far_past_the_exp_clamp_are_the_peak_keys_value(magnitude):
    """Each query head a multiple of one key of its row's prefix: score gaps far beyond the numerators' clamp at
    e^-87 (near 1e30 at 1e29), one-hot softmaxes: finite rows equal to float64 attention (that key's value)."""
    gen = torch.Generator().manual_seed(17)
    start, rows = 40, 50
    q, cache, table = random_case(gen, 3, 3, 64, start + rows, torch.bfloat16)
    q = peaked_queries(gen, cache, table, start, rows, 3, magnitude)
    got = BF16.prefill(q, cache, table, start, 0.125)
    assert bool(torch.isfinite(got).all())
    ref = reference_rows(q, cache, table, start, 0.125)
    torch.testing.assert_close(got.double(), ref, rtol=BF16_PREFILL_TOLERANCE, atol=BF16_PREFILL_TOLERANCE)


@needs_bf16
def test_a_row_does_not_depend_on_chunking_tiles_offsets_or_threads():
    assert_rows_do_not_depend_on_chunking(BF16)


@needs_bf16
def test_a_row_does_not_depend_on_the_cache_past_its_own_positions():
    """Rows of a chunk before the last see the later rows' K/V in their tiles and value pairs: replacing those
    (positions past the first row's own) with other values, infinities included, leaves the first row's result."""
    gen = torch.Generator().manual_seed(12)
    q, cache, table = random_case(gen, 3, 3, 64, 101, torch.bfloat16)
    got = BF16.prefill(q[90:].contiguous(), cache, table, 90, 0.125)[0]
    changed = cache.clone()
    for pos in range(91, 101):
        block, off = int(table[pos // 16]), pos % 16
        changed[:, block, off] = (
            float("inf") if pos == 91 else torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
        )
    assert torch.equal(BF16.prefill(q[90:].contiguous(), changed, table, 90, 0.125)[0], got)


@needs_bf16
def test_bf16_queries_are_taken_as_they_are():
    gen = torch.Generator().manual_seed(10)
    q, cache, table = random_case(gen, 3, 3, 64, 90, torch.bfloat16)
    qb = q.to(torch.bfloat16)
    assert torch.equal(
        BF16.prefill(qb, cache, table, 0, 0.125), BF16.prefill(qb.float(), cache, table, 0, 0.125)
    )


@needs_bf16
def test_what_the_bf16_build_cannot_take_is_refused_by_name():
    gen = torch.Generator().manual_seed(11)
    name = "the AVX512-BF16 build's prefill takes a bf16 cache, head_dim a multiple of 32 up to 128"
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.float32)
    with pytest.raises(ValueError, match=name):
        BF16.prefill(q, cache, table, 0, 0.125)
    for group, kvh, d in ((3, 3, 48), (1, 1, 160), (9, 1, 64)):
        q, cache, table = random_case(gen, group, kvh, d, 40, torch.bfloat16)
        with pytest.raises(ValueError, match=name):
            BF16.prefill(q, cache, table, 0, 0.125)
    q, cache, table = random_case(gen, 3, 3, 64, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="refused its arguments"):
        BF16.prefill(q, cache, table[:1].contiguous(), 0, 0.125)  # a table too short
    bad = table.clone()
    bad[1] = 10_000
    with pytest.raises(ValueError, match="refused its arguments"):
        BF16.prefill(q, cache, bad, 0, 0.125)  # a block id outside the pool
    with pytest.raises(ValueError, match="scratch"):
        BF16.prefill(q, cache, table, 0, 0.125, scratch=torch.empty(10))


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="engine.prefill_kernel: avx512-bf16 needs engine.kv_dtype bfloat16"):
        resolve_prefill_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="got bfloat16, 48 and 3"):
        resolve_prefill_kernel("avx512-bf16", CPU, 3, 48, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="got bfloat16, 64 and 9"):
        resolve_prefill_kernel("avx512-bf16", CPU, 9, 64, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="avx512-bf16 runs on CPU only"):
        resolve_prefill_kernel("avx512-bf16", torch.device("cuda"), 3, 64, kv_dtype=torch.bfloat16)


def test_a_cpu_avx512_only_is_a_named_error_and_auto_takes_the_avx512_build(cpu_avx512_only):
    """An AVX-512 CPU without AVX512-BF16 (its flags faked): ``avx512-bf16`` is refused by name, ``auto`` takes
    the AVX-512 build (loaded only where the CPU really runs AVX-512)."""
    with pytest.raises(
        ValueError, match="engine.prefill_kernel: avx512-bf16 is not available here: no avx512_bf16"
    ):
        resolve_prefill_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.bfloat16)
    if cpu_avx512_only:
        kernel = resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16)
        assert kernel is not None and kernel.isa == "avx512"


@needs_bf16
@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_auto_takes_the_bf16_build_where_it_fits_no_amx_build_does_and_it_is_faster(monkeypatch, vendor):
    """On AMD (a Zen 4: half the fp32 build's time) ``auto`` takes the AVX512-BF16 build; on Intel, where it
    was measured slower than the fp32 build (``BF16_DOT_AUTO_VENDORS``), the AVX-512 build; by name it runs
    on either."""
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx512")
    monkeypatch.setattr("engine.attention_kernels.cpu_vendor", lambda: vendor)
    bf16 = "avx512-bf16" if vendor == "AuthenticAMD" else "avx512"
    amx = native_decode._cpu_ok("amx")[0]
    first = "amx" if amx else bf16  # the AMX build comes first where it runs (head_dim 64 only)
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16).isa == first
    assert resolve_prefill_kernel("auto", CPU, 2, 128, kv_dtype=torch.bfloat16).isa == bf16
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.float32).isa == "avx512"
    assert resolve_prefill_kernel("auto", CPU, 4, 16, kv_dtype=torch.bfloat16).isa == "avx512"
    assert resolve_prefill_kernel("avx512-bf16", CPU, 3, 64, kv_dtype=torch.bfloat16).isa == "avx512-bf16"
    monkeypatch.setenv("PREFIXGATE_ATTENTION_ISA", "avx2")  # another build asked for: no AVX512-BF16
    assert resolve_prefill_kernel("auto", CPU, 3, 64, kv_dtype=torch.bfloat16, threads=2).isa == "avx2"


@needs_bf16
def test_the_build_is_self_checked_and_named_in_the_model_id():
    assert isinstance(BF16, NativeDecodeKernel) and BF16.isa == "avx512-bf16"
    assert BF16.self_check() is None
    ck = tiny_checkpoint("hf-d64")
    engine = make_engine(ck, kv_dtype="bfloat16", prefill_kernel="avx512-bf16", num_threads=2)
    assert "/native-prefill-avx512-bf16" in engine.model_id
    native = make_engine(ck, kv_dtype="bfloat16", prefill_kernel="native", num_threads=2)
    assert engine.model_id.replace("/native-prefill-avx512-bf16", "/native-prefill") == native.model_id


@needs_bf16
def test_engine_tokens_cache_on_equal_off_batched_equal_alone_chunked_equal_whole():
    ck = tiny_checkpoint("hf-d64")
    system = random_tokens(150, 7)
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(4)]
    settings = dict(kv_dtype="bfloat16", prefill_kernel="avx512-bf16", decode_kernel="native", num_threads=2)
    batched, got = checked_greedy_tokens(ck, settings, system, prompts)
    assert batched.runner.prefill_kernel.isa == "avx512-bf16"
