"""The argument structs of ``engine/kernels/decode_step.c`` as ctypes mirrors, and what they point into: the
per-model tables of layer pointers and a step's intermediate buffers (``engine.native_step`` fills and calls them).

Invariants: each ``ctypes.Structure`` here lists the fields of its C struct in the C file's order and types (the
C file names the mirror in a comment beside each struct); a layer table holds raw pointers into a model's
weights and one KV cache tensor, so it is kept on the model and rebuilt when ``cache_key`` changes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.native_linear import NativeLinearKernel

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class DecodeLayer(ctypes.Structure):
    """``struct decode_layer`` (one decoder layer as the decode step takes it)."""

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


class DecodeStepArgs(ctypes.Structure):
    """``struct decode_step``."""

    _fields_ = [
        *((name, _p) for name in ("gemv4", "gemv8", "rmsnorm", "rope", "silu", "attend", "attend_threads")),
        *((name, _i64) for name in ("layers", "rows", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        *((name, _i64) for name in ("block_size", "num_blocks", "table_stride", "max_len", "shared_len")),
        *((name, _i32) for name in ("cache_bf16", "gemv_threads", "glue_threads", "attn_threads")),
        ("attn_batched", _i32),
        ("eps", _f32),
        ("scale", _f32),
        *((name, _p) for name in ("cos_sin", "slots", "tables", "lens", "h", "x")),
        *((name, _p) for name in ("qkv", "q", "attn", "o", "gu", "act", "down", "scratch")),
    ]


class PromptLayer(ctypes.Structure):
    """``struct prompt_layer``."""

    _fields_ = [
        *((name, _p) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _i64) for name in ("qkv_kp", "o_kp", "gate_up_kp", "down_kp")),
        ("post_norm", _p),
        ("next_norm", _p),
        ("cache", _p),
    ]


class PromptStepArgs(ctypes.Structure):
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


def address(fn) -> int:
    """The C address of a ctypes function (for a struct's function-pointer field)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


@dataclass
class ModelTable:
    """A model's layers as ``struct decode_layer`` entries for one KV cache tensor."""

    cache_key: tuple
    layers: ctypes.Array
    linear: NativeLinearKernel


def cache_key(kv_cache: torch.Tensor) -> tuple:
    """What a layer table's cache pointers depend on: the KV cache tensor's storage, shape and dtype."""
    return (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)


def layer_array(model, kv_cache: torch.Tensor, struct, weights) -> ctypes.Array:
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


def step_buffers(t: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """One fp32 allocation cut into ``t * n`` element buffers, one per ``n`` of ``sizes`` (a step's
    intermediate rows)."""
    work = torch.empty(t * sum(sizes), dtype=torch.float32)
    bufs, at = [], 0
    for n in sizes:
        bufs.append(work[at : at + t * n])
        at += t * n
    return bufs
