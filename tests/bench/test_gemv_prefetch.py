"""bench.gemv_prefetch: one step's weights have SmolLM2's shapes and sizes, and a timed step calls the kernel's
own functions with the same results as ``mm``."""

from __future__ import annotations

import pytest
import torch

from bench.gemv_prefetch import HEAD_SHAPE, LAYER_SHAPES, step_fn, step_weights
from engine import native_build
from engine.native_linear import INT8_ACTIVATION_REQUIRED, Int8ActivationKernel, select_int8_isa


def test_a_step_holds_every_layer_s_linears_then_the_head():
    weights = step_weights(2)
    assert [(w.out_features, w.in_features, w.bits) for w in weights] == [
        *[(n, k, 4) for _ in range(2) for n, k in LAYER_SHAPES],
        (*HEAD_SHAPE, 8),
    ]
    # int4: 320 bytes per 16 outputs x 32 inputs; int8: 544
    assert sum(w.nbytes for w in weights) == 2 * sum(n * k // 512 * 320 for n, k in LAYER_SHAPES) + (
        HEAD_SHAPE[0] * HEAD_SHAPE[1] // 512 * 544
    )


@pytest.mark.skipif(
    not (native_build.cpu_ok(INT8_ACTIVATION_REQUIRED[select_int8_isa()])[0] and native_build.compiler()),
    reason="needs the int8-activation kernel's build (x86-64 AVX2 or AVX-512 VNNI, a C compiler)",
)
def test_a_timed_step_computes_what_mm_computes():
    kernel = Int8ActivationKernel.build()
    weights = step_weights(1)
    run, io = step_fn(kernel, weights, rows=3, threads=2)
    run()
    for (x, y), w in zip(io, weights, strict=True):
        assert torch.equal(y, kernel.mm(w, x, threads=2))
