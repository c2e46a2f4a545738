"""Dense GEMMs of the prefill copies on CPU: oneDNN's prepacked bf16 weights and row-invariant calls
(``engine.linear``'s dense copies).

Owns: whether this torch build has oneDNN's prepacked linear ops, packing a bf16 weight for them
(``pack_bf16_dense``), and the product of activations with a dense weight (``dense_mm``): bf16 cut, where the
CPU needs it, into calls of at most ``ROW_INVARIANT_ROWS`` rows (``bf16_gemm``), fp32 padded to at least
``FP32_MIN_ROWS`` rows (``fp32_gemm``).

Invariant: a row's product does not depend on the other rows of its call (batch invariance: batched ==
alone, cache on == cache off; ``docs/engine-step.md``, "Batch invariance"). bf16: whole calls where that was
measured to hold (AMD EPYCs with AVX512-BF16), 32-row calls on CPUs with AMX, where it does not (there the
engine's own AMX kernel, ``engine.amx_gemm``, takes whole calls instead unless ``engine.dense_gemm: onednn``),
and never a one-row call (a lone row runs as a two-row call: oneDNN's one-row kernel differed on a Zen 4). fp32 (the
prefill copy of CPUs without bf16 arithmetic): never a call of fewer than 16 rows (those took other kernels
on an AVX2-only Zen 3).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.amx_gemm import AmxDenseWeight


def onednn_packing_available() -> bool:
    """Whether this PyTorch build has the oneDNN prepacked linear ops (CPU builds with mkldnn)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_PACK_DENSE_FOR_ROWS = 64  # the row count oneDNN's bf16 packing is tuned for (``engine.linear``'s tables)


def pack_bf16_dense(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a bf16 ``[out, in]`` weight on CPU (``torch.ops.mkldnn._reorder_linear_weight``,
    the blocked layout PyTorch's own compiler uses for CPU linears; an opaque mkldnn tensor), or None where it
    is not available or its product differs from ``F.linear``'s on a probe (then the plain weight is used).
    The probe compares bit for bit: both run oneDNN's bf16 GEMM, only the weight's layout differs."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not onednn_packing_available():
        return None
    with torch.inference_mode():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_DENSE_FOR_ROWS)
            probe = torch.randn(
                _PACK_DENSE_FOR_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)
            ).to(torch.bfloat16)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except RuntimeError:
            return None
        return packed if torch.equal(got, F.linear(probe, weight)) else None


ROW_INVARIANT_ROWS = 32
"""Most rows one oneDNN bf16 GEMM call gets on CPUs with AMX (``row_slices_needed``)."""


@functools.cache
def row_slices_needed() -> bool:
    """Whether bf16 GEMMs must be cut into calls of at most ``ROW_INVARIANT_ROWS`` rows to keep each row's
    result independent of the call's other rows (batch invariance: batched == alone, cache on == cache off).

    True on CPUs with AMX (``amx_bf16`` in ``/proc/cpuinfo``). Measured there (torch 2.13, a 2-core Xeon with
    AMX; SmolLM2's four weight shapes, prepacked and plain ``F.linear`` alike, 1 and 2 threads): a call of
    more than 32 rows computes some rows otherwise than the same rows computed alone (up to 0.0625 apart;
    e.g. 111 of the first 700 rows of a 1,400-row call against a 700-row call), depending on the row count
    in no simple way (padding to a multiple of 16-128 rows does not help, nor does hiding AMX from oneDNN),
    while every call of at most 32 rows gives each row exactly its result alone. On AMD EPYCs with
    AVX512-BF16 and no AMX whole calls were measured row-invariant ("Batch invariance" in
    ``docs/engine-step.md``), so they stay whole there. Cost on the Xeon, one thread, 512 rows: ~2.5-3x the
    time of one call (gate/up 1.2 -> 3.7 ms); under 32 rows nothing changes.
    """
    from engine.weight_format import cpu_flags

    return "amx_bf16" in cpu_flags()


def bf16_gemm(x: torch.Tensor, one_call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``one_call(x)`` for a 2-D bf16 ``x`` ``[rows, in]`` on CPU, in slices of ``ROW_INVARIANT_ROWS`` rows
    where ``row_slices_needed`` (each row's result then does not depend on the others), else in one call; a
    one-row call (or last slice) runs as a two-row call (``_at_least_two_rows``). Off CPU: one call."""
    rows = x.shape[0]
    if x.device.type != "cpu":
        return one_call(x)
    if rows <= ROW_INVARIANT_ROWS or not row_slices_needed():
        return _at_least_two_rows(x, one_call)
    return torch.cat(
        [
            _at_least_two_rows(x[s : s + ROW_INVARIANT_ROWS], one_call)
            for s in range(0, rows, ROW_INVARIANT_ROWS)
        ]
    )


def _at_least_two_rows(x: torch.Tensor, one_call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``one_call(x)``, a one-row ``x`` computed as the first row of a two-row call (the row twice).

    Measured on a 2-core AMD EPYC Zen 4 (AVX512-BF16, no AMX; torch 2.13, one and two threads): oneDNN runs a
    one-row bf16 GEMM with another kernel than a call of several rows, and for SmolLM2's down projection (in
    1,536) a few rows in a hundred came out one bf16 ulp apart (e.g. rows 1 and 20 of the first 32), while
    every call of 2 to 1,100 rows gave each row the same bits as its two-row call. A prompt chunk of one token
    (the only token a prefix hit leaves to compute) would otherwise differ from the same token computed in a
    batch (cache on != cache off). Calls of at most 32 rows on AMX CPUs, and every call on Zen 5, gave one-row
    results equal to the others', so the padding changes nothing there; it costs one extra row per such call.
    """
    if x.shape[0] != 1:
        return one_call(x)
    return one_call(x.expand(2, -1).contiguous())[:1]


FP32_MIN_ROWS = 16
"""Fewest rows one fp32 GEMM call gets on CPU (``fp32_gemm``)."""


def fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for 2-D fp32 ``x`` ``[rows, in]`` and ``weight`` ``[out, in]`` -> ``[rows, out]``
    fp32, a call of fewer than ``FP32_MIN_ROWS`` rows on CPU computed as the first rows of a
    ``FP32_MIN_ROWS``-row call (zero rows appended), so each row's result does not depend on the call's row
    count.

    Measured on a 2-core AMD EPYC Zen 3 (AVX2 + FMA, no AVX-512; torch 2.13's CPU GEMM; SmolLM2's weight
    shapes 576 x 576, 1,536 x 576, 576 x 1,536 and 192 x 576): against the rows of one 1,100-row call, calls of
    1-3 rows differed in every row at every thread count (another kernel), and at 2 and 8 threads calls of
    5-7 and 9-11 rows differed in their last rows (the call split between threads); every call of 12 rows or
    more, at any offset, and of 4 or 8 rows, gave each row the 1,100-row call's bits at 1, 2, 3, 4 and 8
    threads. Off CPU: one plain call.
    """
    rows = x.shape[0]
    if x.device.type != "cpu" or rows >= FP32_MIN_ROWS:
        return F.linear(x, weight)
    padded = torch.cat([x, x.new_zeros(FP32_MIN_ROWS - rows, x.shape[1])])
    return F.linear(padded, weight)[:rows]


def dense_mm(x: torch.Tensor, dense: torch.Tensor | AmxDenseWeight) -> torch.Tensor:
    """``x @ dense.T`` with ``x`` ``[..., in]`` cast to the dense copy's dtype -> ``[..., out]`` in that dtype;
    ``dense`` ``[out, in]``, plain or ``pack_bf16_dense``'s; products row-invariant (bf16: ``bf16_gemm``;
    fp32: ``fp32_gemm``; other dtypes: one plain call). An ``engine.amx_gemm.AmxDenseWeight`` runs on its
    kernel in one call (row-invariant by construction) and returns fp32."""
    if isinstance(dense, AmxDenseWeight):
        y = dense.mm(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])
    if not dense.is_mkldnn and dense.dtype != torch.bfloat16:
        x2 = x.reshape(-1, x.shape[-1]).to(dense.dtype)
        y = fp32_gemm(x2, dense) if dense.dtype == torch.float32 else F.linear(x2, dense)
        return y.view(*x.shape[:-1], y.shape[-1])
    if dense.is_mkldnn:
        one_call = lambda part: torch.ops.mkldnn._linear_pointwise(part, dense, None, "none", [], "")  # noqa: E731
    else:
        one_call = lambda part: F.linear(part, dense)  # noqa: E731
    y = bf16_gemm(x.reshape(-1, x.shape[-1]).to(dense.dtype), one_call)
    return y.view(*x.shape[:-1], y.shape[-1])
