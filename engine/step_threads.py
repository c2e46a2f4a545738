"""Torch intra-op threads per step (issue 12, ``engine.small_step_threads``; ``docs/engine-step.md``).

A decode step of one sequence is ~1,800 small ops; on a 2-core CPU each OpenMP parallel region's fork and join
costs more than the second core gives back, so one stream decodes faster on one thread, while a prefill chunk or
a batch of many decode rows wants every thread. ``StepThreads`` says which count a step runs with: decode-only
steps (every sequence computes one token) of at most ``small_max_rows`` rows run with ``small_threads``, every
other step (any prefill chunk, bigger batches) with the configured ``num_threads``. ``ModelRunner.execute``
applies it (``engine.model_runner.use_threads``: only when it changes); the native weight kernel's GEMVs run on
``num_threads`` in every step, small ones included (``engine.native_linear.set_kernel_threads``). Torch-free, so the gateway's config
loader validates ``engine.small_step_threads`` with ``check_small_step_threads``.

Invariants:

- nothing in a step's plan reads torch's live thread count: decode contexts are cut at fixed positions
  (``engine.chunked_decode``) and the weight kernels choose by the token's role (``engine.row_kernels``);
- the kernels a step runs give bit-identical rows at 1 and 2 threads (measured: the int4 kernel, the dense bf16
  copy, the LM head, the CPU flash kernel in bf16 over the fixed chunks, fp32 matmuls over contiguous batches;
  ``tests/engine/test_batch_invariance.py``); torch's fp32 flash kernel does not (each thread's scratch buffer
  has its own alignment), which is why fp32 caches attend with fp32 matmuls;
- the count is set by the thread that runs the forward (``ModelRunner.execute``): OpenMP's thread count and
  MKL's are per calling thread (``at::set_num_threads`` also stores the process default a new thread starts
  from).
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_STEP_MAX_ROWS = 2
"""Decode-only steps of at most this many rows run with ``small_threads`` (measured: docs/engine-step.md)."""

SMALL_STEP_AUTO_THREADS = 1
"""Threads of a small step under ``small_step_threads: auto`` (measured on a 2-core AMD EPYC, Zen 5)."""

SMALL_STEP_AUTO_MAX_THREADS = 2
"""``auto`` switches only when ``num_threads`` is at most this: the one-thread gain was measured at 2 threads
with a 135M model; with more cores (or a larger model, whose decode GEMVs need the memory bandwidth of several
cores) it is not measured, so ``auto`` keeps every step on ``num_threads`` there (set an int to switch)."""


@dataclass(frozen=True)
class StepThreads:
    """The thread count of each step.

    Attributes:
        num_threads: the configured count (``engine.num_threads``, else torch's at start): prefill chunks, mixed
            steps, decode batches of more than ``small_max_rows`` rows, and the decode split's parts.
        small_threads: the count of decode-only steps of at most ``small_max_rows`` rows.
        small_max_rows: see above (0: every step runs with ``num_threads``).
    """

    num_threads: int
    small_threads: int
    small_max_rows: int = SMALL_STEP_MAX_ROWS

    @classmethod
    def from_setting(cls, num_threads: int | None, setting: int | str, default_threads: int) -> StepThreads:
        """The policy of ``engine.num_threads`` (None: ``default_threads``, torch's count at start) and
        ``engine.small_step_threads``: ``"auto"`` (``SMALL_STEP_AUTO_THREADS`` when ``num_threads`` is at most
        ``SMALL_STEP_AUTO_MAX_THREADS``, else as ``"off"``), ``"off"`` (always ``num_threads``) or an int >= 1.

        Raises:
            ValueError: ``num_threads`` < 1 or a bad ``small_step_threads``, naming the key.
        """
        check_small_step_threads(setting)
        if num_threads is not None and (isinstance(num_threads, bool) or num_threads < 1):
            raise ValueError(f"engine.num_threads must be an integer >= 1 or null, got {num_threads!r}")
        n = default_threads if num_threads is None else num_threads
        if setting == "off" or (setting == "auto" and n > SMALL_STEP_AUTO_MAX_THREADS):
            return cls(n, n, 0)
        return cls(n, SMALL_STEP_AUTO_THREADS if setting == "auto" else setting)

    def for_step(self, num_tokens: int, num_seqs: int) -> int:
        """Threads of a step computing ``num_tokens`` tokens of ``num_seqs`` sequences (decode-only when equal)."""
        if num_tokens == num_seqs <= self.small_max_rows:
            return self.small_threads
        return self.num_threads

    @property
    def switches(self) -> bool:
        """True when some steps run with another count than ``num_threads``."""
        return self.small_max_rows > 0 and self.small_threads != self.num_threads


def check_small_step_threads(setting: object) -> None:
    """Raise ValueError naming ``engine.small_step_threads`` unless ``setting`` is ``auto``, ``off`` or an
    int >= 1."""
    ok = setting in ("auto", "off") if isinstance(setting, str) else isinstance(setting, int) and setting >= 1
    if isinstance(setting, bool) or not ok:
        raise ValueError(
            f"engine.small_step_threads must be 'auto', 'off' or an integer >= 1, got {setting!r}"
        )
