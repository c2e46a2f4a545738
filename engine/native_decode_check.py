"""The native decode-attention kernel's self-check (``NativeDecodeKernel.self_check``): each build against float64
attention on random caches, and the bit-for-bit claims each build makes (a lone sequence's threads; the AMX and
AVX512-BF16 prefills' chunks; the bf16 decode equal to the AVX512-BF16 prefill's rows).

Invariant: every check runs on inputs it makes itself and returns None, or a line saying what differed.
"""

from __future__ import annotations

import torch

from engine.native_decode import (
    AMX_HEAD_DIM,
    BF16_PREFILL_TOLERANCE,
    NativeDecodeKernel,
    reference_decode,
)


def check_kernel(kernel: NativeDecodeKernel) -> str | None:
    """Compare the kernel with float64 attention on random caches (bf16 and fp32, shapes on and off the
    vector path, ragged lengths, scattered blocks), and a lone sequence on 2 threads (both splits) with one
    thread; None when every output is within 1e-4 relative and the threads give one thread's bits, else
    what differed."""
    gen = torch.Generator().manual_seed(0)
    for group, d, kvh, dtype in (
        (3, 64, 3, torch.bfloat16),
        (2, 128, 2, torch.float32),
        (3, 24, 1, torch.float32),
    ):
        h, bs, nb = group * kvh, 16, 16
        cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(dtype)
        lens = torch.tensor([37, 1, 80], dtype=torch.int32)
        tables = torch.randperm(nb, generator=gen)[:15].view(3, 5).to(torch.int32).contiguous()
        q = torch.randn(3, h, d, generator=gen)
        got = kernel.attend(q, cache, tables, lens, 80, d**-0.5)
        want = reference_decode(q, cache, tables, lens, d**-0.5)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        if not err <= 1e-4:
            return f"group {group}, head_dim {d}, {dtype}: relative error {err:.2e}"
        # a lone sequence spread over threads: one thread's bits, either split
        one = kernel.attend(q[2:3], cache, tables[2:3], lens[2:3], 80, d**-0.5)
        for split in ("heads", "positions"):
            two = kernel.attend(q[2:3], cache, tables[2:3], lens[2:3], 80, d**-0.5, threads=2, split=split)
            if not torch.equal(two, one):
                return f"group {group}, head_dim {d}, {dtype}: a lone sequence on 2 threads ({split}) differs"
    if kernel.isa == "amx":
        return check_pair_prefill(kernel, gen, "AMX", 2e-4)
    if kernel.isa == "avx512-bf16":
        return check_pair_prefill(kernel, gen, "AVX512-BF16", BF16_PREFILL_TOLERANCE) or check_bf16_decode(
            kernel, gen
        )
    return None


def check_bf16_decode(kernel: NativeDecodeKernel, gen: torch.Generator) -> str | None:
    """The bf16 decode (``bf16_decoder``) against this build's prefill: each sequence's output equal, bit for
    bit, to the prefill's row at its last position, batched with a shared prefix (or without) and alone on 1
    or 2 threads."""
    dec = kernel.bf16_decoder()
    group, kvh, d, n = 3, 2, AMX_HEAD_DIM, 70
    cache = torch.randn(2, 16, 16, kvh, d, generator=gen).to(torch.bfloat16)
    shared = torch.randperm(16, generator=gen)[:2].to(torch.int32)
    rest = [b for b in range(16) if b not in shared.tolist()]
    q = torch.randn(n, group * kvh, d, generator=gen)
    lens = [33, 48, 57, 70]
    tables = torch.stack(
        [torch.cat([shared, torch.tensor(rest[3 * i : 3 * i + 3], dtype=torch.int32)]) for i in range(4)]
    )
    want = torch.stack(
        [kernel.prefill(q[: lens[i]], cache, tables[i], 0, d**-0.5, threads=1)[-1] for i in range(4)]
    )
    qs = torch.stack([q[lens[i] - 1] for i in range(4)])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    for shared_len in (0, 32):
        if not torch.equal(dec.attend(qs, cache, tables, lens_t, n, d**-0.5, shared_len=shared_len), want):
            return f"bf16 decode (shared_len {shared_len}) differs from the AVX512-BF16 prefill's last rows"
    for threads in (1, 2):
        one = dec.attend(qs[3:], cache, tables[3:], lens_t[3:], n, d**-0.5, threads=threads)
        if not torch.equal(one[0], want[3]):
            return f"bf16 decode of a lone sequence on {threads} threads differs from the prefill's row"
    return None


def check_pair_prefill(
    kernel: NativeDecodeKernel, gen: torch.Generator, name: str, tolerance: float
) -> str | None:
    """The AMX or AVX512-BF16 build's prefill against float64 attention (within ``tolerance`` relative: AMX
    keeps ~16 bits of queries and numerators, AVX512-BF16 8), and a chunk of it (on another thread count)
    equal to the same rows of the whole."""
    group, kvh, d, n = 3, 2, AMX_HEAD_DIM, 90
    cache = torch.randn(2, 8, 16, kvh, d, generator=gen).to(torch.bfloat16)
    table = torch.randperm(8, generator=gen)[:6].to(torch.int32)
    q = torch.randn(n, group * kvh, d, generator=gen)
    got = kernel.prefill(q, cache, table, 0, d**-0.5, threads=1)
    lens = torch.arange(1, n + 1, dtype=torch.int32)
    want = reference_decode(q, cache, table.repeat(n, 1), lens, d**-0.5)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    if not err <= tolerance:
        return f"{name} prefill: relative error {err:.2e}"
    part = kernel.prefill(q[37:].contiguous(), cache, table, 37, d**-0.5, threads=2)
    if not torch.equal(part, got[37:]):
        return f"{name} prefill: rows 37.. as a chunk on 2 threads differ from the whole prompt's"
    return None
