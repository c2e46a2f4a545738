"""Pluggable weight formats of the linear layers.

Decoding one token on a CPU reads every weight once, so its speed is bound by the bytes of weights read per
token, not by arithmetic. Each linear layer of ``engine.model.LlamaModel`` therefore holds a ``LinearWeight``
(``forward`` + ``nbytes``) rather than a bare tensor; ``engine.weight_format`` picks the class per layer
(``engine.weights``):

- ``DenseWeight``: fp32 (or the model dtype), stored transposed; the reference.
- ``BF16Weight``: dense bf16 with ``F.linear`` (oneDNN bf16 GEMM); fp32 in and out.
- ``Int4Weight``: 4-bit codes in groups of 32 with a scale and zero each (the GGUF's Q4_0/Q4_1 blocks, exact)
  on a weight-only kernel: the native one (``engine.native_linear``: fp32 activations, exact f16 scales, fp32
  output) where ``engine.linear_kernel`` gives one, else torch's int4 kernel (bf16 activations, scales and
  output).
- ``Int8Weight``: Q8_0 (int8 codes, a scale per 32) exact: the native kernel's int8 path, or two 4-bit planes
  on torch's int4 kernel.

The tables below are torch's kernels; the native kernel against torch's int4 kernel (same rows, streamed weights,
thread CPU time) is in ``docs/engine-step.md`` ("The native linear kernel"): at 1-8 rows it takes ~0.7-0.75x the
time of torch's int4 kernel for the 30 layers and ~0.45x for the Q8_0 head, so ``engine.linear_kernel: auto``
picks it wherever it builds (its int8-activation variant where that builds); the dense prefill copy still serves
prompt rows, except on CPUs without bf16 GEMMs (``engine.dense_min_rows: auto``, below).

Kernel choice per row count, measured (SmolLM2's shapes on AVX512-BF16 EPYCs, an AMX Xeon and an AVX2-only
EPYC; the tables are in ``docs/engine-step.md``, "Weight formats: kernel choice per row count"):

- activations enter torch's int4 kernel in bf16 (its fp32 path is a scalar loop, ~50x slower);
- from ``DENSE_MIN_ROWS`` = 10 rows (prefill chunks, the few-token tail of a prefix hit) a quantized layer uses a
  dense bf16 copy of its dequantized weight (``engine.dense_min_rows``; None = no copy): prepacked by oneDNN on
  CPU, or on CPUs with AMX packed for our own AMX GEMM (``engine.amx_gemm``, ``engine.dense_gemm``: row-invariant
  in whole calls, where oneDNN needed 32-row calls there, ``engine.bf16_gemm``); below, the weight-only kernel;
  the LM head runs on the few logit rows only and keeps no copy;
- on CPUs without bf16 arithmetic (AVX2) the copy is fp32 (``dense_dtype``), or none where the native kernel's
  AVX2 build runs the linears (``engine.weight_format.auto_dense_min_rows``), and the head runs dense fp32 unless
  the native kernel serves it;
- ``DenseWeight`` (fp32) is stored transposed, with a second, oneDNN-prepacked copy on CPU that serves every row
  count and gives each row the same bits at every row count (the plain GEMM's one-row and many-row calls round
  differently).

The plain GEMM serves where there is no prepacked copy (off CPU, other dtypes, no oneDNN).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.amx_gemm import AmxDenseWeight, AmxGemmKernel
from engine.bf16_gemm import bf16_gemm, dense_mm, onednn_packing_available, pack_bf16_dense
from engine.native_linear import pack_int4, pack_int8

if TYPE_CHECKING:
    from engine.native_linear import NativeLinearKernel

log = logging.getLogger(__name__)

_PACK_FOR_ROWS = 8


@runtime_checkable
class LinearWeight(Protocol):
    """A linear map ``y = x @ W.T (+ b)`` whose storage format is its own business."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]`` in the model's compute dtype -> ``[..., out_features]``, same dtype."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) read by one forward pass."""
        ...


class DenseWeight(nn.Module):
    """A dense weight applied as ``x @ W.T (+ b)``, stored transposed (``[in_features, out_features]``).

    See the module docstring for the kernels. On CPU in fp32 (and when oneDNN is available) a prepacked copy
    serves every input (flattened to 2-D rows), so a row's result does not depend on the other rows of its call
    (batch invariance); it is checked against the plain product when made and dropped (plain GEMM used) if it
    disagrees beyond fp32 rounding.

    Args:
        weight: ``[out, in]`` tensor (the PyTorch / Hugging Face layout); its dtype is the compute dtype.
        bias: ``[out]`` tensor or None.
        pack: allow the prepacked copy (default True; it only applies on CPU in fp32).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"a dense weight is 2-D [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight rows {weight.shape[0]}")
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.packed: torch.Tensor | None = None
        if (
            pack
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and onednn_packing_available()
        ):
            self.packed = self._make_packed(weight)

    def _make_packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        with torch.inference_mode():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_FOR_ROWS)
                probe = torch.randn(
                    _PACK_FOR_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)
                )
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
                want = self._plain(probe)
            except RuntimeError:
                return None
        scale = want.abs().max().item() + 1e-30
        return (
            packed
            if (got - want).abs().max().item() <= 1e-5 * scale * max(1, weight.shape[1] ** 0.5)
            else None
        )

    @property
    def weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (a transposed view of the stored ``[in, out]`` tensor)."""
        return self.weight_t.t()

    @property
    def in_features(self) -> int:
        return self.weight_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight_t.shape[1]

    @property
    def nbytes(self) -> int:
        n = self.weight_t.numel() * self.weight_t.element_size()
        if self.bias is not None:
            n += self.bias.numel() * self.bias.element_size()
        return n

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        if x.dim() == 2:
            return torch.addmm(self.bias, x, self.weight_t)
        return torch.matmul(x, self.weight_t) + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``: the prepacked copy where there is one (any row count, same bits
        per row), else the plain GEMM."""
        if self.packed is None or x.numel() == 0:
            return self._plain(x)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    @classmethod
    def concat(
        cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
    ) -> DenseWeight:
        """One weight computing several projections of the same input in one matmul (fused q/k/v, gate/up).

        Rows are stacked in the order given; a missing bias among present ones is zero-filled.
        """
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else weights[i].new_zeros(weights[i].shape[0])
                    for i, b in enumerate(biases)
                ]
            )
        return cls(torch.cat(weights, dim=0), bias)


_PACK_CHUNK_ROWS = 4096  # rows packed at a time (a multiple of the kernel's 64-row blocks)


def _int4_pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pack uint8 codes ``[N, K]`` (0..15) into the layout of torch's int4 weight-only kernel on ``device``."""
    if device.type == "cpu":
        # the kernel's packing is per block of 64 rows (tail rows at the end), so packing whole blocks of rows
        # at a time gives the same bytes while the int32 copy it needs stays small (a 49,152-row head at once:
        # 226 MB of transient int32, the process's peak RSS)
        chunks = [
            torch._convert_weight_to_int4pack_for_cpu(q[i : i + _PACK_CHUNK_ROWS].to(torch.int32), 1)
            for i in range(0, q.shape[0], _PACK_CHUNK_ROWS)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    # CUDA (tinygemm): codes two per byte, high nibble first, then the kernel's own tiling (inner K tiles of
    # 16 weights: 8, 4 or 2 of them, whichever divides in_features)
    k = q.shape[1]
    inner = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
    pairs = q.to(device=device, dtype=torch.uint8).view(q.shape[0], -1, 2)
    return torch._convert_weight_to_int4pack((pairs[..., 0] << 4 | pairs[..., 1]).contiguous(), inner)


def _dense_copy(
    groups, device: torch.device, dtype: torch.dtype, amx: AmxGemmKernel | None = None
) -> torch.Tensor | AmxDenseWeight:
    """The dequantized weight in ``dtype`` for large row counts: in ``amx``'s B tiles when bf16 on CPU and ``amx``
    is given (``engine.dense_gemm``), else prepacked by oneDNN when bf16 on CPU."""
    if amx is not None and dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        return amx.pack(groups.dequantize())
    dense = groups.dequantize().to(device=device, dtype=dtype)
    packed = pack_bf16_dense(dense)
    return dense if packed is None else packed


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)
    return torch._weight_int4pack_mm(x, packed, GROUP, scale_zero)


def _native_pack(native, groups, device: torch.device, pack):
    """(kernel, packed weight) for the native kernel, or (None, None) where there is none, the weight is not
    on CPU, or its scales are not the GGUF's f16 values (then torch's kernel runs it; logged)."""
    if native is None or torch.device(device).type != "cpu":
        return None, None
    try:
        return native, pack(groups)
    except ValueError as exc:
        log.info("a %d x %d weight stays on torch's int4 kernel: %s", *groups.q.shape, exc)
        return None, None


GROUP = 32  # weights per quantization group (one GGUF block)
DENSE_MIN_ROWS = (
    10  # default: a quantized linear with a dense copy uses it from this many rows up (docstring)
)


class Int4Weight(nn.Module):
    """A 4-bit weight-only linear: torch's int4 kernel (``_weight_int4pack_mm_for_cpu`` on CPU,
    ``_weight_int4pack_mm`` on CUDA) over groups of 32 weights along ``in_features``, each
    ``w = (q - 8) * scale + zero`` (Q4_0: ``scale = d, zero = 0``; Q4_1: ``scale = d, zero = m + 8 d``; exact,
    see ``engine.quantized``).

    Activations enter the kernel in bf16 (its fp32-activation path on CPU is a scalar loop, ~50x slower);
    the output comes back in the input's dtype. With ``dense_min_rows`` set, a dense bf16 copy of the
    dequantized weight (prepacked by oneDNN on CPU, ``pack_bf16_dense``) serves inputs of at least that many
    rows (prefill chunks), where a GEMM beats the weight-only kernel (module docstring).

    Args:
        groups: codes and fp32 scale/zero (``engine.quantized.Int4Groups``), ``[out, in]``, ``in % 32 == 0``.
        bias: fp32 ``[out]`` or None.
        device: where to run.
        dense_min_rows: rows from which the dense copy is used; None = no dense copy (int4 kernel only).
        dense_dtype: the dense copy's dtype (bf16, or fp32 on CPUs without bf16 GEMMs).
        native: the native weight-only kernel (``engine.native_linear``), or None for torch's int4 kernel.
        dense_gemm: the AMX kernel a bf16 copy runs on (``engine.amx_gemm``, ``engine.dense_gemm``), or None for
            oneDNN's GEMM.
    """

    def __init__(
        self,
        groups,
        bias: torch.Tensor | None,
        device: torch.device,
        dense_min_rows: int | None = DENSE_MIN_ROWS,
        dense_dtype: torch.dtype = torch.bfloat16,
        native: NativeLinearKernel | None = None,
        dense_gemm: AmxGemmKernel | None = None,
    ) -> None:
        super().__init__()
        n, k = groups.q.shape
        if k % GROUP:
            raise ValueError(f"int4 weights need in_features % {GROUP} == 0, got {k}")
        self.out_features, self.in_features = n, k
        self.native, self.native_packed = _native_pack(native, groups, device, pack_int4)
        self.packed: torch.Tensor | None = None
        self.scale_zero: torch.Tensor | None = None
        self.scale_zero_bf16: torch.Tensor | None = None
        if self.native is None:
            self.packed = _int4_pack(groups.q, device)
            sz = torch.stack([groups.scale.t(), groups.zero.t()], dim=-1).contiguous()  # [K/32, N, 2]
            self.scale_zero = sz.to(device)  # fp32: the exact values (tests, fp32 activations)
            self.scale_zero_bf16 = sz.to(device=device, dtype=torch.bfloat16)
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        self.dense_min_rows = dense_min_rows
        self.dense = None if dense_min_rows is None else _dense_copy(groups, device, dense_dtype, dense_gemm)

    @property
    def nbytes(self) -> int:
        """Bytes one decode step reads: packed codes and scales (bf16 scale/zero for torch's kernel, the GGUF's
        f16 ``d``/``m`` for the native one), and bias."""
        if self.native_packed is not None:
            n = self.native_packed.nbytes
        else:
            n = self.packed.numel() * self.packed.element_size() + self.scale_zero_bf16.numel() * 2
        return n + (0 if self.bias is None else self.bias.numel() * 4)

    @property
    def fp32_kernel(self) -> bool:
        """Whether the weight-only kernel is the native one (exact scales, fp32 output; fp32 activations, or int8
        ones for ``engine.native_linear.Int8ActivationKernel``)."""
        return self.native is not None

    def kernel_mm(self, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """The weight-only kernel alone on ``x`` ``[M, in]``: the native kernel (fp32 in and out; ``fp32``: its
        fp32-activation functions whatever its activations) or torch's int4 kernel (bf16 in and out), no bias.
        Returns ``[M, out]`` (fp32 or bf16)."""
        if self.native is not None:
            return self.native.mm(self.native_packed, x, fp32=fp32)
        return _int4_mm(x.to(torch.bfloat16), self.packed, self.scale_zero_bf16)

    def forward(self, x: torch.Tensor, exact: bool = False, dense: bool | None = None) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x``'s dtype. ``exact`` runs the kernel on fp32 activations
        and fp32 scale/zero (torch's kernel: slow on CPU, tests; the native kernel always does). ``dense``:
        True = the dense copy (when there is one; without one, the weight-only kernel), False = the weight-only
        kernel, None = by row count (``dense_min_rows``; without a copy, the weight-only kernel); the engine
        chooses per row (``forward_rows``)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if (
            self.dense is not None
            and not exact
            and (x2.shape[0] >= self.dense_min_rows if dense is None else dense)
        ):
            y = dense_mm(x2, self.dense)
        elif exact and self.native is None:
            y = _int4_mm(x2.float(), self.packed, self.scale_zero)
        elif x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        else:
            y = self.kernel_mm(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias.to(y.dtype))
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out, in]`` as the kernel sees it: the kernel applied to the identity with fp32 activations
        and scale/zero (one nonzero product per output, so no rounding beyond the weight's own)."""
        if self.native is not None:
            return self.native.mm(self.native_packed, torch.eye(self.in_features), fp32=True).t().contiguous()
        eye = torch.eye(self.in_features, device=self.packed.device)
        return _int4_mm(eye, self.packed, self.scale_zero).t().contiguous()


class Int8Weight(nn.Module):
    """An 8-bit weight-only linear for Q8_0 groups (``w = q * d``, ``q`` int8, ``d`` per 32 weights), exact.

    With the native kernel (``native``; ``engine.native_linear``): the int8 codes and f16 ``d`` as they are,
    fp32 activations and output. Else on torch's int4 kernel: with ``u = q + 128 = 16 hi + lo`` (``hi, lo`` in
    ``0..15``), ``d q = (hi - 8) * 16 d + (lo - 8) * d + 8 d``, i.e. two 4-bit planes with scales ``16 d`` / ``d``
    and zeros ``0`` / ``8 d``, laid side by side along ``in_features`` so ONE kernel call on ``[x, x]`` sums both
    in fp32 (``inner``). Either reads 1 byte per weight like an int8 kernel; torch's own ``_weight_int8pack_mm``
    has one scale per output row only (Q8_0's groups would have to be re-quantized) and was slower here (module
    docstring).

    Args:
        groups: ``engine.quantized.Int8Groups`` ``[out, in]``.
        bias, device, dense_min_rows, dense_dtype, native, dense_gemm: as ``Int4Weight``.
    """

    def __init__(
        self,
        groups,
        bias: torch.Tensor | None,
        device: torch.device,
        dense_min_rows: int | None = DENSE_MIN_ROWS,
        dense_dtype: torch.dtype = torch.bfloat16,
        native: NativeLinearKernel | None = None,
        dense_gemm: AmxGemmKernel | None = None,
    ) -> None:
        super().__init__()
        from engine.quantized import Int4Groups

        self.out_features, self.in_features = groups.q.shape
        self.native, self.native_packed = _native_pack(native, groups, device, pack_int8)
        self.inner: Int4Weight | None = None
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        if self.native is None:
            u = (groups.q.to(torch.int16) + 128).to(torch.uint8)
            planes = Int4Groups(
                torch.cat([u >> 4, u & 15], dim=1),
                torch.cat([groups.scale * 16, groups.scale], dim=1),
                torch.cat([torch.zeros_like(groups.scale), groups.scale * 8], dim=1),
            )
            self.inner = Int4Weight(planes, bias, device, None)
        self.dense_min_rows = dense_min_rows
        self.dense = None if dense_min_rows is None else _dense_copy(groups, device, dense_dtype, dense_gemm)

    @property
    def nbytes(self) -> int:
        if self.inner is not None:
            return self.inner.nbytes
        return self.native_packed.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    @property
    def fp32_kernel(self) -> bool:
        """As ``Int4Weight.fp32_kernel``."""
        return self.native is not None

    def kernel_mm(self, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """As ``Int4Weight.kernel_mm`` (torch's kernel: on the two planes, ``[x, x]``)."""
        if self.native is not None:
            return self.native.mm(self.native_packed, x, fp32=fp32)
        return self.inner.kernel_mm(torch.cat([x, x], dim=-1))

    def forward(self, x: torch.Tensor, exact: bool = False, dense: bool | None = None) -> torch.Tensor:
        """As ``Int4Weight.forward``."""
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if not exact and self.dense is not None and (rows >= self.dense_min_rows if dense is None else dense):
            y = dense_mm(x, self.dense).to(x.dtype)
            return y if self.bias is None else y.add_(self.bias.to(y.dtype))
        if self.inner is not None:
            return self.inner.forward(torch.cat([x, x], dim=-1), exact)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = x2.new_zeros(0, self.out_features) if rows == 0 else self.kernel_mm(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias.to(y.dtype))
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out, in]`` as the kernel sees it (exact; torch's kernel: both planes summed)."""
        if self.native is not None:
            return self.native.mm(self.native_packed, torch.eye(self.in_features), fp32=True).t().contiguous()
        w = self.inner.dequantize()
        return w[:, : self.in_features] + w[:, self.in_features :]


class BF16Weight(nn.Module):
    """A dense bf16 weight ``[out, in]`` applied with ``F.linear`` (oneDNN's bf16 GEMM on CPUs with
    AVX512-BF16/AMX); input cast to bf16, output returned in the input's dtype.

    Args:
        weight: ``[out, in]`` (any float dtype; stored as bf16). bias: ``[out]`` or None. device: where to run.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.weight = weight.to(device=device, dtype=torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.bfloat16)
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2 + (0 if self.bias is None else self.bias.numel() * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = bf16_gemm(x2, lambda part: F.linear(part, self.weight, self.bias)).view(*shape[:-1], -1)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def bf16_in_out(linear: LinearWeight) -> bool:
    """Whether ``linear.forward`` rounds its input to bf16 and its output is the bf16 result of its kernel with
    no fp32 step after it (no fp32 bias add, no fp32 dense copy): then feeding it bf16 and keeping its bf16
    output is bit-identical to the fp32 round trip, and a decoder layer may skip both casts
    (``engine.model.DecoderLayer``). True for ``BF16Weight`` and for bias-free ``Int4Weight`` / ``Int8Weight``
    on torch's int4 kernel whose dense prefill copy (if any) is bf16; False for those on the native kernel
    (fp32 in and out: ``engine.native_linear``), ``DenseWeight`` and anything else."""
    if isinstance(linear, BF16Weight):
        return True
    if isinstance(linear, Int4Weight | Int8Weight):
        return (
            not linear.fp32_kernel
            and linear.bias is None
            and (linear.dense is None or linear.dense.dtype == torch.bfloat16)
        )
    return False


def dense_bf16_in_out(linear: LinearWeight) -> bool:
    """Whether ``linear``'s prompt rows (``forward(x, dense=True)``) round their input to bf16 and return their
    kernel's bf16 result with no fp32 step after it: a bias-free ``Int4Weight`` / ``Int8Weight`` whose dense copy is
    a bf16 tensor for oneDNN (``engine.bf16_gemm``; not ``engine.amx_gemm``'s copy, whose output is fp32). Then
    feeding those rows bf16 and keeping the bf16 output is bit-identical to the fp32 round trip (``bf16_in_out``'s
    argument, for the dense copy alone)."""
    if not isinstance(linear, Int4Weight | Int8Weight) or linear.bias is not None:
        return False
    dense = linear.dense
    return isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16


class GroupedEmbedding(nn.Module):
    """A token embedding kept in its quantized groups, rows decoded on lookup (exact, fp32):
    ``row = (q - offset) * scale + zero`` per group of 32 (Q8_0: offset 0, no zero; Q4_x: offset 8).

    Args:
        q: codes ``[vocab, hidden]`` (int8 or uint8). scale: fp32 ``[vocab, hidden / 32]``.
        zero: fp32 like ``scale`` or None. offset: subtracted from codes. device: where to keep it.
    """

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        offset: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.q, self.scale = q.to(device), scale.to(device)
        self.zero = None if zero is None else zero.to(device)
        self.offset = offset
        self.num_embeddings, self.embedding_dim = q.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> fp32 ``[T, hidden]``."""
        t = ids.shape[0]
        q = self.q.index_select(0, ids).view(t, -1, GROUP).float()
        if self.offset:
            q.sub_(self.offset)
        out = q.mul_(self.scale.index_select(0, ids)[:, :, None])
        if self.zero is not None:
            out.add_(self.zero.index_select(0, ids)[:, :, None])
        return out.view(t, self.embedding_dim)
