"""The native linear kernel with int8 activations (``engine.linear_kernel: int8-activations``,
``engine.native_linear.Int8ActivationKernel``, ``q4_gemv_i8`` / ``q8_gemv_i8`` in ``engine/kernels/quant_gemv.c``).

Against ``int8_activation_reference`` (the quantization emulated in torch, exact integer dot products, float64)
within fp32 summation error, the rounding itself (ties to even) exactly, row invariance bit for bit across row
counts and threads, the setting through ``load_checkpoint`` and ``model_id``, the engine's tokens batched ==
alone and cache on == cache off, and the refusal on CPUs without VNNI / VBMI.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import native_build, native_linear
from engine.checkpoint import linear_kernel_variant
from engine.native_build import NativeKernelError
from engine.native_linear import (
    INT8_ACTIVATION_REQUIRED,
    Int8ActivationKernel,
    NativeLinearKernel,
    int8_activation_reference,
    pack_int4,
    pack_int8,
    quantize_activations,
    resolve_linear_kernel,
)
from engine.quantized import Int8Groups
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint
from tests.engine.test_native_linear import check_linears_on, check_rows_alone_and_in_company, groups_of

AVAILABLE = native_build.cpu_ok(INT8_ACTIVATION_REQUIRED)[0] and native_build.compiler() is not None
needs_kernel = pytest.mark.skipif(
    not AVAILABLE, reason="needs x86-64 AVX-512 with VNNI and VBMI, F16C, and a C compiler"
)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> Int8ActivationKernel:
    return Int8ActivationKernel.build()


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 96), (200, 576)])
def test_the_kernel_computes_the_int8_activation_product(kernel, qtype, n, k):
    groups = groups_of(qtype, n, k, seed=n + k)
    packed = pack_int8(groups) if qtype == "Q8_0" else pack_int4(groups)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    x[2, :32] = 0.0  # a group of zeros: xq = 0, dx = 0
    want = int8_activation_reference(groups, x)
    exact = x.double() @ groups.dequantize().double().T
    for m in range(1, 18):
        got = kernel.mm(packed, x[:m])
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # fp32 rounding of a sum of G group terms: far below one activation step (dx ~ amax / 127)
        assert ((got.double() - want[:m]).abs().max() / want[:m].abs().max()).item() < 1e-5, (qtype, m)
    # the rounding of the activations is what separates it from the fp32 product, and two planes keep it small
    err = ((kernel.mm(packed, x).double() - exact).abs().max() / exact.abs().max()).item()
    assert 1e-8 < err < 1e-4


@needs_kernel
def test_activations_round_to_nearest_with_ties_to_even_and_two_planes_keep_15_bits(kernel):
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0  # amax 127: x * 127 / amax = x
    x[0, 1:9] = torch.tensor([2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 126.5, -0.49999997])
    x[0, 9:16] = torch.tensor([-127.0, 64.25, 64.75, 0.0, 1e-30, -5.5, 6.5])
    xq, dx, rq, dr = quantize_activations(x)
    assert xq[0, 0, :16].tolist() == [127, 2, 4, -2, -4, 0, 2, 126, -0, -127, 64, 65, 0, 0, -6, 6]
    assert dx[0, 0] == 1.0 and rq.abs().max() == 127 and dr[0, 0] == 0.5 / 127
    # one-hot Q8_0 codes with d = 1: output j is x[j] as the two planes carry it
    packed = pack_int8(Int8Groups(torch.eye(16, 32, dtype=torch.int8), torch.ones(16, 1)))
    got = kernel.mm(packed, x)[0].double()
    assert ((got - x[0, :16].double()).abs() <= 127 * 2.0**-15).all()
    assert torch.allclose(
        got,
        int8_activation_reference(Int8Groups(torch.eye(16, 32, dtype=torch.int8), torch.ones(16, 1)), x)[0],
        rtol=0,
        atol=1e-5,  # the fp32 rounding of the sum
    )
    # a group whose largest input is below TINY_GROUP (127 / amax would overflow fp32) quantizes to zeros
    tiny = torch.full((1, 32), 1e-38)
    assert torch.equal(kernel.mm(packed, tiny), torch.zeros(1, 16))
    assert quantize_activations(tiny)[0].abs().sum() == 0


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [53, 61])
def test_row_i_of_any_call_is_the_one_row_call_bit_for_bit(kernel, bits, n):
    check_rows_alone_and_in_company(kernel, bits, n, [*range(1, 18), 24, 33, 41])


@needs_kernel
def test_the_linears_dequantize_exactly_and_bad_inputs_are_refused(kernel):
    check_linears_on(kernel)  # dequantize through the library's fp32 functions: exact
    packed = pack_int8(groups_of("Q8_0", 16, 64, 0))
    with pytest.raises(ValueError, match="the native kernel takes"):
        kernel.mm(packed, torch.randn(2, 32))
    with pytest.raises(ValueError, match="the native kernel takes"):
        kernel.mm(packed, torch.randn(0, 64))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernel.mm(packed, torch.randn(1, 64), threads=0)


@needs_kernel
def test_the_setting_picks_the_kernel_and_names_it_in_the_model_id():
    i8 = tiny_checkpoint(weights="int4", linear_kernel="int8-activations")
    fp32 = tiny_checkpoint(weights="int4", linear_kernel="native")
    lins = [i8.model.lm_head, *(lin for L in i8.model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down))]
    assert all(lin.fp32_kernel and lin.native.activations == "int8" for lin in lins)
    assert linear_kernel_variant(i8.model) == linear_kernel_variant(fp32.model) + "-int8-activations"
    assert i8.model_id != fp32.model_id  # a generated token's K/V differs
    # auto: int8 activations where they build (this test needs them), the fp32 kernel only on request
    assert resolve_linear_kernel("auto", CPU) is i8.model.lm_head.native
    native = resolve_linear_kernel("native", CPU)
    assert type(native) is NativeLinearKernel and native.activations == "float32"
    assert linear_kernel_variant(tiny_checkpoint(weights="int4").model) == linear_kernel_variant(i8.model)


def test_auto_falls_back_to_the_fp32_kernel_where_int8_activations_cannot_be_built(monkeypatch):
    """A CPU without VNNI / VBMI: ``auto`` takes the fp32 kernel (where it builds), ``int8-activations`` is a
    start-up error naming the missing flags."""
    monkeypatch.setattr(native_linear, "_shared_int8_activation_kernel", lambda: "no avx512_vnni on this CPU")
    fp32 = native_linear._shared_kernel()
    auto = resolve_linear_kernel("auto", CPU)
    if isinstance(fp32, str):  # no native kernel at all here: torch's
        assert auto is None
    else:
        assert auto is fp32 and auto.activations == "float32"
    with pytest.raises(ValueError, match="int8-activations is not available here: no avx512_vnni"):
        resolve_linear_kernel("int8-activations", CPU)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_tokens_batched_equal_alone_and_cache_on_equals_off(threads):
    ck = tiny_checkpoint(weights="int4", linear_kernel="int8-activations")
    shared = random_tokens(100, 60)
    prompts = [shared + random_tokens(n, 61 + n) for n in (5, 23, 40)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = {}
        for name, config in (
            ("cache on", {}),
            ("cache off", {"enable_prefix_caching": False}),
        ):
            eng = make_engine(
                ck, num_threads=threads, record_logits=True, max_num_batched_tokens=4096, **config
            )
            alone = [eng.generate([p], greedy(8))[0] for p in prompts]
            reqs = [eng.add_request(p, greedy(8)) for p in prompts]
            eng.run_to_completion()
            assert [r.output_token_ids for r in reqs] == alone, name  # batched == alone
            runs[name] = alone
    finally:
        torch.set_num_threads(previous)
    assert runs["cache on"] == runs["cache off"]


def test_cpus_without_vnni_are_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(
        "engine.weight_format.cpu_flags",
        lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "f16c", "avx2"}),
    )
    if os.uname().machine == "x86_64":
        with pytest.raises(NativeKernelError, match="no avx512_vnni, avx512vbmi on this CPU"):
            Int8ActivationKernel.build(tmp_path)
    native_linear._shared_int8_activation_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match="engine.linear_kernel: int8-activations is not available here"):
            resolve_linear_kernel("int8-activations", CPU)
    finally:
        native_linear._shared_int8_activation_kernel.cache_clear()
    with pytest.raises(ValueError, match="CPU only"):
        resolve_linear_kernel("int8-activations", torch.device("meta"))


@needs_kernel
def test_the_one_call_decode_step_runs_the_int8_kernel_with_the_layer_loop_s_bits(kernel):
    from engine.native_step import _check_against_python, resolve_decode_step, step_kernels

    _, glue, attend = step_kernels()
    step = resolve_decode_step()
    if step is None or isinstance(glue, str) or isinstance(attend, str):
        pytest.skip("needs the native glue and decode kernels")
    # the step calls the GEMVs through the linear kernel's function pointers: the int8 ones here, as the
    # Python layer loop does
    assert _check_against_python(step, kernel, glue, attend) is None
    ck = tiny_checkpoint(weights="int4", linear_kernel="int8-activations")
    on = make_engine(ck, record_logits=True)
    off = make_engine(ck, record_logits=True)
    off.runner.decode_step = None
    prompts = [random_tokens(40, 7), random_tokens(23, 8)]
    before = step.steps
    assert on.generate(prompts, greedy(6)) == off.generate(prompts, greedy(6))
    assert step.steps > before
    for a, b in zip(sorted(on.logits_log), sorted(off.logits_log), strict=True):
        assert torch.equal(torch.stack(on.logits_log[a]), torch.stack(off.logits_log[b]))
