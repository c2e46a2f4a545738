"""``engine.native_build``: a kernel build's hash covers the headers its source includes beside it, so a shared
header's edit rebuilds every kernel using it; a missing one is refused by name. ``shared_build``: once per process
and arguments, a failure kept as its message; every kernel the machine can run builds and passes its self-check
(a broken build would otherwise only make the tests needing it skip)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import native_build
from engine.native_build import NativeKernelError, build_library, local_headers

KERNELS = Path(native_build.__file__).with_name("kernels")


def test_the_amx_kernels_share_one_tile_configuration_header():
    header = KERNELS / "amx_tiles.h"
    assert local_headers(KERNELS / "amx_gemm.c") == [header]
    assert local_headers(KERNELS / "paged_decode.c") == [header]
    assert local_headers(KERNELS / "quant_gemv.c") == []


def test_local_headers_in_order_once_and_missing_ones_named(tmp_path):
    (tmp_path / "a.h").write_text("#define A 1\n")
    (tmp_path / "b.h").write_text("#define B 2\n")
    src = tmp_path / "k.c"
    src.write_text(
        '#include <stdint.h>\n#include "b.h"\n  #  include "a.h"\n#include "b.h"\nint f(void) { return A + B; }\n'
    )
    assert local_headers(src) == [tmp_path / "b.h", tmp_path / "a.h"]
    src.write_text('#include "gone.h"\n')
    with pytest.raises(NativeKernelError, match="includes 'gone.h', which is not beside it"):
        local_headers(src)


def test_a_header_edit_changes_the_build(tmp_path):
    cc = native_build.compiler()
    if cc is None:
        pytest.fail("no C compiler: the native kernels need one (README)")
    (tmp_path / "v.h").write_text("#define V 1\n")
    src = tmp_path / "k.c"
    src.write_text('#include "v.h"\nint value(void) { return V; }\n')
    out = tmp_path / "out"
    first = build_library(src, cc, ("-O2", "-shared", "-fPIC"), directory=out)
    assert build_library(src, cc, ("-O2", "-shared", "-fPIC"), directory=out) == first  # found by its hash
    (tmp_path / "v.h").write_text("#define V 2\n")
    second = build_library(src, cc, ("-O2", "-shared", "-fPIC"), directory=out)
    assert second != first and first.exists() and second.exists()


def test_a_shared_build_runs_once_per_arguments_and_keeps_the_reason_it_failed():
    calls = []

    def build(isa: str = "avx512"):
        calls.append(isa)
        if isa == "neon":
            raise NativeKernelError("no neon build")
        return f"kernel-{isa}"

    shared = native_build.shared_build(build)
    assert shared() == shared() == "kernel-avx512"
    assert shared("neon") == shared("neon") == "no neon build"  # the message, not an exception
    assert calls == ["avx512", "neon"]
    shared.cache_clear()
    assert shared() == "kernel-avx512" and calls == ["avx512", "neon", "avx512"]


def test_a_shared_build_lets_other_errors_through():
    def build():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        native_build.shared_build(build)()


# A kernel that builds but fails its self-check is kept as a message, as a CPU without its instructions is, and
# the tests needing it skip: on a CPU that can run it, that message must never be a broken build or check.
BROKEN_BUILD = ("fails its check", "compiling", "does not load", "does not run", "which is not beside it")


def _shared_builds():
    from engine import amx_gemm, native_decode, native_glue, native_linear, native_step

    return [
        ("amx_gemm", amx_gemm._shared_kernel),
        ("native_decode avx512", lambda: native_decode._shared_kernel(3, 64, "avx512")),
        ("native_decode amx", lambda: native_decode._shared_kernel(3, 64, "amx")),
        ("native_linear", native_linear._shared_kernel),
        ("int8 activations", native_linear._shared_int8_activation_kernel),
        ("native_glue", native_glue._shared_kernel),
        ("native_step", native_step._shared_step),
    ]


@pytest.mark.parametrize("name", [name for name, _ in _shared_builds()])
def test_a_kernel_is_unavailable_only_where_the_machine_cannot_run_it(name):
    shared = dict(_shared_builds())[name]()
    if isinstance(shared, str):
        assert not any(marker in shared for marker in BROKEN_BUILD), f"{name}: {shared}"
