"""The weight stream's prefetch hint (``engine.native_linear.prefetch_flags``, ``GEMV_PREFETCH_LOCALITY`` in
``engine/kernels/quant_gemv.c``) and the CPU description it is chosen by (``engine.weight_format.cpu_vendor``).

The locality by vendor (``prefetchnta`` on AMD, ``prefetcht1`` elsewhere), a bad one refused by name, the flag
reaching the build (another library), and the same bits from every locality: a hint never changes an output.
"""

from __future__ import annotations

import pytest
import torch

from engine import native_build, weight_format
from engine.native_build import NativeKernelError
from engine.native_linear import (
    INT8_ACTIVATION_REQUIRED,
    Int8ActivationKernel,
    NativeLinearKernel,
    pack_int4,
    pack_int8,
    prefetch_flags,
    random_groups,
    select_int8_isa,
)

CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: 25
flags\t\t: fpu avx2 fma f16c avx512f
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: SomeoneElse
flags\t\t: fpu
"""


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_the_vendor_and_flags_are_read_from_the_first_processor(tmp_path, vendor):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(vendor=vendor))
    assert weight_format.cpuinfo_field("vendor_id", str(path)) == vendor
    assert weight_format.cpuinfo_field("flags", str(path)) == "fpu avx2 fma f16c avx512f"
    assert weight_format.cpuinfo_field("cpu family", str(path)) == "25"
    assert weight_format.cpuinfo_field("model name", str(path)) == ""  # absent


def test_no_cpu_description_reads_as_empty(tmp_path):
    assert weight_format.cpuinfo_field("vendor_id", str(tmp_path / "absent")) == ""


@pytest.mark.parametrize(
    ("vendor", "locality"), [("AuthenticAMD", 0), ("GenuineIntel", 2), ("HygonGenuine", 2), ("", 2)]
)
def test_the_locality_follows_the_vendor(monkeypatch, vendor, locality):
    monkeypatch.setattr(weight_format, "cpu_vendor", lambda: vendor)
    assert prefetch_flags() == (f"-DGEMV_PREFETCH_LOCALITY={locality}",)
    assert prefetch_flags(3) == ("-DGEMV_PREFETCH_LOCALITY=3",)  # asked for: whatever the vendor


@pytest.mark.parametrize("bad", [-1, 4, 1.5, "2"])
def test_a_locality_outside_0_to_3_is_refused_by_name(bad, tmp_path):
    with pytest.raises(NativeKernelError, match="prefetch locality is 0, 1, 2 or 3"):
        prefetch_flags(bad)
    with pytest.raises(NativeKernelError, match="prefetch locality"):
        NativeLinearKernel.build(tmp_path, prefetch_locality=bad)
    assert not list(tmp_path.iterdir())  # refused before anything was compiled


INT8_OK = (
    native_build.cpu_ok(INT8_ACTIVATION_REQUIRED[select_int8_isa()])[0]
    and native_build.compiler() is not None
)


@pytest.mark.skipif(not INT8_OK, reason="needs x86-64 AVX2 (or AVX-512 VNNI), F16C, FMA and a C compiler")
@pytest.mark.parametrize("cls", [NativeLinearKernel, Int8ActivationKernel])
def test_every_locality_gives_the_same_bits_from_its_own_build(cls):
    kernels = {loc: cls.build(prefetch_locality=loc) for loc in (0, 1, 2, 3)}
    assert len({k.path for k in kernels.values()}) == 4  # the flag reaches each build
    # 8 KB ahead of a block is past the end of a small matrix: shapes long enough that the prefetches land
    # inside it as well as beyond it (a prefetch never faults)
    for bits, n, k in ((4, 61, 160), (4, 576, 1536), (8, 300, 576)):
        groups = random_groups(bits, n, k, torch.Generator().manual_seed(n))
        packed = pack_int4(groups) if bits == 4 else pack_int8(groups)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
        for m in (1, 8, 9):
            for threads in (1, 2):
                outs = [kern.mm(packed, x[:m], threads=threads) for kern in kernels.values()]
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (bits, n, k, m, threads)
