"""A minimal driver of ``LlamaModel`` for tests: whole block tables, chunked prefill and greedy decode.

The real engine (scheduler, block pool, prefix cache) lives elsewhere; this only lays out slot mappings and
block tables so model tests can run sequences through the paged KV cache in any chunking and block order.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.model import LlamaModel
from engine.native_glue import NativeGlueKernel


class Seq:
    """One sequence: its tokens so far, the blocks it owns, and how many tokens have K/V in the cache."""

    def __init__(self, tokens: list[int], blocks: list[int]) -> None:
        self.tokens = list(tokens)
        self.blocks = list(blocks)
        self.computed = 0


def step(
    model: LlamaModel,
    kv_cache: torch.Tensor,
    seqs: list[Seq],
    counts: list[int],
    block_size: int,
    glue: NativeGlueKernel | None = None,
) -> torch.Tensor:
    """Run ``counts[i]`` not-yet-computed tokens of each seq in one forward (``glue``: the native layer-glue kernel,
    or None for torch's ops); return the hidden state ``[B, H]`` of each seq's last token in this step."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for s, n in zip(seqs, counts, strict=True):
        for p in range(s.computed, s.computed + n):
            ids.append(s.tokens[p])
            pos.append(p)
            slots.append(s.blocks[p // block_size] * block_size + p % block_size)
        s.computed += n
        qsl.append(qsl[-1] + n)
        lens.append(s.computed)
    width = max(len(s.blocks) for s in seqs)
    tables = torch.tensor([s.blocks + [-1] * (width - len(s.blocks)) for s in seqs], dtype=torch.long)
    meta = AttentionMetadata(torch.tensor(slots), qsl, lens, tables, block_size)
    hidden = model(torch.tensor(ids), torch.tensor(pos), kv_cache, meta, glue=glue)
    return hidden[torch.tensor(qsl[1:]) - 1]


def prefill_logits(
    model: LlamaModel,
    kv_cache: torch.Tensor,
    seq: Seq,
    chunks: list[int],
    block_size: int,
    glue: NativeGlueKernel | None = None,
) -> torch.Tensor:
    """Prefill ``seq`` in the given chunk sizes; logits ``[vocab]`` of its last prompt token."""
    assert sum(chunks) == len(seq.tokens) - seq.computed
    hidden = None
    for n in chunks:
        hidden = step(model, kv_cache, [seq], [n], block_size, glue)
    return model.compute_logits(hidden)[0]


def greedy(
    model: LlamaModel,
    kv_cache: torch.Tensor,
    prompt: list[int],
    n: int,
    block_size: int,
    blocks: list[int] | None = None,
    glue: NativeGlueKernel | None = None,
) -> list[int]:
    """Greedy continuation of ``n`` tokens with a contiguous (or given) block table."""
    need = -(-(len(prompt) + n) // block_size)
    seq = Seq(prompt, blocks if blocks is not None else list(range(need)))
    logits = prefill_logits(model, kv_cache, seq, [len(prompt)], block_size, glue)
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        seq.tokens.append(tok)
        logits = model.compute_logits(step(model, kv_cache, [seq], [1], block_size, glue))[0]
    return out
