"""The native linear kernel with int8 activations (``engine.linear_kernel: int8-activations``,
``engine.native_linear.Int8ActivationKernel``, ``q4_gemv_i8`` / ``q8_gemv_i8`` in ``engine/kernels/quant_gemv.c``;
the AVX-512 VNNI build and the AVX2 one).

Against ``int8_activation_reference`` (the quantization emulated in torch, exact integer dot products, float64)
within fp32 summation error, the rounding itself (ties to even) exactly, row invariance bit for bit across row
counts and threads, the AVX2 build against the VNNI build bit for bit (where the CPU runs both), the AVX2 build's
panel path against its per-row path, prompt rows on int8 activations, the setting through ``load_checkpoint`` and
``model_id``, the engine's tokens batched == alone and cache on == cache off (both builds), and the choice and
refusal by CPU flags.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import native_build, native_linear
from engine.checkpoint import linear_kernel_variant, prompt_rows_variant
from engine.native_build import NativeKernelError
from engine.native_linear import (
    INT8_ACTIVATION_REQUIRED,
    ISA_REQUIRED,
    Int8ActivationKernel,
    NativeLinearKernel,
    int8_activation_reference,
    pack_int4,
    pack_int8,
    quantize_activations,
    resolve_linear_kernel,
    select_int8_isa,
    select_isa,
)
from engine.quantized import Int4Groups, Int8Groups
from engine.row_kernels import RowKernels, forward_rows
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint
from tests.engine.test_native_linear import check_linears_on, check_rows_alone_and_in_company, groups_of

AVAILABLE = (
    native_build.cpu_ok(INT8_ACTIVATION_REQUIRED[select_int8_isa()])[0]
    and native_build.compiler() is not None
)
needs_kernel = pytest.mark.skipif(
    not AVAILABLE, reason="needs x86-64 AVX2 (or AVX-512 VNNI), F16C, FMA and a C compiler"
)
BOTH = native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx512"])[0] and native_build.compiler() is not None
# auto takes int8 activations where their build is the CPU's best instruction set (not on AVX-512 without VNNI)
AUTO_IS_INT8 = AVAILABLE and select_int8_isa() == select_isa()
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
    want = kernel.reference(groups, x)  # int8 activations, or fp32 ones (AVX2: int8 weights)
    exact = x.double() @ groups.dequantize().double().T
    for m in range(1, 18):
        got = kernel.mm(packed, x[:m])
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # fp32 rounding of a sum of G group terms: far below one activation step (dx ~ amax / 127)
        assert ((got.double() - want[:m]).abs().max() / want[:m].abs().max()).item() < 1e-5, (qtype, m)
    # the rounding of the activations is what separates it from the fp32 product, and two planes keep it small
    err = ((kernel.mm(packed, x).double() - exact).abs().max() / exact.abs().max()).item()
    int8 = (8 if qtype == "Q8_0" else 4) in kernel.int8_bits
    assert 1e-8 < err < 1e-4 if int8 else err < 1e-5


@needs_kernel
def test_activations_round_to_nearest_with_ties_to_even_and_two_planes_keep_15_bits(kernel):
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0  # amax 127: x * 127 / amax = x
    x[0, 1:9] = torch.tensor([2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 126.5, -0.49999997])
    x[0, 9:16] = torch.tensor([-127.0, 64.25, 64.75, 0.0, 1e-30, -5.5, 6.5])
    xq, dx, rq, dr = quantize_activations(x)
    assert xq[0, 0, :16].tolist() == [127, 2, 4, -2, -4, 0, 2, 126, -0, -127, 64, 65, 0, 0, -6, 6]
    assert dx[0, 0] == 1.0 and rq.abs().max() == 127 and dr[0, 0] == 0.5 / 127
    # the kernel's int4 path: the same planes (its dot products with them are exact integers)
    q4 = Int4Groups(
        torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(3), dtype=torch.uint8),
        torch.full((16, 1), 0.5),
        torch.full((16, 1), 0.25),
    )
    want = int8_activation_reference(q4, x)[0]
    assert ((kernel.mm(pack_int4(q4), x)[0].double() - want).abs().max() / want.abs().max()) < 1e-6
    if 8 not in kernel.int8_bits:  # the AVX2 build: int8 weights keep fp32 activations
        return
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
    # auto: int8 activations where their build is the CPU's best, the fp32 kernel only on request
    native = resolve_linear_kernel("native", CPU)
    assert type(native) is NativeLinearKernel and native.activations == "float32"
    auto = resolve_linear_kernel("auto", CPU)
    assert auto is (i8.model.lm_head.native if AUTO_IS_INT8 else native)
    assert (
        linear_kernel_variant(tiny_checkpoint(weights="int4").model) == linear_kernel_variant(i8.model)
    ) == (AUTO_IS_INT8)


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


def test_cpus_are_given_the_build_their_flags_allow_and_refused_with_the_reason(monkeypatch, tmp_path):
    """AVX-512 without VNNI / VBMI: the VNNI build is refused naming them, the AVX2 build is the one chosen, and
    ``auto`` keeps the fp32 kernel's AVX-512 build; a CPU without AVX2: refused naming it, a start-up error for
    the setting."""
    flags = {"avx512f", "avx512bw", "avx512vl", "fma", "f16c", "avx2"}
    monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset(flags))
    assert select_int8_isa() == "avx2" and select_isa() == "avx512"
    if os.uname().machine == "x86_64":
        with pytest.raises(NativeKernelError, match="no avx512_vnni, avx512vbmi on this CPU"):
            Int8ActivationKernel.build(tmp_path, isa="avx512")
    with pytest.raises(NativeKernelError, match="no 'sse' build of the int8-activation kernel"):
        Int8ActivationKernel.build(tmp_path, isa="sse")
    flags -= {"avx512f", "avx512bw", "avx512vl", "avx2"}
    if os.uname().machine == "x86_64":
        with pytest.raises(NativeKernelError, match="no avx2 on this CPU"):
            Int8ActivationKernel.build(tmp_path)
    native_linear._shared_int8_activation_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match="engine.linear_kernel: int8-activations is not available here"):
            resolve_linear_kernel("int8-activations", CPU)
    finally:
        native_linear._shared_int8_activation_kernel.cache_clear()
    assert ISA_REQUIRED["avx2"] <= INT8_ACTIVATION_REQUIRED["avx2"]
    with pytest.raises(ValueError, match="CPU only"):
        resolve_linear_kernel("int8-activations", torch.device("meta"))


@needs_kernel
def test_the_one_call_decode_step_runs_the_int8_kernel_with_the_layer_loop_s_bits(kernel):
    from engine.native_step import resolve_decode_step, step_kernels
    from engine.native_step_check import check_decode_against_python

    _, glue, attend = step_kernels()
    step = resolve_decode_step()
    if step is None or isinstance(glue, str) or isinstance(attend, str):
        pytest.skip("needs the native glue and decode kernels")
    # the step calls the GEMVs through the linear kernel's function pointers: the int8 ones here, as the
    # Python layer loop does
    assert check_decode_against_python(step, kernel, glue, attend) is None
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


@pytest.mark.skipif(not BOTH, reason="needs a CPU that runs both builds: AVX-512 with VNNI and VBMI")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_avx2_build_gives_the_vnni_build_s_bits(threads):
    """The AVX2 build sums the same integers with other instructions (``vpmaddubsw``) and runs the same fp32
    epilogue, so int4 outputs are equal bit for bit, at 1-9 and 20 rows, on SmolLM2's shapes."""
    vnni = Int8ActivationKernel.build(isa="avx512")
    avx2 = Int8ActivationKernel.build(isa="avx2")
    for n, k in ((37, 96), (576, 1536), (960, 576)):
        groups = groups_of("Q4_1", n, k, seed=n)
        packed = pack_int4(groups)
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(k)) * 3
        x[1, :32] = 0.0
        for m in (*range(1, 10), 20):
            assert torch.equal(vnni.mm(packed, x[:m], threads), avx2.mm(packed, x[:m], threads)), (n, k, m)


@pytest.mark.skipif(
    not (native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx2"])[0] and native_build.compiler()),
    reason="needs x86-64 AVX2, F16C, FMA and a C compiler",
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_avx2_panel_per_row_and_one_row_paths_give_the_same_bits_on_smollm2_shapes(threads):
    """From ``I8_PANEL_MIN_ROWS`` (6) rows the AVX2 build runs a call on its panel path (a tile's codes widened
    once, two rows against both halves at a time), from 2 to 5 on its per-row path, and a 1-row call on its
    one-row path (the activations laid out for the codes, not the codes for the activations); every row equals
    its 1-row call bit for bit, at odd and even row counts, partial tiles, inputs at the int8 planes' extremes
    and codes at 0 and 15 (the 16-bit pair sums' bound), and stays within fp32 summation error of the float64
    reference."""
    avx2 = Int8ActivationKernel.build(isa="avx2")
    gen = torch.Generator().manual_seed(threads)
    for n, k in ((37, 96), (960, 576), (576, 1536)):
        groups = groups_of("Q4_1", n, k, seed=n + k)
        groups.q[:5] = 15  # the largest codes on whole rows, and the smallest
        groups.q[5:9] = 0
        packed = pack_int4(groups)
        x = torch.randn(34, k, generator=gen) * 4
        x[3] = 7.0  # every input the group maximum: xq = 127 everywhere
        x[4] = -7.0
        x[5, : k // 2] = 0.0
        x[6, ::3] = 1e4  # outliers: the rest of the group rounds near zero
        alone = torch.cat([avx2.mm(packed, x[i : i + 1], 1) for i in range(34)])
        for m in (2, 5, 6, 7, 9, 16, 34):
            assert torch.equal(avx2.mm(packed, x[:m], threads), alone[:m]), (n, k, m)
        want = int8_activation_reference(groups, x)
        assert ((alone.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@needs_kernel
def test_the_avx2_build_runs_prompt_rows_on_its_int8_activations_and_names_them():
    """Since its panel path the AVX2 build's int8 activations beat its fp32 functions at prefill sizes
    (``docs/engine-step.md``, "The AVX2 int8 kernel on many rows"), so a linear without a dense copy runs
    prompt rows (``RowKernels.dense``) and generated rows on the same int8 function, each row its 1-row call bit
    for bit; ``model_id`` names prompt rows on the kernel (``/prompt-kernel``), as on the VNNI build, whose bits
    it gives."""
    from engine.linear import Int4Weight, Int8Weight

    avx2 = Int8ActivationKernel.build(isa="avx2")
    assert avx2.int8_bits == (4,)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(5))
    prompt, generated = torch.tensor([0, 1, 2, 4]), torch.tensor([3, 5, 6])
    rows = RowKernels(prompt, generated)
    for lin in (
        Int4Weight(groups_of("Q4_1", 40, 96, 1), None, CPU, None, native=avx2),
        Int8Weight(groups_of("Q8_0", 40, 96, 2), None, CPU, None, native=avx2),
    ):
        got = forward_rows(lin, x, rows)
        for i in range(7):
            assert torch.equal(got[i : i + 1], avx2.mm(lin.native_packed, x[i : i + 1])), i
        if isinstance(lin, Int4Weight):  # int8 activations on prompt rows: not the fp32 product
            assert not torch.equal(got[0], avx2.mm(lin.native_packed, x[0:1], fp32=True)[0])
        assert torch.equal(forward_rows(lin, x, None), avx2.mm(lin.native_packed, x))
    model = torch.nn.ModuleList([Int4Weight(groups_of("Q4_1", 40, 96, 1), None, CPU, None, native=avx2)])
    assert prompt_rows_variant(model) == "/prompt-kernel"


@pytest.mark.skipif(
    not (native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx2"])[0] and native_build.compiler()),
    reason="needs x86-64 AVX2, F16C, FMA and a C compiler",
)
def test_engine_on_the_avx2_build_batched_equals_alone_and_cache_on_equals_off(monkeypatch):
    """The AVX2 build (chosen here whatever the CPU's best), no dense copy: every row on its int8 function
    (prompts of 100-140 tokens on the panel path), through the engine; tokens batched == alone, cache on ==
    cache off."""
    avx2 = Int8ActivationKernel.build(isa="avx2")
    monkeypatch.setattr(native_linear, "_shared_int8_activation_kernel", lambda: avx2)
    ck = tiny_checkpoint.__wrapped__(weights="int4", linear_kernel="int8-activations", dense_min_rows=None)
    lins = [ck.model.lm_head, *(lin for L in ck.model.layers for lin in (L.qkv, L.o_proj, L.gate_up, L.down))]
    assert all(lin.native is avx2 and lin.dense is None for lin in lins)
    assert prompt_rows_variant(ck.model) == "/prompt-kernel"
    shared = random_tokens(100, 70)
    prompts = [shared + random_tokens(n, 71 + n) for n in (5, 23, 40)]
    runs = {}
    for name, config in (("cache on", {}), ("cache off", {"enable_prefix_caching": False})):
        eng = make_engine(ck, record_logits=True, max_num_batched_tokens=4096, **config)
        alone = [eng.generate([p], greedy(8))[0] for p in prompts]
        reqs = [eng.add_request(p, greedy(8)) for p in prompts]
        eng.run_to_completion()
        assert [r.output_token_ids for r in reqs] == alone, name
        runs[name] = alone
    assert runs["cache on"] == runs["cache off"]
