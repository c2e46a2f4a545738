"""Which weight format each linear layer (and the embedding) runs in: ``engine.weights`` and the hardware.

``EngineConfig.weights`` (the ``engine.weights`` setting):

- ``float32``: every weight dequantized to fp32, fp32 GEMMs (the reference; the only format of the fp32
  parity tests against transformers).
- ``bf16``: dense bf16 weights, bf16 GEMMs, fp32 activations between layers.
- ``int4``: 4-bit weight-only (``engine.linear.Int4Weight``). Q4_0/Q4_1 tensors are used as stored (exact);
  anything else is quantized at load to Q4_1 with llama.cpp's reference quantizer (``gguf.quants.quantize``).
- ``int8``: 8-bit weight-only (``engine.linear.Int8Weight``). Q8_0 tensors as stored (exact); anything else is
  quantized at load to Q8_0.
- ``native``: each tensor in its own storage format where a kernel runs it: Q4_0/Q4_1 -> int4, Q8_0 -> int8,
  BF16 -> bf16, F16/F32 -> float32 (an fp16 mantissa does not fit bf16). Start-up error when the hardware has
  no fast kernel for one of them.
- ``auto`` (default): ``native`` when the hardware runs the int4 kernel (AVX2 / AVX-512 CPUs, CUDA), else
  ``float32`` with a log line. It never loses precision the checkpoint has.

``engine.dense_min_rows`` (``auto`` by default, ``auto_dense_min_rows``): whether quantized layers keep a dense
copy for prompt rows; ``auto`` keeps one except where it would be fp32 and the native AVX2 kernel runs prompt rows.

A fused projection (q/k/v, gate/up) whose parts are stored in different formats runs in the widest of them
(any float part -> float32; Q4 with Q8_0 -> int8), with a log line.

Hardware: the int4/int8 formats run torch's int4 weight-only kernel with bf16 activations (its fp32-activation
path is a scalar loop), which is vectorized for AVX2 and AVX-512 CPUs and CUDA (``int4_kernels_available``);
without native bf16 arithmetic (an AVX2 CPU) it widens bf16 to fp32 inside, still reading 4 bits per weight.
Dense bf16 GEMMs only pay with AVX512-BF16 / AMX or CUDA (``bf16_kernels_available``): on an AVX2 EPYC they
ran 3-6x slower than fp32 (``engine.linear`` docstring), so there the ``bf16`` format is refused and a
quantized layer's dense prefill copy is fp32 (``WeightPlan.dense_dtype``). ``check_supported`` refuses a
format whose kernel the device lacks, naming the setting.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.errors import EngineError
from engine.linear import (
    DENSE_MIN_ROWS,
    BF16Weight,
    DenseWeight,
    GroupedEmbedding,
    Int4Weight,
    Int8Weight,
    LinearWeight,
)
from engine.quantized import INT4_TYPES, QK, GGUFBlocks, int4_groups, int8_groups, quantize

if TYPE_CHECKING:
    from engine.amx_gemm import AmxGemmKernel
    from engine.native_linear import NativeLinearKernel

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "native", "int8", "int4", "bf16", "float32")
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_dtype_of(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype for ``EngineConfig.kv_dtype`` ``name``; the model's own dtype when that is not fp32.

    Raises:
        ValueError: ``name`` not ``float32`` / ``bfloat16``.
    """
    if name not in KV_DTYPES:
        raise ValueError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name] if model_dtype == torch.float32 else model_dtype


class UnsupportedHardwareError(EngineError):
    """A setting asks for a kernel this device does not have (the message names the setting)."""


CPUINFO = "/proc/cpuinfo"
"""Where ``cpu_flags`` and ``cpu_vendor`` read the CPU's description (Linux's format: ``key<tabs>: value`` lines)."""


def cpuinfo_field(name: str, path: str = CPUINFO) -> str:
    """The value of the first ``name`` line of ``path`` (the first processor's), "" where there is none or the
    file cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where there is none)."""
    return frozenset(cpuinfo_field("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The ``vendor_id`` of ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``, ...; "" where there is none)."""
    return cpuinfo_field("vendor_id")


def bf16_kernels_available(device: torch.device | str) -> bool:
    """True on CUDA, and on CPUs whose torch build dispatches AVX512 kernels and that have AVX512-BF16 or AMX
    (``torch.backends.cpu.get_cpu_capability()`` and ``/proc/cpuinfo``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type != "cpu":
        return False
    cap = torch.backends.cpu.get_cpu_capability()
    return cap.startswith("AVX512") and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


BF16_GEMM_VENDORS = frozenset({"AuthenticAMD"})
"""``/proc/cpuinfo`` vendors whose AVX512-BF16 CPUs without AMX run prompt rows faster on a bf16 dense copy than
on the native kernel (``fast_bf16_gemm``): a 2-core Zen 4 EPYC, where ``VDPBF16PS`` issues once a cycle. Not
Intel: on a 2-core Xeon (family 6 model 207) whose VM shows AVX512-BF16 but no AMX (session 37), oneDNN's bf16
GEMM ran SmolLM2's 30 layers of linears on 1,070 rows in 1.53-1.55 s against 0.87-0.93 s in fp32, and a cold
1,070-token prompt took 2.14-2.42 s on the bf16 copy, 1.55 s on an fp32 copy and 1.31-1.40 s on the native
kernel with no copy (a ~50-token tail over 1,028 cached: 0.135-0.15 s against 0.082-0.105 s; peak RSS 1,038
against 823 MB). There ``VDPBF16PS`` issues once per ~1.6 cycles against 0.4 for ``VFMADD231PS``
(``engine.attention_kernels.BF16_DOT_AUTO_VENDORS``, session 30)."""


def fast_bf16_gemm(device: torch.device | str) -> bool:
    """True where a bf16 dense copy is the fast way to run prompt rows: CUDA, and CPUs with
    ``bf16_kernels_available`` that have AMX (``amx_bf16``) or are of a ``BF16_GEMM_VENDORS`` vendor."""
    device = torch.device(device)
    if not bf16_kernels_available(device):
        return False
    if device.type != "cpu":
        return True
    return "amx_bf16" in cpu_flags() or cpu_vendor() in BF16_GEMM_VENDORS


def int4_kernels_available(device: torch.device | str) -> bool:
    """True where torch's int4 weight-only kernel is vectorized: CUDA, and CPUs whose torch build dispatches
    AVX2 or AVX-512 kernels (``torch.backends.cpu.get_cpu_capability()``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type != "cpu":
        return False
    cap = torch.backends.cpu.get_cpu_capability()
    return cap.startswith("AVX512") or cap.startswith("AVX2")


def check_supported(weights: str, kv_dtype: str, device: torch.device | str) -> None:
    """Validate ``engine.weights`` / ``engine.kv_dtype`` for ``device`` before anything is loaded.

    Raises:
        ValueError: an unknown value (named with the choices).
        UnsupportedHardwareError: ``int4`` / ``int8`` / ``native`` without the int4 kernel
            (``int4_kernels_available``), ``bf16`` without bf16 kernels (``bf16_kernels_available``).
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"engine.weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if weights in ("int4", "int8", "native") and not int4_kernels_available(device):
        raise UnsupportedHardwareError(
            f"engine.weights: {weights} needs the int4 weight-only kernel (a CPU with AVX2 or AVX-512, or "
            f"CUDA); this {torch.device(device).type} device has none (cpu capability "
            f"{torch.backends.cpu.get_cpu_capability()}). Use weights: auto or float32."
        )
    if weights == "bf16" and not bf16_kernels_available(device):
        raise UnsupportedHardwareError(
            f"engine.weights: bf16 needs bf16 kernels (a CPU with AVX512-BF16 or AMX, or CUDA); "
            f"this {torch.device(device).type} device has none (cpu capability "
            f"{torch.backends.cpu.get_cpu_capability()}). Use weights: auto or float32."
        )


def storage_kind(t: torch.Tensor | GGUFBlocks) -> str:
    """``"int4"`` (Q4_0/Q4_1), ``"int8"`` (Q8_0), ``"bf16"`` or ``"float32"`` (F32, F16 and anything else)."""
    if isinstance(t, GGUFBlocks):
        return "int4" if t.qtype in INT4_TYPES else "int8"
    return "bf16" if t.dtype == torch.bfloat16 else "float32"


_WIDTH = {"int4": 0, "int8": 1, "bf16": 2, "float32": 3}


@dataclass(frozen=True)
class WeightPlan:
    """How to build the model's weights.

    Attributes:
        weights: the resolved ``engine.weights`` (never ``auto``: ``resolve`` turns it into ``native`` or
            ``float32``).
        device: where the weights live.
        dense_min_rows: quantized linears keep a dense copy used from this many rows up (prefill
            chunks); None = int4/int8 kernel at every row count (no copy, less memory).
        dtype: dtype of float weights and activations (fp32, or the model dtype when it is bf16/fp16).
        dense_dtype: dtype of that dense copy: bf16 where bf16 GEMMs are fast (``fast_bf16_gemm``), fp32 elsewhere
            (``resolve``).
        linear_kernel: the native kernel int4/int8 linears run generated tokens' rows and the LM head on
            (``engine.native_linear``, ``engine.linear_kernel``), or None for torch's int4 kernel.
        dense_gemm: the AMX kernel a bf16 dense copy runs prompt rows on (``engine.amx_gemm``,
            ``engine.dense_gemm``), or None for oneDNN's bf16 GEMM.
    """

    weights: str
    device: torch.device
    dense_min_rows: int | None = DENSE_MIN_ROWS
    dtype: torch.dtype = torch.float32
    dense_dtype: torch.dtype = torch.bfloat16
    linear_kernel: NativeLinearKernel | None = None
    dense_gemm: AmxGemmKernel | None = None

    def kind_for(self, parts: list[torch.Tensor | GGUFBlocks], name: str) -> str:
        """The format one fused projection (its ``parts``) runs in."""
        if self.weights != "native":
            return self.weights
        kinds = {storage_kind(p) for p in parts}
        kind = max(kinds, key=_WIDTH.__getitem__)
        if len(kinds) > 1:
            log.info("%s: parts stored as %s run as %s", name, sorted(kinds), kind)
        return kind

    def build_linear(
        self, parts: list[torch.Tensor | GGUFBlocks], biases: list[torch.Tensor | None] | None, name: str
    ) -> LinearWeight:
        """One ``LinearWeight`` computing the row-stacked ``parts`` (``[out_i, in]`` each).

        A part whose ``in`` is not a multiple of 32 cannot be quantized: such a layer falls back to bf16 with
        a log line.
        """
        kind = self.kind_for(parts, name)
        bias = _concat_bias(parts, biases)
        if kind in ("int4", "int8") and parts[0].shape[1] % QK:
            log.info(
                "%s: in_features %d is not a multiple of %d; %s falls back to bf16",
                name,
                parts[0].shape[1],
                QK,
                kind,
            )
            kind = "bf16"
        if kind in ("int4", "int8"):
            decode, target, keep, weight_class = (
                (int4_groups, "Q4_1", INT4_TYPES, Int4Weight)
                if kind == "int4"
                else (int8_groups, "Q8_0", ("Q8_0",), Int8Weight)
            )
            groups = [decode(_as_blocks(p, target, keep, name)) for p in parts]
            return weight_class(
                type(groups[0]).concat(groups),
                bias,
                self.device,
                self.dense_min_rows,
                self.dense_dtype,
                self.linear_kernel,
                self.dense_gemm,
            )
        dense = torch.cat([_as_float(p) for p in parts])
        if kind == "bf16":
            return BF16Weight(dense, bias, self.device)
        return DenseWeight(
            dense.to(device=self.device, dtype=self.dtype),
            None if bias is None else bias.to(self.device, self.dtype),
        )

    def build_embedding(self, t: torch.Tensor | GGUFBlocks) -> torch.nn.Module | torch.Tensor:
        """The token embedding: quantized blocks stay quantized (``GroupedEmbedding``, exact) unless the plan is
        ``float32`` / ``bf16``; otherwise a dense tensor in ``dtype``."""
        if isinstance(t, GGUFBlocks) and self.weights not in ("float32", "bf16"):
            if t.qtype in INT4_TYPES:
                g = int4_groups(t)
                return GroupedEmbedding(g.q, g.scale, g.zero, 8, self.device)
            g = int8_groups(t)
            return GroupedEmbedding(g.q, g.scale, None, 0, self.device)
        return _as_float(t).to(device=self.device, dtype=self.dtype)


def check_dense_min_rows(setting: object) -> None:
    """Raise ``ValueError`` naming ``engine.dense_min_rows`` unless ``setting`` is ``"auto"``, None or an integer
    >= 1."""
    ok = setting is None or setting == "auto" or (type(setting) is int and setting >= 1)
    if not ok:
        raise ValueError(f"engine.dense_min_rows must be auto, null or an integer >= 1, got {setting!r}")


def auto_dense_min_rows(device: torch.device, kernel: NativeLinearKernel | None) -> int | None:
    """``engine.dense_min_rows: auto``: no dense prefill copy (None) where the quantized linears run on the native
    kernel (either build) on a CPU without fast bf16 GEMMs (``fast_bf16_gemm``), else ``DENSE_MIN_ROWS``.

    There the copy would be fp32, 4 bytes per weight beside the 0.56 of the codes (SmolLM2-135M: 424 MB), and
    the native kernel's panel path (``quant_gemv.c``) runs prompt rows at 0.9x the copy's time at 64 rows and
    1.1-1.3x at 300-1,070 rows while reading 7x fewer bytes per step; measured over HTTP on a 2-core AVX2 EPYC
    (``docs/engine-step.md``, "Prompt rows on the native kernel"): peak RSS 0.68x, the few-token tails of
    prefix hits (W4) 0.59x the time, a cold 1,070-token prefill 1.15x. With bf16 GEMMs the bf16 copy stays:
    there it is ~4x faster than fp32 at prefill sizes. The AVX-512 build has no panel path, and on the one AVX-512
    CPU without fast bf16 GEMMs measured (an Intel Xeon showing AVX512-BF16 but no AMX, ``BF16_GEMM_VENDORS``) it
    still ran a cold 1,070-token prompt in 0.6x the bf16 copy's time and 0.87x an fp32 copy's, with 0.8x the
    peak RSS.
    """
    isa = getattr(kernel, "isa", None)
    if isa in ("avx2", "avx512") and device.type == "cpu" and not fast_bf16_gemm(device):
        return None
    return DENSE_MIN_ROWS


def resolve(
    weights: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    dense_min_rows: int | None | str = "auto",
    linear_kernel: str = "auto",
    dense_gemm: str = "auto",
) -> WeightPlan:
    """``WeightPlan`` for ``engine.weights`` on ``device`` (``auto`` -> ``native`` or ``float32``, logged); the
    dense prefill copy of quantized layers is bf16 where ``fast_bf16_gemm``, else fp32, kept from
    ``dense_min_rows`` rows (``auto``: ``auto_dense_min_rows``; None = no copy); quantized linears run their
    weight-only rows on the kernel ``linear_kernel`` names (``engine.linear_kernel``:
    ``engine.native_linear.resolve_linear_kernel``; only built when some weights stay quantized), and a bf16
    dense copy on the GEMM ``dense_gemm`` names (``engine.dense_gemm``: ``engine.amx_gemm.resolve_dense_gemm``;
    only built when there is a bf16 copy).

    Raises:
        ValueError, UnsupportedHardwareError: see ``check_supported``; ``linear_kernel`` or ``dense_gemm``
            unknown, or ``native`` / ``amx`` where that kernel cannot be built (the message names the setting); a
            bad ``dense_min_rows`` (``check_dense_min_rows``).
    """
    from engine.amx_gemm import check_dense_gemm, resolve_dense_gemm
    from engine.native_linear import check_linear_kernel, resolve_linear_kernel

    check_linear_kernel(linear_kernel)
    check_dense_gemm(dense_gemm)
    check_dense_min_rows(dense_min_rows)
    device = torch.device(device)
    if weights == "auto":
        if int4_kernels_available(device) and dtype == torch.float32:
            weights = "native"
        else:
            log.info(
                "engine.weights auto: no int4 kernel on this %s (or dtype %s); running float32",
                device.type,
                dtype,
            )
            weights = "float32"
    check_supported(weights, "float32", device)
    dense_dtype = torch.bfloat16 if fast_bf16_gemm(device) else torch.float32
    kernel = None if weights in ("float32", "bf16") else resolve_linear_kernel(linear_kernel, device)
    if dense_min_rows == "auto":
        dense_min_rows = auto_dense_min_rows(device, kernel)
        if dense_min_rows is None and weights in ("native", "int4", "int8"):
            log.info(
                "engine.dense_min_rows auto: no dense prefill copy on this CPU (no fast bf16 GEMMs); prompt rows "
                "run on the native linear kernel"
            )
    amx = None
    if weights not in ("float32", "bf16") and dense_min_rows is not None and dense_dtype == torch.bfloat16:
        amx = resolve_dense_gemm(dense_gemm, device)
    elif dense_gemm == "amx":
        raise ValueError(
            "engine.dense_gemm: amx runs a bf16 dense prefill copy of quantized weights, and this configuration "
            f"has none (weights {weights}, dense_min_rows {dense_min_rows}, copy dtype {dense_dtype})"
        )
    return WeightPlan(weights, device, dense_min_rows, dtype, dense_dtype, kernel, amx)


def _concat_bias(parts, biases) -> torch.Tensor | None:
    if biases is None or all(b is None for b in biases):
        return None
    return torch.cat(
        [b.float() if b is not None else torch.zeros(p.shape[0]) for p, b in zip(parts, biases, strict=True)]
    )


def _as_float(t: torch.Tensor | GGUFBlocks) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GGUFBlocks) else t


def _as_blocks(t: torch.Tensor | GGUFBlocks, target: str, keep: tuple[str, ...], name: str) -> GGUFBlocks:
    if isinstance(t, GGUFBlocks) and t.qtype in keep:
        return t
    if isinstance(t, GGUFBlocks):
        log.info("%s: %s re-quantized to %s at load (engine.weights asks for it)", name, t.qtype, target)
    return quantize(_as_float(t).float().cpu(), target)
