"""The model runner: one scheduled step in, one sampled token per finished-prefill / decode row out.

``prepare`` flattens a step's sequences (prefill chunks and decodes, any mix) into the model's inputs, as in
vLLM v1's ``gpu_model_runner`` and nano-vllm's ``prepare_prefill``/``prepare_decode``:

- ``input_ids`` / ``positions``: int64 ``[T]``, the tokens ``[start, start + n)`` of each sequence, in order;
- ``slot_mapping``: int64 ``[T]``, ``block_table[p // block_size] * block_size + p % block_size`` for position p;
- ``AttentionMetadata``: ``query_start_loc`` (B+1), ``seq_lens`` (context after the step), ``block_tables``
  int64 ``[B, max_blocks]`` padded with 0 (padding is never read);
- ``logit_rows``: int64 ``[N]``, the last row of each sequence that needs a token: a prefill chunk that
  reaches the end of its known tokens, and every decode. Only those rows go through the LM head.

``execute`` runs the forward pass and samples with ``engine.sampling`` (each sequence's own sampler), with the
torch thread count ``engine.step_threads`` picks for the step, set by the thread that calls it; the native
weight kernel (``engine.native_linear``) runs with the engine's ``num_threads`` in every step.
The runner owns the KV tensor (``engine.model.allocate_kv_cache``); the block ids in it are the
``KVCacheManager``'s.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.model import LlamaModel, allocate_kv_cache
from engine.native_decode import NativeDecodeKernel
from engine.native_glue import NativeGlueKernel
from engine.native_linear import set_kernel_threads
from engine.native_step import NativeDecodeStep
from engine.row_kernels import RowKernels
from engine.sampling import SampledToken, SequenceSampler, sample_sequences
from engine.step_threads import StepThreads


def use_threads(n: int) -> bool:
    """Set the calling thread's torch intra-op thread count to ``n`` unless it already is (a change costs
    microseconds, a read less: docs/engine-step.md). Returns True when it changed."""
    if torch.get_num_threads() == n:
        return False
    torch.set_num_threads(n)
    return True


@dataclass
class SeqInput:
    """One sequence of a step.

    Attributes:
        token_ids: its tokens to compute this step (``n >= 1`` of them).
        start: position of the first of them (= tokens already computed).
        block_table: physical block ids covering positions ``[0, start + n)``.
        needs_token: True when a token is sampled after this step (the chunk reaches the sequence's end).
        sampler: its own sampling state (read when ``needs_token``).
        prompt_len: its prompt's length: rows of positions before it run the quantized linears' dense copy,
            the others their int4 kernel (``engine.row_kernels``); None for every sequence of a step = by the
            step's row count.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    needs_token: bool
    sampler: SequenceSampler
    prompt_len: int | None = None


@dataclass
class ModelInput:
    """Flattened inputs of one step (see the module docstring); ``sample_seqs`` index the sequences sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    samplers: list[SequenceSampler]
    sample_seqs: list[int]
    row_kernels: RowKernels | None = None


@dataclass
class StepResult:
    """Sampled tokens, one per entry of ``ModelInput.sample_seqs`` (ids, and logprobs / forks in ``samples``),
    and their float32 logits when asked."""

    token_ids: list[int]
    logits: torch.Tensor | None
    samples: list[SampledToken] = field(default_factory=list)


class ModelRunner:
    """Runs a ``LlamaModel`` over the paged KV cache.

    Args:
        model: the decoder; its device and dtype are used for the KV cache.
        num_blocks: blocks of the KV pool.
        block_size: tokens per block.
        kv_dtype: dtype of the KV cache (default: the model's).
        shared_prefix: cascade attention for decode sequences sharing leading blocks (``engine.decode_attention``).
        step_threads: the torch thread count of each step (``engine.step_threads``); None = torch's live count,
            never changed.
        decode_kernel: the native decode-attention kernel (``engine.native_decode``), or None for torch's
            paths.
        prefill_kernel: the native kernel for prompt tokens (``NativeDecodeKernel.prefill``), or None for
            torch's chunked prefill.
        glue_kernel: the native layer-glue kernel (``engine.native_glue``) every row of every step runs its
            norms, RoPE, K/V store and SiLU * up on, or None for torch's ops.
        decode_step: with the glue kernel, the one-call decode step (``engine.native_step``) decode-only steps
            take where they can (the same bits as the layer loop), or None.

    Attributes:
        steps_by_threads: forward passes run, by the thread count they ran with (only with ``step_threads``).
        thread_switches: ``torch.set_num_threads`` calls made (only when a step's count differed).
    """

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
        shared_prefix: bool = True,
        step_threads: StepThreads | None = None,
        decode_kernel: NativeDecodeKernel | None = None,
        prefill_kernel: NativeDecodeKernel | None = None,
        glue_kernel: NativeGlueKernel | None = None,
        decode_step: NativeDecodeStep | None = None,
    ):
        self.model = model
        self.glue_kernel = glue_kernel
        self.decode_step = decode_step if glue_kernel is not None else None
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.shared_prefix = shared_prefix
        self.step_threads = step_threads
        self.steps_by_threads: Counter[int] = Counter()
        self.thread_switches = 0
        self.block_size = block_size
        self.kv_cache = allocate_kv_cache(
            model.config, num_blocks, block_size, kv_dtype or model.dtype, model.device
        )

    def prepare(self, seqs: list[SeqInput]) -> ModelInput:
        """Flatten ``seqs`` into one step's tensors.

        Raises:
            ValueError: an empty step, or a block table too short for a sequence.
        """
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        rows: list[int] = []
        sample_seqs: list[int] = []
        by_role = all(s.prompt_len is not None for s in seqs)
        dense_rows: list[int] = []  # rows of prompt tokens (by_role)
        kernel_rows: list[int] = []  # rows of generated tokens
        max_blocks = max(len(s.block_table) for s in seqs)
        padded: list[list[int]] = []
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            end = s.start + n
            table = s.block_table
            if n < 1 or len(table) * bs < end:
                raise ValueError(f"sequence {i}: {n} tokens at {s.start} do not fit {len(table)} blocks")
            ids.extend(s.token_ids)
            pos = range(s.start, end)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            row = qsl[-1]
            if by_role:
                # positions before prompt_len are prompt tokens: the first min(n, prompt_len - start) rows
                cut = row + min(n, max(0, s.prompt_len - s.start))
                dense_rows.extend(range(row, cut))
                kernel_rows.extend(range(cut, row + n))
            qsl.append(row + n)
            seq_lens.append(end)
            padded.append(table + [0] * (max_blocks - len(table)))
            if s.needs_token:
                rows.append(qsl[-1] - 1)
                sample_seqs.append(i)
        row_kernels = None
        if by_role:
            row_kernels = RowKernels(
                torch.tensor(dense_rows, dtype=torch.int64) if dense_rows else None,
                torch.tensor(kernel_rows, dtype=torch.int64) if kernel_rows else None,
            )
        tables = torch.tensor(padded, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=bs,
            decode_kernel=self.decode_kernel,
            prompt_lens=[s.prompt_len for s in seqs]
            if row_kernels is not None or self.prefill_kernel is not None
            else None,
            prefill_kernel=self.prefill_kernel,
        )
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            meta=meta,
            logit_rows=torch.tensor(rows, dtype=torch.int64),
            samplers=[seqs[i].sampler for i in sample_seqs],
            sample_seqs=sample_seqs,
            row_kernels=row_kernels,
        )

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V into block ``dst``, every layer (copy-on-write of a forked partial block)."""
        self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    @torch.inference_mode()
    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots (token positions) of block ``src``'s K and V into block ``dst``, every
        layer (a token-granular prefix hit, ``KVCacheManager.set_slot_copier``); ``src`` is only read.

        Raises:
            ValueError: ``n`` not in ``[1, block_size]``, or ``src == dst``.
        """
        if not 1 <= n <= self.block_size or src == dst:
            raise ValueError(f"cannot copy {n} slots of block {src} into block {dst}")
        self.kv_cache[:, :, dst, :n].copy_(self.kv_cache[:, :, src, :n])

    @torch.inference_mode()
    def execute(self, inp: ModelInput, return_logits: bool = False) -> StepResult:
        """Forward the step, compute logits of ``logit_rows`` only, and sample one token for each.

        Args:
            inp: from ``prepare``.
            return_logits: also return the float32 ``[N, vocab]`` logits (tests).
        """
        if self.step_threads is not None:
            n = self.step_threads.for_step(inp.meta.query_start_loc[-1], len(inp.meta.seq_lens))
            # set under ``off`` too: a count another engine left in this thread is not inherited
            self.thread_switches += use_threads(n)
            self.steps_by_threads[n] += 1
            set_kernel_threads(self.step_threads.num_threads)  # weight GEMVs: every core, any step
        hidden = self.model(
            inp.input_ids,
            inp.positions,
            self.kv_cache,
            inp.meta,
            self.shared_prefix,
            inp.row_kernels,
            self.glue_kernel,
            self.decode_step,
            inp.logit_rows.to(self.model.device),
        )
        if not inp.sample_seqs:
            return StepResult([], None)
        logits = self.model.compute_logits(hidden)
        logits = logits.float().cpu()
        samples = sample_sequences(logits, inp.samplers)
        return StepResult([s.token_id for s in samples], logits if return_logits else None, samples)
