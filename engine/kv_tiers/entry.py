"""The tier entry: how one KV block is keyed and laid out in a tier below the RAM pool (disk, Redis).

Key. ``tier_key = sha256(model digest || layout digest || chain hash)`` in hex, where

- the *chain hash* is the block's prefix-cache hash (``engine.block_hash``; with tiers on it is keyed by the
  deployment secret, ``engine.kv_tiers.keys``, so it is the same in every process of a deployment). It
  already covers the parent chain, the block's tokens and the extra keys (model id, cache salt);
- the *model digest* covers what makes the KV bytes of the same tokens differ between weights: the model id
  (which carries the weights' fingerprint, ``engine.checkpoint``) and the weight format;
- the *layout digest* covers how the bytes are laid out: layout version, KV dtype, block size, layers, KV
  heads and head dim.

Value (layout version 1), little-endian::

    b"PGKV" | u16 version | 32 B model digest | 32 B layout digest
    | u16 len + chain hash | u8 has_parent | u16 len + parent hash | u32 len + extra keys (canonical bytes)
    | u32 n + n x i64 token ids | u64 len + KV payload | 32 B blake2b-256 of everything before

The KV payload is ``kv_cache[:, :, block_id]`` of ``engine.model.allocate_kv_cache``, contiguous:
``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the KV dtype, row-major. Keys are stored
after RoPE, with each head's dims in rotate-half *pair order* (``engine.model.interleave_rope_rows``:
``0, h/2, 1, h/2 + 1, ...``), exactly as the pool holds them; a reader with another order would get wrong
attention scores, so the order is part of the layout version.

Decoding checks everything (``decode_entry``): any mismatch raises ``EntryRejected`` with a cause
(``truncated``, ``corrupt``, ``format``, ``model``, ``collision``) and is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash, encode_extra_keys

LAYOUT_VERSION = 1
MAGIC = b"PGKV"
_DIGEST = 32
_CHECKSUM = 32
REJECT_CAUSES = ("truncated", "corrupt", "format", "model", "collision")
"""Why an entry read from a tier was refused (each is counted; each is a miss)."""


class EntryRejected(ValueError):
    """A tier entry that must not be used. ``cause`` is one of ``REJECT_CAUSES``."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``.

    Raises:
        ValueError: a dtype the KV cache does not use.
    """
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} has no tier layout")


@dataclass(frozen=True)
class KVLayout:
    """What the KV bytes of one block depend on besides its tokens (hashed into every tier key).

    Attributes:
        model_id: stable id of the weights (``engine.checkpoint``: file name + weight fingerprint).
        weight_format: how the linear weights are stored (e.g. ``"float32/DenseWeight"``); a different
            format computes different (rounded) KV for the same weights.
        kv_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        block_size: tokens per block.
        num_layers, num_kv_heads, head_dim: the KV tensor's shape per token.
        layout_version: ``LAYOUT_VERSION`` (bumped with any change of the byte layout or the key order).
    """

    model_id: str
    weight_format: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int = LAYOUT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, block_size, num_kv_heads, head_dim]``: one block's KV."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one block's KV payload."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.tensor([], dtype=self.torch_dtype).element_size()

    def model_digest(self) -> bytes:
        """32 bytes: sha256 over the model id and the weight format."""
        return _sha(("model", self.model_id, self.weight_format))

    def layout_digest(self) -> bytes:
        """32 bytes: sha256 over the layout version, pair-ordered keys, KV dtype and shape."""
        return _sha(
            (
                "layout",
                self.layout_version,
                "keys-rope-pair-order",
                self.kv_dtype,
                self.block_size,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
            )
        )

    def tier_key(self, block_hash: BlockHash) -> str:
        """The key of a block in every tier: hex sha256(model digest, layout digest, chain hash)."""
        return hashlib.sha256(self.model_digest() + self.layout_digest() + bytes(block_hash)).hexdigest()

    @classmethod
    def of_model(cls, model, model_id: str, block_size: int, kv_dtype: torch.dtype | None = None) -> KVLayout:
        """The layout of ``model``'s KV cache (an ``engine.model.LlamaModel``).

        The weight format names the dtype and the linear-weight classes of the first layer and the LM head.
        """
        c = model.config
        layer = model.layers[0]
        kinds = sorted({type(w).__name__ for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)})
        weight_format = f"{dtype_name(model.dtype)}/{'+'.join(kinds)}/head:{type(model.lm_head).__name__}"
        return cls(
            model_id=model_id,
            weight_format=weight_format,
            kv_dtype=dtype_name(kv_dtype or model.dtype),
            block_size=block_size,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
        )


def _sha(fields: tuple) -> bytes:
    return hashlib.sha256(encode_extra_keys(fields)).digest()


@dataclass(frozen=True)
class BlockMeta:
    """What identifies one block's content: its chain hash, parent hash, token ids and extra keys."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM).digest()


def encode_entry(layout: KVLayout, meta: BlockMeta, kv: torch.Tensor) -> bytes:
    """Serialize one block (see the module docstring for the layout).

    Args:
        layout: the engine's KV layout.
        meta: the block's identity.
        kv: ``layout.block_shape`` in ``layout.torch_dtype`` (any device; copied to CPU bytes).

    Raises:
        ValueError: ``kv`` has another shape or dtype, or ``meta`` has the wrong number of tokens.
    """
    if tuple(kv.shape) != layout.block_shape or kv.dtype != layout.torch_dtype:
        raise ValueError(
            f"KV block {tuple(kv.shape)} {kv.dtype} is not {layout.block_shape} {layout.kv_dtype}"
        )
    if len(meta.token_ids) != layout.block_size:
        raise ValueError(f"a block holds {layout.block_size} tokens, got {len(meta.token_ids)}")
    payload = kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    extra = encode_extra_keys(tuple(meta.extra_keys))
    parent = meta.parent_hash or b""
    out = bytearray()
    out += MAGIC + struct.pack("<H", layout.layout_version)
    out += layout.model_digest() + layout.layout_digest()
    out += struct.pack("<H", len(meta.block_hash)) + bytes(meta.block_hash)
    out += struct.pack("<BH", meta.parent_hash is not None, len(parent)) + parent
    out += struct.pack("<I", len(extra)) + extra
    out += struct.pack("<I", len(meta.token_ids)) + array("q", meta.token_ids).tobytes()
    out += struct.pack("<Q", len(payload)) + payload
    out += _checksum(out)
    return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise EntryRejected("truncated", f"needs {self.pos + n} bytes, has {len(self.data)}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def decode_entry(layout: KVLayout, meta: BlockMeta, data: bytes) -> torch.Tensor:
    """Check one tier entry against the block it should hold and return its KV.

    Args:
        layout: the reader's KV layout.
        meta: the block the reader looks for (chain hash, parent hash, token ids, extra keys).
        data: the bytes read from the tier.

    Returns:
        CPU tensor ``layout.block_shape`` of ``layout.torch_dtype`` (its own memory).

    Raises:
        EntryRejected: ``truncated`` (short or length fields disagree), ``corrupt`` (checksum), ``format``
            (magic, version, layout digest), ``model`` (other weights or weight format), ``collision``
            (another block's hash, parent, tokens or extra keys).
    """
    if len(data) < len(MAGIC) + 2 + 2 * _DIGEST + _CHECKSUM:
        raise EntryRejected("truncated", f"{len(data)} bytes")
    r = _Reader(data)
    if bytes(r.take(4)) != MAGIC:
        raise EntryRejected("format", "not a prefixgate KV entry")
    (version,) = r.unpack("<H")
    if version != layout.layout_version:
        raise EntryRejected("format", f"layout version {version}, reader has {layout.layout_version}")
    model_digest, layout_digest = bytes(r.take(_DIGEST)), bytes(r.take(_DIGEST))
    (hlen,) = r.unpack("<H")
    block_hash = bytes(r.take(hlen))
    has_parent, plen = r.unpack("<BH")
    parent_bytes = bytes(r.take(plen))
    parent = parent_bytes if has_parent else None
    (elen,) = r.unpack("<I")
    extra = bytes(r.take(elen))
    (ntok,) = r.unpack("<I")
    tokens = array("q")
    tokens.frombytes(r.take(8 * ntok))
    (nbytes,) = r.unpack("<Q")
    payload = r.take(nbytes)
    body_end = r.pos
    checksum = bytes(r.take(_CHECKSUM))
    if r.pos != len(data):
        raise EntryRejected("truncated", f"{len(data) - r.pos} bytes after the checksum")
    if _checksum(memoryview(data)[:body_end]) != checksum:
        raise EntryRejected("corrupt", "checksum mismatch")
    if layout_digest != layout.layout_digest() or nbytes != layout.payload_nbytes:
        raise EntryRejected("format", "KV layout (dtype, block size, shape or version) differs")
    if model_digest != layout.model_digest():
        raise EntryRejected("model", "written by other weights or another weight format")
    if (
        block_hash != bytes(meta.block_hash)
        or parent != (None if meta.parent_hash is None else bytes(meta.parent_hash))
        or extra != encode_extra_keys(tuple(meta.extra_keys))
        or tuple(tokens) != tuple(meta.token_ids)
    ):
        raise EntryRejected("collision", "the entry holds another block (hash, parent, tokens or extra keys)")
    kv = torch.frombuffer(bytearray(payload), dtype=layout.torch_dtype)
    return kv.view(layout.block_shape)


def decode_extra_keys(raw: bytes) -> tuple:
    """Inverse of ``engine.block_hash.encode_extra_keys`` (tuples come back as tuples).

    Raises:
        ValueError: the bytes are not one canonical encoding of a tuple.
    """
    r = _Reader(raw)

    def one() -> object:
        tag = bytes(r.take(1))
        if tag == b"N":
            return None
        if tag == b"T":
            return bytes(r.take(1)) == b"\x01"
        if tag == b"I":
            (n,) = r.unpack("<I")
            return int(bytes(r.take(n)).decode("ascii"))
        if tag == b"F":
            return r.unpack("<d")[0]
        if tag == b"S":
            (n,) = r.unpack("<I")
            return bytes(r.take(n)).decode("utf-8")
        if tag == b"B":
            (n,) = r.unpack("<I")
            return bytes(r.take(n))
        if tag == b"U":
            (n,) = r.unpack("<I")
            return tuple(one() for _ in range(n))
        raise ValueError(f"unknown extra-key tag {tag!r}")

    try:
        value = one()
    except EntryRejected as e:
        raise ValueError(str(e)) from None
    if not isinstance(value, tuple) or r.pos != len(raw):
        raise ValueError("not one encoded tuple")
    return value


def entry_meta(data: bytes) -> BlockMeta | None:
    """The identity an entry claims (chain hash, parent, tokens, extra keys), read from its header without
    checking the checksum or the layout (listing, dropping by tenant or model, tests).

    Returns None when the bytes do not parse as an entry header.
    """
    try:
        r = _Reader(data)
        if bytes(r.take(4)) != MAGIC:
            return None
        r.unpack("<H")
        r.take(2 * _DIGEST)
        (hlen,) = r.unpack("<H")
        block_hash = bytes(r.take(hlen))
        has_parent, plen = r.unpack("<BH")
        parent = bytes(r.take(plen))
        (elen,) = r.unpack("<I")
        extra = decode_extra_keys(bytes(r.take(elen)))
        (ntok,) = r.unpack("<I")
        tokens = array("q")
        tokens.frombytes(r.take(8 * ntok))
        return BlockMeta(block_hash, parent if has_parent else None, tuple(tokens), extra)
    except (EntryRejected, struct.error, ValueError):
        return None
