"""Building and caching the engine's native C kernels (``engine/kernels/*.c``), shared by every kernel module.

Owns: where built kernels live (``$PREFIXGATE_KERNEL_DIR``, default ``~/.cache/prefixgate/kernels``), which
compiler builds them (``$CC``, else ``cc``, else ``gcc``), whether the CPU runs them (x86-64 with the AVX-512
subsets a kernel names), and the build itself: ``<stem>-<hash>.so`` named by a hash of the source, the flags
and the compiler's version, compiled to a temporary name in the same directory and renamed into place, so a
half-written library is never loaded and two processes building at once both end with a whole one. Used by
``engine.native_decode`` (decode attention) and ``engine.native_linear`` (quantized linears).

Invariants: no kernel is built with ``-ffast-math`` (GCC 12 links ``crtfastmath.o`` into a shared library
built with it, which sets flush-to-zero for the whole process); a library is only ever loaded from its final
name.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "fma"})
"""CPU flags every AVX-512 build needs (``engine.weight_format.cpu_flags`` names)."""
AMX_BF16 = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}
"""CPU flags the AMX builds need (``engine.amx_gemm``, ``engine.native_decode``'s ``amx``)."""
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")
"""Compiler flags every kernel build starts with (a shared library, OpenMP: the runtime torch loaded)."""
AMX_BF16_FLAGS = ("-mavx512bf16", "-mamx-tile", "-mamx-bf16")
"""Compiler flags the AMX builds add to their AVX-512 ones."""


class NativeKernelError(RuntimeError):
    """A native kernel cannot be built or loaded here (the message says why: CPU, compiler, compile, check)."""


def kernel_dir() -> Path:
    """Where built kernels are kept: ``$PREFIXGATE_KERNEL_DIR``, else ``~/.cache/prefixgate/kernels``."""
    env = os.environ.get("PREFIXGATE_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixgate" / "kernels"


def compiler() -> str | None:
    """Path of the C compiler: ``$CC`` (default ``cc``) if on ``PATH``, else ``gcc``, else None."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def cpu_ok(required: frozenset[str] = AVX512) -> tuple[bool, str]:
    """(True, "") when this is an x86-64 CPU with every flag of ``required``, else (False, the reason)."""
    from engine.weight_format import cpu_flags

    if os.uname().machine != "x86_64":
        return False, f"a {os.uname().machine} CPU (the kernel is built for x86-64 AVX-512)"
    missing = required - cpu_flags()
    if missing:
        return False, f"no {', '.join(sorted(missing))} on this CPU"
    return True, ""


def compiler_version(cc: str) -> str:
    """``cc --version``'s output (part of the build's hash).

    Raises:
        NativeKernelError: the compiler does not run.
    """
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelError(f"the C compiler {cc} does not run: {exc}") from exc


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The headers ``source`` includes with quotes (``#include "name.h"``, beside it), in order of first
    appearance, each once: part of the build's hash, so editing a shared header rebuilds every kernel using it.

    Raises:
        NativeKernelError: an included header is not beside the source.
    """
    found: list[Path] = []
    for name in _LOCAL_INCLUDE.findall(source.read_bytes()):
        path = source.parent / name.decode()
        if not path.is_file():
            raise NativeKernelError(f"{source.name} includes {name.decode()!r}, which is not beside it")
        if path not in found:
            found.append(path)
    return found


def build_library(
    source: Path, cc: str, flags: tuple[str, ...], libs: tuple[str, ...] = (), directory: Path | None = None
) -> Path:
    """The shared library of ``source`` built with ``cc flags ... libs`` in ``directory`` (default
    ``kernel_dir()``): found by its hash if built before, else compiled to a temporary name and renamed.

    Raises:
        NativeKernelError: the compiler does not run or the compile fails (its last error lines quoted).
    """
    version = compiler_version(cc)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in local_headers(source))
    digest = hashlib.sha256(text + repr((flags, libs, version)).encode()).hexdigest()[:16]
    directory = kernel_dir() if directory is None else directory
    target = directory / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, str(source), *libs]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeKernelError(f"compiling {source.name} failed: {exc}") from exc
        if res.returncode != 0:
            raise NativeKernelError(f"compiling {source.name} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CheckedKernel(Protocol):
    """A loaded kernel that can check itself against a reference (``self_check``: None, or what is wrong)."""

    def self_check(self) -> str | None: ...


_log = logging.getLogger(__name__)

K = TypeVar("K", bound=CheckedKernel)


def build_checked(
    load: Callable[[Path], K],
    source: Path,
    cpu: tuple[bool, str],
    cc: str | None,
    flags: tuple[str, ...],
    libs: tuple[str, ...] = (),
    directory: Path | None = None,
) -> K:
    """Build (or find built) ``source``, load it with ``load`` and check it: the steps both native kernels
    share. ``cpu``: ``cpu_ok``'s answer for the kernel's instruction sets; ``cc``: ``compiler()``'s.

    Raises:
        NativeKernelError: the CPU lacks an instruction set, no C compiler, the compile failed, the library
            does not load, or it fails its ``self_check``; the message says which.
    """
    ok, why = cpu
    if not ok:
        raise NativeKernelError(why)
    if cc is None:
        raise NativeKernelError("no C compiler (set CC, or install gcc)")
    target = build_library(source, cc, flags, libs, directory)
    try:
        kernel = load(target)
    except OSError as exc:
        raise NativeKernelError(f"{target} does not load: {exc}") from exc
    err = kernel.self_check()
    if err is not None:
        raise NativeKernelError(f"{target} fails its check against a float64 reference: {err}")
    return kernel


def shared_build(build: Callable[..., K]) -> Callable[..., K | str]:
    """``build`` once per process and argument tuple: the kernel it returns, or the message of the
    ``NativeKernelError`` it raised (what ``resolve_setting``'s ``shared`` takes). The result is a
    ``functools.cache`` (``cache_clear`` builds again)."""

    @functools.cache
    def shared(*args, **kwargs) -> K | str:
        try:
            return build(*args, **kwargs)
        except NativeKernelError as exc:
            return str(exc)

    return shared


def resolve_setting(
    setting_name: str, setting: str, device: str, shared: Callable[[], K | str], fallback: str
) -> K | None:
    """The kernel a ``native | auto | torch`` setting (already validated) asks for on ``device``: ``torch`` ->
    None; ``auto`` -> the kernel where it builds on a CPU, else None with a log line naming ``fallback`` and why;
    any other value (``native``, or a named variant such as ``engine.linear_kernel: int8-activations``) ->
    ``shared()``'s kernel, or a start-up error. ``shared``: the kernel, or why it is not available.

    Raises:
        ValueError: a value other than ``auto`` where the kernel is not available (the message names
            ``setting_name`` and the value).
    """
    if setting == "torch":
        return None
    if device != "cpu":
        if setting != "auto":
            raise ValueError(f"{setting_name}: {setting} runs on CPU only, not on {device}")
        return None
    kernel = shared()
    if isinstance(kernel, str):
        if setting != "auto":
            raise ValueError(f"{setting_name}: {setting} is not available here: {kernel}")
        _log.info("%s auto: %s (%s)", setting_name, fallback, kernel)
        return None
    return kernel
