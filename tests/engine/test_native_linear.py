"""The native quantized linear kernel (``engine.native_linear``, ``engine/kernels/quant_gemv.c``) and the engine
setting ``engine.linear_kernel``.

The kernel against a float64 product of the dequantized weights (Q4_0, Q4_1, Q8_0 from ``gguf``'s own
quantizers; output counts off the 16-row tile, 1-17 rows) within fp32 summation error; row invariance bit for
bit across row counts and threads; bad arguments refused by name; the build cache and the fallback without a
compiler or AVX-512; the setting through ``load_checkpoint``; the engine's tokens cache on == cache off.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from engine import native_build, native_linear
from engine.checkpoint import linear_kernel_variant, load_checkpoint
from engine.linear import Int4Weight, Int8Weight
from engine.native_build import NativeKernelError
from engine.native_linear import (
    NativeLinearKernel,
    pack_int4,
    pack_int8,
    random_groups,
    resolve_linear_kernel,
)
from engine.quantized import int4_groups, int8_groups, quantize
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

RUNNABLE = [isa for isa, flags in native_linear.ISA_REQUIRED.items() if native_build.cpu_ok(flags)[0]]
"""The builds this CPU runs (AVX-512 and AVX2, or AVX2 alone)."""
AVAILABLE = bool(RUNNABLE) and native_build.compiler() is not None
needs_kernel = pytest.mark.skipif(
    not AVAILABLE, reason="needs x86-64 AVX2 (or AVX-512) + F16C and a C compiler"
)
CPU = torch.device("cpu")
EPS = 2.0**-24  # fp32 unit roundoff


@pytest.fixture(scope="module")
def kernel() -> NativeLinearKernel:
    return NativeLinearKernel.build()


def groups_of(qtype: str, n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    b = quantize(w, qtype)
    return int8_groups(b) if qtype == "Q8_0" else int4_groups(b)


def error_bound(groups, x: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, N]`` bound on the kernel's fp32 error: ``K * u`` times the sum of the magnitudes of the
    terms it adds (int4: ``|q - 8| |d| |x|`` and ``|zero| |x|`` per group; int8: ``|q| |d| |x|``), the
    classic bound for a recursively summed dot product (Higham, Accuracy and Stability, 2nd ed., eq. 3.5)
    with room for the per-group factorization's extra roundings."""
    k = x.shape[1]
    xa = x.double().abs()
    if hasattr(groups, "zero"):
        n = groups.q.shape[0]
        qd = ((groups.q.double() - 8).abs().view(n, -1, 32) * groups.scale.double().abs()[..., None]).view(
            n, k
        )
        za = groups.zero.double().abs().repeat_interleave(32, dim=1)
        mag = xa @ (qd + za).T
    else:
        n = groups.q.shape[0]
        mag = xa @ (groups.q.double().abs().view(n, -1, 32) * groups.scale.double()[..., None]).view(n, k).T
    return (k + 4) * EPS * mag + 1e-30


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 96), (200, 576)])
def test_the_kernel_is_an_fp32_product_of_the_dequantized_weights(kernel, qtype, n, k):
    groups = groups_of(qtype, n, k, seed=n + k)
    packed = pack_int8(groups) if qtype == "Q8_0" else pack_int4(groups)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    want = x.double() @ groups.dequantize().double().T
    for m in range(1, 18):
        got = kernel.mm(packed, x[:m])
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert ((got.double() - want[:m]).abs() <= error_bound(groups, x[:m])).all(), (qtype, m)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [53, 61])
def test_row_i_of_any_call_is_the_one_row_call_bit_for_bit(kernel, bits, n):
    # n = 53: the last tile's first half partly filled; 61: its second half. Row counts from 1 to 41 take the
    # AVX2 build's per-row path and its panel path (PANEL_MIN_ROWS = 16 rows and up), with 0, 1 and 2 rows
    # left after the panel's groups of 3.
    packed, x, alone = check_rows_alone_and_in_company(kernel, bits, n, [*range(1, 21), 32, 33, 41])
    for isa in RUNNABLE:  # every build this CPU runs computes the same bits (the same operations per lane)
        other = NativeLinearKernel.build(isa=isa)
        assert other.isa == isa, isa
        for m in (1, 15, 16, 17, 41):
            assert torch.equal(other.mm(packed, x[:m]), alone[:m]), (isa, m)


def check_rows_alone_and_in_company(kernel: NativeLinearKernel, bits: int, n: int, row_counts: list[int]):
    """Assert that every row of ``kernel.mm`` calls of ``row_counts`` rows (1-3 threads, the rows in order and
    shuffled) is the 1-row call of that row bit for bit, on random ``[n, 160]`` weights of ``bits``; returns
    (packed weights, ``x`` ``[41, 160]``, the 1-row results ``[41, n]``)."""
    groups = random_groups(bits, n, 160, torch.Generator().manual_seed(bits))
    packed = pack_int4(groups) if bits == 4 else pack_int8(groups)
    x = torch.randn(41, 160, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernel.mm(packed, x[i : i + 1], threads=1) for i in range(41)])
    for m in row_counts:
        for threads in (1, 2, 3):
            assert torch.equal(kernel.mm(packed, x[:m], threads=threads), alone[:m]), (m, threads)
            # the same rows in another order and company: each keeps its bits
            perm = torch.randperm(m, generator=torch.Generator().manual_seed(m))
            assert torch.equal(kernel.mm(packed, x[:m][perm], threads=threads), alone[:m][perm])
    return packed, x, alone


def check_linears_on(kernel: NativeLinearKernel) -> None:
    """Assert that Q4_1, Q4_0 and Q8_0 ``Int4Weight`` / ``Int8Weight`` on ``kernel`` dequantize to the GGUF's
    values exactly, forward as ``kernel.mm`` and take zero rows."""
    for qtype, cls in (("Q4_1", Int4Weight), ("Q4_0", Int4Weight), ("Q8_0", Int8Weight)):
        w = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
        b = quantize(w, qtype)
        groups = int8_groups(b) if qtype == "Q8_0" else int4_groups(b)
        lin = cls(groups, None, CPU, None, native=kernel)
        assert lin.fp32_kernel and lin.nbytes == lin.native_packed.nbytes
        assert torch.equal(lin.dequantize(), b.dequantize())  # identity input: one product per output
        x = torch.randn(3, 64)
        assert torch.equal(lin.forward(x), kernel.mm(lin.native_packed, x))
        assert lin.forward(x[:0]).shape == (0, 40)


@needs_kernel
def test_the_linears_on_the_native_kernel_dequantize_exactly_and_are_fp32(kernel):
    check_linears_on(kernel)


@needs_kernel
def test_the_dense_prefill_copy_and_a_bias_are_unchanged_by_the_kernel(kernel):
    groups = groups_of("Q4_1", 48, 64, seed=4)
    bias = torch.randn(48)
    torch_lin = Int4Weight(groups, bias, CPU)
    native_lin = Int4Weight(groups, bias, CPU, native=kernel)
    x = torch.randn(12, 64)
    assert torch.equal(native_lin.forward(x, dense=True), torch_lin.forward(x, dense=True))
    assert torch.equal(native_lin.forward(x, dense=False), kernel.mm(native_lin.native_packed, x) + bias)


@needs_kernel
def test_a_kernel_out_of_memory_is_a_memory_error_naming_the_call(kernel, monkeypatch):
    """The C kernel's -2 (its scratch could not be allocated; nothing written) is a ``MemoryError``, not a refusal
    of the arguments."""
    packed = pack_int4(random_groups(4, 20, 64, torch.Generator().manual_seed(5)))
    monkeypatch.setitem(kernel._fns, 4, lambda *args: -2)
    with pytest.raises(MemoryError, match=r"q4_gemv could not allocate its scratch .*x \(40, 64\)"):
        kernel.mm(packed, torch.randn(40, 64))


@needs_kernel
def test_bad_arguments_are_refused_by_name(kernel):
    groups = random_groups(4, 20, 64, torch.Generator().manual_seed(5))
    packed = pack_int4(groups)
    with pytest.raises(ValueError, match=r"takes \[M >= 1, 64\] on CPU"):
        kernel.mm(packed, torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"takes \[M >= 1, 64\]"):
        kernel.mm(packed, torch.randn(0, 64))
    with pytest.raises(ValueError, match="a float tensor"):
        kernel.mm(packed, torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernel.mm(packed, torch.randn(2, 64), threads=0)
    misaligned = replace(packed, data=packed.storage[1 : 1 + packed.data.numel()])
    if misaligned.data.data_ptr() % 64:
        with pytest.raises(ValueError, match="q4_gemv refused its arguments"):
            kernel.mm(misaligned, torch.randn(2, 64))
    # the C function's own checks, past the Python ones
    fn = kernel._fns[8]
    y = torch.empty(2, 20)
    x = torch.randn(2, 64)
    assert fn(packed.data.data_ptr(), 20, 48, x.data_ptr(), 2, y.data_ptr(), 1) == -1  # K % 32
    assert fn(packed.data.data_ptr(), 20, 64, x.data_ptr(), 2, y.data_ptr(), 0) == -1  # threads
    assert fn(None, 20, 64, x.data_ptr(), 2, y.data_ptr(), 1) == -1


def test_packing_refuses_what_the_kernel_cannot_hold():
    g = random_groups(4, 16, 64, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="int4 scales are not all f16 values"):
        pack_int4(replace(g, scale=g.scale + 1e-6))
    with pytest.raises(ValueError, match="int4 zeros"):
        pack_int4(replace(g, zero=g.zero + 1e-7))
    with pytest.raises(ValueError, match="K % 32 == 0"):
        pack_int4(replace(g, q=g.q[:, :48], scale=g.scale[:, :1], zero=g.zero[:, :1]))
    g8 = random_groups(8, 16, 64, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="need int8"):
        pack_int8(replace(g8, q=g8.q.to(torch.uint8)))
    with pytest.raises(ValueError, match="int8 scales are not all f16 values"):
        pack_int8(replace(g8, scale=g8.scale * (1 + 2**-20)))


def test_a_weight_whose_scales_are_not_f16_stays_on_torch_s_kernel():
    g = random_groups(4, 16, 64, torch.Generator().manual_seed(8))
    g = replace(g, scale=g.scale * (1 + 2**-20), zero=g.zero)
    lin = Int4Weight(g, None, CPU, None, native=object())  # never called: packing fails first
    assert not lin.fp32_kernel and lin.packed is not None


@needs_kernel
def test_the_build_is_cached_by_source_and_compiler(tmp_path):
    first = NativeLinearKernel.build(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("quant_gemv-") and built[0].endswith(".so")
    mtime = first.path.stat().st_mtime_ns
    again = NativeLinearKernel.build(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == mtime  # found, not rebuilt


def test_no_compiler_is_a_named_error_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    monkeypatch.setattr(native_build, "cpu_ok", lambda required=None: (True, ""))
    with pytest.raises(NativeKernelError, match="no C compiler"):
        NativeLinearKernel.build(tmp_path)
    native_linear._shared_kernel.cache_clear()
    native_linear._shared_int8_activation_kernel.cache_clear()
    try:
        assert resolve_linear_kernel("auto", CPU) is None
        with pytest.raises(
            ValueError, match="engine.linear_kernel: native is not available here: no C compiler"
        ):
            resolve_linear_kernel("native", CPU)
        with pytest.raises(ValueError, match="engine.linear_kernel: native is not available here"):
            tiny_checkpoint.__wrapped__(weights="int4", linear_kernel="native")
        ck = tiny_checkpoint.__wrapped__(weights="int4", linear_kernel="auto")  # falls back to torch's
        assert not ck.model.layers[0].qkv.fp32_kernel and ck.model.layers[0].qkv.packed is not None
    finally:
        native_linear._shared_kernel.cache_clear()
        native_linear._shared_int8_activation_kernel.cache_clear()


def test_other_cpus_are_refused_with_the_reason(monkeypatch, tmp_path):
    if os.uname().machine == "x86_64":
        monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
        assert native_linear.select_isa() == "avx2"
        with pytest.raises(NativeKernelError, match="no avx512bw, avx512f, avx512vl on this CPU"):
            NativeLinearKernel.build(tmp_path, isa="avx512")
        monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset({"sse4_2", "fma"}))
        with pytest.raises(NativeKernelError, match="no avx2, f16c on this CPU"):
            NativeLinearKernel.build(tmp_path)
    with pytest.raises(NativeKernelError, match="no 'neon' build of the linear kernel"):
        NativeLinearKernel.build(tmp_path, isa="neon")


def test_the_setting_is_checked():
    with pytest.raises(
        ValueError, match="engine.linear_kernel must be one of auto, native, int8-activations, torch"
    ):
        resolve_linear_kernel("fast", CPU)
    with pytest.raises(
        ValueError, match="engine.linear_kernel must be one of auto, native, int8-activations, torch"
    ):
        load_checkpoint("default", weights="float32", linear_kernel="fast")
    assert resolve_linear_kernel("torch", CPU) is None
    with pytest.raises(ValueError, match="CPU only"):
        resolve_linear_kernel("native", torch.device("meta"))


@needs_kernel
def test_the_setting_picks_the_kernel_and_the_model_id(monkeypatch):
    native = tiny_checkpoint(weights="int4", linear_kernel="native")
    plain = tiny_checkpoint(weights="int4", linear_kernel="torch")
    lins = [
        native.model.lm_head,
        *(lin for L in native.model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down)),
    ]
    assert all(lin.fp32_kernel for lin in lins)
    # torch's kernel: the head is int4 where bf16 GEMMs are fast, else dense fp32 (engine.model)
    assert (
        not getattr(plain.model.lm_head, "fp32_kernel", False)
        and plain.model.layers[0].qkv.packed is not None
    )
    assert native.model_id != plain.model_id  # a generated token's K/V differs
    kernel = native.model.lm_head.native
    assert linear_kernel_variant(plain.model) == ""
    for isa, variant in (("avx512", "/native-linear"), ("avx2", "/native-linear-avx2")):
        monkeypatch.setattr(kernel, "isa", isa)
        assert linear_kernel_variant(native.model) == variant
    assert native.model.weight_nbytes < plain.model.weight_nbytes * 1.05


@needs_kernel
def test_cache_on_equals_cache_off_on_the_native_kernel():
    ck = tiny_checkpoint(weights="int4", linear_kernel="native")
    shared = random_tokens(100, 60)
    prompts = [shared + random_tokens(n, 61 + n) for n in (5, 23, 40)]
    outs = []
    for caching in (True, False):
        eng = make_engine(ck, enable_prefix_caching=caching)
        outs.append([eng.generate([p], greedy(8))[0] for p in prompts])
    assert outs[0] == outs[1]
