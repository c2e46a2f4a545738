"""Stable, keyed block hashes for blocks that outlive the process (the disk and Redis tiers).

``engine.block_hash.hash_block`` seeds sha256 with 16 random bytes per process, so a restarted engine (or a
second gateway) could never find a block written before. With tiers on, the engine hashes blocks with
``keyed_block_hash(secret)`` instead:

    hash_i = HMAC-SHA256(key = deployment secret, "prefixgate-block-v1" || parent || tokens_i || extra_keys)

over the same canonical encoding as ``hash_block`` (``encode_token_ids``, ``encode_extra_keys``). Every process
of one deployment (same secret) computes the same hashes, so persisted entries stay readable after a restart
and are shared through Redis; without the secret, keys are still not predictable from outside (a client
cannot aim a collision at another tenant's block), which is what the per-process seed protects.

The secret comes from the config (``EngineConfig.deployment_secret``). With a disk tier and no secret, one is
made once and kept beside the disk tier (``load_or_create_secret``), readable by the owner only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from engine.block_hash import BlockHash, HashFn, encode_extra_keys, encode_token_ids

_DOMAIN = b"prefixgate-block-v1"
SECRET_FILE = "deployment-secret"
MIN_SECRET_BYTES = 16


def keyed_block_hash(secret: bytes) -> HashFn:
    """A block hash function keyed by ``secret`` (stable across processes; see the module docstring).

    Args:
        secret: the deployment secret (>= 16 bytes).

    Returns:
        ``(parent, token_ids, extra_keys) -> 32 bytes``, the signature of ``engine.block_hash.hash_block``.

    Raises:
        ValueError: ``secret`` shorter than 16 bytes.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the deployment secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
        )
    base = hmac.new(bytes(secret), _DOMAIN, hashlib.sha256)

    def hash_fn(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
        h = base.copy()
        if parent is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01" + struct.pack("<I", len(parent)) + parent)
        h.update(encode_token_ids(token_ids))
        h.update(encode_extra_keys(tuple(extra_keys)))
        return h.digest()

    return hash_fn


def load_or_create_secret(directory: str | Path) -> bytes:
    """The deployment secret kept in ``directory`` (made with ``os.urandom(32)``, mode 0600, on first use).

    Raises:
        OSError: the directory cannot be written or the file read.
    """
    path = Path(directory) / SECRET_FILE
    try:
        data = path.read_bytes()
        if len(data) >= MIN_SECRET_BYTES:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = os.urandom(32)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    try:
        os.link(tmp, path)  # first writer wins; a racing process reads the winner's secret
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
