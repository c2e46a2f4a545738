"""Which kernel each row of a step's quantized linears runs on: by the token's role, not the step's row count.

An ``engine.linear.Int4Weight`` / ``Int8Weight`` with a dense copy has two kernels: torch's int4 weight-only
kernel (fast for a few rows: decode) and a dense bf16 GEMM on the dequantized copy (fast for many: prefill).
Each gives a row the same bits whatever the other rows of the call are (measured on torch 2.13, 1-2,048 rows,
1 and 2 threads: ``docs/engine-step.md``), but the two round differently. Choosing by the step's row count
(``dense_min_rows``) made a sequence's rows change kernel with what else was in its step; here the engine
chooses per row: a prompt token's row runs on the dense copy, a generated token's row on the int4 kernel, in
any step, any batch, any chunking of the prompt, cache on or off (a prompt token is computed once, a generated
token's K/V comes from the kernel that computed its logits' step).

Invariant: a row's kernel depends only on whether its position is before the sequence's prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.linear import Int4Weight, Int8Weight, LinearWeight


@dataclass(frozen=True)
class RowKernels:
    """Which rows of a step's ``[T, in]`` input a quantized linear with a dense copy runs on that copy (the
    rows of prompt tokens) and which on its int4 kernel (the rows of generated tokens), made once per step by
    ``engine.model_runner.ModelRunner.prepare``. Both kernels give a row the same bits whatever the other rows
    are (measured, ``docs/engine-step.md``), so choosing per row by the token's role, not by the step's row
    count, keeps a sequence's logits independent of its batch and of how its prompt was chunked.

    Attributes:
        dense: int64 ``[T_d]`` rows on the dense copy, or None (none).
        kernel: int64 ``[T_k]`` rows on the int4 kernel, or None (none).
    """

    dense: torch.Tensor | None
    kernel: torch.Tensor | None


def forward_rows(linear: LinearWeight, x: torch.Tensor, rows: RowKernels | None) -> torch.Tensor:
    """``linear.forward(x)`` for ``x`` ``[T, in]``, an ``Int4Weight`` / ``Int8Weight`` with a dense copy running
    ``rows.dense`` on the copy and ``rows.kernel`` on the int4 kernel (two calls when both are present); one
    without a copy (every row on its kernel), any other linear, or ``rows`` None, as ``linear.forward(x)``.
    Returns ``[T, out]`` in ``x``'s dtype."""
    if rows is None or not isinstance(linear, Int4Weight | Int8Weight) or linear.dense is None:
        return linear.forward(x)
    if rows.kernel is None or rows.dense is None:
        return linear.forward(x, dense=rows.kernel is None)
    y_dense = linear.forward(x.index_select(0, rows.dense), dense=True)
    y_kernel = linear.forward(x.index_select(0, rows.kernel), dense=False)
    out = y_dense.new_empty(x.shape[0], y_dense.shape[1])
    return out.index_copy_(0, rows.dense, y_dense).index_copy_(0, rows.kernel, y_kernel)
