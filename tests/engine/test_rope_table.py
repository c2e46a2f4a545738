"""``engine.rope_table.RopeTable``: a position's RoPE rotation is the same bits whatever the step's rows and
torch's thread count (and, where each position is whole vectors, ``rope_rotation`` of that position alone), and
the table grows as steps reach further."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model import rope_inv_freq
from engine.rope_table import PIECE, RopeTable, rope_rotation


def inv_freq(head_dim: int = 64, theta: float = 100000.0) -> torch.Tensor:
    return rope_inv_freq(SimpleNamespace(head_dim=head_dim, rope_theta=theta))


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_a_position_has_the_same_rotation_in_any_step_and_thread_count(head_dim):
    freqs = inv_freq(head_dim)
    table = RopeTable(freqs)
    previous = torch.get_num_threads()
    seen: dict[int, torch.Tensor] = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            fresh = RopeTable(freqs)  # grown by this step alone
            for size in (2500, 1, 37):  # a long step (torch would split it over threads), shuffled, repeats
                g = torch.Generator().manual_seed(threads + size)
                positions = torch.randperm(3000, generator=g)[:size]
                positions[: size // 2] = positions[size // 2]
                got = table.rotations(positions)
                assert got.shape == (size, 1, head_dim // 2) and got.dtype == torch.complex64
                assert torch.equal(torch.view_as_real(got), torch.view_as_real(fresh.rotations(positions)))
                for p, row in zip(positions.tolist(), torch.view_as_real(got), strict=True):
                    assert torch.equal(seen.setdefault(p, row), row), (threads, p)
                if head_dim % 64 == 0:  # whole vectors per position: what rope_rotation gives it alone
                    for k in range(0, size, 53):
                        alone = rope_rotation(freqs, positions[k : k + 1])
                        assert torch.equal(torch.view_as_real(got[k : k + 1]), torch.view_as_real(alone))
    finally:
        torch.set_num_threads(previous)


def test_the_table_grows_by_doubling_keeps_its_rows_and_refuses_negative_positions():
    freqs = inv_freq()
    table = RopeTable(freqs)
    assert table.rotations(torch.tensor([], dtype=torch.int64)).shape == (0, 1, 32)
    first = table.rotations(torch.tensor([5]))
    assert table.table.shape[0] == PIECE
    kept = table.table.clone()
    table.rotations(torch.tensor([PIECE, 3, 1000]))
    assert table.table.shape[0] == 1024
    assert torch.equal(torch.view_as_real(table.table[:PIECE]), torch.view_as_real(kept))
    assert torch.equal(torch.view_as_real(table.rotations(torch.tensor([5]))), torch.view_as_real(first))
    with pytest.raises(ValueError, match="RoPE positions must be >= 0, got -2"):
        table.rotations(torch.tensor([4, -2]))
