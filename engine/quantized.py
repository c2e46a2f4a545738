"""GGUF quantized blocks kept as they are in the file, and their exact decoding into groups of 32.

A 2-D GGUF tensor of type Q4_0, Q4_1 or Q8_0 stores each row as blocks of 32 weights (ggml's ``block_q4_0`` /
``block_q4_1`` / ``block_q8_0``, https://github.com/ggml-org/ggml/blob/master/src/ggml-common.h):

| type | bytes | layout | weight ``j`` of the block |
|---|---|---|---|
| Q4_0 | 18 | ``d: f16, qs[16]`` (element ``j < 16`` in the low nibble of ``qs[j]``, ``j >= 16`` in the high one) | ``d * (q_j - 8)`` |
| Q4_1 | 20 | ``d: f16, m: f16, qs[16]`` (nibbles as Q4_0) | ``d * q_j + m`` |
| Q8_0 | 34 | ``d: f16, qs[32]: int8`` | ``d * q_j`` |

``GGUFBlocks`` holds such a tensor's raw bytes ``[rows, bytes_per_row]`` with its logical shape ``[rows, cols]``;
row permutations (llama.cpp's Q/K order, RoPE pair order) and row concatenation (fused q/k/v, gate/up) apply to
it without decoding, because blocks never cross rows. ``int4_groups`` / ``int8_groups`` decode it into integer
codes plus fp32 per-group scale (and zero) such that, in fp32, ``(q - 8) * scale + zero`` (int4) or
``q * scale`` (int8) equals ``gguf.quants.dequantize`` of the same bytes bit for bit: every product of an f16
scale and a code of at most 8 bits is exact in fp32, and Q4_1's zero ``m + 8 d`` is exact whenever the two f16
values are within 13 binades of each other (checked per group; ``InexactZeroError`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # weights per block, every type here
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
INT4_TYPES = ("Q4_0", "Q4_1")


class InexactZeroError(ValueError):
    """A Q4_1 group whose zero ``m + 8 d`` is not exactly representable in fp32 (never seen in practice)."""


@dataclass
class GGUFBlocks:
    """A quantized 2-D tensor as stored in a GGUF file.

    Attributes:
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        raw: uint8 ``[rows, cols / 32 * BLOCK_BYTES[qtype]]``, the file's bytes, row-major.
        cols: logical columns (input features); a multiple of 32.
    """

    qtype: str
    raw: np.ndarray
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUFBlocks holds {', '.join(BLOCK_BYTES)}, not {self.qtype}")
        if (
            self.cols % QK
            or self.raw.ndim != 2
            or self.raw.shape[1] != self.cols // QK * BLOCK_BYTES[self.qtype]
        ):
            raise ValueError(f"{self.qtype} bytes {self.raw.shape} do not hold rows of {self.cols} weights")

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``(rows, cols)`` = ``(out_features, in_features)``."""
        return (self.raw.shape[0], self.cols)

    def dim(self) -> int:
        return 2

    def rows(self, index: np.ndarray | torch.Tensor) -> GGUFBlocks:
        """The rows ``index`` (int array) in that order."""
        return GGUFBlocks(self.qtype, np.ascontiguousarray(self.raw[np.asarray(index)]), self.cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]`` by ``gguf.quants.dequantize`` (the reference decoder)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.qtype]
        return torch.from_numpy(
            np.asarray(gguf.quants.dequantize(self.raw, qtype), dtype=np.float32).reshape(self.shape).copy()
        )

    def _blocks(self) -> np.ndarray:
        return self.raw.reshape(self.raw.shape[0], -1, BLOCK_BYTES[self.qtype])  # [rows, groups, bytes]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs`` uint8 ``[..., 16]`` -> codes uint8 ``[..., 32]``: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


@dataclass
class Int4Groups:
    """4-bit codes with fp32 per-group scale and zero: ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``,
    ``g = k // 32`` (torch's ``_weight_int4pack_mm`` convention, verified by ``tests/engine/test_weight_formats``).

    Attributes:
        q: uint8 ``[N, K]`` codes in ``0..15``.
        scale, zero: fp32 ``[N, K / 32]``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]``."""
        n, k = self.q.shape
        w = (self.q.view(n, -1, QK).float() - 8) * self.scale[:, :, None] + self.zero[:, :, None]
        return w.view(n, k)

    @staticmethod
    def concat(parts: list[Int4Groups]) -> Int4Groups:
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))


@dataclass
class Int8Groups:
    """8-bit codes with an fp32 scale per group of 32: ``w[n, k] = q[n, k] * scale[n, k // 32]`` (Q8_0).

    Attributes:
        q: int8 ``[N, K]``.
        scale: fp32 ``[N, K / 32]``.
    """

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, -1, QK).float() * self.scale[:, :, None]).view(n, k)

    @staticmethod
    def concat(parts: list[Int8Groups]) -> Int8Groups:
        return Int8Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


def int4_groups(b: GGUFBlocks) -> Int4Groups:
    """Exact ``Int4Groups`` of a Q4_0 or Q4_1 tensor: Q4_0 ``(d, 0)``, Q4_1 ``(d, m + 8 d)``.

    Raises:
        ValueError: another type. InexactZeroError: a Q4_1 zero not exact in fp32 (the group is named).
    """
    blocks = b._blocks()
    d = _f16(blocks[..., 0:2])
    if b.qtype == "Q4_0":
        zero = np.zeros_like(d)
        qs = blocks[..., 2:]
    elif b.qtype == "Q4_1":
        m = _f16(blocks[..., 2:4])
        zero = m + np.float32(8) * d
        exact = zero.astype(np.float64) == m.astype(np.float64) + 8 * d.astype(np.float64)
        if not exact.all():
            row, group = (int(i[0]) for i in np.nonzero(~exact))
            raise InexactZeroError(f"Q4_1 row {row} group {group}: zero m + 8d is not exact in fp32")
        qs = blocks[..., 4:]
    else:
        raise ValueError(f"{b.qtype} is not a 4-bit type ({', '.join(INT4_TYPES)})")
    q = _nibbles(qs).reshape(b.shape)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(zero))


def int8_groups(b: GGUFBlocks) -> Int8Groups:
    """Exact ``Int8Groups`` of a Q8_0 tensor.

    Raises:
        ValueError: another type.
    """
    if b.qtype != "Q8_0":
        raise ValueError(f"{b.qtype} is not Q8_0")
    blocks = b._blocks()
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(b.shape)
    return Int8Groups(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)))


def quantize(w: torch.Tensor, qtype: str) -> GGUFBlocks:
    """Quantize an ``[N, K]`` float tensor (K a multiple of 32) to GGUF blocks with ``gguf.quants.quantize``
    (llama.cpp's reference quantizers), for checkpoints quantized at load.

    Raises:
        ValueError: K not a multiple of 32, or an unknown type.
    """
    import gguf

    if w.dim() != 2 or w.shape[1] % QK:
        raise ValueError(
            f"cannot quantize a tensor of shape {tuple(w.shape)} to {qtype}: need [N, K], K % 32 == 0"
        )
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"cannot quantize to {qtype}")
    raw = gguf.quants.quantize(w.detach().float().cpu().numpy(), gguf.GGMLQuantizationType[qtype])
    return GGUFBlocks(qtype, np.ascontiguousarray(raw.reshape(w.shape[0], -1)), w.shape[1])
