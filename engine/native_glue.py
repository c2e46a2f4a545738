"""The native layer-glue kernel: RMSNorm (with the residual add), RoPE with the K/V store, SiLU(gate) * up.

Owns building, loading and calling ``engine/kernels/layer_glue.c``: the elementwise work of a decoder layer between
its linear kernels and its attention kernel, which torch runs as ~26 small ops per layer (``docs/engine-step.md``,
"Layer glue kernel"), each one C call here:

- ``rmsnorm``: ``h += y`` (optional; ``y`` fp32 or bf16) then ``x = h / sqrt(mean(h^2) + eps) * w``, ``x`` written
  in the dtype the next linear takes (fp32, or bf16 rounded to nearest even);
- ``rope_store``: RoPE of the q heads (into their own contiguous tensor, as attention takes them) and of the k
  heads (in place) of a fused ``[T, (H + 2 KV) * D]`` qkv buffer in
  ``engine.model.interleave_rope_rows`` pair order, with the step's ``(cos, sin)`` pairs (``engine.rope_table.
  rope_rotation``'s, computed by torch as Hugging Face computes them, once per position: ``RopeTable``);
  then each row's K and V stored at its cache slot (what ``engine.attention.write_kv`` does);
- ``silu_mul``: ``silu(g) * u`` of a ``[T, 2 I]`` gate/up buffer into a new ``[T, I]`` fp32 or bf16 tensor.

Numerics against torch's glue (``engine.model``): RoPE, the residual add, the products and the K/V store are the
same fp32 operations (bit-identical); the RMSNorm's sum of squares is added in another order (16 lanes, then a
tree) and SiLU's ``e^-g`` is Cephes' polynomial, not Sleef's: a few ulp apart (at most 5 and 4 over millions of
random elements, each side as close to float64 as the other). So a model served with the kernel
is named apart in ``model_id`` (``glue_kernel_variant``: ``/native-glue``), since its K/V differ from torch's.

Invariants: each row is computed alone by one fixed sequence of fp32 operations (its width decides it), so a row's
result is the same bits whatever the other rows of the call, their number and the thread count (OpenMP splits
rows, never a row): batched == alone and cache on == off hold with the kernel as with torch's glue, provided the
same function serves every row of every step (``engine.model.LlamaModel.forward`` with ``glue``). The kernel
refuses an argument it cannot take before it reads or writes anything; here a bad dtype, shape, layout, device or
slot raises ``GlueArgumentError`` (a ``ValueError``).

Two builds, as ``engine.native_linear``'s: AVX-512 (F/BW/VL) and AVX2, each with FMA (never fused:
``-ffp-contract=off``); ``select_isa`` takes the best the CPU has; the AVX2 build is named apart in ``model_id``
(``/native-glue-avx2``: the same operations per element on 8-lane vectors, where GCC had lowered the 16-lane ones
to scalar code through the stack, 2.5-4x slower; equal by construction, not checked on one machine running both
AVX-512 and AVX2, and checked against the AVX build's 16-lane lowering on every AVX2 CPU). Built by
``engine.native_build`` (once per machine, cached by hash, checked against torch's glue before use; no
``-ffast-math``). ``engine.glue_kernel`` selects it (``resolve_glue_kernel``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine import native_build
from engine.api import GLUE_KERNELS
from engine.native_build import NativeKernelError

SOURCE = Path(__file__).with_name("kernels") / "layer_glue.c"
FLAGS = (*native_build.BASE_FLAGS, "-ffp-contract=off", "-mfma", "-Wno-psabi")
"""Flags of every build (no multiply-add is fused: RoPE rounds as torch's complex multiply); ``ISA_FLAGS`` adds
the instruction set's."""
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl"), "avx2": ("-mavx2",), "avx": ()}
"""The builds, best first. ``avx`` (AVX and FMA only: the 16-lane vectors lowered to 8-lane float and 4-lane
integer operations) is never selected; the tests compare it with the others, so that a CPU running one of them
still checks that the bits do not depend on how the vectors were lowered."""
ISA_REQUIRED = {
    "avx512": native_build.AVX512,
    "avx2": frozenset({"avx2", "fma"}),
    "avx": frozenset({"avx", "fma"}),
}
"""CPU flags each build needs (``engine.weight_format.cpu_flags`` names)."""
_DTYPES = (torch.float32, torch.bfloat16)
_F32 = (torch.float32,)


class GlueArgumentError(ValueError):
    """An argument the glue kernel does not take (dtype, shape, layout, device, a cache slot out of range); the
    message names it. Raised before the kernel reads or writes anything."""


def _need(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None) -> None:
    """Raise ``GlueArgumentError`` unless ``t`` is a contiguous CPU tensor of one of ``dtypes`` (and ``shape``)."""
    if not isinstance(t, torch.Tensor):
        raise GlueArgumentError(f"{name}: needs a tensor, got {type(t).__name__}")
    if not (t.is_cpu and t.dtype in dtypes and t.is_contiguous()):
        raise GlueArgumentError(
            f"{name}: needs a contiguous CPU tensor of {', '.join(map(str, dtypes))}, got {t.dtype} on "
            f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}"
        )
    if shape is not None and t.shape != shape:
        raise GlueArgumentError(f"{name}: needs shape {shape}, got {tuple(t.shape)}")


def _out_dtype(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise GlueArgumentError(f"out_dtype: float32 or bfloat16, got {dtype}")
    return int(dtype == torch.bfloat16)


def _threads(threads: int | None) -> int:
    n = torch.get_num_threads() if threads is None else threads
    if n < 1:
        raise GlueArgumentError(f"threads must be >= 1, got {n}")
    return n


class NativeGlueKernel:
    """The loaded ``glue_rmsnorm``, ``glue_rope_store`` and ``glue_silu_mul`` functions.

    Args:
        path: the built shared library.
        isa: the instruction set it was built for (a key of ``ISA_FLAGS``).

    Raises:
        OSError: the library cannot be loaded.
    """

    def __init__(self, path: Path, isa: str = "avx512") -> None:
        self.path = path
        self.isa = isa
        lib = ctypes.CDLL(str(path))
        p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self._rmsnorm = lib.glue_rmsnorm
        self._rmsnorm.argtypes = [p, p, i32, p, p, i32, i64, i64, f32, i32]
        self._rope = lib.glue_rope_store
        self._rope.argtypes = [p, p, i64, i64, i64, i64, p, p, i32, i64, p, i32]
        self._silu = lib.glue_silu_mul
        self._silu.argtypes = [p, i32, p, i32, i64, i64, i32]
        for fn in (self._rmsnorm, self._rope, self._silu):
            fn.restype = ctypes.c_int
        self._lib = lib

    @classmethod
    def build(cls, directory: Path | None = None, isa: str | None = None) -> NativeGlueKernel:
        """Build (or find already built) and load the kernel: the ``isa`` build (default ``select_isa()``).

        Raises:
            NativeKernelError: not an x86-64 CPU with the build's instruction sets, an unknown ``isa``, no C
                compiler, the compile failed, or the build fails its ``self_check``; the message says which.
        """
        isa = select_isa() if isa is None else isa
        if isa not in ISA_FLAGS:
            raise NativeKernelError(f"no {isa!r} build of the glue kernel (builds: {', '.join(ISA_FLAGS)})")
        return native_build.build_checked(
            lambda path: cls(path, isa),
            SOURCE,
            native_build.cpu_ok(ISA_REQUIRED[isa]),
            native_build.compiler(),
            (*FLAGS, *ISA_FLAGS[isa]),
            (),
            directory,
        )

    def rmsnorm(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        y: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        threads: int | None = None,
    ) -> torch.Tensor:
        """RMSNorm of the rows of ``h``, after ``h += y`` when ``y`` is given (the residual add, in place).

        Args:
            h: fp32 ``[T, n]``, contiguous (updated in place when ``y`` is given).
            weight: fp32 ``[n]``.
            eps: added to the mean square.
            y: fp32 or bf16 ``[T, n]``, contiguous, or None.
            out_dtype: float32, or bfloat16 (rounded to nearest even, as ``.to(torch.bfloat16)``).
            threads: OpenMP threads for many rows (default ``torch.get_num_threads()``); the result does not
                depend on it.

        Returns:
            ``[T, n]`` of ``out_dtype``: ``h / sqrt(mean(h^2) + eps) * weight``.

        Raises:
            GlueArgumentError: a dtype, shape, layout or device the kernel does not take.
        """
        _need(h, "h", _F32, None)
        if h.dim() != 2 or h.shape[1] < 1:
            raise GlueArgumentError(f"h: needs [T, n >= 1], got shape {tuple(h.shape)}")
        rows, n = h.shape
        _need(weight, "weight", _F32, (n,))
        if y is not None:
            _need(y, "y", _DTYPES, (rows, n))
        x_bf16 = _out_dtype(out_dtype)
        x = torch.empty(rows, n, dtype=out_dtype)
        rc = self._rmsnorm(
            h.data_ptr(),
            None if y is None else y.data_ptr(),
            y is not None and y.dtype == torch.bfloat16,
            weight.data_ptr(),
            x.data_ptr(),
            x_bf16,
            rows,
            n,
            eps,
            _threads(threads),
        )
        if rc != 0:
            raise GlueArgumentError(f"glue_rmsnorm refused its arguments (rc {rc}): h {tuple(h.shape)}")
        return x

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos_sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        layer_cache: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """RoPE of the q and k heads of ``qkv``: k in place, q into a new contiguous tensor; then, with
        ``layer_cache``, each row's K (rotated) and V stored at its slot (``engine.attention.write_kv``'s job).

        Args:
            qkv: fp32 ``[T, (heads + 2 kv_heads) * head_dim]`` (or any contiguous shape of those ``T`` rows), q
                heads, then k heads, then v heads, each head's dims in ``interleave_rope_rows`` pair order.
            cos_sin: fp32 ``[T, head_dim / 2, 2]``: each row's ``(cos, sin)`` per pair
                (``torch.view_as_real`` of ``engine.rope_table.rope_rotation``'s rotation, reshaped).
            heads, kv_heads, head_dim: the layout (``head_dim`` even).
            layer_cache: ``[2, num_blocks, block_size, kv_heads, head_dim]`` fp32 or bf16, contiguous, or None.
            slots: int64 ``[T]`` flat slot of each row (``block * block_size + offset``), with ``layer_cache``.
            threads: as ``rmsnorm``.

        Returns:
            the rotated queries, fp32 ``[T, heads, head_dim]`` (``qkv``'s q heads are left as they were).

        Raises:
            GlueArgumentError: a dtype, shape, layout or device the kernel does not take, or a slot outside the
                cache (nothing written then).
        """
        _need(qkv, "qkv", _F32, None)
        if heads < 1 or kv_heads < 1 or head_dim < 2 or head_dim % 2:
            raise GlueArgumentError(
                f"heads {heads}, kv_heads {kv_heads} must be >= 1 and head_dim {head_dim} even and >= 2"
            )
        width = (heads + 2 * kv_heads) * head_dim
        if qkv.dim() < 1 or qkv.numel() != qkv.shape[0] * width:
            raise GlueArgumentError(f"qkv: needs [T, {width}], got shape {tuple(qkv.shape)}")
        rows = qkv.shape[0]
        _need(cos_sin, "cos_sin", _F32, (rows, head_dim // 2, 2))
        cache_ptr, cache_bf16, num_slots, slots_ptr = None, 0, 0, None
        if layer_cache is not None:
            _need(layer_cache, "layer_cache", _DTYPES, None)
            if (
                layer_cache.dim() != 5
                or layer_cache.shape[0] != 2
                or layer_cache.shape[3:] != (kv_heads, head_dim)
            ):
                raise GlueArgumentError(
                    f"layer_cache: needs [2, blocks, block_size, {kv_heads}, {head_dim}], got "
                    f"{tuple(layer_cache.shape)}"
                )
            if slots is None:
                raise GlueArgumentError("slots: needed with layer_cache")
            _need(slots, "slots", (torch.int64,), (rows,))
            cache_ptr, cache_bf16 = layer_cache.data_ptr(), layer_cache.dtype == torch.bfloat16
            num_slots, slots_ptr = layer_cache.shape[1] * layer_cache.shape[2], slots.data_ptr()
        q = torch.empty(rows, heads, head_dim, dtype=torch.float32)
        rc = self._rope(
            qkv.data_ptr(),
            q.data_ptr(),
            rows,
            heads,
            kv_heads,
            head_dim,
            cos_sin.data_ptr(),
            cache_ptr,
            cache_bf16,
            num_slots,
            slots_ptr,
            _threads(threads),
        )
        if rc == -2:
            raise GlueArgumentError(f"slots: outside [0, {num_slots}) of the cache: {slots.tolist()}")
        if rc != 0:
            raise GlueArgumentError(f"glue_rope_store refused its arguments (rc {rc})")
        return q

    def silu_mul(
        self, gu: torch.Tensor, out_dtype: torch.dtype = torch.float32, threads: int | None = None
    ) -> torch.Tensor:
        """``silu(g) * u`` of each row ``[g | u]`` of ``gu``.

        Args:
            gu: fp32 or bf16 ``[T, 2 I]``, contiguous (gate then up, ``engine.model.DecoderLayer.gate_up``'s).
            out_dtype: float32, or bfloat16 (rounded to nearest even).
            threads: as ``rmsnorm``.

        Returns:
            ``[T, I]`` of ``out_dtype``.

        Raises:
            GlueArgumentError: a dtype, shape, layout or device the kernel does not take.
        """
        _need(gu, "gu", _DTYPES, None)
        if gu.dim() != 2 or gu.shape[1] < 2 or gu.shape[1] % 2:
            raise GlueArgumentError(f"gu: needs [T, 2 I], got shape {tuple(gu.shape)}")
        rows, n = gu.shape[0], gu.shape[1] // 2
        out_bf16 = _out_dtype(out_dtype)
        out = torch.empty(rows, n, dtype=out_dtype)
        rc = self._silu(
            gu.data_ptr(),
            int(gu.dtype == torch.bfloat16),
            out.data_ptr(),
            out_bf16,
            rows,
            n,
            _threads(threads),
        )
        if rc != 0:
            raise GlueArgumentError(f"glue_silu_mul refused its arguments (rc {rc}): gu {tuple(gu.shape)}")
        return out

    def self_check(self) -> str | None:
        """Compare the kernel with torch's glue (``engine.model``'s ``rms_norm``, ``apply_rope``, SiLU * up) on random
        rows (a width that is not a multiple of 16 included; 1 and 2 threads); None when RMSNorm and SiLU * up are
        within 1e-5 relative of torch's and RoPE equal, else what differed."""
        from engine.model import apply_rope, rms_norm

        gen = torch.Generator().manual_seed(0)
        for n in (72, 45):
            h, w = torch.randn(5, n, generator=gen), torch.randn(n, generator=gen)
            for threads in (1, 2):
                got, want = self.rmsnorm(h, w, 1e-5, threads=threads), rms_norm(h, w, 1e-5)
                err = ((got - want).abs().max() / want.abs().max()).item()
                if not err <= 1e-5:
                    return f"rmsnorm, width {n}: relative error {err:.2e}"
                gu = torch.randn(5, 2 * n, generator=gen) * 4
                g, u = gu.split(n, dim=-1)
                got, want = self.silu_mul(gu, threads=threads), torch.nn.functional.silu(g) * u
                err = ((got - want).abs().max() / want.abs().max()).item()
                if not err <= 1e-5:
                    return f"silu_mul, width {n}: relative error {err:.2e}"
        heads, kvh, d = 3, 1, 34
        qkv = torch.randn(4, (heads + 2 * kvh) * d, generator=gen)
        angles = torch.rand(4, 1, d // 2, generator=gen) * 100
        rotation = torch.complex(angles.cos(), angles.sin())
        want = apply_rope(qkv.view(4, -1, d)[:, : heads + kvh], rotation)
        q = self.rope_store(qkv, torch.view_as_real(rotation).reshape(4, d // 2, 2), heads, kvh, d)
        if not torch.equal(q, want[:, :heads]) or not torch.equal(
            qkv.view(4, -1, d)[:, heads:-kvh], want[:, heads:]
        ):
            return "rope: differs from torch's complex multiply"
        return None


def select_isa() -> str:
    """The best build this CPU runs: ``avx512`` where it has AVX-512 F/BW/VL and FMA, else ``avx2``."""
    return "avx512" if native_build.cpu_ok(ISA_REQUIRED["avx512"])[0] else "avx2"


_shared_kernel = native_build.shared_build(NativeGlueKernel.build)


def glue_kernel_variant(kernel: NativeGlueKernel | None) -> str:
    """The part of ``model_id`` naming the glue kernel (``LLMEngine`` appends it after the attention kernels'):
    ``""`` for torch's glue, ``"/native-glue"`` for the AVX-512 build, ``"/native-glue-<isa>"`` for another (a
    token's K/V differ by a few ulp between them; the KV tiers key by ``model_id``)."""
    if kernel is None:
        return ""
    return "/native-glue" if kernel.isa == "avx512" else f"/native-glue-{kernel.isa}"


def check_glue_kernel(setting: str) -> None:
    """Raise ``ValueError`` naming ``engine.glue_kernel`` unless ``setting`` is one of ``GLUE_KERNELS``."""
    if setting not in GLUE_KERNELS:
        raise ValueError(f"engine.glue_kernel must be one of {', '.join(GLUE_KERNELS)}, got {setting!r}")


AUTO_NATIVE = True
"""Whether ``auto`` takes the kernel where it builds (measured: ``docs/engine-step.md``, "Layer glue kernel")."""


def resolve_glue_kernel(
    setting: str, device: torch.device | str, model_dtype: torch.dtype = torch.float32
) -> NativeGlueKernel | None:
    """The kernel ``engine.glue_kernel`` asks for: ``torch`` -> None (``engine.model``'s torch ops); ``native`` ->
    the kernel, or a start-up error; ``auto`` -> the kernel where it builds on a CPU and the model computes in
    float32 (and ``AUTO_NATIVE``), else None with a log line saying why. Built once per process.

    Raises:
        ValueError: an unknown setting, or ``native`` where the kernel is not available: not a CPU, a model
            that does not compute in float32, or a kernel that does not build (the message names
            ``engine.glue_kernel`` and the reason).
    """
    check_glue_kernel(setting)
    if setting == "auto" and not AUTO_NATIVE:
        return None
    kernel = native_build.resolve_setting(
        "engine.glue_kernel", setting, torch.device(device).type, _shared_kernel, "torch's layer glue"
    )
    if kernel is not None and model_dtype != torch.float32:
        if setting == "native":
            raise ValueError(
                f"engine.glue_kernel: native needs a float32 model, this one computes in {model_dtype}"
            )
        return None
    return kernel
