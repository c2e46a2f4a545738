"""Weight formats (``engine.linear``, ``engine.quantized``, ``engine.weight_format``).

- Stored weights decode bit-exactly to the GGUF's own values (``gguf.quants.dequantize`` is the reference),
  both from the codes and as the int4 kernel itself sees them (the kernel on the identity, fp32 activations).
- The fast kernels (bf16 activations, dense bf16 copy for prefill rows) agree with the fp32 product of the same
  dequantized weights within a stated bound: bf16 keeps 8 significant bits, so activations, scales and the
  output each carry a relative error <= 2^-9; the bound used is ``2^-6 * (|x| @ |W|^T)`` per output element.
- For every format on tiny checkpoints: cache on == cache off and batched == alone give identical greedy
  tokens; greedy tokens agree with the fp32 reference (same dequantized weights) at >= 99% of teacher-forced
  positions (slow test, the real SmolLM2: >= 98% over 500 positions; ``bench.weight_agreement`` measures 2,000).
- Bad settings: unknown values and formats the hardware has no kernel for are start-up errors naming the setting.
"""

from __future__ import annotations

import logging
import tempfile
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from bench.weight_agreement import chat_prompts, teacher_forced_agreement
from engine.bf16_gemm import pack_bf16_dense
from engine.checkpoint import default_model_path, load_checkpoint
from engine.linear import (
    DENSE_MIN_ROWS,
    BF16Weight,
    DenseWeight,
    GroupedEmbedding,
    Int4Weight,
    Int8Weight,
    bf16_in_out,
)
from engine.native_linear import resolve_linear_kernel
from engine.quantized import GGUFBlocks, int4_groups, int8_groups, quantize
from engine.weight_format import (
    UnsupportedHardwareError,
    check_supported,
    fast_bf16_gemm,
    int4_kernels_available,
    resolve,
)
from tests.engine.checkpoints import make_tiny_gguf_llama
from tests.engine.engine_helpers import greedy, make_engine, random_tokens

needs_int4 = pytest.mark.skipif(not int4_kernels_available("cpu"), reason="CPU has no AVX2/AVX-512")
CPU = torch.device("cpu")


def random_blocks(qtype: str, rows: int = 48, cols: int = 96, seed: int = 0) -> GGUFBlocks:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)  # rows of different scales
    w[0] = 0.5  # a constant row: Q4_1's scale d is 0
    return quantize(w, qtype)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2.0**-6 * (x.abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_weights_decode_bit_exactly_to_gguf(qtype):
    b = random_blocks(qtype)
    ref = b.dequantize()
    groups = int4_groups(b)
    assert torch.equal(groups.dequantize(), ref)
    lin = Int4Weight(groups, None, CPU, None)
    assert torch.equal(lin.dequantize(), ref)  # the kernel itself, fp32 activations: (q - 8) * scale + zero


def test_int8_weights_decode_bit_exactly_to_gguf():
    b = random_blocks("Q8_0")
    ref = b.dequantize()
    groups = int8_groups(b)
    assert torch.equal(groups.dequantize(), ref)
    assert torch.equal(Int8Weight(groups, None, CPU, None).dequantize(), ref)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_grouped_embedding_rows_are_exact(qtype):
    b = random_blocks(qtype, rows=40, cols=64)
    ref = b.dequantize()
    emb = (
        resolve("int4" if qtype != "Q8_0" else "int8", CPU).build_embedding(b)
        if int4_kernels_available(CPU)
        else None
    )
    if emb is None:
        g = int4_groups(b) if qtype != "Q8_0" else int8_groups(b)
        emb = GroupedEmbedding(g.q, g.scale, getattr(g, "zero", None), 8 if qtype != "Q8_0" else 0, CPU)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(emb(ids), ref[ids])


def test_row_permutation_and_concat_act_on_whole_rows():
    a, b = random_blocks("Q4_1", rows=8, seed=1), random_blocks("Q4_1", rows=16, seed=2)
    perm = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(a.rows(perm).dequantize(), a.dequantize()[perm])
    both = type(int4_groups(a)).concat([int4_groups(a), int4_groups(b)])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_quantize_refuses_columns_not_in_groups_of_32():
    with pytest.raises(ValueError, match="K % 32"):
        quantize(torch.randn(4, 40), "Q4_1")


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 8, 15, 16, 40])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_fast_kernels_agree_with_fp32_reference(qtype, rows):
    """Below ``dense_min_rows`` (16) the weight-only kernel runs, from it the dense bf16 copy."""
    b = random_blocks(qtype, rows=64, cols=128)
    w = b.dequantize()
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(64)
    if qtype == "Q8_0":
        lin = Int8Weight(int8_groups(b), bias, CPU, 16)
    else:
        lin = Int4Weight(int4_groups(b), bias, CPU, 16)
    y = lin.forward(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    ref = x @ w.t() + bias
    assert ((y - ref).abs() <= bound(x, w)).all()


@needs_int4
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_bf16_in_out_linears_give_the_same_bits_from_bf16_input(qtype, rows):
    """``bf16_in_out``: feeding bf16 and keeping the bf16 output equals the fp32 round trip bit for bit (the
    decoder layer relies on it); a bias, or an fp32 dense copy, rules a linear out."""
    b = random_blocks(qtype, rows=64, cols=128)
    make = Int8Weight if qtype == "Q8_0" else Int4Weight
    groups = int8_groups(b) if qtype == "Q8_0" else int4_groups(b)
    lin = make(groups, None, CPU, 16)
    assert bf16_in_out(lin)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    y16 = lin.forward(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16.float(), lin.forward(x.to(torch.bfloat16).float()))
    assert not bf16_in_out(make(groups, torch.randn(64), CPU, 16))
    assert not bf16_in_out(make(groups, None, CPU, 16, torch.float32))
    assert bf16_in_out(BF16Weight(torch.randn(64, 128), torch.randn(64), CPU))
    assert not bf16_in_out(DenseWeight(torch.randn(64, 128)))


@needs_int4
def test_int4_packing_in_row_chunks_gives_the_same_bytes(monkeypatch):
    """The head is packed a few thousand rows at a time (bounded transient memory): same bytes as at once,
    also with a row count that is not a multiple of the kernel's 64-row blocks."""
    from engine import linear

    q = torch.randint(0, 16, (208, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    whole = linear._int4_pack(q, CPU)
    monkeypatch.setattr(linear, "_PACK_CHUNK_ROWS", 64)
    assert torch.equal(linear._int4_pack(q, CPU), whole)


@needs_int4
@pytest.mark.parametrize(("tensor_type", "weights"), [("Q4_1", "auto"), ("Q8_0", "auto"), ("Q4_0", "native")])
def test_quantized_head_rescores_its_top_logits_exactly(tensor_type, weights):
    """A quantized head's kernel rounds logits to bf16; ``compute_logits`` recomputes each row's
    ``RESCORE_TOP_K`` largest in fp32 from the head's exact rows: those equal the fp32 product of the hidden
    state and the dequantized weights (to fp32 summation order), the rest are the kernel's."""
    from engine.model import RESCORE_TOP_K

    # torch's int4 kernel (the native one's logits are fp32: below), as loaded where bf16 GEMMs are fast: where
    # they are slow (AVX2) the head on torch's kernel is dense fp32 instead (engine.model), checked here too
    assert isinstance(tiny(tensor_type, weights, "torch").model.lm_head, DenseWeight) or fast_bf16_gemm(CPU)
    ck = tiny(tensor_type, weights, "torch", as_bf16_cpu=True)
    model = ck.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    kernel = model.lm_head.forward(hidden).float()
    logits = model.compute_logits(hidden)
    assert model.head_rows is not None
    w = model.lm_head.dequantize()  # the GGUF's values (tested bit-exact above)
    exact = hidden @ w.t()
    top = kernel.topk(RESCORE_TOP_K, dim=-1).indices
    rest = torch.ones_like(kernel, dtype=torch.bool).scatter_(1, top, False)
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[rest], kernel[rest])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    float_ck = tiny(tensor_type, "float32")
    assert float_ck.model.head_rows is None  # an exact head is left alone


@needs_int4
@pytest.mark.parametrize(("tensor_type", "weights"), [("Q4_1", "auto"), ("Q8_0", "auto"), ("Q4_0", "native")])
def test_a_head_on_the_native_kernel_gives_fp32_logits_and_is_not_rescored(tensor_type, weights):
    """On the native kernel (``engine.native_linear``, where it builds) every logit is the fp32 product of the
    hidden state and the dequantized weights up to summation order (with int8 activations, ``auto`` where they
    build: up to their ~15-bit rounding), so nothing is rescored; elsewhere ``engine.linear_kernel: auto`` keeps
    torch's kernel and its rescoring."""
    model = tiny(tensor_type, weights, "auto").model
    if resolve_linear_kernel("auto", CPU) is None:
        assert model.head_rows is not None and not model.lm_head.fp32_kernel
        return
    assert model.head_rows is None and model.lm_head.fp32_kernel
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    logits = model.compute_logits(hidden)
    exact = hidden.double() @ model.lm_head.dequantize().double().t()
    if model.lm_head.native.activations == "int8":
        err = ((logits.double() - exact).abs().max() / exact.abs().max()).item()
        assert err < 1e-4  # two int8 planes per group of 32 (test_int8_activations bounds the kernel alone)
    else:
        assert torch.allclose(logits.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_bf16_weight_agrees_with_fp32_reference():
    w = torch.randn(64, 96)
    x = torch.randn(5, 96)
    y = BF16Weight(w, None, CPU).forward(x)
    assert y.dtype == torch.float32
    assert ((y - x @ w.t()).abs() <= bound(x, w)).all()


# ---- engine level, tiny GGUF checkpoints ---------------------------------------------------------------------
@cache
def tiny(tensor_type: str, weights: str, linear_kernel: str = "auto", as_bf16_cpu: bool = False):
    """A tiny GGUF checkpoint of ``tensor_type`` loaded with ``engine.weights: weights`` (and
    ``engine.linear_kernel: linear_kernel``). ``bf16`` (and anything with ``as_bf16_cpu``) is loaded as
    if the CPU had bf16 kernels (on one without, the setting is a start-up error, tested below; torch still
    runs bf16 GEMMs there, slowly), so the bf16 path's correctness is checked on every machine."""
    root = Path(tempfile.mkdtemp(prefix="prefixgate-formats-"))
    path = make_tiny_gguf_llama(root / f"tiny-{tensor_type}.gguf", tensor_type=tensor_type, seed=1)
    if (weights == "bf16" or as_bf16_cpu) and not fast_bf16_gemm(CPU):
        with (
            mock.patch("engine.weight_format.bf16_kernels_available", lambda device: True),
            mock.patch("engine.weight_format.fast_bf16_gemm", lambda device: True),
        ):
            return load_checkpoint(str(path), weights=weights, linear_kernel=linear_kernel)
    return load_checkpoint(str(path), weights=weights, linear_kernel=linear_kernel)


FORMATS = [
    ("Q4_1", "auto"),
    ("Q4_0", "native"),
    ("Q8_0", "auto"),
    ("BF16", "native"),
    ("F32", "int4"),
    ("F32", "int8"),
    ("F32", "bf16"),
]


@needs_int4
@pytest.mark.parametrize(("tensor_type", "weights"), FORMATS)
def test_formats_load_as_asked(tensor_type, weights):
    ck = tiny(tensor_type, weights)
    expected = {
        ("Q4_1", "auto"): "GroupedEmbedding,Int4Weight",
        ("Q4_0", "native"): "GroupedEmbedding,Int4Weight",
        ("Q8_0", "auto"): "GroupedEmbedding,Int8Weight",
        ("BF16", "native"): "BF16Weight,Tensor",
        ("F32", "int4"): "Int4Weight,Tensor",
        ("F32", "int8"): "Int8Weight,Tensor",
        ("F32", "bf16"): "BF16Weight,Tensor",
    }[(tensor_type, weights)]
    quantized = "Int4Weight" in expected or "Int8Weight" in expected
    native_head = quantized and resolve_linear_kernel("auto", CPU) is not None  # the head on its own codes
    if not fast_bf16_gemm(CPU) and weights != "bf16" and not native_head:
        expected = ",".join(
            sorted({*expected.split(","), "DenseWeight"})
        )  # AVX2: LM head dense fp32 (engine.model)
    assert ck.model.weight_formats == expected
    assert ck.model_id != tiny(tensor_type, "float32").model_id  # KV of another format never shares a key


@needs_int4
@pytest.mark.parametrize(("tensor_type", "weights"), FORMATS)
def test_cache_on_equals_cache_off_and_batched_equals_alone(tensor_type, weights):
    ck = tiny(tensor_type, weights)
    base = random_tokens(200, 1)
    prompts = [
        base[:120] + random_tokens(9, 2),
        base[:40] + random_tokens(30, 3),
        random_tokens(50, 4),
        base[:160],
    ]
    alone = []
    for p in prompts:
        eng = make_engine(ck, enable_prefix_caching=False)
        alone.append(eng.generate([p], greedy(10))[0])
    eng = make_engine(ck, max_num_batched_tokens=48, max_batch=4)  # chunked, batched, cached
    eng.generate([base], greedy(2))
    together = eng.generate(prompts, greedy(10))
    assert (
        eng.stats().prefix_hit_tokens == 120 + 40 + 0 + 159
    )  # token-granular: every shared token but the last
    assert together == alone


@needs_int4
@pytest.mark.parametrize(
    ("tensor_type", "weights"),
    [("Q4_1", "auto"), ("Q8_0", "auto"), ("F32", "bf16")],
)
def test_greedy_tokens_agree_with_fp32_reference_of_the_same_weights(tensor_type, weights):
    agree, total, _ = teacher_forced_agreement(
        tiny(tensor_type, weights),
        tiny(tensor_type, "float32"),
        [random_tokens(20 + 7 * i, 50 + i) for i in range(6)],
        12,
    )
    assert agree / total >= 0.99, (agree, total)


# ---- settings and hardware -------------------------------------------------------------------------------------
def test_unknown_settings_are_named():
    with pytest.raises(ValueError, match="engine.weights must be one of"):
        check_supported("q4", "float32", "cpu")
    with pytest.raises(ValueError, match="engine.kv_dtype must be one of"):
        check_supported("auto", "float16", "cpu")


@pytest.mark.parametrize("weights", ["int4", "int8", "native"])
def test_format_without_kernel_is_a_startup_error_naming_the_setting(monkeypatch, weights):
    monkeypatch.setattr("engine.weight_format.int4_kernels_available", lambda device: False)
    with pytest.raises(
        UnsupportedHardwareError, match=f"engine.weights: {weights} needs the int4 weight-only"
    ):
        check_supported(weights, "float32", "cpu")


def test_bf16_without_bf16_kernels_is_a_startup_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr("engine.weight_format.bf16_kernels_available", lambda device: False)
    with pytest.raises(UnsupportedHardwareError, match="engine.weights: bf16 needs bf16 kernels"):
        check_supported("bf16", "float32", "cpu")


def test_auto_without_kernels_falls_back_to_float32_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr("engine.weight_format.int4_kernels_available", lambda device: False)
    with caplog.at_level(logging.INFO, logger="engine.weight_format"):
        plan = resolve("auto", "cpu")
    assert plan.weights == "float32"
    assert "running float32" in caplog.text


def test_dense_prefill_copy_is_fp32_without_fast_bf16_gemms(monkeypatch):
    """On a CPU without fast bf16 GEMMs (AVX2; an Intel CPU without AMX) quantized layers run int4 and their
    prefill copy, where one is asked for, is fp32."""
    monkeypatch.setattr("engine.weight_format.int4_kernels_available", lambda device: True)
    monkeypatch.setattr("engine.weight_format.fast_bf16_gemm", lambda device: False)
    plan = resolve("auto", "cpu", dense_min_rows=10)
    assert (plan.weights, plan.dense_dtype) == ("native", torch.float32)
    lin = plan.build_linear([random_blocks("Q4_1", rows=64, cols=128)], None, "x")
    assert isinstance(lin, Int4Weight) and lin.dense.dtype == torch.float32
    monkeypatch.setattr("engine.weight_format.fast_bf16_gemm", lambda device: True)
    assert resolve("auto", "cpu").dense_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("bf16_kernels", "flags", "vendor", "want"),
    [
        (True, {"avx512_bf16", "amx_bf16", "amx_tile"}, "GenuineIntel", True),  # AMX
        (True, {"avx512_bf16"}, "AuthenticAMD", True),  # Zen 4
        (
            True,
            {"avx512_bf16"},
            "GenuineIntel",
            False,
        ),  # AVX512-BF16 without AMX: VDPBF16PS at a quarter rate
        (False, {"avx2"}, "AuthenticAMD", False),  # AVX2
    ],
)
def test_fast_bf16_gemm_is_amx_or_an_amd_avx512_bf16_cpu(monkeypatch, bf16_kernels, flags, vendor, want):
    monkeypatch.setattr("engine.weight_format.bf16_kernels_available", lambda device: bf16_kernels)
    monkeypatch.setattr("engine.weight_format.cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr("engine.weight_format.cpu_vendor", lambda: vendor)
    assert fast_bf16_gemm("cpu") is want


@pytest.mark.parametrize(
    ("bf16_gemms", "native_isa", "want"),
    [
        (False, "avx2", None),
        (False, "avx512", None),
        (False, None, DENSE_MIN_ROWS),
        (True, "avx2", DENSE_MIN_ROWS),
        (True, "avx512", DENSE_MIN_ROWS),
        (True, None, 10),
    ],
)
def test_dense_min_rows_auto_drops_the_copy_on_the_native_kernel_without_fast_bf16_gemms(
    monkeypatch, caplog, bf16_gemms, native_isa, want
):
    """``auto``: no dense prefill copy where it would not run on fast bf16 GEMMs and the native kernel runs prompt
    rows (either build), a copy everywhere else (torch's int4 kernel: None); an explicit setting is kept as
    given."""
    monkeypatch.setattr("engine.weight_format.int4_kernels_available", lambda device: True)
    monkeypatch.setattr("engine.weight_format.fast_bf16_gemm", lambda device: bf16_gemms)
    kernel = None if native_isa is None else SimpleNamespace(isa=native_isa)
    monkeypatch.setattr("engine.native_linear.resolve_linear_kernel", lambda setting, device: kernel)
    with caplog.at_level(logging.INFO, logger="engine.weight_format"):
        plan = resolve("auto", "cpu")
    assert plan.dense_min_rows == want and plan.linear_kernel is kernel
    assert ("no dense prefill copy" in caplog.text) == (want is None)
    assert resolve("auto", "cpu", dense_min_rows=12).dense_min_rows == 12
    assert resolve("auto", "cpu", dense_min_rows=None).dense_min_rows is None


@pytest.mark.parametrize("bad", [0, -3, "always", 2.5, True, "10"])
def test_a_bad_dense_min_rows_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match="engine.dense_min_rows must be auto, null or an integer >= 1"):
        resolve("float32", "cpu", dense_min_rows=bad)


def test_mixed_storage_in_one_projection_runs_in_the_widest_format(caplog):
    plan = resolve("float32", "cpu")
    native = type(plan)("native", CPU)
    parts = [random_blocks("Q4_1", rows=8), random_blocks("Q8_0", rows=8)]
    with caplog.at_level(logging.INFO, logger="engine.weight_format"):
        assert native.kind_for(parts, "qkv") == "int8"
        assert native.kind_for([parts[0], torch.zeros(8, 96)], "qkv") == "float32"
    assert "run as int8" in caplog.text


# ---- the real model (slow) -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_q4_1_tensors_decode_bit_exactly():
    from engine.gguf_loader import open_gguf

    reader = open_gguf(default_model_path())
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0"):
            cols = int(t.shape[0])
            b = GGUFBlocks(t.tensor_type.name, np.asarray(t.data).reshape(int(t.shape[1]), -1), cols)
            g = int4_groups(b) if b.qtype == "Q4_1" else int8_groups(b)
            assert torch.equal(g.dequantize(), b.dequantize()), t.name
            checked += 1
    assert checked == 211


@pytest.mark.slow
@needs_int4
def test_smollm2_int4_agrees_with_fp32_reference():
    """The GGUF's own Q4_1/Q8_0 weights on the int4 kernel against the fp32 reference of the same dequantized
    weights, teacher-forced (``bench.weight_agreement``). Issue 12 asks top-1 agreement >= 99% over >= 2,000
    positions: ``python -m bench.weight_agreement`` measures that (1,975 / 2,000 = 98.75% on an AVX2 EPYC with
    the fp32 head; on a Xeon with AMX 1,964 / 2,000 = 98.2% before the head rescored its top logits exactly,
    1,979 / 2,000 = 98.95% after: the 99% target is NOT met by one position. The kernel itself is exact
    inside; what is left is its bf16 interface: activations and f16 scales rounded to bf16 on the way in, each
    layer's output rounded to bf16 on the way out). This test runs 20 prompts x 25 positions, the size CI
    affords, and guards the measured level (>= 98%)."""
    from tests.engine.engine_helpers import smollm2_checkpoint

    ref = smollm2_checkpoint()
    ck = load_checkpoint(default_model_path(), weights="auto")
    agree, total, misses = teacher_forced_agreement(ck, ref, chat_prompts(ref, 20), 25)
    print(f"int4 top-1 agreement: {agree} / {total}, disagreeing at {misses}")
    assert total == 500
    assert agree / total >= 0.98, (agree, total)


@needs_int4
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_dense_copy_is_prepacked_and_used_from_dense_min_rows(qtype):
    """The bf16 dense copy is oneDNN-prepacked where oneDNN packs bf16 here (CPUs with bf16 arithmetic; else
    the plain bf16 weight) and gives ``F.linear``'s bits on the same bf16 weight either way; 9 rows run the
    weight-only kernel, 10 (``DENSE_MIN_ROWS``) the copy."""
    b = random_blocks(qtype, rows=64, cols=128)
    make = Int8Weight if qtype == "Q8_0" else Int4Weight
    groups = int8_groups(b) if qtype == "Q8_0" else int4_groups(b)
    lin = make(groups, None, CPU)
    packs = pack_bf16_dense(torch.ones(64, 128, dtype=torch.bfloat16)) is not None
    assert lin.dense_min_rows == DENSE_MIN_ROWS == 10 and lin.dense.is_mkldnn == packs
    assert lin.dense.dtype == torch.bfloat16
    w16 = groups.dequantize().to(torch.bfloat16)
    for rows in (9, 10, 40):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        dense = torch.nn.functional.linear(x.to(torch.bfloat16), w16).float()
        assert torch.equal(lin.forward(x), dense) == (rows >= 10)


def test_what_prompt_rows_run_on_is_part_of_the_model_id():
    """A prompt token's K/V depends on the kernel its rows ran on: a dense fp32 copy, a dense bf16 copy (the ids
    of earlier releases) or the weight-only kernel; entries shared through KV tiers must never mix them."""
    from engine.amx_gemm import AmxDenseWeight
    from engine.checkpoint import prompt_rows_variant
    from tests.engine.engine_helpers import tiny_checkpoint

    copy = tiny_checkpoint(weights="int4", dense_min_rows=10)
    rows = tiny_checkpoint(weights="int4", dense_min_rows=None)
    ref = tiny_checkpoint()
    # without a copy: the weight-only kernel, every row
    assert prompt_rows_variant(rows.model) == "/prompt-kernel" and prompt_rows_variant(ref.model) == ""
    dense = copy.model.layers[0].qkv.dense
    if isinstance(dense, AmxDenseWeight):
        want = "/prompt-dense-amx"
    else:
        want = "" if dense.dtype == torch.bfloat16 else "/prompt-dense-float32"
    assert prompt_rows_variant(copy.model) == want
    assert len({copy.model_id, rows.model_id, ref.model_id}) == 3
    # oneDNN's copy (engine.dense_gemm: onednn) keeps the ids of earlier releases, apart from the AMX kernel's
    onednn = tiny_checkpoint(weights="int4", dense_min_rows=10, dense_gemm="onednn")
    assert not isinstance(onednn.model.layers[0].qkv.dense, AmxDenseWeight)
    assert prompt_rows_variant(onednn.model) == want.replace("/prompt-dense-amx", "")
    assert (onednn.model_id == copy.model_id) == (want != "/prompt-dense-amx")
