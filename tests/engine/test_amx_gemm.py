"""The AMX bf16 GEMM of prompt rows (``engine.amx_gemm``, ``engine/kernels/amx_gemm.c``) and the setting
``engine.dense_gemm``.

On CPUs with AMX: the kernel against a float64 product of the bf16-rounded inputs within fp32 summation error
(shapes off the 32-wide blocks, 1-77 rows); every row bit-identical to its one-row call whatever the row count,
offset and thread count; bad arguments refused by name; the build cache; the engine's tokens cache on == cache off
and batched == alone with whole prompt chunks on the kernel. Everywhere: the B-tile layout, the setting's checks,
and the start-up errors where the kernel cannot run.
"""

from __future__ import annotations

import pytest
import torch

from engine import amx_gemm, native_build
from engine.amx_gemm import AmxDenseWeight, AmxGemmKernel, pack_b_tiles, resolve_dense_gemm, unpack_b_tiles
from engine.checkpoint import load_checkpoint
from engine.native_build import NativeKernelError
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

SHARED = amx_gemm._shared_kernel()
AVAILABLE = not isinstance(SHARED, str)
needs_amx = pytest.mark.skipif(not AVAILABLE, reason=f"needs AMX: {SHARED if not AVAILABLE else ''}")
CPU = torch.device("cpu")
EPS = 2.0**-24  # fp32 unit roundoff


@pytest.fixture(scope="module")
def kernel() -> AmxGemmKernel:
    return SHARED


def reference_and_bound(w: AmxDenseWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x.bf16 @ W.bf16.T`` and the bound ``(K + 2) u sum |terms|`` on an fp32 sum of exact bf16
    products (Higham, Accuracy and Stability, 2nd ed., eq. 3.5)."""
    wf = unpack_b_tiles(w.data, w.out_features, w.in_features).double()
    xb = x.to(torch.bfloat16).double()
    return xb @ wf.T, (w.in_features + 2) * EPS * (xb.abs() @ wf.abs().T) + 1e-30


def test_the_b_tiles_hold_the_weight_in_pairs_and_invert():
    w = torch.randn(37, 70, generator=torch.Generator().manual_seed(1))
    data = pack_b_tiles(w)
    assert data.shape == (4, 3, 16, 16, 2) and data.dtype == torch.bfloat16  # 64 x 96 padded
    wb = w.to(torch.bfloat16)
    # block nb, chunk kb, pair row r, output n, element j = W[16 nb + n, 32 kb + 2 r + j]
    assert data[1, 1, 3, 4, 1] == wb[16 + 4, 32 + 7] and data[0, 0, 0, 5, 0] == wb[5, 0]
    assert torch.equal(unpack_b_tiles(data, 37, 70), wb)
    padded = data.permute(0, 3, 1, 2, 4).reshape(64, 96)
    assert not padded[37:].any() and not padded[:, 70:].any()


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 96), (200, 576), (576, 1536), (70, 100)])
@pytest.mark.parametrize("rows", [1, 13, 16, 32, 49, 77])
def test_the_kernel_is_an_fp32_sum_of_bf16_products(kernel, n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = kernel.pack(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen) * 3
    y = kernel.mm(w, x)
    ref, bound = reference_and_bound(w, x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert bool(((y.double() - ref).abs() <= bound).all())


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(192, 576), (70, 100)])
def test_row_i_of_any_call_is_the_one_row_call_bit_for_bit(kernel, n, k):
    gen = torch.Generator().manual_seed(5)
    w = kernel.pack(torch.randn(n, k, generator=gen))
    x = torch.randn(150, k, generator=gen)
    whole = kernel.mm(w, x, threads=1)
    for threads in (1, 2, 3, 5):
        assert torch.equal(kernel.mm(w, x, threads=threads), whole)
    # slices whose last row block has <= 16 rows take the 16-row block: the same bits as the 32-row blocks above
    for start, stop in (
        (0, 1),
        (31, 32),
        (32, 33),
        (149, 150),
        (5, 70),
        (40, 150),
        (17, 50),
        (0, 16),
        (2, 50),
        (6, 150),
    ):
        assert torch.equal(kernel.mm(w, x[start:stop], threads=2), whole[start:stop])
    # a row's result does not depend on its neighbours either
    other = x.clone()
    other[::2] = torch.randn(75, k, generator=gen)
    assert torch.equal(kernel.mm(w, other)[1::2], whole[1::2])


@needs_amx
def test_strided_and_bf16_inputs_are_taken(kernel):
    gen = torch.Generator().manual_seed(6)
    w = kernel.pack(torch.randn(64, 96, generator=gen))
    big = torch.randn(20, 200, generator=gen)
    x = big[:, 10:106]  # row stride 200
    assert torch.equal(kernel.mm(w, x), kernel.mm(w, x.contiguous()))
    assert torch.equal(kernel.mm(w, x.to(torch.bfloat16)), kernel.mm(w, x.to(torch.bfloat16).float()))


@needs_amx
def test_bad_arguments_are_refused_by_name(kernel):
    w = kernel.pack(torch.randn(32, 64))
    for bad in (
        torch.randn(3, 63),
        torch.randn(0, 64),
        torch.randn(64),
        torch.ones(2, 64, dtype=torch.int32),
    ):
        with pytest.raises(ValueError, match=r"the AMX GEMM takes float \[M >= 1, 64\] on CPU"):
            kernel.mm(w, bad)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernel.mm(w, torch.randn(2, 64), threads=0)
    for bad in (torch.randn(64), torch.ones(4, 4, dtype=torch.int64), torch.randn(0, 4)):
        with pytest.raises(ValueError, match="the AMX GEMM packs a 2-D float CPU weight"):
            kernel.pack(bad)


@needs_amx
def test_the_build_is_cached_by_source_and_compiler(tmp_path):
    first = AmxGemmKernel.build(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("amx_gemm-") and built[0].endswith(".so")
    mtime = first.path.stat().st_mtime_ns
    assert AmxGemmKernel.build(tmp_path).path.stat().st_mtime_ns == mtime  # found, not rebuilt


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="engine.dense_gemm must be one of auto, amx, onednn, got 'fast'"):
        resolve_dense_gemm("fast", CPU)
    with pytest.raises(ValueError, match="engine.dense_gemm must be one of auto, amx, onednn"):
        load_checkpoint("default", weights="float32", dense_gemm="fast")
    assert resolve_dense_gemm("onednn", CPU) is None
    with pytest.raises(ValueError, match="CPU only"):
        resolve_dense_gemm("amx", torch.device("meta"))
    with pytest.raises(ValueError, match="engine.dense_gemm: amx runs a bf16 dense prefill copy"):
        tiny_checkpoint.__wrapped__(weights="int4", dense_min_rows=None, dense_gemm="amx")


def test_a_cpu_without_amx_is_refused_with_the_reason_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(
        "engine.weight_format.cpu_flags",
        lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "f16c"}),
    )
    with pytest.raises(NativeKernelError, match="no amx_bf16, amx_tile, avx512_bf16 on this CPU"):
        AmxGemmKernel.build(tmp_path)
    amx_gemm._shared_kernel.cache_clear()
    try:
        assert resolve_dense_gemm("auto", CPU) is None
        with pytest.raises(ValueError, match="engine.dense_gemm: amx is not available here: no amx_bf16"):
            resolve_dense_gemm("amx", CPU)
    finally:
        amx_gemm._shared_kernel.cache_clear()


def test_no_compiler_is_a_named_error(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    monkeypatch.setattr(native_build, "cpu_ok", lambda required=None: (True, ""))
    with pytest.raises(NativeKernelError, match="no C compiler"):
        AmxGemmKernel.build(tmp_path)


@needs_amx
def test_auto_puts_the_dense_copy_on_the_kernel_and_onednn_keeps_it_off():
    amx = tiny_checkpoint(weights="int4", dense_min_rows=10)
    onednn = tiny_checkpoint(weights="int4", dense_min_rows=10, dense_gemm="onednn")
    assert isinstance(amx.model.layers[0].gate_up.dense, AmxDenseWeight)
    assert not isinstance(onednn.model.layers[0].gate_up.dense, AmxDenseWeight)
    assert amx.model_id != onednn.model_id  # a prompt token's K/V differs


@needs_amx
def test_cache_on_equals_cache_off_and_batched_equals_alone_on_the_kernel():
    ck = tiny_checkpoint(weights="int4", dense_min_rows=10)
    assert isinstance(ck.model.layers[0].qkv.dense, AmxDenseWeight)
    shared = random_tokens(100, 70)
    prompts = [shared + random_tokens(n, 71 + n) for n in (5, 23, 40, 90)]
    outs = []
    for caching in (True, False):
        eng = make_engine(ck, enable_prefix_caching=caching)
        outs.append([eng.generate([p], greedy(8))[0] for p in prompts])
    batched = make_engine(ck, enable_prefix_caching=False).generate(prompts, greedy(8))
    assert outs[0] == outs[1] == batched
