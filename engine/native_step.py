"""The native layer step: every decoder layer of a decode-only step, or of a step of prompt chunks (with or
without generated rows before them) on the AMX dense copies, in one C call (issue 12 item 4).

Owns ``engine/kernels/decode_step.c`` (``decode_step_layers``, ``prompt_step_layers``, ``mixed_step_layers``),
the per-model tables of layer pointers they read, and the tests of whether a step can take them
(``NativeDecodeStep.run`` / ``run_prompt`` return None otherwise). The C file does no arithmetic: it calls the
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
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import native_build
from engine.amx_gemm import TILE_K, TILE_M
from engine.native_decode import NativeDecodeKernel, scratch_size
from engine.native_glue import NativeGlueKernel
from engine.native_linear import NativeLinearKernel, kernel_threads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_step.c"
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-fopenmp")
"""No instruction-set flags: the file only sequences calls into the other kernels (and splits the step's
sequences over threads for attention: OpenMP, the runtime torch loaded, as the other kernels)."""
STAGES = ("qkv", "rope_store", "attention", "o_proj", "post_norm", "gate_up", "silu_mul", "down", "next_norm")
"""The C file's stage numbers, by name (``DecodeStepError``)."""

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    """``struct decode_layer``."""

    _fields_ = [
        ("qkv", _p),
        ("o", _p),
        ("gate_up", _p),
        ("down", _p),
        ("qkv_bits", _i32),
        ("o_bits", _i32),
        ("gate_up_bits", _i32),
        ("down_bits", _i32),
        ("post_norm", _p),
        ("next_norm", _p),
        ("cache", _p),
    ]


class _Step(ctypes.Structure):
    """``struct decode_step``."""

    _fields_ = [
        *((name, _p) for name in ("gemv4", "gemv8", "rmsnorm", "rope", "silu", "attend", "attend_threads")),
        *((name, _i64) for name in ("layers", "rows", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        *((name, _i64) for name in ("block_size", "num_blocks", "table_stride", "max_len", "shared_len")),
        *((name, _i32) for name in ("cache_bf16", "gemv_threads", "glue_threads", "attn_threads")),
        ("eps", _f32),
        ("scale", _f32),
        *((name, _p) for name in ("cos_sin", "slots", "tables", "lens", "h", "x")),
        *((name, _p) for name in ("qkv", "q", "attn", "o", "gu", "act", "down", "scratch")),
    ]


class _PromptLayer(ctypes.Structure):
    """``struct prompt_layer``."""

    _fields_ = [
        *((name, _p) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _i64) for name in ("qkv_kp", "o_kp", "gate_up_kp", "down_kp")),
        ("post_norm", _p),
        ("next_norm", _p),
        ("cache", _p),
    ]


class _PromptStep(ctypes.Structure):
    """``struct prompt_step``."""

    _fields_ = [
        *((name, _p) for name in ("gemm", "rmsnorm", "rope", "silu", "prefill")),
        *((name, _i64) for name in ("layers", "rows", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        *((name, _i64) for name in ("block_size", "num_blocks", "chunks", "attn_scratch_floats")),
        *((name, _i32) for name in ("cache_bf16", "gemm_threads", "glue_threads", "attn_threads")),
        ("eps", _f32),
        ("scale", _f32),
        *((name, _p) for name in ("cos_sin", "slots", "row0", "start", "table_len", "tables", "h", "x")),
        *(
            (name, _p)
            for name in ("qkv", "q", "attn", "o", "gu", "act", "down", "attn_scratch", "gemm_scratch")
        ),
    ]


class DecodeStepError(ValueError):
    """A kernel refused its arguments inside the one-call decode step (the message names the layer and stage);
    nothing after it ran."""


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@dataclass
class _ModelTable:
    """A model's layers as ``struct decode_layer`` entries for one KV cache tensor."""

    cache_key: tuple
    layers: ctypes.Array
    linear: NativeLinearKernel


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


def _cache_key(kv_cache: torch.Tensor) -> tuple:
    """What a layer table's cache pointers depend on: the KV cache tensor's storage, shape and dtype."""
    return (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)


def _layer_array(model, kv_cache: torch.Tensor, struct, weights) -> ctypes.Array:
    """``struct`` per layer of ``model`` (``struct decode_layer`` or ``struct prompt_layer``): ``weights(layer)``'s
    fields, then the post-attention norm, the next layer's input norm (the final norm after the last) and the
    layer's slice of ``kv_cache``."""
    n = len(model.layers)
    layers = (struct * n)()
    for i, layer in enumerate(model.layers):
        nxt = model.layers[i + 1].input_norm if i + 1 < n else model.norm
        layers[i] = struct(
            *weights(layer), layer.post_norm.data_ptr(), nxt.data_ptr(), kv_cache[i].data_ptr()
        )
    return layers


def _step_buffers(t: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """One fp32 allocation cut into ``t * n`` element buffers, one per ``n`` of ``sizes`` (a step's
    intermediate rows)."""
    work = torch.empty(t * sum(sizes), dtype=torch.float32)
    bufs, at = [], 0
    for n in sizes:
        bufs.append(work[at : at + t * n])
        at += t * n
    return bufs


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
        self._fn.argtypes = [_p, _p, _p]
        self._fn.restype = ctypes.c_int
        self._prompt_fn = lib.prompt_step_layers
        self._prompt_fn.argtypes = [_p, _p, _p]
        self._prompt_fn.restype = ctypes.c_int
        self._mixed_fn = lib.mixed_step_layers
        self._mixed_fn.argtypes = [_p, _p, _p, _p, _p]
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

    def _table(self, model, kv_cache: torch.Tensor) -> _ModelTable:
        key = _cache_key(kv_cache)
        table: _ModelTable | None = getattr(model, "_decode_step_table", None)
        if table is not None and table.cache_key == key:
            return table

        def weights(layer) -> list[int]:
            packed = [lin.native_packed for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            return [*(p.data.data_ptr() for p in packed), *(p.bits for p in packed)]

        table = _ModelTable(key, _layer_array(model, kv_cache, _Layer, weights), model.layers[0].qkv.native)
        model._decode_step_table = table
        return table

    def _decode_struct(
        self, model, h, x, cos_sin, slots, native, kv_cache, glue, threads=None, layers=None
    ) -> tuple[_Step, tuple]:
        """``struct decode_step`` for the generated rows ``h`` / ``x`` / ``cos_sin`` / ``slots`` (each the
        rows' own, contiguous) attended through ``native`` (``engine.decode_attention.NativeDecode``), and what it
        points into (kept alive by the caller until the call returns; the model's layer table first)."""
        c = model.config
        t = h.shape[0]
        nh, nkv, hd, inter, hid = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.hidden_size
        table = self._table(model, kv_cache)
        threads = kernel_threads() if threads is None else threads
        sizes = ((nh + 2 * nkv) * hd, nh * hd, nh * hd, hid, 2 * inter, inter, hid)
        bufs = _step_buffers(t, sizes)
        need = scratch_size(t, nh, hd, native.max_len)
        if native.scratch is None or native.scratch.numel() < need:
            native.scratch = torch.empty(need, dtype=torch.float32)
        cos_sin = cos_sin.contiguous()
        lin = table.linear
        step = _Step(
            _address(lin._fns[4]),
            _address(lin._fns[8]),
            _address(glue._rmsnorm),
            _address(glue._rope),
            _address(glue._silu),
            _address(native.kernel._fn),
            _address(native.kernel._threads_fn),
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
            threads,  # attention: runs of sequences, one per thread
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
        key = _cache_key(kv_cache)
        table = getattr(model, "_prompt_step_table", None)
        if table is not None and table[0] == key:
            return table[1]

        def weights(layer) -> list[int]:
            dense = [lin.dense for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            return [*(d.data.data_ptr() for d in dense), *(d.data.shape[1] * TILE_K for d in dense)]

        layers = _layer_array(model, kv_cache, _PromptLayer, weights)
        model._prompt_step_table = (key, layers)
        return layers

    def _prompt_struct(
        self, model, h, x, cos_sin, slots, chunks, row0, kv_cache, glue, layers
    ) -> tuple[_PromptStep, tuple] | None:
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
        bufs = _step_buffers(t, ((nh + 2 * nkv) * hd, nh * hd, nh * hd, hid, 2 * inter, inter, hid))
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
        step = _PromptStep(
            _address(amx._lib.amx_gemm_f32),
            _address(glue._rmsnorm),
            _address(glue._rope),
            _address(glue._silu),
            _address(native.kernel._prefill),
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
        builds, random prompt chunks and a mixed step too (``_check_prompt_against_python``,
        ``_check_mixed_against_python``); None when the residual, the output and the KV cache are
        bit-identical, else what differed or which kernel is missing."""
        kernels = step_kernels()
        for k in kernels:
            if isinstance(k, str):
                return f"needs the native linear, glue and decode kernels: {k}"
        return (
            _check_against_python(self, *kernels)
            or _check_prompt_against_python(self, *kernels[1:])
            or _check_mixed_against_python(self, *kernels)
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


def _check_against_python(
    step: NativeDecodeStep, lin: NativeLinearKernel, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """``self_check``'s body (also used by the tests with the kernels they build)."""
    from types import SimpleNamespace

    from engine.decode_attention import NativeDecode
    from engine.native_linear import pack_int4, pack_int8, random_groups
    from engine.row_kernels import RowKernels

    gen = torch.Generator().manual_seed(0)
    hid, nh, nkv, hd, inter, nl, bs, nb = 64, 6, 3, 16, 96, 2, 16, 12

    def linear(n: int, k: int, bits: int):
        groups = random_groups(bits, n, k, gen)
        packed = pack_int4(groups) if bits == 4 else pack_int8(groups)
        return SimpleNamespace(native=lin, native_packed=packed, bias=None)

    layers = []
    for i in range(nl):
        layers.append(
            SimpleNamespace(
                qkv=linear((nh + 2 * nkv) * hd, hid, 4),
                o_proj=linear(hid, nh * hd, 8 if i else 4),
                gate_up=linear(2 * inter, hid, 4),
                down=linear(hid, inter, 4),
                input_norm=torch.rand(hid, generator=gen) + 0.5,
                post_norm=torch.rand(hid, generator=gen) + 0.5,
            )
        )
    config = SimpleNamespace(
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        hidden_size=hid,
        rms_norm_eps=1e-5,
    )
    model = SimpleNamespace(layers=layers, norm=torch.rand(hid, generator=gen) + 0.5, config=config)
    model._decode_step_ok = True
    cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen)
    # three sequences (attention split by sequences), then one (spread by the kernel: the build's split)
    for lens in ([37, 16, 5], [37]):
        t = len(lens)
        tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]][:t], dtype=torch.int32)
        slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
        h0 = torch.randn(t, hid, generator=gen)
        angles = torch.rand(t, hd // 2, generator=gen) * 6
        cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))

        def plan(tables=tables, lens=lens, slots=slots):
            native = NativeDecode(attend, tables, torch.tensor(lens, dtype=torch.int32), max(lens))
            decode = SimpleNamespace(rows=None, native=native)
            return SimpleNamespace(decode=decode, prefills=[], slot_mapping=slots)

        # the Python loop, kernel by kernel (forward_glued's calls)
        h_py, cache_py = h0.clone(), cache.clone()
        x = glue.rmsnorm(h_py, layers[0].input_norm, 1e-5)
        p = plan()
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
            qkv = lin.mm(layer.qkv.native_packed, x)
            q = glue.rope_store(qkv, cos_sin, nh, nkv, hd, cache_py[i], slots)
            a = p.decode.native.attend(q, cache_py[i], hd**-0.5).reshape(t, nh * hd)
            x = glue.rmsnorm(h_py, layer.post_norm, 1e-5, lin.mm(layer.o_proj.native_packed, a))
            act = glue.silu_mul(lin.mm(layer.gate_up.native_packed, x))
            x = glue.rmsnorm(h_py, nxt, 1e-5, lin.mm(layer.down.native_packed, act))
        # the same step in one call, on 1-3 threads
        for threads in (1, 2, 3):
            h_c, cache_c = h0.clone(), cache.clone()
            x_c = glue.rmsnorm(h_c, layers[0].input_norm, 1e-5)
            rows = RowKernels(None, torch.arange(t))
            got = step.run(model, h_c, x_c, cos_sin, plan(), cache_c, rows, glue, threads)
            if got is None:
                return "the step was not taken"
            for name, a, b in (("output", got, x), ("residual", h_c, h_py), ("KV cache", cache_c, cache_py)):
                if not torch.equal(a, b):
                    return f"{name} differs from the kernels called one by one (sequences={t}, threads={threads})"
    return None


def _random_check_model(gen: torch.Generator, amx, lin: NativeLinearKernel | None = None):
    """The self-checks' random two-layer model (a ``SimpleNamespace`` with ``LlamaModel``'s attributes: 4 query
    heads of 64 over 2 KV heads, hidden 96, intermediate 160): each linear's dense copy on ``amx`` (an
    ``AmxGemmKernel``) and, with ``lin``, random int4 groups on the native kernel too."""
    from types import SimpleNamespace

    from engine.native_linear import pack_int4, random_groups

    hid, nh, nkv, hd, inter = 96, 4, 2, 64, 160

    def linear(n: int, k: int) -> SimpleNamespace:
        weight = SimpleNamespace(dense=amx.pack(torch.randn(n, k, generator=gen) / 8), bias=None)
        if lin is not None:
            weight.native, weight.native_packed = lin, pack_int4(random_groups(4, n, k, gen))
        return weight

    layers = [
        SimpleNamespace(
            qkv=linear((nh + 2 * nkv) * hd, hid),
            o_proj=linear(hid, nh * hd),
            gate_up=linear(2 * inter, hid),
            down=linear(hid, inter),
            input_norm=torch.rand(hid, generator=gen) + 0.5,
            post_norm=torch.rand(hid, generator=gen) + 0.5,
        )
        for _ in range(2)
    ]
    config = SimpleNamespace(
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        hidden_size=hid,
        rms_norm_eps=1e-5,
    )
    model = SimpleNamespace(layers=layers, norm=torch.rand(hid, generator=gen) + 0.5, config=config)
    model._prompt_step_ok = True
    model._decode_step_ok = lin is not None
    return model


def _first_difference(got: tuple, want: tuple) -> str | None:
    """The name of the first of the output, the residual and the KV cache whose bits differ, or None."""
    for name, a, b in zip(("output", "residual", "KV cache"), got, want, strict=True):
        if not torch.equal(a, b):
            return name
    return None


def _check_prompt_against_python(
    step: NativeDecodeStep, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """``run_prompt`` against the kernels called one by one as ``forward_glued`` calls them for prompt rows:
    a random two-layer model on the AMX GEMM's dense copies, chunks of 1, 20 and 37 rows over 0 and 19 cached
    positions and a step of two sequences' chunks, every layer and the first only, an fp32 cache on
    ``attend``'s prefill and, where the AMX build of the attention kernel builds, a bf16 cache on its prefill.
    None when the output, the residual and the KV cache are bit-identical (or the AMX GEMM does not build here:
    the path is then never taken), else what differed."""
    from types import SimpleNamespace

    from engine import amx_gemm, native_decode
    from engine.attention import NativePrefill
    from engine.row_kernels import RowKernels

    amx = amx_gemm._shared_kernel()
    if isinstance(amx, str):
        return None
    prefills = [(torch.float32, attend)]
    amx_attend = native_decode._shared_kernel(None, None, "amx")
    if not isinstance(amx_attend, str):
        prefills.append((torch.bfloat16, amx_attend))
    gen = torch.Generator().manual_seed(1)
    model = _random_check_model(gen, amx)
    layers, c = model.layers, model.config
    hid, nh, nkv, hd, nl, bs, nb, eps = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, 2, 16, 8, 1e-5
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    table, other = ids[:4].contiguous(), ids[4:].contiguous()  # two sequences' blocks
    # (block table, cached positions, new rows) per chunk; the last case: two sequences' chunks in one step
    cases = ([(table, 0, 1)], [(table, 0, 37)], [(table, 19, 20)], [(table, 19, 20), (other, 0, 13)])
    for cache_dtype, kernel in prefills:
        cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen).to(cache_dtype)
        for case in cases:
            t = sum(n for _, _, n in case)
            slots = torch.cat(
                [
                    tab.long()[pos // bs] * bs + pos % bs
                    for tab, start, n in case
                    for pos in [torch.arange(start, start + n)]
                ]
            )
            h0 = torch.randn(t, hid, generator=gen)
            angles = torch.rand(t, hd // 2, generator=gen) * 6
            cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))
            rows = RowKernels(torch.arange(t), None)
            bounds = [0]
            for _, _, n in case:
                bounds.append(bounds[-1] + n)
            for count in (nl, 1):
                h_py, cache_py = h0.clone(), cache.clone()
                x = glue.rmsnorm(h_py, layers[0].input_norm, eps)
                natives = [NativePrefill(kernel, tab, start) for tab, start, _ in case]
                for i, layer in enumerate(layers[:count]):
                    nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
                    qkv = layer.qkv.dense.mm(x)
                    q = glue.rope_store(qkv, cos_sin, nh, nkv, hd, cache_py[i], slots)
                    a = torch.cat(
                        [
                            nat.attend(q[r0:r1], cache_py[i], hd**-0.5)
                            for nat, r0, r1 in zip(natives, bounds[:-1], bounds[1:], strict=True)
                        ]
                    ).reshape(t, nh * hd)
                    x = glue.rmsnorm(h_py, layer.post_norm, eps, layer.o_proj.dense.mm(a))
                    act = glue.silu_mul(layer.gate_up.dense.mm(x))
                    x = glue.rmsnorm(h_py, nxt, eps, layer.down.dense.mm(act))
                h_c, cache_c = h0.clone(), cache.clone()
                x_c = glue.rmsnorm(h_c, layers[0].input_norm, eps)
                chunks = [
                    SimpleNamespace(start=r0, end=r1, native=NativePrefill(kernel, tab, start))
                    for (tab, start, _), r0, r1 in zip(case, bounds[:-1], bounds[1:], strict=True)
                ]
                plan = SimpleNamespace(decode=None, prefills=chunks, slot_mapping=slots)
                got = step.run_prompt(model, h_c, x_c, cos_sin, plan, cache_c, rows, glue, count)
                if got is None:
                    return "the prompt step was not taken"
                name = _first_difference((got, h_c, cache_c), (x, h_py, cache_py))
                if name is not None:
                    where = (
                        f"chunks {[(start, n) for _, start, n in case]}, layers={count}, cache {cache_dtype}"
                    )
                    return f"the prompt step's {name} differs from the kernels called one by one ({where})"
    return None


def _check_mixed_against_python(
    step: NativeDecodeStep, lin: NativeLinearKernel, glue: NativeGlueKernel, attend: NativeDecodeKernel
) -> str | None:
    """``run_prompt`` on a mixed step (two sequences' generated rows, then a 23-row prompt chunk over 19
    cached positions) against the kernels called one by one as ``forward_glued`` calls them: the generated
    rows on the native int4 kernel and the decode kernel, the prompt rows on the AMX GEMM and ``attend``'s
    prefill; a random two-layer model, an fp32 and a bf16 cache, every layer and the first only. None when the
    output, the residual and the KV cache are bit-identical (or the AMX GEMM does not build here), else what
    differed."""
    from types import SimpleNamespace

    from engine import amx_gemm
    from engine.attention import NativePrefill
    from engine.decode_attention import NativeDecode
    from engine.row_kernels import RowKernels

    amx = amx_gemm._shared_kernel()
    if isinstance(amx, str):
        return None
    gen = torch.Generator().manual_seed(2)
    model = _random_check_model(gen, amx, lin)
    layers, c = model.layers, model.config
    hid, nh, nkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    nl, bs, nb, eps = 2, 16, 12, 1e-5
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    table, dec_tables = ids[:4].contiguous(), ids[4:12].view(2, 4).contiguous()
    lens, (start, n) = [37, 9], (19, 23)
    g, t = len(lens), len(lens) + n
    pos = torch.arange(start, start + n)
    slots = torch.cat(
        [
            torch.tensor([int(dec_tables[i, (m - 1) // bs]) * bs + (m - 1) % bs for i, m in enumerate(lens)]),
            table.long()[pos // bs] * bs + pos % bs,
        ]
    )
    angles = torch.rand(t, hd // 2, generator=gen) * 6
    cos_sin = torch.view_as_real(torch.polar(torch.ones(t, hd // 2), angles))
    rows = RowKernels(torch.arange(g, t), torch.arange(g))

    def by_rows(layer_lin, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin.mm(layer_lin.native_packed, x[:g]), layer_lin.dense.mm(x[g:])])

    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(nl, 2, nb, bs, nkv, hd, generator=gen).to(cache_dtype)
        h0 = torch.randn(t, hid, generator=gen)
        for count in (nl, 1):
            decode = NativeDecode(attend, dec_tables, torch.tensor(lens, dtype=torch.int32), max(lens))
            prefill = NativePrefill(attend, table, start)
            h_py, cache_py = h0.clone(), cache.clone()
            x = glue.rmsnorm(h_py, layers[0].input_norm, eps)
            for i, layer in enumerate(layers[:count]):
                nxt = layers[i + 1].input_norm if i + 1 < nl else model.norm
                q = glue.rope_store(by_rows(layer.qkv, x), cos_sin, nh, nkv, hd, cache_py[i], slots)
                a = torch.cat(
                    [
                        decode.attend(q[:g], cache_py[i], hd**-0.5),
                        prefill.attend(q[g:], cache_py[i], hd**-0.5),
                    ]
                )
                x = glue.rmsnorm(h_py, layer.post_norm, eps, by_rows(layer.o_proj, a.reshape(t, nh * hd)))
                act = glue.silu_mul(by_rows(layer.gate_up, x))
                x = glue.rmsnorm(h_py, nxt, eps, by_rows(layer.down, act))
            h_c, cache_c = h0.clone(), cache.clone()
            x_c = glue.rmsnorm(h_c, layers[0].input_norm, eps)
            plan = SimpleNamespace(
                decode=SimpleNamespace(
                    rows=torch.arange(g),
                    native=NativeDecode(attend, dec_tables, torch.tensor(lens, dtype=torch.int32), max(lens)),
                ),
                prefills=[SimpleNamespace(start=g, end=t, native=NativePrefill(attend, table, start))],
                slot_mapping=slots,
            )
            got = step.run_prompt(model, h_c, x_c, cos_sin, plan, cache_c, rows, glue, count)
            if got is None:
                return "the mixed step was not taken"
            name = _first_difference((got, h_c, cache_c), (x, h_py, cache_py))
            if name is not None:
                return (
                    f"the mixed step's {name} differs from the kernels called one by one (layers={count}, "
                    f"cache {cache_dtype})"
                )
    return None


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
