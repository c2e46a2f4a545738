"""The native layer step: every decoder layer of a decode-only step, or of a step of prompt chunks (with or
without generated rows before them) on the AMX dense copies, in one C call (issue 12 item 4).

Owns ``engine/kernels/decode_step.c`` (``decode_step_layers``, ``prompt_step_layers``, ``mixed_step_layers``)
and the tests of whether a step can take them (``NativeDecodeStep.run`` / ``run_prompt`` return None
otherwise); the C structs' mirrors and the per-model layer tables are ``engine.native_step_abi``'s, the checks
against the Python layer loop ``engine.native_step_check``'s. The C file does no arithmetic: it calls the
native linear, AMX GEMM, glue and attention kernels (``engine.native_linear``, ``engine.amx_gemm``,
``engine.native_glue``, ``engine.native_decode``; each from its own built and checked library, reached through
function pointers) in the order and with the arguments ``engine.model.DecoderLayer.forward_glued`` passes them,
so a step's outputs, K/V and tokens are bit for bit those of the Python layer loop; what goes is the Python
between the calls: ~9 wrapper calls per layer, each with argument checks, output tensors and a ctypes crossing
(docs/engine-step.md, "The decode step in one call", "A prefix hit's tail on the AMX Xeon").

A step takes the decode path when every sequence computes one generated token (no prompt row: those run the dense
copy), attention runs on the native decode kernel, the glue kernel runs the layer's elementwise work, every linear
is an ``Int4Weight`` / ``Int8Weight`` on the native kernel without bias, and the cache is fp32 or bf16. It takes
the prompt path (session 26: ~7 ms of Python off a ~70-row prefix-hit tail on an AMX Xeon) when its rows are
prompt chunks (one or more sequences', each a run of rows), every linear's dense copy is on the AMX GEMM
(``engine.amx_gemm``) without bias, and attention runs on one native prefill kernel; with generated rows before
them (a mixed step) those also need the decode path's conditions. The last layer stays in Python when only the
output rows go on through it (``engine.output_rows``). Any other step runs the Python loop.

Invariants: the kernels' own checks run inside them (a block id or slot out of range is refused before
anything is written, and the error names the layer and stage: ``DecodeStepError``); the layer table holds raw
pointers into the model's weights and is rebuilt whenever the KV cache tensor changes, and kept on the model,
whose tensors it points into, so it never outlives them.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine import native_build
from engine.amx_gemm import TILE_K, TILE_M
from engine.native_decode import scratch_size
from engine.native_glue import NativeGlueKernel
from engine.native_linear import kernel_threads
from engine.native_step_abi import (
    DecodeLayer,
    DecodeStepArgs,
    ModelTable,
    PromptLayer,
    PromptStepArgs,
    address,
    cache_key,
    layer_array,
    step_buffers,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_step.c"
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")
"""No instruction-set flags: the file only sequences calls into the other kernels (and splits the step's
sequences over threads for attention: OpenMP, the runtime torch loaded, as the other kernels)."""
STAGES = ("qkv", "rope_store", "attention", "o_proj", "post_norm", "gate_up", "silu_mul", "down", "next_norm")
"""The C file's stage numbers, by name (``DecodeStepError``)."""


class DecodeStepError(ValueError):
    """A kernel refused its arguments inside the one-call decode step (the message names the layer and stage);
    nothing after it ran."""


def _eligible_linear(lin) -> bool:
    from engine.linear import Int4Weight, Int8Weight

    return (
        isinstance(lin, Int4Weight | Int8Weight)
        and lin.native is not None
        and lin.native_packed is not None
        and lin.bias is None
    )


def _eligible_prompt_linear(lin) -> bool:
    from engine.amx_gemm import AmxDenseWeight
    from engine.linear import Int4Weight, Int8Weight

    return (
        isinstance(lin, Int4Weight | Int8Weight)
        and isinstance(lin.dense, AmxDenseWeight)
        and lin.bias is None
    )


def model_takes_prompt_step(model) -> bool:
    """Whether ``model``'s prompt rows can run their layers in one call: every linear's dense copy on the AMX
    GEMM (one kernel), no bias, and fp32 between the linears (``DecoderLayer``'s ``o_bf16`` None,
    ``gate_up_in`` and ``act_dtype`` fp32, ``prompt_bf16`` off: what ``forward_glued`` then passes), cached
    on the model."""
    ok = getattr(model, "_prompt_step_ok", None)
    if ok is None:
        lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        ok = (
            model.dtype == torch.float32
            and model.device.type == "cpu"
            and all(_eligible_prompt_linear(lin) for lin in lins)
            and len({id(lin.dense.kernel) for lin in lins}) == 1
            and all(
                layer.o_bf16 is None
                and layer.gate_up_in == torch.float32
                and layer.act_dtype == torch.float32
                and not layer.prompt_bf16
                for layer in model.layers
            )
        )
        model._prompt_step_ok = ok
    return ok


def model_takes_step(model) -> bool:
    """Whether ``model``'s layers can run in one call: every linear on the native kernel (one kernel), no
    bias, fp32 activations (cached on the model)."""
    ok = getattr(model, "_decode_step_ok", None)
    if ok is None:
        lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        ok = (
            model.dtype == torch.float32
            and model.device.type == "cpu"
            and all(_eligible_linear(lin) for lin in lins)
            and len({id(lin.native) for lin in lins}) == 1
        )
        model._decode_step_ok = ok
    return ok


class NativeDecodeStep:
    """The loaded ``decode_step_layers``.

    Args:
        path: the built shared library.

    Raises:
        OSError: the library cannot be loaded.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps = 0
        """Decode steps run in one call (tests, benches)."""
        self.prompt_steps = 0
        """Prompt-only steps whose layers (all, or all but the last) ran in one call (tests, benches)."""
        self.mixed_steps = 0
        """Steps of generated rows then prompt rows whose layers ran in one call (tests, benches)."""
        lib = ctypes.CDLL(str(path))
        self._fn = lib.decode_step_layers
        self._fn.argtypes = [ctypes.c_void_p] * 3
        self._fn.restype = ctypes.c_int
        self._prompt_fn = lib.prompt_step_layers
        self._prompt_fn.argtypes = [ctypes.c_void_p] * 3
        self._prompt_fn.restype = ctypes.c_int
        self._mixed_fn = lib.mixed_step_layers
        self._mixed_fn.argtypes = [ctypes.c_void_p] * 5
        self._mixed_fn.restype = ctypes.c_int
        self._lib = lib

    @classmethod
    def build(cls, directory: Path | None = None) -> NativeDecodeStep:
        """Build (or find built) and load it, then check it against the Python layer loop (``self_check``).

        Raises:
            NativeKernelError: not x86-64, no C compiler, the compile failed, or the check failed (the native
                linear, glue or decode kernel is not available here, or an output differed).
        """
        return native_build.build_checked(
            cls, SOURCE, native_build.cpu_ok(frozenset()), native_build.compiler(), FLAGS, (), directory
        )

    def _table(self, model, kv_cache: torch.Tensor) -> ModelTable:
        key = cache_key(kv_cache)
        table: ModelTable | None = getattr(model, "_decode_step_table", None)
        if table is not None and table.cache_key == key:
            return table

        def weights(layer) -> list[int]:
            packed = [lin.native_packed for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            return [*(p.data.data_ptr() for p in packed), *(p.bits for p in packed)]

        table = ModelTable(
            key, layer_array(model, kv_cache, DecodeLayer, weights), model.layers[0].qkv.native
        )
        model._decode_step_table = table
        return table

    def _decode_struct(
        self, model, h, x, cos_sin, slots, native, kv_cache, glue, threads=None, layers=None
    ) -> tuple[DecodeStepArgs, tuple]:
        """``struct decode_step`` for the generated rows ``h`` / ``x`` / ``cos_sin`` / ``slots`` (each the
        rows' own, contiguous) attended through ``native`` (``engine.decode_attention.NativeDecode``), and what it
        points into (kept alive by the caller until the call returns; the model's layer table first)."""
        c = model.config
        t = h.shape[0]
        nh, nkv, hd, inter, hid = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.hidden_size
        table = self._table(model, kv_cache)
        threads = kernel_threads() if threads is None else threads
        sizes = ((nh + 2 * nkv) * hd, nh * hd, nh * hd, hid, 2 * inter, inter, hid)
        bufs = step_buffers(t, sizes)
        need = scratch_size(t, nh, hd, native.max_len)
        if native.scratch is None or native.scratch.numel() < need:
            native.scratch = torch.empty(need, dtype=torch.float32)
        cos_sin = cos_sin.contiguous()
        lin = table.linear
        step = DecodeStepArgs(
            address(lin._fns[4]),
            address(lin._fns[8]),
            address(glue._rmsnorm),
            address(glue._rope),
            address(glue._silu),
            address(native.kernel._fn),
            address(native.kernel._threads_fn),
            len(model.layers) if layers is None else layers,
            t,
            hid,
            nh,
            nkv,
            hd,
            inter,
            kv_cache.shape[3],
            kv_cache.shape[2],
            native.tables.shape[1],
            native.max_len,
            native.shared_len,
            int(kv_cache.dtype == torch.bfloat16),
            threads,
            torch.get_num_threads(),
            threads,  # attention: runs of sequences, one per thread (the bf16 decode: all of them on every thread)
            int(native.kernel.bf16_decode),
            c.rms_norm_eps,
            c.head_dim**-0.5,
            cos_sin.data_ptr(),
            slots.data_ptr(),
            native.tables.data_ptr(),
            native.lens.data_ptr(),
            h.data_ptr(),
            x.data_ptr(),  # the kernels write each layer's normed output into x
            *(b.data_ptr() for b in bufs),
            native.scratch.data_ptr(),
        )
        return step, (table, bufs, cos_sin, slots)

    def run(
        self,
        model,
        h: torch.Tensor,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        plan,
        kv_cache: torch.Tensor,
        rows,
        glue: NativeGlueKernel,
        threads: int | None = None,
    ) -> torch.Tensor | None:
        """Every layer of ``model`` for a decode-only step, or None when the step cannot take this path.

        Args:
            model: the ``engine.model.LlamaModel``.
            h: fp32 ``[T, hidden]`` residual after the embedding (updated in place).
            x: fp32 ``[T, hidden]``, ``h`` normed by layer 0's input norm.
            cos_sin: fp32 ``[T, head_dim / 2, 2]`` (``forward_glued``'s).
            plan: the step's ``engine.attention.AttentionPlan``.
            kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` fp32 or bf16.
            rows: the step's ``engine.row_kernels.RowKernels`` (every row must be a generated token's).
            glue: the glue kernel the step runs.
            threads: the GEMVs' threads and the attention's runs of sequences (default
                ``engine.native_linear.kernel_threads()``, the engine's ``num_threads``); the glue kernels run on
                torch's count, as in the layer loop. Outputs do not depend on either.

        Returns:
            fp32 ``[T, hidden]``: the final-normed hidden states (``LlamaModel.forward``'s output).

        Raises:
            DecodeStepError: a kernel refused its arguments (a slot or block id out of range); names the
                layer and stage.
        """
        dec = plan.decode
        if (
            dec is None
            or plan.prefills
            or dec.rows is not None
            or dec.native is None
            or rows is None
            or rows.dense is not None
            or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or not kv_cache.is_contiguous()
            or h.dtype != torch.float32
            or not model_takes_step(model)
        ):
            return None
        step, keep = self._decode_struct(
            model, h, x, cos_sin, plan.slot_mapping, dec.native, kv_cache, glue, threads
        )
        self.steps += 1
        failed = (ctypes.c_int32 * 3)()
        rc = self._fn(ctypes.addressof(step), ctypes.addressof(keep[0].layers), ctypes.addressof(failed))
        if rc != 0:
            raise DecodeStepError(
                f"the decode step's {STAGES[failed[1]]} kernel refused its arguments in layer {failed[0]} "
                f"(rc {rc}): slots {plan.slot_mapping.tolist()}, context lengths {dec.native.lens.tolist()}"
            )
        return x

    def _prompt_table(self, model, kv_cache: torch.Tensor) -> ctypes.Array:
        key = cache_key(kv_cache)
        table = getattr(model, "_prompt_step_table", None)
        if table is not None and table[0] == key:
            return table[1]

        def weights(layer) -> list[int]:
            dense = [lin.dense for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            return [*(d.data.data_ptr() for d in dense), *(d.data.shape[1] * TILE_K for d in dense)]

        layers = layer_array(model, kv_cache, PromptLayer, weights)
        model._prompt_step_table = (key, layers)
        return layers

    def _prompt_struct(
        self, model, h, x, cos_sin, slots, chunks, row0, kv_cache, glue, layers
    ) -> tuple[PromptStepArgs, tuple] | None:
        """``struct prompt_step`` for the prompt rows ``h`` / ``x`` / ``cos_sin`` / ``slots`` (each the rows'
        own, contiguous), chunk ``c`` (``chunks[c]``, a ``NativePrefill``) being rows ``row0[c] .. row0[c + 1] -
        1`` of them, and what it points into (kept alive by the caller until the call returns; the layer table
        first); None when the prefill kernel does not take a chunk's shape."""
        c = model.config
        t = h.shape[0]
        nh, nkv, hd, inter, hid = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.hidden_size
        native = chunks[0]
        threads = torch.get_num_threads()  # forward_glued's count for the glue and the prefill kernels
        needs = [
            native.kernel.prefill_scratch_size(
                row0[i + 1] - row0[i], nh, nkv, hd, ch.start + row0[i + 1] - row0[i], threads
            )
            for i, ch in enumerate(chunks)
        ]
        if min(needs) < 0:
            return None
        if native.scratch is None or native.scratch.numel() < max(needs):
            native.scratch = torch.empty(max(max(needs), 1), dtype=torch.float32)  # every chunk's, in turn
        table = self._prompt_table(model, kv_cache)
        amx = model.layers[0].qkv.dense.kernel
        bufs = step_buffers(t, ((nh + 2 * nkv) * hd, nh * hd, nh * hd, hid, 2 * inter, inter, hid))
        row0_t = torch.tensor(row0, dtype=torch.int64)
        starts = torch.tensor([ch.start for ch in chunks], dtype=torch.int64)
        table_lens = torch.tensor([ch.table.shape[0] for ch in chunks], dtype=torch.int64)
        tables = (ctypes.c_void_p * len(chunks))(*(ch.table.data_ptr() for ch in chunks))
        first = model.layers[0]
        kp = (
            max(lin.dense.data.shape[1] for lin in (first.qkv, first.o_proj, first.gate_up, first.down))
            * TILE_K
        )
        gemm_scratch = amx._scratch_for(-(-t // TILE_M) * TILE_M * kp)
        cos_sin = cos_sin.contiguous()
        step = PromptStepArgs(
            address(amx._lib.amx_gemm_f32),
            address(glue._rmsnorm),
            address(glue._rope),
            address(glue._silu),
            address(native.kernel._prefill),
            layers,
            t,
            hid,
            nh,
            nkv,
            hd,
            inter,
            kv_cache.shape[3],
            kv_cache.shape[2],
            len(chunks),
            native.scratch.numel(),
            int(kv_cache.dtype == torch.bfloat16),
            kernel_threads(),  # the AMX GEMM's, as AmxGemmKernel.mm's default
            threads,
            threads,
            c.rms_norm_eps,
            c.head_dim**-0.5,
            cos_sin.data_ptr(),
            slots.data_ptr(),
            row0_t.data_ptr(),
            starts.data_ptr(),
            table_lens.data_ptr(),
            ctypes.addressof(tables),
            h.data_ptr(),
            x.data_ptr(),
            *(b.data_ptr() for b in bufs),
            native.scratch.data_ptr(),
            gemm_scratch.data_ptr(),
        )
        return step, (table, bufs, row0_t, starts, table_lens, tables, gemm_scratch, cos_sin, slots)

    def run_prompt(
        self,
        model,
        h: torch.Tensor,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        plan,
        kv_cache: torch.Tensor,
        rows,
        glue: NativeGlueKernel,
        layers: int,
    ) -> torch.Tensor | None:
        """The first ``layers`` decoder layers of ``model`` for a step of prompt rows (one or more sequences'
        chunks), with or without generated rows before them (a mixed step), or None when the step cannot take
        this path (then nothing was run).

        Args:
            model: the ``engine.model.LlamaModel``.
            h: fp32 ``[T, hidden]`` residual after the embedding (updated in place).
            x: fp32 ``[T, hidden]``, ``h`` normed by layer 0's input norm (overwritten).
            cos_sin: fp32 ``[T, head_dim / 2, 2]`` (``forward_glued``'s).
            plan: the step's ``engine.attention.AttentionPlan``: generated rows ``0 .. G - 1`` (``G >= 0``; the
                scheduler puts decodes first) on the native decode kernel, then prefills covering rows ``G .. T -
                1`` in order, each on the same native prefill kernel (``NativePrefill``; attended chunk by chunk,
                its scratch the first chunk's).
            kv_cache: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` fp32 or bf16.
            rows: the step's ``engine.row_kernels.RowKernels``: generated rows on the int4 / int8 kernel, prompt
                rows on the dense copies.
            glue: the glue kernel the step runs.
            layers: how many layers from the first (``1 .. len(model.layers)``).

        Returns:
            ``x``: fp32 ``[T, hidden]``, the output of layer ``layers - 1`` normed by the next layer's input norm
            (or by the final norm after the last), the same bits as ``forward_glued``'s loop.

        Raises:
            DecodeStepError: a kernel refused its arguments (a slot or block id out of range); names the part,
                the layer and the stage.
        """
        dec = plan.decode
        if (
            not plan.prefills
            or not 1 <= layers <= len(model.layers)
            or rows is None
            or rows.dense is None
            or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or not kv_cache.is_contiguous()
            or h.dtype != torch.float32
            or x.dtype != torch.float32
            or not model_takes_prompt_step(model)
        ):
            return None
        t = h.shape[0]
        g = 0 if dec is None else (dec.rows.numel() if dec.rows is not None else -1)
        if dec is not None and (
            g <= 0
            or dec.native is None
            or dec.rows.tolist() != list(range(g))
            or rows.kernel is None
            or rows.kernel.tolist() != list(range(g))
            or not model_takes_step(model)
        ):
            return None  # generated rows first, on the native decode kernel and the int4 / int8 kernel
        if dec is None and rows.kernel is not None:
            return None
        chunks = [pre.native for pre in plan.prefills]
        row0 = [pre.start for pre in plan.prefills] + [t]
        if (
            any(native is None or native.kernel is not chunks[0].kernel for native in chunks)
            or row0[0] != g
            or any(pre.end != row0[i + 1] for i, pre in enumerate(plan.prefills))
            or rows.dense.numel() != t - g
        ):
            return None  # each chunk's rows in order, every row after the generated ones in one, one kernel
        slots = plan.slot_mapping
        built = self._prompt_struct(
            model, h[g:], x[g:], cos_sin[g:], slots[g:], chunks, [r - g for r in row0], kv_cache, glue, layers
        )
        if built is None:
            return None
        step, keep = built
        failed = (ctypes.c_int32 * 3)()
        if dec is None:
            self.prompt_steps += 1
            rc = self._prompt_fn(ctypes.addressof(step), ctypes.addressof(keep[0]), ctypes.addressof(failed))
        else:
            dstep, dkeep = self._decode_struct(
                model, h[:g], x[:g], cos_sin[:g], slots[:g], dec.native, kv_cache, glue, layers=layers
            )
            self.mixed_steps += 1
            rc = self._mixed_fn(
                ctypes.addressof(dstep),
                ctypes.addressof(dkeep[0].layers),
                ctypes.addressof(step),
                ctypes.addressof(keep[0]),
                ctypes.addressof(failed),
            )
        if rc != 0:
            part = "generated rows'" if dec is not None and failed[2] == 0 else "prompt rows'"
            raise DecodeStepError(
                f"the {'mixed' if dec is not None else 'prompt'} step's {part} {STAGES[failed[1]]} kernel refused "
                f"its arguments in layer {failed[0]} (rc {rc}): prompt chunks at positions "
                f"{[ch.start for ch in chunks]}, slots {slots.tolist()}"
            )
        return x

    def self_check(self) -> str | None:
        """Run a random two-layer step of three sequences through the library (on 1, 2 and 3 threads) and
        through the kernels called one by one from Python (``forward_glued``'s sequence); where the AMX GEMM
        builds, random prompt chunks and a mixed step too (``check_prompt_against_python``,
        ``check_mixed_against_python``); None when the residual, the output and the KV cache are
        bit-identical, else what differed or which kernel is missing."""
        kernels = step_kernels()
        for k in kernels:
            if isinstance(k, str):
                return f"needs the native linear, glue and decode kernels: {k}"
        from engine.native_step_check import (
            check_decode_against_python,
            check_mixed_against_python,
            check_prompt_against_python,
        )

        return (
            check_decode_against_python(self, *kernels)
            or check_prompt_against_python(self, *kernels[1:])
            or check_mixed_against_python(self, *kernels)
        )


def step_kernels() -> tuple:
    """The kernels a decode step calls, each the build the engine uses on this CPU (``native_linear``'s,
    ``native_glue``'s and ``native_decode.build_isa``'s decode kernel), shared per process: a
    (``NativeLinearKernel``, ``NativeGlueKernel``, ``NativeDecodeKernel``) tuple whose entries are the reason
    (str) where one does not build."""
    from engine import native_decode, native_glue, native_linear

    return (
        native_linear._shared_kernel(),
        native_glue._shared_kernel(),
        native_decode._shared_kernel(None, None, native_decode.build_isa()),
    )


_shared_step = native_build.shared_build(NativeDecodeStep.build)


def resolve_decode_step(enabled: bool = True) -> NativeDecodeStep | None:
    """The one-call decode step, built once per process, or None (``enabled`` False, or it does not build
    here: logged once with the reason; steps then run the Python layer loop, with the same bits)."""
    if not enabled:
        return None
    step = _shared_step()
    if isinstance(step, str):
        logger.info(
            "the one-call decode step is not available (%s); decode steps run the Python layer loop", step
        )
        return None
    return step
