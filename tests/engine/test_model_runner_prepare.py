"""``ModelRunner.prepare``: one step's flat tensors from its sequences (``engine.model_runner``): token ids,
positions, slot mapping, block tables padded with block 0, the sampled rows, and which rows run the quantized
linears' dense copy (prompt tokens) or their kernel (generated tokens, ``engine.row_kernels``)."""

from __future__ import annotations

import pytest
import torch

from engine.model_runner import ModelRunner, SeqInput
from tests.engine.engine_helpers import make_engine


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_engine(num_blocks=64).runner


def seq(start: int, n: int, table: list[int], prompt_len: int | None, needs_token: bool = True) -> SeqInput:
    # prepare carries the sampler through without reading it
    return SeqInput(list(range(100 + start, 100 + start + n)), start, table, needs_token, None, prompt_len)


def expected_roles(seqs: list[SeqInput]) -> tuple[list[int], list[int]]:
    """Rows whose position lies before their sequence's prompt length, and the others: the definition."""
    dense, kernel, row = [], [], 0
    for s in seqs:
        for p in range(s.start, s.start + len(s.token_ids)):
            (dense if p < s.prompt_len else kernel).append(row)
            row += 1
    return dense, kernel


@pytest.mark.parametrize(
    "layout",
    [
        [(0, 5, 10), (8, 4, 10), (20, 1, 10)],  # a prompt chunk, one crossing the prompt's end, a decode
        [(40, 1, 7), (17, 1, 9)],  # decodes only: no dense rows
        [(0, 16, 30), (16, 3, 30)],  # prompt rows only: no kernel rows
        [(3, 6, 3), (0, 1, 1)],  # a chunk starting exactly at the prompt's end; a one-token prompt
    ],
)
def test_rows_are_split_by_role_and_the_tensors_are_flat(runner, layout):
    bs = runner.block_size
    # scattered block ids, as many blocks as each sequence's positions need (so the tables differ in width)
    seqs = [
        seq(
            start,
            n,
            [(7 * i + 5 * j + 3) % 60 for j in range(-(-(start + n) // bs))],
            plen,
            needs_token=i != 0,
        )
        for i, (start, n, plen) in enumerate(layout)
    ]
    inp = runner.prepare(seqs)
    dense, kernel = expected_roles(seqs)
    rk = inp.row_kernels
    assert (rk.dense.tolist() if rk.dense is not None else []) == dense
    assert (rk.kernel.tolist() if rk.kernel is not None else []) == kernel
    assert rk.dense is None or rk.dense.dtype == torch.int64
    positions = [p for s in seqs for p in range(s.start, s.start + len(s.token_ids))]
    assert inp.positions.tolist() == positions
    assert inp.input_ids.tolist() == [t for s in seqs for t in s.token_ids]
    slots = [
        s.block_table[p // bs] * bs + p % bs for s in seqs for p in range(s.start, s.start + len(s.token_ids))
    ]
    assert inp.meta.slot_mapping.tolist() == slots
    width = max(len(s.block_table) for s in seqs)
    assert inp.meta.block_tables.tolist() == [
        s.block_table + [0] * (width - len(s.block_table)) for s in seqs
    ]
    assert inp.meta.block_tables.dtype == torch.int64
    assert inp.sample_seqs == [i for i in range(len(seqs)) if i != 0]
    ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
    assert inp.logit_rows.tolist() == ends[1:].tolist()


def test_without_prompt_lengths_there_is_no_split_and_a_short_table_is_refused(runner):
    inp = runner.prepare([seq(0, 3, [2], None), seq(5, 1, [4], 3)])
    assert inp.row_kernels is None
    with pytest.raises(ValueError, match="sequence 1: 2 tokens at 15 do not fit 1 blocks"):
        runner.prepare([seq(0, 1, [2], 1), seq(15, 2, [4], 3)])
    with pytest.raises(ValueError, match="a step needs at least one sequence"):
        runner.prepare([])
