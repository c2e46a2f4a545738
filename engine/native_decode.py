"""The native decode-attention kernel: one C function over the paged KV cache, built once per machine.

Owns building, loading and calling ``engine/kernels/paged_decode.c`` (``paged_decode_attention``): decode
attention (one query token per sequence) read in place from a layer's cache ``[2, num_blocks, block_size,
kv_heads, head_dim]`` through the block tables, fp32 arithmetic, each sequence alone with its positions in
order. Against torch's paths (``engine.decode_attention``: copy the blocks, then the flash kernel, merged by
log-sum-exp where the context is cut or shared) it reads every K and V position once, copies nothing, and
its result for a sequence depends only on that sequence: not on the batch, the thread count or a shared
prefix (batched == alone, bit for bit). Measured: docs/engine-step.md ("The native decode kernel").

Built with the system C compiler (``$CC``, else ``cc``) into ``$PREFIXGATE_KERNEL_DIR`` (default
``~/.cache/prefixgate/kernels``), named by a hash of the source, the flags and the compiler's version, written
to a temporary name and renamed (a half-written library is never loaded; ``engine.native_build``); ~1 s once
per machine, at engine start, never per request. The AVX-512 build where the CPU has it, else the AVX2 one (``build_isa``), whose scores
and values passes are written for 8-lane registers (the generic 16-lane code split in two spilled its accumulators
and was slower than torch's path); a model it serves is named apart in ``model_id``
(``engine.attention_kernels.decode_kernel_variant``; which build runs is chosen there). Two more builds serve
prompt rows only: ``amx`` (CPUs with AMX and AVX512-BF16; ``engine.prefill_kernel: amx``,
``paged_prefill_attention_amx``: a bf16 cache, head_dim 64, scores and values on AMX tiles) and ``avx512-bf16``
(CPUs with AVX512-BF16; ``engine.prefill_kernel: avx512-bf16``, ``paged_prefill_attention_bf16``: a bf16 cache,
head_dim a multiple of 32 up to 128, scores and values on ``VDPBF16PS`` with the queries and softmax numerators
rounded to bf16); the latter also decodes in that arithmetic (``NativeDecodeKernel.bf16_decoder``,
``paged_decode_attention_bf16``: ``engine.decode_kernel: avx512-bf16``, each sequence's result the bits its
prefill gives a prompt row at that position). A new build is checked against a float64 reference on random inputs
before use (``self_check``, ``engine.native_decode_check``).

Invariants: the kernel only reads the cache; an out-of-range argument (a block id outside the pool, a length
past ``max_len``, a table too short) is refused by the kernel before anything is read (``ValueError`` here).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from engine import native_build

SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
FLAGS = (*native_build.BASE_FLAGS, "-Wno-psabi")
ISA_FLAGS = {
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mfma",
        "-mprefer-vector-width=512",
        "-DPD_ROWS=16",
        "-DPD_LANES=16",
    ),
    "avx2": ("-mavx2", "-mfma", "-DPD_ROWS=32", "-DPD_LANES=8"),
}
"""Instruction-set flags of a build: ``avx512``, and ``avx2`` on CPUs without AVX-512 (the same C operations on
16-lane vectors split in two; the scores and values passes of decode written for 8-lane registers with the same
per-lane arithmetic: ``scores_tile_pairs`` / ``values_heads_pairs`` over a bf16 cache, ``scores_tile_halves`` /
``values_heads_halves`` over fp32; measured bit-identical to the generic code's AVX2 build).
``-mprefer-vector-width=512``: GCC's default tuning lowered some of the 16-lane vector code in 256-bit halves
(the same bits, 1.4x the prefill attention's time on a Zen 4: docs/engine-step.md, session 17)."""
ISA_FLAGS["amx"] = (*ISA_FLAGS["avx512"], *native_build.AMX_BF16_FLAGS, "-DPD_AMX=1")
"""The AMX build: the AVX-512 one plus ``paged_prefill_attention_amx`` (``-DPD_AMX``; prompt rows only)."""
ISA_FLAGS["avx512-bf16"] = (*ISA_FLAGS["avx512"], "-mavx512bf16", "-DPD_BF16DOT=1")
"""The AVX512-BF16 build: the AVX-512 one plus ``paged_prefill_attention_bf16`` and ``paged_decode_attention_bf16``
(``-DPD_BF16DOT``: scores and values on ``VDPBF16PS``, queries and softmax numerators rounded to bf16)."""
SPLITS = {"auto": 0, "heads": 1, "positions": 2}
"""``NativeDecodeKernel.attend``'s ways to spread a lone sequence over threads, as ``paged_decode.c`` numbers them
(``SPLIT_DEFAULT``, ``SPLIT_HEADS``, ``SPLIT_POSITIONS``)."""
ONE_SEQUENCE_SPLIT = {"AuthenticAMD": "positions"}
"""How the AVX-512 builds spread a lone decoding sequence over threads (``paged_decode.c``'s
``ONE_SEQUENCE_SPLIT``: what ``split="auto"`` and the one-call decode step take), by ``/proc/cpuinfo`` vendor;
others keep the build's own default, ``heads`` (AVX2 builds: ``positions``). A schedule only: every split gives
the same bits. Measured (docs/engine-step.md, session 29): on a Zen 4, 30 layers of 1,070 positions, 2 threads,
``positions`` 38-40 against ``heads`` 43-44 us a layer over a bf16 cache (54.5 against 58.4 over fp32); on the AMX
Xeon of session 26, ``heads`` 43-47 against ``positions`` 48-50."""
ISA_CPU_FLAGS = {
    "avx512": native_build.AVX512,
    "avx2": frozenset({"avx2", "fma"}),
    "amx": native_build.AMX_BF16,
    "avx512-bf16": native_build.AVX512 | {"avx512_bf16"},
}
LIBS: tuple[str, ...] = ()


def split_flags(isa: str) -> tuple[str, ...]:
    """The flag that sets an AVX-512 build's one-sequence split for this CPU's vendor (``-DPD_ONE_SEQUENCE_SPLIT``,
    ``ONE_SEQUENCE_SPLIT``), or none: the AVX2 build, or a vendor not listed (the build's default)."""
    from engine.weight_format import cpu_vendor

    split = None if isa == "avx2" else ONE_SEQUENCE_SPLIT.get(cpu_vendor())
    return () if split is None else (f"-DPD_ONE_SEQUENCE_SPLIT={SPLITS[split]}",)


def build_isa() -> str:
    """The instruction set the engine builds the kernel for: ``$PREFIXGATE_ATTENTION_ISA`` if set (e.g. ``avx2``
    to check the AVX2 build's arithmetic on an AVX-512 CPU), else ``avx512`` where the CPU has it, else ``avx2``
    (whose build then says what is missing, if anything).

    Raises:
        ValueError: an unknown value.
    """
    isa = os.environ.get("PREFIXGATE_ATTENTION_ISA") or ("avx512" if _cpu_ok("avx512")[0] else "avx2")
    if isa not in ISA_FLAGS:
        raise ValueError(f"PREFIXGATE_ATTENTION_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def kernel_dir() -> Path:
    """Where built kernels are kept (``engine.native_build.kernel_dir``)."""
    return native_build.kernel_dir()


def _compiler() -> str | None:
    return native_build.compiler()


def _cpu_ok(isa: str = "avx512") -> tuple[bool, str]:
    return native_build.cpu_ok(ISA_CPU_FLAGS[isa])


class NativeDecodeKernel:
    """The loaded ``paged_decode_attention`` function.

    Args:
        path: the built shared library.
        isa: the instruction set it was built for (a key of ``ISA_FLAGS``).

    Raises:
        OSError: the library cannot be loaded.
    """

    def __init__(self, path: Path, isa: str = "avx512", bf16_decode: bool = False) -> None:
        if bf16_decode and isa != "avx512-bf16":
            raise ValueError(f"bf16 decode attention is the avx512-bf16 build's, not the {isa} build's")
        self.path = path
        self.isa = isa
        self.bf16_decode = bf16_decode
        """Whether ``attend`` runs ``paged_decode_attention_bf16`` (``VDPBF16PS``: each sequence's result is the
        AVX512-BF16 prefill's for a row at its last position) rather than the fp32 decode arithmetic."""
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_decode_attention_bf16 if bf16_decode else lib.paged_decode_attention
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [
            p,
            i32,
            p,
            i32,
            p,
            i64,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            p,
            p,
            i64,
            i64,
        ]
        fn.restype = ctypes.c_int
        # the same with a lone sequence spread over threads (the last arguments: threads, split), for attend's
        # `threads` and engine.native_step's one-sequence steps
        self._threads_fn = (
            lib.paged_decode_attention_bf16_threads if bf16_decode else lib.paged_decode_attention_threads
        )
        self._threads_fn.argtypes = [*fn.argtypes, ctypes.c_int, ctypes.c_int]
        self._threads_fn.restype = ctypes.c_int
        amx = isa == "amx"  # the AMX build's prefill (paged_prefill_attention_amx: bf16 cache, head_dim 64)
        if amx:
            from engine.amx_gemm import request_amx_permission

            request_amx_permission()
        bf16 = isa == "avx512-bf16"  # paged_prefill_attention_bf16: bf16 cache, head_dim % 32 == 0, <= 128
        pf = (
            lib.paged_prefill_attention_amx
            if amx
            else lib.paged_prefill_attention_bf16
            if bf16
            else lib.paged_prefill_attention
        )
        pf.argtypes = [
            p,
            i32,
            p,
            i32,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            p,
            p,
            i64,
            i32,
        ]
        pf.restype = ctypes.c_int
        size = (
            lib.paged_prefill_amx_scratch_floats
            if amx
            else lib.paged_prefill_bf16_scratch_floats
            if bf16
            else lib.paged_prefill_scratch_floats
        )
        size.argtypes = [i64] * 6
        size.restype = i64
        self._lib = lib
        self._fn = fn
        self._prefill = pf
        self._prefill_size = size

    @classmethod
    def build(
        cls,
        directory: Path | None = None,
        group: int | None = None,
        head_dim: int | None = None,
        isa: str | None = None,
    ) -> NativeDecodeKernel:
        """Build (or find already built) and load the kernel for this machine.

        ``group`` (query heads per KV head) and ``head_dim``: the model's shape, compiled with constants so its
        accumulators stay in registers (``-DPD_GROUP -DPD_HEAD_DIM``; one shape keeps the build at ~1-2 s);
        other shapes run the same code with runtime sizes. ``isa``: ``ISA_FLAGS``' key (default ``build_isa()``).

        Raises:
            NativeKernelError: not an x86-64 CPU with AVX-512 (F, BW, VL) and FMA (or ``isa``'s flags), no C
                compiler, the compile failed, or the build fails its ``self_check``; the message says which.
            ValueError: an unknown ``isa``.
        """
        isa = build_isa() if isa is None else isa
        if isa not in ISA_FLAGS:
            raise ValueError(f"isa must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
        shape = (
            () if group is None or head_dim is None else (f"-DPD_GROUP={group}", f"-DPD_HEAD_DIM={head_dim}")
        )
        return native_build.build_checked(
            lambda path: cls(path, isa),
            SOURCE,
            _cpu_ok() if isa == "avx512" else _cpu_ok(isa),
            _compiler(),
            (*FLAGS, *ISA_FLAGS[isa], *split_flags(isa), *shape),
            LIBS,
            directory,
        )

    def bf16_decoder(self) -> NativeDecodeKernel:
        """This AVX512-BF16 build's library with ``attend`` on ``paged_decode_attention_bf16`` (``bf16_decode``):
        decode attention in the arithmetic of this build's prefill, so a position's K/V and output are the same
        bits whether it came as a prompt row or a generated one (``engine.decode_kernel: avx512-bf16``).

        Raises:
            ValueError: not the ``avx512-bf16`` build.
        """
        return type(self)(self.path, self.isa, bf16_decode=True)

    def attend(
        self,
        q: torch.Tensor,
        layer_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        scale: float,
        scratch: torch.Tensor | None = None,
        shared_len: int = 0,
        threads: int = 1,
        split: str = "auto",
    ) -> torch.Tensor:
        """Decode attention of ``B`` sequences, one query token each.

        Args:
            q: ``[B, H, D]`` fp32 or bf16 queries (RoPE applied), contiguous.
            layer_cache: ``[2, num_blocks, block_size, kv_heads, D]`` fp32 or bf16, contiguous (K = 0, V = 1).
            tables: int32 ``[B, max_blocks]`` block tables, contiguous.
            lens: int32 ``[B]`` context lengths (positions attended, the new token's included), each in
                ``[1, max_len]``.
            max_len: bound on ``lens`` (sizes the scratch).
            scale: softmax scale (``D ** -0.5``).
            scratch: fp32 of at least ``scratch_size(...)`` elements, reused across layers (allocated if None).
            shared_len: leading positions whose blocks every sequence shares (one cached system prompt, many
                users), a multiple of 16 within every length: walked 16 positions at a time across all the
                sequences, so those blocks come from memory once per step, not once per sequence; 0: each
                sequence alone (``engine.shared_prefix_attention: false``, for comparison). The result is the
                same bits either way.
            threads: OpenMP threads for a lone sequence (``B == 1``), each number computed as on one thread
                (the same bits for any count; ``engine/kernels/decode_step.c`` calls it so for one-sequence
                steps). Ignored for ``B > 1`` (the caller spreads sequences).
            split: how a lone sequence is spread (``SPLITS``): ``positions`` (scores by position tiles, softmax
                by query heads, values by (KV head, half of ``D``), barriers between), ``heads`` (whole KV heads
                per thread), ``auto`` the build's choice (positions on AVX2 and, by ``ONE_SEQUENCE_SPLIT``, on
                AMD CPUs' AVX-512 builds; heads on other AVX-512 builds: where each was measured faster).

        Returns:
            fp32 ``[B, H, D]``.

        Raises:
            ValueError: a dtype, layout or device the kernel does not take, or an argument out of range
                (a length outside ``[1, max_len]``, a block id outside the pool, a table too short, ``shared_len``
                not a multiple of 16 or past a length, ``threads < 1``, an unknown ``split``).
        """
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        b, h, d = q.shape
        two, num_blocks, block_size, kvh, hd = layer_cache.shape
        if two != 2 or hd != d or h % kvh:
            raise ValueError(f"q {tuple(q.shape)} does not match a cache of shape {tuple(layer_cache.shape)}")
        for name, t, dtypes in (
            ("q", q, (torch.float32, torch.bfloat16)),
            ("layer_cache", layer_cache, (torch.float32, torch.bfloat16)),
            ("tables", tables, (torch.int32,)),
            ("lens", lens, (torch.int32,)),
        ):
            if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"{name}: needs a contiguous CPU tensor of {dtypes}, got {t.dtype} on {t.device}"
                )
        if tables.dim() != 2 or tables.shape[0] != b or lens.shape != (b,):
            raise ValueError(
                f"tables {tuple(tables.shape)} / lens {tuple(lens.shape)} do not match {b} sequences"
            )
        if self.bf16_decode and not bf16_prefill_fits(layer_cache.dtype, d, h // kvh):
            raise ValueError(
                "bf16 decode attention takes a bf16 cache, head_dim a multiple of 32 up to 128 and at most "
                f"{MAX_GROUP} query heads per KV head, got {layer_cache.dtype}, {d} and {h // kvh}"
            )
        need = scratch_size(b, h, d, max_len)
        if scratch is None:
            scratch = torch.empty(need, dtype=torch.float32)
        elif scratch.dtype != torch.float32 or scratch.numel() < need or not scratch.is_contiguous():
            raise ValueError(f"scratch: needs {need} contiguous fp32 elements")
        out = torch.empty(b, h, d, dtype=torch.float32)
        rc = self._threads_fn(
            q.data_ptr(),
            int(q.dtype == torch.bfloat16),
            layer_cache.data_ptr(),
            int(layer_cache.dtype == torch.bfloat16),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            b,
            h,
            kvh,
            d,
            block_size,
            num_blocks,
            scale,
            out.data_ptr(),
            scratch.data_ptr(),
            max_len,
            shared_len,
            threads,
            SPLITS[split],
        )
        if rc != 0:
            raise ValueError(
                f"paged_decode_attention refused its arguments: lens {lens.tolist()} (max_len {max_len}), "
                f"block ids outside [0, {num_blocks}) or tables of {tables.shape[1]} blocks too short"
            )
        return out

    def prefill_scratch_size(
        self, rows: int, heads: int, kv_heads: int, head_dim: int, seq_len: int, threads: int
    ) -> int:
        """fp32 elements of ``prefill``'s scratch: the widened queries, each position's cache offset, and per
        thread a row tile's scores and softmax sums; -1 for a shape the kernel does not take."""
        return int(self._prefill_size(rows, heads, kv_heads, head_dim, seq_len, threads))

    def prefill(
        self,
        q: torch.Tensor,
        layer_cache: torch.Tensor,
        table: torch.Tensor,
        start: int,
        scale: float,
        scratch: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``L`` consecutive query rows of one sequence (a prefill chunk), read in place from
        the cache through its block table: row ``r`` (position ``start + r``) attends positions ``0 .. start + r``
        with exactly the arithmetic ``attend`` gives one query at that position (bit for bit: the same per-row
        operation sequence, whatever row tile, chunk or thread computes it; ``engine/kernels/paged_decode.c``).
        The AMX build (``isa == "amx"``; a bf16 cache, head_dim 64) computes scores and values on AMX tiles
        instead (``paged_prefill_attention_amx``): not ``attend``'s bits, but still one fixed per-row operation
        sequence, so a row's result does not depend on the row tile, chunk, offset or thread count either. So does
        the AVX512-BF16 build (``isa == "avx512-bf16"``; a bf16 cache, head_dim a multiple of 32 up to 128,
        ``paged_prefill_attention_bf16``): queries and softmax numerators rounded to bf16, products summed by
        ``VDPBF16PS``.

        Args:
            q: ``[L, H, D]`` fp32 or bf16 queries (RoPE applied), contiguous.
            layer_cache: ``[2, num_blocks, block_size, kv_heads, D]`` fp32 or bf16, contiguous, already holding the
                K/V of positions ``0 .. start + L - 1``.
            table: int32 ``[n]`` the sequence's block ids, covering positions ``0 .. start + L - 1``, contiguous.
            start: position of the first row (the cached context before the chunk), ``>= 0``.
            scale: softmax scale (``D ** -0.5``).
            scratch: fp32 of at least ``prefill_scratch_size(...)`` elements, reused across layers (allocated if
                None).
            threads: OpenMP threads (default ``torch.get_num_threads()``); the result does not depend on it.

        Returns:
            fp32 ``[L, H, D]``.

        Raises:
            ValueError: a dtype, layout or device the kernel does not take, or an argument out of range (``start``
                negative, a block id outside the pool, a table too short, a scratch too small).
        """
        rows, h, d = q.shape
        two, num_blocks, block_size, kvh, hd = layer_cache.shape
        if two != 2 or hd != d or h % kvh or rows == 0:
            raise ValueError(f"q {tuple(q.shape)} does not match a cache of shape {tuple(layer_cache.shape)}")
        for name, t, dtypes in (
            ("q", q, (torch.float32, torch.bfloat16)),
            ("layer_cache", layer_cache, (torch.float32, torch.bfloat16)),
            ("table", table, (torch.int32,)),
        ):
            if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"{name}: needs a contiguous CPU tensor of {dtypes}, got {t.dtype} on {t.device}"
                )
        if table.dim() != 1:
            raise ValueError(f"table: needs one dimension, got shape {tuple(table.shape)}")
        threads = torch.get_num_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if self.isa == "amx" and (layer_cache.dtype != torch.bfloat16 or d != AMX_HEAD_DIM):
            raise ValueError(
                f"the AMX build's prefill takes a bf16 cache and head_dim {AMX_HEAD_DIM}, got {layer_cache.dtype} and {d}"
            )
        if self.isa == "avx512-bf16" and not bf16_prefill_fits(layer_cache.dtype, d, h // kvh):
            raise ValueError(
                "the AVX512-BF16 build's prefill takes a bf16 cache, head_dim a multiple of 32 up to 128 and at "
                f"most {MAX_GROUP} query heads per KV head, got {layer_cache.dtype}, {d} and {h // kvh}"
            )
        need = self.prefill_scratch_size(rows, h, kvh, d, start + rows, threads)
        if need < 0:
            raise ValueError(
                f"paged_prefill_attention does not take {h} heads over {kvh} KV heads of size {d}"
            )
        if scratch is None:
            scratch = torch.empty(need, dtype=torch.float32)
        elif scratch.dtype != torch.float32 or scratch.numel() < need or not scratch.is_contiguous():
            raise ValueError(f"scratch: needs {need} contiguous fp32 elements")
        out = torch.empty(rows, h, d, dtype=torch.float32)
        rc = self._prefill(
            q.data_ptr(),
            int(q.dtype == torch.bfloat16),
            layer_cache.data_ptr(),
            int(layer_cache.dtype == torch.bfloat16),
            table.data_ptr(),
            table.shape[0],
            start,
            rows,
            h,
            kvh,
            d,
            block_size,
            num_blocks,
            scale,
            out.data_ptr(),
            scratch.data_ptr(),
            scratch.numel(),
            threads,
        )
        if rc != 0:
            raise ValueError(
                f"paged_prefill_attention refused its arguments: positions {start}..{start + rows - 1}, "
                f"block ids outside [0, {num_blocks}) or a table of {table.shape[0]} blocks too short"
            )
        return out

    def self_check(self) -> str | None:
        """Compare the kernel with float64 attention on random caches (``engine.native_decode_check``); None when
        it agrees, else what differed."""
        from engine.native_decode_check import check_kernel

        return check_kernel(self)


def scratch_size(num_seqs: int, num_heads: int, head_dim: int, max_len: int) -> int:
    """fp32 elements of the kernel's scratch for ``num_seqs`` sequences, per sequence ``num_heads * (2 * (max_len +
    31) + head_dim + 1)`` (``paged_decode.c``'s ``PD_SEQ_FLOATS``; ``decode_step.c`` gives each sequence of a run
    that much): the bf16 decode's scores (``max_len`` rounded up to 32), bf16 numerators, query pairs and sums;
    the fp32 decode uses ``max_len + head_dim + 1`` of it (scores, widened query, sums)."""
    return num_seqs * num_heads * (2 * (max_len + 31) + head_dim + 1)


def reference_decode(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 decode attention (the kernel's specification; tests and ``self_check``): ``q`` ``[B, H, D]``,
    ``cache`` ``[2, num_blocks, block_size, kv_heads, D]``, int ``tables`` ``[B, n]``, ``lens`` ``[B]`` ->
    float64 ``[B, H, D]``."""
    b, h, d = q.shape
    kvh = cache.shape[3]
    out = []
    for i in range(b):
        n = int(lens[i])
        kv = cache[:, tables[i].long()].reshape(2, -1, kvh, d)[:, :n].double()  # [2, n, kvh, d]
        qi = q[i].double().view(kvh, h // kvh, d)
        s = torch.einsum("hgd,lhd->hgl", qi, kv[0]) * scale
        out.append(torch.einsum("hgl,lhd->hgd", s.softmax(-1), kv[1]).reshape(h, d))
    return torch.stack(out)


def _build(group: int | None, head_dim: int | None, isa: str = "avx512") -> NativeDecodeKernel:
    return NativeDecodeKernel.build(group=group, head_dim=head_dim, isa=isa)


_shared_kernel = native_build.shared_build(_build)


AMX_HEAD_DIM = 64
"""The one head size the AMX build's prefill takes (``paged_decode.c``'s ``AMX_D``)."""
MAX_GROUP = 8
"""Query heads per KV head the vector paths take (``paged_decode.c``'s ``MAX_GROUP``)."""
BF16_PREFILL_TOLERANCE = 2e-2
"""``self_check``'s bound on the AVX512-BF16 prefill's error relative to float64 attention (the largest output):
queries and numerators rounded to bf16 (a relative error up to 2^-9 each) over unit-variance random inputs."""


def bf16_prefill_fits(kv_dtype: torch.dtype, head_dim: int | None, group: int | None) -> bool:
    """Whether the AVX512-BF16 build's prefill takes a cache of ``kv_dtype`` and this shape: bf16, ``head_dim`` a
    multiple of 32 up to 128, at most ``MAX_GROUP`` query heads per KV head (``paged_prefill_attention_bf16``)."""
    return (
        kv_dtype == torch.bfloat16
        and head_dim is not None
        and head_dim % 32 == 0
        and 0 < head_dim <= 128
        and (group is None or 0 < group <= MAX_GROUP)
    )
