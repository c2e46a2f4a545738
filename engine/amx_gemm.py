"""The AMX bf16 GEMM of prompt rows (``engine.dense_gemm: amx``): our own kernel where oneDNN's is not
row-invariant.

Owns building, loading and calling ``engine/kernels/amx_gemm.c`` (``AmxGemmKernel``), the weight layout it reads
(``AmxDenseWeight``: a bf16 copy of a quantized linear's dequantized weight in AMX B tiles), and the choice of
``engine.dense_gemm`` (``resolve_dense_gemm``).

Why: on CPUs with AMX, oneDNN's bf16 GEMM computes some rows of a call of more than 32 rows otherwise than the
same rows alone, so ``engine.bf16_gemm`` cuts its calls into 32-row slices, which reads the weights once per 32
rows (a 1,070-token prompt's linears ~2.2x the time of whole calls on a 2-core Xeon with AMX). Here every output
element is one fixed sequence of tile operations (C from zero, one ``TDPBF16PS`` per 32-wide chunk of the inputs,
in order), whatever the row count, the row's place and the thread count, so whole calls keep batch invariance
(batched == alone, cache on == cache off). Activations enter as fp32 and are rounded to bf16 (nearest even, as
``Tensor.to(torch.bfloat16)``) inside the kernel; products of bf16 pairs are summed in fp32 and returned in
fp32 (oneDNN's path returned bf16), so a row is computed as ``x.bfloat16() @ W.bfloat16().T`` up to fp32
summation order.

Built like the other native kernels (``engine.native_build``: once per machine, cached by hash, temp name
renamed into place, checked against a float64 reference and for row invariance before use; no
``-ffast-math``). Needs x86-64 with AVX512-BF16 and AMX (``amx_tile``, ``amx_bf16``) and Linux's permission for
the tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, Linux 5.16+), asked once per process.

Invariants: the kernel reads its inputs and writes only the output and its scratch; an argument it cannot take is
refused before anything runs (``ValueError``).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import native_build
from engine.api import DENSE_GEMMS
from engine.native_build import NativeKernelError

SOURCE = Path(__file__).with_name("kernels") / "amx_gemm.c"
FLAGS = (*native_build.BASE_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", *native_build.AMX_BF16_FLAGS)
"""Compiler flags of the one build."""
REQUIRED = native_build.AMX_BF16
"""CPU flags the build needs (``engine.weight_format.cpu_flags`` names)."""
TILE_K = 32  # inputs per tile row pair chunk (one TDPBF16PS)
TILE_N = 32  # outputs per block of two B tiles
TILE_M = 32  # rows per block of two A tiles


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


_SYS_ARCH_PRCTL = 158  # x86-64 Linux
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> None:
    """Ask Linux for AMX's tile data state for this process (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``, Linux
    5.16+; idempotent), which every AMX kernel needs before its first tile instruction.

    Raises:
        NativeKernelError: the kernel or the CPU (e.g. a VM that hides AMX) refuses it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        raise NativeKernelError(
            "Linux refused the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, errno "
            f"{ctypes.get_errno()}; needs Linux 5.16+ and a CPU or VM that exposes AMX)"
        )


def pack_b_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float, rounded to bf16 as ``Tensor.to``) -> bf16 ``[Np / 16, Kp / 32, 16, 16, 2]``,
    ``AmxDenseWeight.data``'s layout (``Np``, ``Kp``: ``N``, ``K`` rounded up to 32, zero padding); ``unpack_b_tiles``
    inverts it."""
    n, k = weight.shape
    np_, kp = _round_up(n, TILE_N), _round_up(k, TILE_K)
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16)
    padded[:n, :k] = weight.to(torch.bfloat16)
    return padded.view(np_ // 16, 16, kp // TILE_K, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def unpack_b_tiles(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """bf16 ``[n, k]``: the weight ``pack_b_tiles`` packed into ``data``."""
    return data.permute(0, 3, 1, 2, 4).reshape(data.shape[0] * 16, data.shape[1] * TILE_K)[:n, :k]


@dataclass(frozen=True)
class AmxDenseWeight:
    """A bf16 ``[out_features, in_features]`` weight packed for ``AmxGemmKernel`` (``AmxGemmKernel.pack``).

    Attributes:
        data: bf16 ``[Np / 16, Kp / 32, 16, 16, 2]``: for output block ``nb`` and input chunk ``kb`` one 1 KiB B
            tile whose row ``r`` holds, for its 16 outputs ``n``, ``W[16 nb + n, 32 kb + 2 r + {0, 1}]``; ``Np`` /
            ``Kp``: ``out_features`` / ``in_features`` rounded up to 32, the padding zero.
        out_features, in_features: the weight's shape.
        kernel: the kernel that multiplies it.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    kernel: AmxGemmKernel

    dtype = torch.bfloat16
    """The copy's element type (``engine.linear``'s dense copies are compared by dtype)."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (padding included)."""
        return self.data.numel() * 2

    def mm(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[M, in_features]`` -> fp32 ``[M, out_features]`` (``AmxGemmKernel.mm``)."""
        return self.kernel.mm(self, x, threads)


class AmxGemmKernel:
    """The loaded ``amx_gemm.c`` library (``build`` builds, loads and checks it).

    Args:
        path: the built shared library.

    Raises:
        OSError: the library cannot be loaded.
        NativeKernelError: Linux refuses the AMX tile data state to this process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.amx_gemm_f32.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, p, i32]
        lib.amx_gemm_f32.restype = ctypes.c_int
        request_amx_permission()
        self._lib = lib
        self._scratch = threading.local()

    @classmethod
    def build(cls, directory: Path | None = None) -> AmxGemmKernel:
        """Build (or find already built), load and check the kernel.

        Raises:
            NativeKernelError: not an x86-64 CPU with AVX-512 (F, BW, VL), AVX512-BF16 and AMX (tile, bf16); no
                C compiler; the compile failed; Linux refused the tile state; or the build fails its
                ``self_check``; the message says which.
        """

        def load(path: Path) -> AmxGemmKernel:
            try:
                return cls(path)
            except NativeKernelError as exc:
                raise OSError(str(exc)) from exc

        return native_build.build_checked(
            load,
            SOURCE,
            native_build.cpu_ok(REQUIRED),
            native_build.compiler(),
            FLAGS,
            (),
            directory,
        )

    def pack(self, weight: torch.Tensor) -> AmxDenseWeight:
        """``weight`` ``[out, in]`` (any float dtype, rounded to bf16 as ``Tensor.to``) in the kernel's B tiles.

        Raises:
            ValueError: ``weight`` not a 2-D float tensor on CPU with both sizes >= 1.
        """
        if (
            weight.dim() != 2
            or not weight.is_floating_point()
            or weight.device.type != "cpu"
            or 0 in weight.shape
        ):
            raise ValueError(
                f"the AMX GEMM packs a 2-D float CPU weight, got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
            )
        return AmxDenseWeight(pack_b_tiles(weight), weight.shape[0], weight.shape[1], self)

    def _scratch_for(self, elements: int) -> torch.Tensor:
        """This thread's bf16 scratch of at least ``elements`` (grown, never shrunk: a prompt chunk's rows)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < elements:
            buf = torch.empty(elements, dtype=torch.bfloat16)
            self._scratch.buf = buf
        return buf

    def mm(self, w: AmxDenseWeight, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T``: ``x`` ``[M, in_features]`` (M >= 1; fp32, other float dtypes widened first) -> fp32
        ``[M, out_features]``; the inputs rounded to bf16, bf16 products summed in fp32 (module docstring). Output
        blocks split over ``threads`` (default ``engine.native_linear.kernel_threads()``); the result does not
        depend on ``threads``, ``M`` or the other rows.

        Raises:
            ValueError: ``x`` not 2-D ``[M >= 1, in_features]`` float on CPU, or ``threads < 1``.
        """
        from engine.native_linear import kernel_threads

        if (
            x.dim() != 2
            or x.shape[1] != w.in_features
            or x.shape[0] < 1
            or x.device.type != "cpu"
            or not x.is_floating_point()
        ):
            raise ValueError(
                f"x {tuple(x.shape)} {x.dtype} on {x.device}: the AMX GEMM takes float [M >= 1, {w.in_features}] on CPU"
            )
        threads = kernel_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        x = x.to(torch.float32)
        if x.stride(1) != 1:
            x = x.contiguous()
        m, kp = x.shape[0], w.data.shape[1] * TILE_K
        scratch = self._scratch_for(_round_up(m, TILE_M) * kp)
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        rc = self._lib.amx_gemm_f32(
            x.data_ptr(),
            m,
            w.in_features,
            x.stride(0),
            w.data.data_ptr(),
            w.out_features,
            kp,
            y.data_ptr(),
            w.out_features,
            scratch.data_ptr(),
            threads,
        )
        if rc != 0:
            raise ValueError(
                f"amx_gemm_f32 refused its arguments (rc {rc}): x {tuple(x.shape)}, weight {w.shape}"
            )
        return y

    _check_shapes = ((70, 100), (576, 576), (192, 1536))
    """``(out, in)`` shapes ``self_check`` runs: padded in both, and two of SmolLM2's."""

    def self_check(self) -> str | None:
        """None when the kernel agrees with a float64 product of the bf16-rounded inputs (relative error within
        fp32 summation's bound) and gives every row of a 77-row call (on 1 and 3 threads) the bits of its one-row
        call; else what differs."""
        gen = torch.Generator().manual_seed(0)
        for n, k in self._check_shapes:
            w = self.pack(torch.randn(n, k, generator=gen))
            wf = unpack_b_tiles(w.data, n, k).double()
            x = torch.randn(77, k, generator=gen)
            y = self.mm(w, x, threads=1)
            ref = x.to(torch.bfloat16).double() @ wf.T
            bound = 1e-6 * k * (x.to(torch.bfloat16).double().abs() @ wf.abs().T)
            if not bool(((y.double() - ref).abs() <= bound + 1e-30).all()):
                err = (y.double() - ref).abs().max().item()
                return f"{n} x {k}: max error {err:.3g} against a float64 reference"
            if not torch.equal(self.mm(w, x, threads=3), y):
                return f"{n} x {k}: 3 threads differ from one"
            for i in (0, 31, 32, 76):
                if not torch.equal(self.mm(w, x[i : i + 1], threads=1), y[i : i + 1]):
                    return f"{n} x {k}: row {i} alone differs from the 77-row call"
        return None


_shared_kernel = native_build.shared_build(AmxGemmKernel.build)


def check_dense_gemm(setting: str) -> None:
    """Raise ``ValueError`` naming ``engine.dense_gemm`` unless ``setting`` is one of ``DENSE_GEMMS``."""
    if setting not in DENSE_GEMMS:
        raise ValueError(f"engine.dense_gemm must be one of {', '.join(DENSE_GEMMS)}, got {setting!r}")


def resolve_dense_gemm(setting: str, device: torch.device | str) -> AmxGemmKernel | None:
    """The kernel ``engine.dense_gemm`` asks for on ``device``: ``onednn`` -> None (``engine.bf16_gemm``);
    ``amx`` -> this kernel, or a start-up error; ``auto`` -> this kernel where it builds on a CPU, else None with a
    log line saying why. Built once per process.

    Raises:
        ValueError: an unknown setting, or ``amx`` where the kernel is not available (the message names
            ``engine.dense_gemm`` and the reason).
    """
    check_dense_gemm(setting)
    return native_build.resolve_setting(
        "engine.dense_gemm",
        "torch" if setting == "onednn" else setting,
        torch.device(device).type,
        _shared_kernel,
        "oneDNN's bf16 GEMM",
    )
