"""The native layer-glue kernel (``engine.native_glue``, ``engine/kernels/layer_glue.c``) and ``engine.glue_kernel``.

Against torch's glue (``engine.model``): RMSNorm within 6 ulp (fp32 out; bf16 out within one bf16 ulp of torch's
fp32 result rounded), the residual add bit for bit, RoPE and the K/V store bit for bit, SiLU(gate) * up within
6 ulp; fp32 and bf16 inputs and outputs, widths on and off the 16-lane vectors, ragged row counts. Each row equals
the same row computed alone, inside any batch and at 1, 2 and 3 threads (row counts past the kernel's OpenMP
threshold included); the AVX-512 and AVX2 builds give the same bits. Bad arguments raise ``GlueArgumentError``
before anything is written. The setting: validated, ``native`` refused by name where it cannot run, the build
named in ``model_id``; the engine with the kernel: cache on == cache off and batched == alone, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import native_build, native_glue
from engine.attention import write_kv
from engine.model import apply_rope, rms_norm
from engine.native_glue import (
    GlueArgumentError,
    NativeGlueKernel,
    glue_kernel_variant,
    resolve_glue_kernel,
)
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

RUNNABLE = [isa for isa, flags in native_glue.ISA_REQUIRED.items() if native_build.cpu_ok(flags)[0]]
"""The builds this CPU runs, best first (AVX-512, AVX2 and AVX on an AVX-512 machine)."""
WIDTHS = [576, 64, 45]  # SmolLM2's hidden size, the tiny model's, a width off the 16-lane vectors
ROWS = [1, 3, 17, 130]  # 130 x 576 is past the kernel's threshold for OpenMP
ULP = 6  # measured: at most 5 ulp from torch's over 2.3 M random elements (each side within 4 ulp of float64)


@pytest.fixture(scope="module", params=RUNNABLE)
def kernel(request) -> NativeGlueKernel:
    return NativeGlueKernel.build(isa=request.param)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = ULP) -> None:
    """Every element of fp32 ``got`` within ``ulps`` units in the last place of ``want``'s element."""
    g, w = got.numpy().astype(np.float64), want.numpy()
    spacing = np.abs(np.spacing(w.astype(np.float32))).astype(np.float64)
    err = np.abs(g - w.astype(np.float64)) / spacing
    assert err.max() <= ulps, f"{err.max():.1f} ulp apart"


def assert_within_bf16_ulp(got: torch.Tensor, want_fp32: torch.Tensor) -> None:
    """bf16 ``got`` within one bf16 ulp of ``want_fp32`` rounded to bf16."""
    w = want_fp32.to(torch.bfloat16)
    spacing = torch.from_numpy(np.abs(np.spacing(w.float().numpy())) * 65536.0)
    assert ((got.float() - w.float()).abs() <= spacing).all()


# ---- RMSNorm with the residual add -------------------------------------------------------------------------


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_is_torch_s_within_a_few_ulp(kernel, rows, n):
    g = gen(rows * 1000 + n)
    h, w = torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
    assert_within_ulp(kernel.rmsnorm(h, w, 1e-5), rms_norm(h, w, 1e-5))
    assert_within_bf16_ulp(kernel.rmsnorm(h, w, 1e-5, out_dtype=torch.bfloat16), rms_norm(h, w, 1e-5))


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", WIDTHS)
def test_the_residual_add_is_torch_s_bit_for_bit(kernel, n, y_dtype):
    g = gen(n)
    h, w = torch.randn(17, n, generator=g), torch.randn(n, generator=g)
    y = torch.randn(17, n, generator=g).to(y_dtype)
    want_h = h.clone().add_(y)
    got = kernel.rmsnorm(h, w, 1e-6, y)
    assert torch.equal(h, want_h)  # updated in place, as ``h.add_(y)``
    assert_within_ulp(got, rms_norm(want_h, w, 1e-6))


# ---- RoPE and the K/V store ------------------------------------------------------------------------------------


def qkv_case(rows: int, heads: int, kvh: int, d: int, seed: int):
    g = gen(seed)
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=g)
    angles = torch.randint(0, 4096, (rows, 1), generator=g).float() * torch.rand(1, d // 2, generator=g)
    rotation = torch.complex(angles.cos(), angles.sin())[:, None, :]
    return qkv, rotation, torch.view_as_real(rotation).reshape(rows, d // 2, 2)


@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (4, 2, 16), (3, 1, 34)])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_is_torch_s_complex_multiply_bit_for_bit(kernel, rows, heads, kvh, d):
    qkv, rotation, cos_sin = qkv_case(rows, heads, kvh, d, rows + d)
    want = apply_rope(qkv.view(rows, -1, d)[:, : heads + kvh], rotation)
    v = qkv.view(rows, -1, d)[:, heads + kvh :].clone()
    q = kernel.rope_store(qkv, cos_sin, heads, kvh, d)
    assert q.shape == (rows, heads, d) and q.is_contiguous()
    assert torch.equal(q, want[:, :heads])
    assert torch.equal(qkv.view(rows, -1, d)[:, heads : heads + kvh], want[:, heads:])  # k in place
    assert torch.equal(qkv.view(rows, -1, d)[:, heads + kvh :], v)  # v untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_the_kv_store_is_write_kv_s_bit_for_bit(kernel, rows, cache_dtype):
    heads, kvh, d, blocks, bs = 9, 3, 64, 16, 16
    qkv, _, cos_sin = qkv_case(rows, heads, kvh, d, rows)
    slots = torch.randperm(blocks * bs, generator=gen(1))[:rows]
    cache = torch.randn(2, blocks, bs, kvh, d, generator=gen(2)).to(cache_dtype)
    want = cache.clone()
    kernel.rope_store(qkv, cos_sin, heads, kvh, d, cache, slots)
    kv = qkv.view(rows, -1, d)[:, heads:]
    write_kv(want, kv[:, :kvh], kv[:, kvh:], slots)
    assert torch.equal(cache, want)


def test_a_slot_outside_the_cache_writes_nothing(kernel):
    heads, kvh, d = 4, 2, 16
    qkv, _, cos_sin = qkv_case(3, heads, kvh, d, 5)
    cache = torch.zeros(2, 4, 16, kvh, d)
    before = qkv.clone()
    for bad in (64, -1):
        with pytest.raises(GlueArgumentError, match=r"slots: outside \[0, 64\)"):
            kernel.rope_store(qkv, cos_sin, heads, kvh, d, cache, torch.tensor([0, bad, 2]))
    assert torch.equal(qkv, before) and not cache.any()


# ---- SiLU(gate) * up --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1536, 128, 45])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_is_torch_s_within_a_few_ulp(kernel, rows, n):
    gu = torch.randn(rows, 2 * n, generator=gen(rows + n)) * 4
    g, u = gu.split(n, dim=-1)
    want = F.silu(g) * u
    assert_within_ulp(kernel.silu_mul(gu), want)
    assert_within_bf16_ulp(kernel.silu_mul(gu, torch.bfloat16), want)
    gu16 = gu.to(torch.bfloat16)  # bf16 in: the values widened exactly
    assert torch.equal(kernel.silu_mul(gu16), kernel.silu_mul(gu16.float()))


def test_silu_mul_at_the_ends_of_the_exponential(kernel):
    g = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 80.0, -80.0, 87.0, -87.0, 88.5, -88.5, 89.0, -89.0,
                      100.0, -100.0, 1e30, -1e30, float("inf"), float("-inf")])  # fmt: skip
    gu = torch.cat([g, torch.ones_like(g)])[None]
    got, want = kernel.silu_mul(gu)[0], F.silu(g)
    finite = want.isfinite() & want.ne(0)
    assert_within_ulp(got[finite], want[finite])
    assert torch.equal(got[~finite], want[~finite]) or torch.allclose(
        got[~finite], want[~finite], equal_nan=True
    )


# ---- row invariance ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_row_gets_the_same_bits_alone_in_any_batch_and_at_any_thread_count(kernel, threads):
    rows, n, inter, heads, kvh, d = 200, 576, 1536, 9, 3, 64
    g = gen(9)
    h, w = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    y = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    gu = torch.randn(rows, 2 * inter, generator=g)
    qkv, _, cos_sin = qkv_case(rows, heads, kvh, d, 11)
    alone_h = [h[i : i + 1].clone() for i in range(rows)]
    alone_x = torch.cat([kernel.rmsnorm(alone_h[i], w, 1e-5, y[i : i + 1], threads=1) for i in range(rows)])
    alone_act = torch.cat([kernel.silu_mul(gu[i : i + 1], threads=1) for i in range(rows)])
    alone_q = torch.cat(
        [
            kernel.rope_store(qkv[i : i + 1].clone(), cos_sin[i : i + 1], heads, kvh, d, threads=1)
            for i in range(rows)
        ]
    )
    for first, last in ((0, rows), (7, 150), (3, 4)):
        hb = h[first:last].clone()
        x = kernel.rmsnorm(hb, w, 1e-5, y[first:last].contiguous(), threads=threads)
        assert torch.equal(x, alone_x[first:last])
        assert torch.equal(hb, torch.cat(alone_h[first:last]))
        assert torch.equal(
            kernel.silu_mul(gu[first:last].contiguous(), threads=threads), alone_act[first:last]
        )
        q = kernel.rope_store(
            qkv[first:last].clone(), cos_sin[first:last].contiguous(), heads, kvh, d, threads=threads
        )
        assert torch.equal(q, alone_q[first:last])


def test_every_build_gives_the_same_bits():
    """The AVX-512, AVX2 and AVX builds run the same operations per lane (16-lane vectors on AVX-512 and AVX, 8-lane
    on AVX2, the sum of squares kept in 16 lanes): the same bits, compared among every build this CPU runs (at
    least AVX2 and AVX), at widths that fill whole vectors and leave every tail length, fp32 and bf16 in and out,
    and at the exponential's ends (NaN, infinities, overflow)."""
    assert len(RUNNABLE) >= 2 and RUNNABLE[-1] == "avx"
    builds = [NativeGlueKernel.build(isa=isa) for isa in RUNNABLE]
    g = gen(4)
    ends = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), 88.8, -88.8, 80.5, -80.5, 1e-40, -0.0, 0.0]
    )
    for n in (1, 7, 8, 9, 15, 16, 17, 45, 64, 576, 1536):
        h, w = torch.randn(5, n, generator=g), torch.randn(n, generator=g)
        y = torch.randn(5, n, generator=g)
        gu = torch.randn(5, 2 * n, generator=g) * 5
        gu[0, : min(n, len(ends))] = ends[: min(n, len(ends))]
        want = builds[-1]
        for kernel in builds[:-1]:
            for y_in, x_dtype in (
                (y, torch.float32),
                (y.to(torch.bfloat16), torch.bfloat16),
                (None, torch.float32),
            ):
                got_h, want_h = h.clone(), h.clone()
                got = kernel.rmsnorm(got_h, w, 1e-5, y_in, out_dtype=x_dtype)
                assert torch.equal(got, want.rmsnorm(want_h, w, 1e-5, y_in, out_dtype=x_dtype)), (
                    kernel.isa,
                    n,
                )
                assert torch.equal(got_h, want_h), (kernel.isa, n)
            for gu_in in (gu, gu.to(torch.bfloat16)):
                for out_dtype in (torch.float32, torch.bfloat16):
                    got, expect = kernel.silu_mul(gu_in, out_dtype), want.silu_mul(gu_in, out_dtype)
                    assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                                       expect.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)), (kernel.isa, n)  # fmt: skip


# ---- bad arguments ---------------------------------------------------------------------------------------------


def test_bad_arguments_raise_a_named_error_before_anything_is_written(kernel):
    h, w = torch.randn(4, 64), torch.randn(64)
    before = h.clone()
    bad_calls = {
        "h: needs a contiguous CPU tensor of torch.float32, got torch.float64": lambda: kernel.rmsnorm(
            h.double(), w, 1e-5
        ),
        "not contiguous": lambda: kernel.rmsnorm(torch.randn(64, 4).t(), torch.randn(4), 1e-5),
        r"weight: needs shape \(64,\)": lambda: kernel.rmsnorm(h, torch.randn(63), 1e-5),
        r"y: needs shape \(4, 64\)": lambda: kernel.rmsnorm(h, w, 1e-5, torch.randn(3, 64)),
        "y: needs a contiguous CPU tensor": lambda: kernel.rmsnorm(h, w, 1e-5, torch.randn(4, 64).half()),
        "out_dtype: float32 or bfloat16": lambda: kernel.rmsnorm(h, w, 1e-5, out_dtype=torch.float16),
        r"h: needs \[T, n >= 1\]": lambda: kernel.rmsnorm(torch.randn(64), w, 1e-5),
        "threads must be >= 1": lambda: kernel.rmsnorm(h, w, 1e-5, threads=0),
        "needs a tensor": lambda: kernel.rmsnorm(h.numpy(), w, 1e-5),
        r"gu: needs \[T, 2 I\]": lambda: kernel.silu_mul(torch.randn(2, 7)),
        "gu: needs a contiguous CPU tensor": lambda: kernel.silu_mul(torch.randn(8, 2).t()),
        r"qkv: needs \[T, 128\]": lambda: kernel.rope_store(
            torch.randn(2, 190), torch.randn(2, 8, 2), 4, 2, 16
        ),
        r"cos_sin: needs shape \(2, 8, 2\)": lambda: kernel.rope_store(
            torch.randn(2, 128), torch.randn(2, 16), 4, 2, 16
        ),
        "head_dim 15 even": lambda: kernel.rope_store(torch.randn(2, 120), torch.randn(2, 7, 2), 4, 2, 15),
        "layer_cache: needs": lambda: kernel.rope_store(
            torch.randn(2, 128),
            torch.randn(2, 8, 2),
            4,
            2,
            16,
            torch.zeros(2, 4, 16, 3, 16),
            torch.tensor([0, 1]),
        ),
        "slots: needed with layer_cache": lambda: kernel.rope_store(
            torch.randn(2, 128), torch.randn(2, 8, 2), 4, 2, 16, torch.zeros(2, 4, 16, 2, 16)
        ),
        "slots: needs a contiguous CPU tensor of torch.int64": lambda: kernel.rope_store(
            torch.randn(2, 128),
            torch.randn(2, 8, 2),
            4,
            2,
            16,
            torch.zeros(2, 4, 16, 2, 16),
            torch.tensor([0, 1]).int(),
        ),
    }
    for message, call in bad_calls.items():
        with pytest.raises(GlueArgumentError, match=message):
            call()
    assert torch.equal(h, before)
    assert issubclass(GlueArgumentError, ValueError)


# ---- the setting -------------------------------------------------------------------------------------------------


def test_the_setting_is_checked_and_native_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="engine.glue_kernel must be one of auto, native, torch"):
        resolve_glue_kernel("fast", "cpu")
    assert resolve_glue_kernel("torch", "cpu") is None
    with pytest.raises(ValueError, match="engine.glue_kernel: native runs on CPU only"):
        resolve_glue_kernel("native", torch.device("meta"))
    assert resolve_glue_kernel("auto", torch.device("meta")) is None
    with pytest.raises(ValueError, match="engine.glue_kernel: native needs a float32 model"):
        resolve_glue_kernel("native", "cpu", torch.bfloat16)
    assert resolve_glue_kernel("auto", "cpu", torch.bfloat16) is None
    assert isinstance(resolve_glue_kernel("native", "cpu"), NativeGlueKernel)


def test_native_without_a_compiler_is_a_start_up_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    native_glue._shared_kernel.cache_clear()
    try:
        with pytest.raises(
            ValueError, match="engine.glue_kernel: native is not available here: no C compiler"
        ):
            resolve_glue_kernel("native", "cpu")
        assert resolve_glue_kernel("auto", "cpu") is None
    finally:
        native_glue._shared_kernel.cache_clear()


def test_the_build_is_named_in_the_model_id():
    ck = tiny_checkpoint()
    off = make_engine(ck, glue_kernel="torch", decode_kernel="torch", prefill_kernel="torch")
    on = make_engine(ck, glue_kernel="native", decode_kernel="torch", prefill_kernel="torch")
    assert off.model_id == ck.model_id and off.runner.glue_kernel is None
    assert on.model_id == ck.model_id + glue_kernel_variant(on.runner.glue_kernel)
    assert glue_kernel_variant(None) == ""
    for isa, variant in (("avx512", "/native-glue"), ("avx2", "/native-glue-avx2")):
        fake = NativeGlueKernel.__new__(NativeGlueKernel)
        fake.isa = isa
        assert glue_kernel_variant(fake) == variant


# ---- the engine with the kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["hf", "qwen2"])
def test_engine_with_the_kernel_cache_on_equals_off_and_batched_equals_alone(kind, kv_dtype):
    # int4 weights (the native linear kernel, the dense bf16 prefill copy): the float32 format's GEMMs are not
    # row-invariant themselves (docs/engine-step.md), the glue must not add anything that is not
    ck = tiny_checkpoint(kind, weights="int4")
    system = random_tokens(150, 7)
    prompts = [system + random_tokens(5 + 3 * i, 20 + i) for i in range(4)]

    def run(batched: bool, **config):
        eng = make_engine(ck, glue_kernel="native", kv_dtype=kv_dtype, record_logits=True, **config)
        assert eng.runner.glue_kernel is not None
        if batched:
            reqs = [eng.add_request(p, greedy(8)) for p in prompts]
            eng.run_to_completion()
        else:
            reqs = []
            for p in prompts:
                reqs.append(eng.add_request(p, greedy(8)))
                eng.run_to_completion()
        return [(r.output_token_ids, torch.stack(eng.logits_log[r.request_id])) for r in reqs]

    alone = run(False, max_num_batched_tokens=4096)
    for got in (
        run(True, max_num_batched_tokens=4096),  # batched, the system prompt shared in flight
        run(True, enable_prefix_caching=False, max_num_batched_tokens=37),  # no cache, ragged chunks
    ):
        for (tokens, logits), (want_tokens, want_logits) in zip(got, alone, strict=True):
            assert tokens == want_tokens
            assert torch.equal(logits, want_logits)


@pytest.mark.parametrize("kind", ["hf", "qwen2", "gguf"])
def test_engine_logits_with_the_kernel_are_torch_s_within_rounding(kind):
    ck = tiny_checkpoint(kind)
    prompts = [random_tokens(40 + 9 * i, 60 + i) for i in range(3)]
    out = {}
    for setting in ("native", "torch"):
        eng = make_engine(ck, glue_kernel=setting, record_logits=True)
        reqs = [eng.add_request(p, greedy(1)) for p in prompts]
        eng.run_to_completion()
        out[setting] = torch.stack([eng.logits_log[r.request_id][0] for r in reqs])
    scale = out["torch"].abs().max()
    assert ((out["native"] - out["torch"]).abs().max() / scale).item() < 1e-4
