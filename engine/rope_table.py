"""Each position's RoPE rotation computed once and looked up per step (issue 12: step overhead).

``rope_rotation`` computes ``exp(i * position * inv_freq)`` with six small torch ops (float cast,
outer product, ``cos``, ``sin``, ``complex``, view); a decode step of SmolLM2 spent 60-95 us on them, cold after
the C step streamed every weight through the caches (2-core Zen 4: docs/engine-step.md, "Step overhead in
Python"). ``RopeTable`` holds the rotations of positions ``[0, n)``, computed by ``rope_rotation`` itself in
pieces of ``PIECE`` positions (below torch's grain size: one thread each) and grown by doubling on the device of
``inv_freq`` when a step reaches past it; a step's rotations are then one ``index_select``.

Invariant: the rotation of a position is the same bits in every step, whatever the step's rows and thread count
(each is computed once). It equals what ``rope_rotation`` gives the position in a step of any size where each
position's ``head_dim / 2`` elements are whole vectors (``tests/engine/test_rope_table.py``: head_dim 64 and 128,
steps of 1 to 4,097 rows on 1-3 threads), so the table changes no result of the models served so far.
"""

from __future__ import annotations

import torch

PIECE = 64
"""Positions per ``rope_rotation`` call when the table grows (64 x 32 = 2,048 elements for head_dim 64)."""


def rope_rotation(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE rotations ``exp(i * position * inv_freq)`` as complex64 ``[T, 1, head_dim / 2]`` for int64
    ``positions`` ``[T]`` and fp32 ``inv_freq`` ``[head_dim / 2]`` (``engine.model.rope_inv_freq``); the angle, its
    cos and its sin are computed in fp32 as Hugging Face computes them."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.complex(freqs.cos(), freqs.sin())[:, None, :]


class RopeTable:
    """RoPE rotations by position, complex64 ``[n, 1, head_dim / 2]`` (``rope_rotation``'s layout).

    Args:
        inv_freq: fp32 ``[head_dim / 2]`` inverse frequencies (``engine.model.rope_inv_freq``); the table lives
            on its device.
    """

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self.table = torch.empty(0, 1, inv_freq.shape[0], dtype=torch.complex64, device=inv_freq.device)

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """complex64 ``[T, 1, head_dim / 2]`` rotations of int64 ``positions`` ``[T]`` (any device; the result is
        on the table's).

        Raises:
            ValueError: a negative position.
        """
        if positions.numel() == 0:
            return self.table[:0]
        low, high = torch.aminmax(positions)
        low, top = int(low), int(high)
        if low < 0:
            raise ValueError(f"RoPE positions must be >= 0, got {low}")
        if top >= self.table.shape[0]:
            self._grow(top + 1)
        return self.table.index_select(0, positions.to(self.table.device))

    def _grow(self, n: int) -> None:
        """Extend the table to at least ``n`` positions (the next power of two, at least ``PIECE``)."""
        size = max(PIECE, 1 << (n - 1).bit_length())
        have = self.table.shape[0]
        device = self.inv_freq.device
        pieces = [self.table]
        for start in range(have, size, PIECE):
            positions = torch.arange(start, start + PIECE, dtype=torch.int64, device=device)
            pieces.append(rope_rotation(self.inv_freq, positions))
        self.table = torch.cat(pieces)  # a new tensor: a step holding the old one keeps it whole
