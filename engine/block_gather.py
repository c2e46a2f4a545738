"""Reading blocks of a paged KV cache, and masking the padding of such reads.

Owns ``BlockGather`` (how to read a list of blocks' K and V from one layer's cache
``[2, num_blocks, block_size, kv_heads, head_dim]``: a view when the blocks are consecutive, else ONE
``index_select`` over K and V together), ``block_gather`` (which of the two a list of block ids gets) and
``length_mask`` (which positions of sequences padded to the longest are real). Both prefill
(``engine.attention``) and decode (``engine.decode_attention``) attention build on these.

Invariants: a gather only reads the cache, never writes it, and reads the blocks in the order given; padding
positions are the ones ``length_mask`` marks False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockGather:
    """How to read a list of blocks' K and V from one layer's cache ``[2, num_blocks, block_size, kvh, hd]``.

    Either ``first`` (the blocks are ``first, first+1, ...``: a view, no copy) or ``rows``: int64
    ``[2 * n]`` = ``ids`` then ``ids + num_blocks``, rows of the cache viewed as ``[2 * num_blocks, -1]``, so
    K and V of every block come from ONE ``index_select`` on the leading dimension.
    """

    num_blocks: int  # n, blocks to read
    first: int | None = None
    rows: torch.Tensor | None = None

    def read_into(self, layer_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the blocks' K and V into ``out`` (``[2 * n, block_size * kv_heads * head_dim]``, the cache's
        dtype; reused by every layer of a step) and return it as ``[2, n, block_size, kv_heads, head_dim]``."""
        bs, kvh, hd = layer_cache.shape[2:]
        if self.first is not None:
            out.view(2, self.num_blocks, bs, kvh, hd).copy_(
                layer_cache[:, self.first : self.first + self.num_blocks]
            )
        else:
            torch.index_select(layer_cache.view(2 * layer_cache.shape[1], -1), 0, self.rows, out=out)
        return out.view(2, self.num_blocks, bs, kvh, hd)

    def read(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """``[2, n * block_size, kv_heads, head_dim]``: K (index 0) and V (index 1) of the blocks, in order."""
        kvh, hd = layer_cache.shape[-2:]
        if self.first is not None:
            return layer_cache[:, self.first : self.first + self.num_blocks].reshape(2, -1, kvh, hd)
        flat = layer_cache.view(2 * layer_cache.shape[1], -1)
        return flat.index_select(0, self.rows).view(2, -1, kvh, hd)


def block_gather(ids: list[int], pool_blocks: int, device: torch.device) -> BlockGather:
    """A ``BlockGather`` for block ids ``ids`` of a pool of ``pool_blocks`` blocks."""
    if all(b == ids[0] + i for i, b in enumerate(ids)):
        return BlockGather(len(ids), first=ids[0])
    t = torch.tensor(ids, dtype=torch.long)
    return BlockGather(len(ids), rows=torch.cat((t, t + pool_blocks)).to(device))


def length_mask(lens: list[int], device: torch.device) -> torch.Tensor | None:
    """bool ``[B, 1, 1, max(lens)]``, True at positions ``< lens[b]``; None when all lengths are equal."""
    max_len = max(lens)
    if min(lens) == max_len:
        return None
    len_t = torch.tensor(lens, dtype=torch.long, device=device)
    return (torch.arange(max_len, device=device)[None, :] < len_t[:, None])[:, None, None, :]
