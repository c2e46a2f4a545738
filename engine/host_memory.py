"""Host (CPU) memory behaviour of the engine process: keep freed activation buffers for reuse.

A prefill step allocates activations of megabytes per op (a 1,024-token chunk of SmolLM2's MLP is
``1024 * 3072 * 4`` bytes = 12 MiB) and frees them at the end of the op; PyTorch's CPU allocator hands every
such request to ``malloc``. glibc serves requests above its mmap threshold with a fresh ``mmap`` and returns
them with ``munmap`` on free, so the next step takes a page fault on every 4 KiB page it writes again. The
threshold is dynamic (raised up to 32 MiB each time an mmapped chunk is freed) and the heap top is trimmed
back to the OS, so the same step costs more or less depending on what ran before in the process: on the
2-core reference machine a 1,082-token cold prefill of SmolLM2 took 1.15 s after a warm-up and 1.45-1.65 s
after transformers had run in the same process.

``tune_host_allocator`` pins glibc's thresholds (``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)``,
glibc manual, "Malloc Tunable Parameters") so freed buffers stay in the heap and are reused without faults:
the effect the usual advice for PyTorch on CPU (run under jemalloc or tcmalloc) is after, without preloading a
library. Memory freed stays with the process (its peak resident size does not shrink), which suits a
long-running server that will need the same buffers at the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc <malloc.h> parameter numbers (stable ABI since glibc 2.0).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 1 << 30  # requests below 1 GiB come from the heap (a KV pool above it still mmaps)
MMAP_THRESHOLD_FALLBACK = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, for builds that cap the value
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # never give the heap top back to the OS

_tuned = False


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        gnu_get_libc_version = libc.gnu_get_libc_version  # only glibc has it (musl does not)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    gnu_get_libc_version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc


def tune_host_allocator() -> bool:
    """Set glibc's mmap and trim thresholds for this process (idempotent).

    Returns:
        True when the thresholds are set (now or by an earlier call), False where the C library is not glibc
        (macOS, musl) or refused a value: nothing is changed then and the engine works as before, only with
        step times that depend on the allocator's history.
    """
    global _tuned
    if _tuned:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = any(libc.mallopt(M_MMAP_THRESHOLD, v) == 1 for v in (MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_FALLBACK))
    ok = ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    _tuned = ok
    return ok


def is_glibc() -> bool:
    """Whether this process runs on glibc (where ``tune_host_allocator`` applies)."""
    return _glibc() is not None
