"""Which attention kernels an engine runs: ``engine.decode_kernel`` and ``engine.prefill_kernel`` resolved to a
build of ``engine.native_decode``'s kernel (or None: torch's paths), and each choice's part of ``model_id``.

Owns the settings' rules (``auto``: where a build was measured faster, and the AMX build's fit: ``amx_fits``) and
their start-up errors; ``engine.native_decode`` owns building, loading and calling the kernel itself.

Invariant: a token's K/V depends on the kernels that computed it, so every non-torch choice adds its part to
``model_id`` (``decode_kernel_variant``, ``prefill_kernel_variant``) and KV tiers never mix them.
"""

from __future__ import annotations

import logging

import torch

from engine import native_build, native_decode
from engine.api import DECODE_KERNELS, PREFILL_KERNELS
from engine.native_decode import NativeDecodeKernel
from engine.weight_format import cpu_vendor

logger = logging.getLogger(__name__)


def decode_kernel_variant(kernel: NativeDecodeKernel | None) -> str:
    """The part of ``model_id`` naming the decode kernel (``LLMEngine`` appends it): ``""`` for torch's paths,
    ``"/native-decode"`` for the AVX-512 build, ``"/native-decode-<isa>"`` for another (named apart: their bits
    are equal by construction, not checked on one machine running both), ``"/native-decode-bf16-dot"`` for the
    bf16 decode (``NativeDecodeKernel.bf16_decode``)."""
    if kernel is None:
        return ""
    if kernel.bf16_decode:  # another arithmetic (VDPBF16PS), not the avx512-bf16 build's fp32 decode
        return "/native-decode-bf16-dot"
    return "/native-decode" if kernel.isa == "avx512" else f"/native-decode-{kernel.isa}"


def resolve_decode_kernel(
    setting: str,
    device: torch.device,
    group: int | None = None,
    head_dim: int | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> NativeDecodeKernel | None:
    """The kernel ``engine.decode_kernel`` asks for on ``device``: ``torch`` -> None (torch's paths);
    ``native`` -> the kernel, or a start-up error; ``avx512-bf16`` -> the AVX512-BF16 build's bf16 decode
    (``NativeDecodeKernel.bf16_decoder``: scores and values on ``VDPBF16PS``, the query and numerators rounded to
    bf16, each token's result the AVX512-BF16 prefill's for that position), or a start-up error where the cache or
    shape does not fit it or the CPU lacks AVX512-BF16; ``auto`` -> on a CPU, the bf16 decode where
    ``engine.prefill_kernel: auto`` takes the AVX512-BF16 prefill (``bf16_fits``: a bf16 cache and shape it takes,
    an AMD CPU with AVX512-BF16; on a 2-core Zen 4, 8 streams over a shared ~1,000-token SmolLM2 prompt decoded
    1.10x as fast in process, one stream the same: docs/engine-step.md, session 38), else the kernel where it
    builds, else None with a log line saying why. Built once per process and model shape (``group`` query heads
    per KV head, ``head_dim``: compiled with constants, ``NativeDecodeKernel.build``).

    Raises:
        ValueError: an unknown setting, or ``native`` / ``avx512-bf16`` where that kernel is not available or
            does not fit (the message names ``engine.decode_kernel`` and the reason).
    """
    if setting not in DECODE_KERNELS:
        raise ValueError(f"engine.decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got {setting!r}")
    kind = torch.device(device).type
    if setting == "avx512-bf16":
        if not native_decode.bf16_prefill_fits(kv_dtype, head_dim, group):
            raise ValueError(
                "engine.decode_kernel: avx512-bf16 needs engine.kv_dtype bfloat16, a head_dim that is a multiple "
                f"of 32 up to 128 and at most {native_decode.MAX_GROUP} query heads per KV head, got "
                f"{str(kv_dtype).removeprefix('torch.')}, {head_dim} and {group}"
            )
        kernel = native_build.resolve_setting(
            "engine.decode_kernel",
            setting,
            kind,
            lambda: native_decode._shared_kernel(group, head_dim, setting),
            "",
        )
        return None if kernel is None else kernel.bf16_decoder()
    if setting == "auto" and kind == "cpu" and bf16_fits(kv_dtype, head_dim, group):
        kernel = native_decode._shared_kernel(group, head_dim, "avx512-bf16")
        if not isinstance(kernel, str):
            return kernel.bf16_decoder()
        logger.info("engine.decode_kernel auto: not the AVX512-BF16 bf16 decode (%s)", kernel)
    return native_build.resolve_setting(
        "engine.decode_kernel",
        setting,
        kind,
        lambda: native_decode._shared_kernel(group, head_dim, native_decode.build_isa()),
        "torch's decode attention",
    )


def prefill_kernel_variant(kernel: NativeDecodeKernel | None) -> str:
    """The part of ``model_id`` naming the prefill kernel (``LLMEngine`` appends it after the decode kernel's):
    ``""`` for torch's chunked prefill, ``"/native-prefill"`` for the AVX-512 build, ``"/native-prefill-<isa>"``
    for another (``"/native-prefill-amx"`` and ``"/native-prefill-avx512-bf16"`` for the AMX and AVX512-BF16
    builds' other arithmetic). A prompt's K/V differs by kernel; the KV tiers key by ``model_id``."""
    if kernel is None:
        return ""
    return "/native-prefill" if kernel.isa == "avx512" else f"/native-prefill-{kernel.isa}"


def amx_fits(kv_dtype: torch.dtype, head_dim: int | None) -> bool:
    """Whether ``engine.prefill_kernel: auto`` tries the AMX build: a bf16 cache, ``head_dim`` 64, a CPU with AMX
    and AVX512-BF16, and no other instruction set asked for (``$PREFIXGATE_ATTENTION_ISA``)."""
    return (
        kv_dtype == torch.bfloat16
        and head_dim == native_decode.AMX_HEAD_DIM
        and native_decode.build_isa() == "avx512"
        and native_decode._cpu_ok("amx")[0]
    )


BF16_DOT_AUTO_VENDORS = frozenset({"AuthenticAMD"})
"""``/proc/cpuinfo`` vendors whose CPUs ``engine.prefill_kernel: auto`` gives the AVX512-BF16 build, where it was
measured faster than the fp32 AVX-512 build (``python -m bench.prefill_kernels``, SmolLM2's shape, 2 threads):
on a 2-core Zen 4 EPYC 0.48-0.55x a layer (session 29). Not on Intel: on a 2-core Xeon (family 6 model 207,
session 30) it took 1.05-1.25x the fp32 build's time (1,070 rows 10.6 vs 8.4 ms, 56 rows over 1,028 cached 1.26
vs 1.04 ms), because there ``VDPBF16PS`` (two bf16 products a lane) issued once per ~1.6 TSC cycles against 0.4
for ``VFMADD231PS`` (12 independent chains of each): the halved instruction count costs more. The fp32 build,
the more exact, is then also the faster; asked for by name the AVX512-BF16 build still runs everywhere."""


def bf16_fits(kv_dtype: torch.dtype, head_dim: int | None, group: int | None) -> bool:
    """Whether ``engine.prefill_kernel: auto`` tries the AVX512-BF16 build: the cache and shape fit it
    (``native_decode.bf16_prefill_fits``), a CPU with AVX512-BF16 of a vendor it is measured faster on
    (``BF16_DOT_AUTO_VENDORS``), and no other instruction set asked for (``$PREFIXGATE_ATTENTION_ISA``)."""
    return (
        native_decode.bf16_prefill_fits(kv_dtype, head_dim, group)
        and native_decode.build_isa() == "avx512"
        and native_decode._cpu_ok("avx512-bf16")[0]
        and cpu_vendor() in BF16_DOT_AUTO_VENDORS
    )


def resolve_prefill_kernel(
    setting: str,
    device: torch.device,
    group: int | None = None,
    head_dim: int | None = None,
    threads: int = 1,
    kv_dtype: torch.dtype = torch.float32,
) -> NativeDecodeKernel | None:
    """The kernel ``engine.prefill_kernel`` asks for on ``device`` (``NativeDecodeKernel.prefill``): ``amx`` -> the
    AMX build (``paged_prefill_attention_amx``: a bf16 cache and ``head_dim`` 64 only), or a start-up error;
    ``auto`` takes it first where it builds and the cache and shape fit (``amx_fits``; on a 2-core Xeon with AMX,
    SmolLM2's shape, 1,070 rows, 2 threads: 3.2 against 7.9 ms a layer for the AVX-512 build);
    ``avx512-bf16`` -> the AVX512-BF16 build (``paged_prefill_attention_bf16``: a bf16 cache, ``head_dim`` a
    multiple of 32 up to 128), or a start-up error; ``auto`` takes it next where it builds and fits on an AMD
    CPU (``bf16_fits``, ``BF16_DOT_AUTO_VENDORS``; on a 2-core Zen 4 EPYC, SmolLM2's shape, 1,070 rows, 2
    threads: 4.3 against 8.7 ms a layer for the AVX-512 build; slower than it on an Intel Xeon); ``torch`` ->
    None (torch's chunked prefill); ``native`` -> the kernel (the same library as the decode kernel, built once
    per process and model shape), or a start-up error; ``auto`` -> the kernel where it is measured faster than
    torch's chunked prefill, else None: on a CPU, the AVX-512 build (``build_isa``), and the AVX2 build (CPUs
    without AVX-512) when the engine runs at least 2 ``threads``. On a 2-core AMD EPYC Zen 4 with AVX512-BF16
    (session 17, SmolLM2, 2 threads, whole requests from ``add_request`` to the first token, native over torch's
    time): bf16 cache 0.74x cold at 1,082 tokens (930 vs 1,255 ms), 0.72x for 54 rows over 1,028 cached (80 vs
    111 ms), 0.64x cold at ~4,000 tokens (6.8 vs 10.6 s); the fp32 cache runs the same kernel at the same speed
    (938 / 81 ms). Session 12 had measured the bf16 cache at 0.80-1.08x of torch's speed, before the kernel's
    K/V loads served every query head of a KV head and its build asked for 512-bit vectors. On an AVX2-only EPYC
    Zen 3 (session 15, each value row widened once per tile; attention time, bf16 cache, 512-token chunks):
    1.12x / 1.28x at 1,024 tokens, 0.83x / 1.08x at 4,096 (1 / 2 threads); whole requests at 2 threads took
    0.75x (4 prompt tokens over 983 cached), 0.95x (48 over 1,600) and 0.79x (1,050 cold) of torch's time.
    Torch attends in fp32 there whatever the cache (``engine.attention.attention_dtype``).
    ``docs/engine-step.md``.

    Args:
        threads: the engine's thread count for prefill steps (``auto`` on AVX2 needs 2 or more).
        kv_dtype: the KV cache's dtype (the AMX build takes bf16 only).

    Raises:
        ValueError: an unknown setting, or ``native`` / ``amx`` / ``avx512-bf16`` where that kernel is not
            available or (``amx``, ``avx512-bf16``) the cache or shape does not fit it (the message names
            ``engine.prefill_kernel`` and the reason).
    """
    if setting not in PREFILL_KERNELS:
        raise ValueError(
            f"engine.prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}, got {setting!r}"
        )
    dtype = str(kv_dtype).removeprefix("torch.")
    refusal = {
        "amx": None
        if kv_dtype == torch.bfloat16 and head_dim == native_decode.AMX_HEAD_DIM
        else f"needs engine.kv_dtype bfloat16 and head_dim {native_decode.AMX_HEAD_DIM}, got {dtype} and {head_dim}",
        "avx512-bf16": None
        if native_decode.bf16_prefill_fits(kv_dtype, head_dim, group)
        else "needs engine.kv_dtype bfloat16, a head_dim that is a multiple of 32 up to 128 and at most "
        f"{native_decode.MAX_GROUP} query heads per KV head, got {dtype}, {head_dim} and {group}",
    }
    if setting in refusal:  # a build asked for by name: it must fit, then build
        if refusal[setting] is not None:
            raise ValueError(f"engine.prefill_kernel: {setting} {refusal[setting]}")
        return native_build.resolve_setting(
            "engine.prefill_kernel",
            setting,
            torch.device(device).type,
            lambda: native_decode._shared_kernel(group, head_dim, setting),
            "",
        )
    if setting == "auto" and torch.device(device).type == "cpu":  # the rounding builds first, where they fit
        for build, fits, name in (
            ("amx", amx_fits(kv_dtype, head_dim), "AMX"),
            ("avx512-bf16", bf16_fits(kv_dtype, head_dim, group), "AVX512-BF16"),
        ):
            if fits:
                kernel = native_decode._shared_kernel(group, head_dim, build)
                if not isinstance(kernel, str):
                    return kernel
                logger.info("engine.prefill_kernel auto: not the %s build (%s)", name, kernel)
    isa = native_decode.build_isa()
    measured_faster = isa == "avx512" or (isa == "avx2" and threads >= 2)
    if setting == "auto" and not measured_faster:
        return None
    return native_build.resolve_setting(
        "engine.prefill_kernel",
        setting,
        torch.device(device).type,
        lambda: native_decode._shared_kernel(group, head_dim, isa),
        "torch's chunked prefill",
    )
