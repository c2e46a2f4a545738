"""Token sampling: greedy at temperature 0, else temperature, top-k and top-p (nucleus) sampling.

Each request owns a ``torch.Generator`` (seeded by ``SamplingParams.seed``, or from fresh entropy when no seed
is given), and every sampled row draws only from its own generator, one row at a time. So what a request samples
depends only on its logits and its own generator state, never on the batch it ran in or on what ran before.

Order of the logits processors follows Hugging Face ``generate`` (temperature, then top-k, then top-p).
Top-p keeps the smallest set of most likely tokens whose probability mass reaches ``top_p`` (Holtzman et al.
2020, "The Curious Case of Neural Text Degeneration"); the most likely token is always kept.
"""

from __future__ import annotations

import os

import torch

from engine.api import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by ``seed``, or by 8 bytes of ``os.urandom`` when ``seed`` is None."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen.manual_seed(seed)
    return gen


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest entries of a 1-D float32 ``[vocab]`` row, others set to -inf (0 = keep all)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    idx = torch.topk(logits, top_k).indices
    out = torch.full_like(logits, float("-inf"))
    out[idx] = logits[idx]
    return out


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter of a 1-D float32 ``[vocab]`` row: keep the most likely tokens whose mass reaches ``top_p``.

    A token is dropped when the mass of the tokens strictly more likely than it already reaches ``top_p``;
    the most likely token is always kept. ``top_p >= 1`` keeps everything.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from a float32 ``[vocab]`` logits row.

    Temperature 0 is greedy (argmax, the lowest id on a tie); otherwise logits are divided by the temperature,
    filtered by top-k then top-p, and one token is drawn with ``torch.multinomial`` from ``generator``.
    """
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    scaled = apply_top_k(scaled, params.top_k)
    scaled = apply_top_p(scaled, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """Sample one token per row.

    Args:
        logits: float32 ``[N, vocab]``, one row per request that needs a token this step.
        params: the N requests' sampling parameters, row order.
        generators: the N requests' own generators, row order.

    Returns:
        N token ids. Greedy rows are taken with one batched argmax (exact per row); sampled rows one at a time
        from their own generator, so no row's result depends on the others.
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"{logits.shape[0]} logits rows for {len(params)} params and {len(generators)} generators"
        )
    logits = logits.float().cpu()
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, tok in zip(greedy, ids, strict=True):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            out[i] = sample_row(logits[i], p, generators[i])
    return out
