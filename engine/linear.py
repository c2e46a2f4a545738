"""Pluggable weight formats of the linear layers.

Decoding one token on a CPU reads every weight once, so its speed is bound by the bytes of weights read per
token, not by arithmetic. Each linear layer of ``engine.model.LlamaModel`` therefore holds a ``LinearWeight``
rather than a bare tensor: ``DenseWeight`` is fp32 / bf16 / fp16; int8 and int4 weight-only formats
(quantized blocks + scales, dequantized inside a fused matmul kernel) plug in here next by implementing the
same two members, without touching the model.

Kernel choice of ``DenseWeight`` (fp32 on CPU, SmolLM2-135M shapes, one thread, weights streamed from memory;
measured with ``time.thread_time`` so other processes do not distort it):

| rows (tokens) | ``F.linear(x, W[out,in])`` | ``x @ W.T`` stored ``[in,out]`` | oneDNN prepacked (packed for 8 rows) |
|---|---|---|---|
| 1 (decode of one sequence) | 34 ms / 30 layers | **31 ms** | 41 ms |
| 8 (batched decode) | 79 ms | 72 ms | **52 ms** |
| 512 (prefill chunk) | | **687 ms** | 714 ms |

So the weight is stored transposed and used by a plain GEMM, and on CPU in fp32 a second, prepacked copy
(oneDNN's blocked layout, ``torch.ops.mkldnn._reorder_linear_weight``, the format PyTorch's own compiler uses
for CPU linears) serves batches of ``PACKED_ROWS`` rows: it costs a second copy of the weights in memory, not
in bytes read per token (each step reads one copy).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

PACKED_ROWS = range(2, 49)  # row counts served by the prepacked copy (decode batches)
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


def onednn_packing_available() -> bool:
    """Whether this PyTorch build has the oneDNN prepacked linear ops (CPU builds with mkldnn)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class DenseWeight(nn.Module):
    """A dense weight applied as ``x @ W.T (+ b)``, stored transposed (``[in_features, out_features]``).

    See the module docstring for the kernels. On CPU in fp32 (and when oneDNN is available) a prepacked copy
    serves 2-D inputs with a row count in ``PACKED_ROWS``; it is checked against the plain product when made
    and dropped (plain GEMM used) if it disagrees beyond fp32 rounding.

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
        if self.packed is not None and x.dim() == 2 and x.shape[0] in PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return self._plain(x)

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
