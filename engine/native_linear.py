"""The native quantized linear kernel: ``y = x @ W.T`` on the GGUF's own 4-bit and 8-bit codes, fp32 throughout.

Owns building, loading and calling ``engine/kernels/quant_gemv.c`` (``q4_gemv``, ``q8_gemv``) and the weight
layout it reads (``pack_int4`` / ``pack_int8``): tiles of 16 output rows, one 320-byte (int4) or 544-byte
(int8) block per tile and group of 32 inputs, holding the 16 rows' f16 scales (the GGUF's ``d`` and, for int4,
``m``: exact) and their codes interleaved so each vector lane owns one output row. Activations stay fp32,
scales are exact, every product and sum is fp32, the output is fp32: the kernel computes the same function as
an fp32 matmul on the dequantized weight, up to fp32 summation order (a few ulp), where torch's int4 kernel
(``engine.linear.Int4Weight``) rounds activations, scales and outputs to bf16 (``docs/engine-step.md``, "The
native linear kernel").

It reads 4 (8) bits per weight plus 4 (2) bytes of scales per 32 weights, like the GGUF. Rows of the input are
taken 4 at a time per tile (one decode of the codes serves 4 rows; AVX2: 2 rows per half tile, and from 16 rows
the panel path, each half tile's codes widened once into floats that every row runs against, 6 rows at a time:
prompt rows where there is no dense copy, ``engine.weight_format.auto_dense_min_rows``); output tiles are split
over ``kernel_threads()`` threads (OpenMP, the runtime torch itself loaded: the engine's ``num_threads`` in every
step, ``set_kernel_threads``). Each output element is computed by one fixed sequence of fp32 operations, so row ``i`` of an ``M``-row call is bit-identical to the 1-row call
of that row whatever ``M``, the other rows and the thread count (batch invariance).

``engine.linear_kernel: int8-activations`` (``Int8ActivationKernel``; what ``auto`` picks where it builds) runs
the same packed weights with each row's activations cut into two int8 planes per group of 32 and integer dot
products (``q4_gemv_i8`` / ``q8_gemv_i8``: a third build, AVX-512 with VNNI and VBMI; on other AVX2 CPUs the AVX2
build's ``q4_gemv_i8``, the same bits by other instructions, with a panel path for prompt-sized calls, int8
weights keeping fp32 activations there; docs/engine-step.md, "The AVX2 int8 kernel on many rows"): ~15 bits of
each input kept (llama.cpp keeps one plane, 8 bits), top-1 agreement with the fp32 reference 2,000 / 2,000 on SmolLM2, a decode
step of 8 streams ~12 % faster on AVX-512 and ~1.3x on an AVX2 Zen 3, one stream ~1.2x there
(docs/engine-step.md, "int8 activations"; "int8 activations on AVX2"). ``native`` names the fp32 kernel.

Two builds: AVX-512 (F/BW/VL) and AVX2, each with F16C and FMA; ``select_isa`` takes the best the CPU has.
Both compute every output with the same sequence of fp32 operations per lane (``quant_gemv.c``), yet a model
served by the AVX2 build is named apart (``isa``, in ``model_id``: ``engine.checkpoint``), since that equality
was checked by construction, not on one machine running both.

Measured (SmolLM2-135M, one decode step, thread CPU time; ``bench.decode_compile --breakdown
--linear-kernel``): see the tables in ``docs/engine-step.md``. ``engine.linear_kernel: auto`` uses the int8
activation kernel where its build is the CPU's best (AVX-512 with VNNI and VBMI; AVX2 on CPUs without AVX-512),
else this kernel wherever it builds (x86-64 with AVX-512 F/BW/VL or AVX2, F16C and FMA, and a C compiler), else
torch's int4 kernel.

Built like ``engine.native_decode`` (``engine.native_build``: once per machine, cached by hash, temp name
renamed into place, checked against a float64 reference before use; no ``-ffast-math``).

Invariants: the kernel only reads its inputs; an argument it cannot take (shape, dtype, alignment, an
in_features that is not a multiple of 32) is refused before anything runs (``ValueError``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import native_build
from engine.api import LINEAR_KERNELS
from engine.native_build import NativeKernelError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "quant_gemv.c"
FLAGS = (
    *native_build.BASE_FLAGS,
    "-ffp-contract=off",
    "-mf16c",
    "-mfma",
    "-Wno-psabi",
)
"""Flags of every build; ``ISA_FLAGS`` adds the instruction set's."""
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl"), "avx2": ("-mavx2",)}
"""The builds, best first: the AVX-512 one (a tile in one 512-bit vector) and the AVX2 one (two 8-lane halves)."""
ISA_REQUIRED = {
    "avx512": native_build.AVX512 | {"f16c"},
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
"""CPU flags each build needs (``engine.weight_format.cpu_flags`` names)."""
INT8_ACTIVATION_FLAGS = {
    "avx512": (*ISA_FLAGS["avx512"], "-mavx512vnni", "-mavx512vbmi"),
    "avx2": ISA_FLAGS["avx2"],
}
"""The int8-activation builds (``Int8ActivationKernel``), best first: the AVX-512 build's flags plus VNNI
(``vpdpbusd``) and VBMI (``vpermb``); the AVX2 build (the fp32 kernel's own library: ``vpmaddubsw`` sums, the
same bits; int4 weights only)."""
INT8_ACTIVATION_REQUIRED = {
    "avx512": ISA_REQUIRED["avx512"] | {"avx512_vnni", "avx512vbmi"},
    "avx2": ISA_REQUIRED["avx2"],
}
"""CPU flags each int8-activation build needs."""
PREFETCH_LOCALITY = {"AuthenticAMD": 0}
"""The weight stream's software prefetch (``quant_gemv.c`` ``GEMV_PREFETCH_LOCALITY``: ``__builtin_prefetch``'s
locality, 0 ``prefetchnta`` .. 3 ``prefetcht0``) by ``/proc/cpuinfo`` vendor; others take
``DEFAULT_PREFETCH_LOCALITY``. Measured (docs/engine-step.md, "The weight stream's prefetch hint"): on a Zen 4,
``prefetchnta`` 8 KB ahead read a one-row GEMV ~1.12x faster than no prefetch (session 18), and a decode step's
GEMVs 1.01-1.04x faster than the other three localities at 1 and 8 rows (session 29); on an AMX Xeon the
same ``prefetchnta`` made the GEMVs 2-4x slower than ``prefetcht1`` (the weights then stream from L3), and
slower than no prefetch at all."""
DEFAULT_PREFETCH_LOCALITY = 2
"""``prefetcht1`` (into L2): the locality of every vendor not in ``PREFETCH_LOCALITY``."""
TINY_GROUP = 1e-30
"""A group of activations whose largest ``|x|`` is below this quantizes to zeros (``127 / amax`` would overflow fp32
for subnormal maxima); what it drops is below ``1e-30`` per input."""
LIBS: tuple[str, ...] = ()
TILE = 16  # output rows per tile (one 512-bit vector of fp32)
QK = 32  # inputs per group
BLOCK = {4: 320, 8: 544}  # bytes per tile and group: int4 32 f16 scales + 256 code bytes; int8 16 + 512
_ALIGN = 64


_calling_thread = threading.local()


def set_kernel_threads(n: int | None) -> None:
    """Set the OpenMP thread count of this kernel's calls made by the calling thread without ``threads``:
    ``n`` (>= 1), or None for torch's live count (``torch.get_num_threads()``, the default).

    ``engine.model_runner.ModelRunner.execute`` sets the engine's ``num_threads`` before each step, so a
    one-thread small step (``engine.step_threads``) still splits its weight GEMVs over every core: those are
    the step's memory-bound work (one decode step reads every weight once), while its ~1,000 small torch ops
    run faster without a fork and join each (docs/engine-step.md, "Weight kernels on every thread"). Outputs
    do not depend on the count.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n is not None and n < 1:
        raise ValueError(f"kernel threads must be >= 1, got {n}")
    _calling_thread.threads = n


def kernel_threads() -> int:
    """The count a call without ``threads`` runs with in the calling thread (``set_kernel_threads``)."""
    n = getattr(_calling_thread, "threads", None)
    return torch.get_num_threads() if n is None else n


@dataclass(frozen=True)
class PackedQuant:
    """A quantized ``[out_features, in_features]`` weight in the kernel's tiles (``pack_int4`` / ``pack_int8``).

    Attributes:
        bits: 4 (Q4_0 / Q4_1 codes) or 8 (Q8_0).
        data: uint8 ``[tiles * groups * BLOCK[bits]]``, 64-byte aligned (a view into ``storage``).
        storage: the allocation ``data`` lies in (kept alive with it).
        out_features, in_features: the logical shape (``in_features % 32 == 0``).
    """

    bits: int
    data: torch.Tensor
    storage: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes one call reads (codes and scales, padding rows of the last tile included)."""
        return self.data.numel()


def _aligned(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    off = (-storage.data_ptr()) % _ALIGN
    return storage[off : off + nbytes], storage


def _f16_exact(t: torch.Tensor, what: str) -> torch.Tensor:
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t):
        raise ValueError(f"{what} are not all f16 values (the native kernel stores the GGUF's f16 scales)")
    return h


def _tiles(t: torch.Tensor, fill: int | float) -> torch.Tensor:
    """``[N, ...]`` -> ``[T, 16, ...]``, the last tile padded with ``fill``."""
    n = t.shape[0]
    pad = -n % TILE
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.view(-1, TILE, *t.shape[1:])


def _pack(bits: int, n: int, k: int, scales: list[torch.Tensor], codes: torch.Tensor) -> PackedQuant:
    """Blocks ``[T, G, BLOCK]`` from f16 ``scales`` (each ``[T, 16, G]``) and code bytes ``[T, G, C]``."""
    t, g = codes.shape[0], codes.shape[1]
    parts = [s.permute(0, 2, 1).contiguous().view(torch.uint8).view(t, g, 2 * TILE) for s in scales]
    blocks = torch.cat([*parts, codes], dim=2)
    if blocks.shape[2] != BLOCK[bits]:
        raise AssertionError(f"block of {blocks.shape[2]} bytes, expected {BLOCK[bits]}")
    data, storage = _aligned(blocks.numel())
    data.copy_(blocks.reshape(-1))
    return PackedQuant(bits, data, storage, n, k)


def pack_int4(groups) -> PackedQuant:
    """The kernel's tiles of ``engine.quantized.Int4Groups`` (``w = (q - 8) * scale + zero``).

    Stores ``d = scale`` and ``m = zero - 8 * scale`` in f16 (the GGUF's own Q4_0 / Q4_1 values); the kernel
    recomputes ``zero = m + 8 d`` in fp32, exactly (checked here).

    Raises:
        ValueError: ``in_features % 32 != 0``, or scales / zeros that are not such f16 pairs (not from a GGUF
            Q4 block: the caller keeps torch's kernel).
    """
    q, scale, zero = groups.q, groups.scale.float(), groups.zero.float()
    n, k = q.shape
    if k % QK or scale.shape != (n, k // QK) or zero.shape != scale.shape:
        raise ValueError(
            f"int4 codes {tuple(q.shape)} / scales {tuple(scale.shape)}: need [N, K], K % 32 == 0"
        )
    m = zero - 8 * scale
    d16, m16 = _f16_exact(scale, "int4 scales"), _f16_exact(m, "int4 zeros - 8 * scale")
    if not torch.equal(m16.double() + 8 * d16.double(), zero.double()):
        raise ValueError("int4 zeros are not m + 8 d exactly (the native kernel recomputes them so)")
    codes = _tiles(q.to(torch.uint8), 8).view(-1, TILE, k // QK, QK)  # [T, 16, G, 32]
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).permute(0, 2, 3, 1)  # [T, G, 16 i, 16 rows]
    t, g = packed.shape[0], packed.shape[1]
    return _pack(4, n, k, [_tiles(d16, 0.0), _tiles(m16, 0.0)], packed.reshape(t, g, 256))


def pack_int8(groups) -> PackedQuant:
    """The kernel's tiles of ``engine.quantized.Int8Groups`` (``w = q * scale``, Q8_0).

    Raises:
        ValueError: ``in_features % 32 != 0`` or scales that are not f16 values.
    """
    q, scale = groups.q, groups.scale.float()
    n, k = q.shape
    if k % QK or scale.shape != (n, k // QK) or q.dtype != torch.int8:
        raise ValueError(
            f"int8 codes {tuple(q.shape)} {q.dtype} / scales {tuple(scale.shape)}: need int8 [N, K]"
        )
    d16 = _f16_exact(scale, "int8 scales")
    codes = _tiles(q, 0).view(torch.uint8).view(-1, TILE, k // QK, QK).permute(0, 2, 3, 1)  # [T, G, 32 i, 16]
    t, g = codes.shape[0], codes.shape[1]
    return _pack(8, n, k, [_tiles(d16, 0.0)], codes.reshape(t, g, 512))


class NativeLinearKernel:
    """The loaded ``q4_gemv`` / ``q8_gemv`` functions.

    Args:
        path: the built shared library.
        isa: the instruction set it was built for (a key of ``ISA_FLAGS``).

    Raises:
        OSError: the library cannot be loaded.
    """

    activations = "float32"
    """What the kernel computes with: fp32 activations (``Int8ActivationKernel``: int8)."""
    _names = ((4, "q4_gemv"), (8, "q8_gemv"))

    def __init__(self, path: Path, isa: str = "avx512") -> None:
        self.path = path
        self.isa = isa
        lib = ctypes.CDLL(str(path))
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._fns, self._fp32_fns = {}, {}
        for fns, names in ((self._fns, self._names), (self._fp32_fns, NativeLinearKernel._names)):
            for bits, name in names:
                fn = getattr(lib, name)
                fn.argtypes = [p, i64, i64, p, i64, p, i32]
                fn.restype = ctypes.c_int
                fns[bits] = fn
        self._lib = lib

    @classmethod
    def build(
        cls, directory: Path | None = None, isa: str | None = None, prefetch_locality: int | None = None
    ) -> NativeLinearKernel:
        """Build (or find already built) and load the kernel for this machine: the ``isa`` build (a key of
        ``ISA_FLAGS``), by default the best this CPU runs (``select_isa``), with the weight stream's prefetch at
        ``prefetch_locality`` (default this CPU's: ``prefetch_flags``).

        Raises:
            NativeKernelError: not an x86-64 CPU with AVX-512 (F, BW, VL) or AVX2, and F16C and FMA; an unknown
                ``isa``; a locality not in 0-3; no C compiler, the compile failed, or the build fails its
                ``self_check``; the message says which.
        """
        isa = select_isa() if isa is None else isa
        if isa not in ISA_FLAGS:
            raise NativeKernelError(f"no {isa!r} build of the linear kernel (builds: {', '.join(ISA_FLAGS)})")
        return native_build.build_checked(
            lambda path: cls(path, isa),
            SOURCE,
            native_build.cpu_ok(ISA_REQUIRED[isa]),
            native_build.compiler(),
            (*FLAGS, *ISA_FLAGS[isa], *prefetch_flags(prefetch_locality)),
            LIBS,
            directory,
        )

    def mm(
        self, w: PackedQuant, x: torch.Tensor, threads: int | None = None, fp32: bool = False
    ) -> torch.Tensor:
        """``x @ W.T``: ``x`` fp32 ``[M, in_features]`` (M >= 1; other float dtypes are widened to fp32) ->
        fp32 ``[M, out_features]``, output tiles split over ``threads`` (default ``kernel_threads()``: the
        calling thread's ``set_kernel_threads`` count, else torch's live count). ``fp32``: with fp32 activations
        whatever ``activations`` is (the library holds both; exact dequantization, ``Int4Weight.dequantize``).

        Raises:
            ValueError: ``x`` not 2-D ``[M, in_features]`` on CPU, ``M == 0``, or ``threads < 1``.
            MemoryError: the kernel could not allocate its scratch (group sums or int8 planes; on AVX2 the panel
                paths' panels, and from 16 rows the fp32 one's packed rows, ~4 bytes per input element); nothing
                was written.
        """
        if x.dim() != 2 or x.shape[1] != w.in_features or x.shape[0] < 1 or x.device.type != "cpu":
            raise ValueError(
                f"x {tuple(x.shape)} on {x.device}: the native kernel takes [M >= 1, {w.in_features}] on CPU"
            )
        if not x.is_floating_point():
            raise ValueError(f"x: a float tensor, not {x.dtype}")
        x = x.to(torch.float32).contiguous()
        threads = kernel_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
        rc = (self._fp32_fns if fp32 else self._fns)[w.bits](
            w.data.data_ptr(), w.out_features, w.in_features, x.data_ptr(), x.shape[0], y.data_ptr(), threads
        )
        shapes = f"weight {w.out_features} x {w.in_features}, x {tuple(x.shape)}, {threads} threads"
        if rc == -2:
            raise MemoryError(f"q{w.bits}_gemv could not allocate its scratch (nothing written): {shapes}")
        if rc != 0:
            raise ValueError(f"q{w.bits}_gemv refused its arguments (rc {rc}): {shapes}")
        return y

    _check_rows = (1, 5, 6, 20)
    """Row counts ``self_check`` runs: the AVX2 build's per-row and panel paths."""

    def reference(self, groups, x: torch.Tensor) -> torch.Tensor:
        """float64 ``[M, N]``: what ``mm`` computes, up to its fp32 rounding, for ``engine.quantized`` groups
        ``[N, K]`` and fp32 ``x`` ``[M, K]``: the product with the dequantized weights."""
        return x.double() @ groups.dequantize().double().T

    def self_check(self) -> str | None:
        """Compare the kernel with ``reference`` on random Q4_1- and Q8_0-like weights (a partial tile,
        ``_check_rows`` rows, 1 and 2 threads, a group of zero inputs) and check row invariance; None when every
        output is within 1e-5 of the largest, else what differed."""
        gen = torch.Generator().manual_seed(0)
        for bits, n, k in ((4, 37, 96), (8, 21, 64)):
            groups = random_groups(bits, n, k, gen)
            packed = pack_int4(groups) if bits == 4 else pack_int8(groups)
            x = torch.randn(20, k, generator=gen)
            x[3, :32] = 0.0
            want = self.reference(groups, x)
            alone = torch.cat([self.mm(packed, x[i : i + 1], 1) for i in range(20)])
            for rows in self._check_rows:
                for threads in (1, 2):
                    got = self.mm(packed, x[:rows], threads)
                    err = ((got.double() - want[:rows]).abs().max() / want.abs().max()).item()
                    if not err <= 1e-5:
                        return f"int{bits} {n}x{k}, {rows} rows, {threads} threads: relative error {err:.2e}"
                    if not torch.equal(got, alone[:rows]):
                        return (
                            f"int{bits} {n}x{k}, {rows} rows, {threads} threads: rows differ from 1-row calls"
                        )
        return None


class Int8ActivationKernel(NativeLinearKernel):
    """The kernel with int8 activations (``engine.linear_kernel: int8-activations``): ``q4_gemv_i8`` /
    ``q8_gemv_i8`` of the build with AVX-512 VNNI and VBMI (``isa`` ``avx512``), on the same packed weights as
    ``NativeLinearKernel``; or (``isa`` ``avx2``) the AVX2 build's ``q4_gemv_i8``, whose integer sums come from
    ``vpmaddubsw`` / ``vpmaddwd`` and give the same bits, with int8 weights (the LM head) on the fp32 ``q8_gemv``:
    without VNNI an 8-bit code's products cost more instructions than fp32 fused multiply-adds
    (``quant_gemv.c``).

    Each row of ``x`` is cut per group of 32 inputs into two int8 planes, ``x ~ dx * xq + dr * rq``
    (``quantize_activations``: the rounding of llama.cpp's Q8 activation blocks, applied to ``x`` and then to
    what it left), each plane's dot product with the codes is an exact integer sum (``vpdpbusd``), and the output
    is ``sum_g (d dx) dot_x + (d dr) dot_r + m S_g`` in fp32 (int4; ``S_g`` the group's exact fp32 sum; int8
    without the ``m`` term): ``int8_activation_reference`` in float64. Two planes keep about 15 bits of each
    group where one keeps 8 (one plane agreed with the fp32 reference on 93 % of SmolLM2's greedy tokens); at 8
    rows, where the fp32 kernel is bound by its multiply-adds, a GEMV takes ~0.8x its time, one row the same
    (memory-bound either way; docs/engine-step.md, "int8 activations"). Each output element is one fixed
    sequence of operations whatever the call's rows and threads: row ``i`` of an ``M``-row call equals the 1-row
    call of that row (batch invariance).

    Args:
        path: the built shared library.
        isa: which build (a key of ``INT8_ACTIVATION_FLAGS``).

    Raises:
        OSError: the library cannot be loaded.
    """

    activations = "int8"
    _names_by_isa = {
        "avx512": ((4, "q4_gemv_i8"), (8, "q8_gemv_i8")),
        "avx2": ((4, "q4_gemv_i8"), (8, "q8_gemv")),
    }

    def __init__(self, path: Path, isa: str = "avx512") -> None:
        self._names = self._names_by_isa[isa]
        super().__init__(path, isa)

    @property
    def int8_bits(self) -> tuple[int, ...]:
        """The weight widths (4, 8) whose calls take int8 activations; the others take fp32 ones."""
        return tuple(bits for bits, name in self._names if name.endswith("_i8"))

    @classmethod
    def build(
        cls, directory: Path | None = None, isa: str | None = None, prefetch_locality: int | None = None
    ) -> Int8ActivationKernel:
        """Build (or find built), load and check the int8-activation kernel: the ``isa`` build (a key of
        ``INT8_ACTIVATION_FLAGS``), by default the best this CPU runs (``select_int8_isa``), with the weight
        stream's prefetch at ``prefetch_locality`` (default this CPU's: ``prefetch_flags``).

        Raises:
            NativeKernelError: an unknown ``isa``; the CPU lacks what the build needs (AVX-512 F/BW/VL, VNNI and
                VBMI, or AVX2; F16C and FMA); a locality not in 0-3; no C compiler; the compile failed; or the
                build fails its ``self_check``; the message says which.
        """
        isa = select_int8_isa() if isa is None else isa
        if isa not in INT8_ACTIVATION_FLAGS:
            raise NativeKernelError(
                f"no {isa!r} build of the int8-activation kernel (builds: {', '.join(INT8_ACTIVATION_FLAGS)})"
            )
        return native_build.build_checked(
            lambda path: cls(path, isa),
            SOURCE,
            native_build.cpu_ok(INT8_ACTIVATION_REQUIRED[isa]),
            native_build.compiler(),
            (*FLAGS, *INT8_ACTIVATION_FLAGS[isa], *prefetch_flags(prefetch_locality)),
            LIBS,
            directory,
        )

    _check_rows = (1, 4, 5, 8, 9, 20)  # a shared decode of 8 rows; AVX2: its panel path from 6 rows

    def reference(self, groups, x: torch.Tensor) -> torch.Tensor:
        """``int8_activation_reference``; for int8 weights where they take fp32 activations (the AVX2 build), the
        product with the dequantized weights."""
        from engine.quantized import Int8Groups

        if isinstance(groups, Int8Groups) and 8 not in self.int8_bits:
            return super().reference(groups, x)
        return int8_activation_reference(groups, x)


def quantize_groups(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q(v)`` of ``Int8ActivationKernel``, emulated: fp32 ``v`` ``[M, G, 32]`` -> int8-valued fp32 ``vq`` ``[M, G,
    32]`` and fp32 ``dv`` ``[M, G]``, ``v ~ dv * vq`` per group (``dv = amax / 127``, ``vq = round(v * (127 /
    amax))`` ties to even, in fp32; all 0 where ``amax < TINY_GROUP``). The scheme of llama.cpp's Q8 activation
    blocks."""
    amax = v.abs().amax(dim=-1)
    inv = torch.where(amax >= TINY_GROUP, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(v * inv[..., None]), amax / 127.0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Int8ActivationKernel``'s two planes of fp32 ``x`` ``[M, K]`` (``K % 32 == 0``), emulated: ``(xq, dx, rq,
    dr)`` with ``(xq, dx) = quantize_groups(x)`` and ``(rq, dr) = quantize_groups(x - dx * xq)`` (the product, then
    the difference, in fp32), so ``x ~ dx * xq + dr * rq`` per group of 32 to about 2**-15 of its largest
    ``|x|``. Planes ``[M, K / 32, 32]``, scales ``[M, K / 32]``."""
    g = x.float().view(x.shape[0], -1, QK)
    xq, dx = quantize_groups(g)
    rq, dr = quantize_groups(g - dx[..., None] * xq)
    return xq, dx, rq, dr


def int8_activation_reference(groups, x: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, N]``: what ``Int8ActivationKernel.mm`` computes (in fp32, up to its rounding) for
    ``engine.quantized`` ``Int4Groups`` (``w = (q - 8) d + zero``) or ``Int8Groups`` (``w = q d``) ``[N, K]`` and
    fp32 ``x`` ``[M, K]``: per group ``d dx sum q xq + d dr sum q rq`` (+ ``(zero - 8 d) sum x`` for int4, with
    ``q`` the unsigned codes 0..15) over ``quantize_activations``' planes."""
    from engine.quantized import Int4Groups

    xq, dx, rq, dr = quantize_activations(x)  # [M, G, 32] planes, [M, G] scales
    n, k = groups.q.shape
    q = groups.q.double().view(n, k // QK, QK)  # [N, G, 32]
    d = groups.scale.double()  # [N, G]
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for plane, scale in ((xq, dx), (rq, dr)):
        dots = torch.einsum("mgi,ngi->mng", plane.double(), q)  # exact: integers below 2**53
        y += (dots * (d[None] * scale.double()[:, None])).sum(-1)
    if isinstance(groups, Int4Groups):
        mins = groups.zero.double() - 8 * d  # [N, G]
        y += torch.einsum("mg,ng->mn", x.double().view(x.shape[0], -1, QK).sum(-1), mins)
    return y


def default_prefetch_locality() -> int:
    """This CPU's weight-stream prefetch locality: ``PREFETCH_LOCALITY`` by ``engine.weight_format.cpu_vendor``,
    else ``DEFAULT_PREFETCH_LOCALITY``."""
    from engine.weight_format import cpu_vendor

    return PREFETCH_LOCALITY.get(cpu_vendor(), DEFAULT_PREFETCH_LOCALITY)


def prefetch_flags(locality: int | None = None) -> tuple[str, ...]:
    """The compiler flag that sets the weight stream's prefetch locality (``GEMV_PREFETCH_LOCALITY``): ``locality``,
    or by default this CPU's (``default_prefetch_locality``). A hint only: every output is the same bits whatever
    it is.

    Raises:
        NativeKernelError: ``locality`` not one of 0, 1, 2, 3.
    """
    if locality is None:
        locality = default_prefetch_locality()
    if locality not in (0, 1, 2, 3):
        raise NativeKernelError(f"a prefetch locality is 0, 1, 2 or 3, got {locality!r}")
    return (f"-DGEMV_PREFETCH_LOCALITY={locality}",)


def select_isa() -> str:
    """The best build this CPU runs: ``avx512`` where it has AVX-512 F/BW/VL, F16C and FMA, else ``avx2`` (whose
    build then says what is missing, if anything)."""
    return "avx512" if native_build.cpu_ok(ISA_REQUIRED["avx512"])[0] else "avx2"


def select_int8_isa() -> str:
    """The best int8-activation build this CPU runs: ``avx512`` where it has AVX-512 F/BW/VL with VNNI and VBMI,
    F16C and FMA, else ``avx2`` (whose build then says what is missing, if anything)."""
    return "avx512" if native_build.cpu_ok(INT8_ACTIVATION_REQUIRED["avx512"])[0] else "avx2"


def random_groups(bits: int, n: int, k: int, gen: torch.Generator):
    """Random ``Int4Groups`` (Q4_1-like: f16 ``d > 0``, ``m`` f16, ``zero = m + 8 d``) or ``Int8Groups``
    (Q8_0-like) ``[n, k]`` for checks and tests."""
    from engine.quantized import Int4Groups, Int8Groups

    g = k // QK
    d = (torch.rand(n, g, generator=gen) * 0.05 + 0.001).half().float()
    if bits == 8:
        return Int8Groups(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), d)
    m = (torch.randn(n, g, generator=gen) * 0.1).half().float()
    return Int4Groups(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, m + 8 * d)


_shared_kernel = native_build.shared_build(NativeLinearKernel.build)
_shared_int8_activation_kernel = native_build.shared_build(Int8ActivationKernel.build)


def _auto_kernel() -> NativeLinearKernel | str:
    """``auto``'s kernel: int8 activations where they build for the best instruction set the CPU has (AVX-512 with
    VNNI and VBMI, or AVX2 on a CPU without AVX-512), else the fp32 kernel (or why neither builds). An AVX-512 CPU
    without VNNI or VBMI keeps the fp32 kernel's AVX-512 build: its int8 kernel would be the AVX2 build, never
    measured against it."""
    int8 = _shared_int8_activation_kernel()
    if isinstance(int8, str):
        logger.info("engine.linear_kernel auto: the fp32 kernel, not int8 activations (%s)", int8)
    elif int8.isa == select_isa():
        return int8
    else:
        logger.info(
            "engine.linear_kernel auto: the fp32 kernel's %s build, not int8 activations on AVX2",
            select_isa(),
        )
    return _shared_kernel()


def check_linear_kernel(setting: str) -> None:
    """Raise ``ValueError`` naming ``engine.linear_kernel`` unless ``setting`` is one of ``LINEAR_KERNELS``."""
    if setting not in LINEAR_KERNELS:
        raise ValueError(f"engine.linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {setting!r}")


def resolve_linear_kernel(setting: str, device: torch.device | str) -> NativeLinearKernel | None:
    """The kernel ``engine.linear_kernel`` asks for on ``device``: ``torch`` -> None (torch's int4 kernel);
    ``native`` -> the (fp32) kernel, or a start-up error; ``int8-activations`` -> ``Int8ActivationKernel``, or a
    start-up error; ``auto`` -> on a CPU, ``Int8ActivationKernel`` where it builds for the CPU's best instruction
    set (AVX-512 with VNNI and VBMI; AVX2 without AVX-512: ``_auto_kernel``), else the fp32 kernel where it builds,
    else None, with a log line saying why. Built once per process.

    Raises:
        ValueError: an unknown setting, or ``native`` / ``int8-activations`` where that kernel is not available
            (the message names ``engine.linear_kernel`` and the reason).
    """
    check_linear_kernel(setting)
    shared = {"auto": _auto_kernel, "int8-activations": _shared_int8_activation_kernel}.get(
        setting, _shared_kernel
    )
    return native_build.resolve_setting(
        "engine.linear_kernel", setting, torch.device(device).type, shared, "torch's int4 kernel"
    )
