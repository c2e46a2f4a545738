"""The last layer of a step for the rows whose hidden state is read: the output rows (``LlamaModel.forward``).

Only the rows that go through the LM head (``engine.model_runner``'s ``logit_rows``: the last row of a prefill
chunk that ends its prompt, every decode row) need the last layer's output. Every other row of a step needs
only that layer's K/V, which the cache keeps for later tokens; its attention, o projection, norms and MLP in
the last layer feed nothing. llama.cpp skips them the same way (its graph keeps only the output rows before the
last layer's feed-forward). For a cold prompt of ~1,000 tokens that is ~1/30 of SmolLM2's prefill; a prefill
chunk that does not end its prompt runs no last-layer work after the K/V store at all.

Owns: which step can take the shortcut and the reduced step for its output rows (``OutputStep``): an
``AttentionMetadata`` holding, per output row, its sequence with that one query row (context, block table and
prompt length unchanged) and the rows' ``RowKernels``.

Invariant: an output row's hidden state is the same bits as when the whole step runs the last layer. That holds
because every kernel on this path computes a row independently of the other rows of its call: the linears by
the token's role (``engine.row_kernels``; the dense copies are row-invariant, ``engine.bf16_gemm`` /
``engine.amx_gemm``), the glue per row, decode attention per sequence, and the native prefill kernel per row
whatever the chunk (a one-token query that is still a prompt token takes the prefill kernel,
``engine.attention.plan_attention``). So the shortcut is taken only where both native attention kernels run the
step (``AttentionMetadata.decode_kernel`` and ``prefill_kernel``) and each output row is the last row of its
sequence; anywhere else the step runs every row, as before.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch

from engine.attention import AttentionMetadata
from engine.row_kernels import RowKernels


@dataclass(frozen=True)
class OutputStep:
    """The last layer's step for the output rows of a step.

    Attributes:
        rows: int64 ``[N]`` the output rows (indices into the step's ``T`` rows), in the caller's order.
        meta: the attention metadata of ``N`` one-row sequences: the ``j``-th holds output row ``rows[j]`` with
            the context length, block table and prompt length of the step's sequence that row ends.
        row_kernels: the output rows' kernels (``RowKernels`` indices into ``0 .. N - 1``), or None where the
            step had none.
    """

    rows: torch.Tensor
    meta: AttentionMetadata
    row_kernels: RowKernels | None


def _subset(index: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    """Positions ``j`` of ``rows`` whose row is in ``index`` (int64), or None when there are none."""
    if index is None:
        return None
    members = set(index.tolist())
    picked = [j for j, r in enumerate(rows) if r in members]
    return torch.tensor(picked, dtype=torch.int64) if picked else None


def output_step(
    meta: AttentionMetadata, row_kernels: RowKernels | None, output_rows: torch.Tensor
) -> OutputStep | None:
    """The reduced last-layer step for ``output_rows`` (int64 ``[N]``, each the last row of a distinct sequence of
    the step, ``N`` may be 0), or None when the step runs every row in its last layer: every row is an output
    row (nothing to skip: a decode step), a native attention kernel is missing (another path may attend a lone
    row otherwise than within its chunk), or an output row is not its sequence's last or appears twice.

    Raises:
        ValueError: an output row outside ``[0, T)``.
    """
    qsl = meta.query_start_loc
    rows = output_rows.tolist()
    if meta.decode_kernel is None or meta.prefill_kernel is None or len(rows) == qsl[-1]:
        return None
    seqs: list[int] = []
    for r in rows:
        if not 0 <= r < qsl[-1]:
            raise ValueError(f"output row {r} is outside the step's {qsl[-1]} rows")
        i = bisect.bisect_right(qsl, r) - 1
        if r != qsl[i + 1] - 1:
            return None
        seqs.append(i)
    if len(set(seqs)) != len(seqs):
        return None
    tables = meta.block_tables
    sub = replace(
        meta,
        slot_mapping=meta.slot_mapping[rows] if rows else meta.slot_mapping[:0],
        query_start_loc=list(range(len(rows) + 1)),
        seq_lens=[meta.seq_lens[i] for i in seqs],
        block_tables=tables[seqs] if seqs else tables[:0],
        prompt_lens=None if meta.prompt_lens is None else [meta.prompt_lens[i] for i in seqs],
    )
    kernels = None
    if row_kernels is not None:
        kernels = RowKernels(_subset(row_kernels.dense, rows), _subset(row_kernels.kernel, rows))
    return OutputStep(output_rows, sub, kernels)
