"""Model registry and prefix keys: which backend serves a request, and which prefix group it belongs to.

The prefix key names a prefix group: requests with the same model, the same tenant (cache salt) and the same
stable prefix (the rules' ``stable_prefix_material()``: tools + system, documents) share it. It is a 128-bit
BLAKE2b digest (RFC 7693) over length-prefixed fields, not seeded per process, so every gateway replica
computes the same key and can route by prefix affinity. It is a hash: it never reveals prompt text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from gateway.backends.base import Backend
from gateway.core.errors import ModelNotFoundError

_PERSON = b"prefixgate-pk-v1"


def prefix_key(model_id: str, tenant: str, stable_material: bytes) -> str:
    """Hex prefix key (32 characters) of (model id, tenant salt, stable prefix material).

    Each field is fed as an 8-byte little-endian length then its bytes, so no two field tuples collide by
    concatenation.
    """
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (model_id.encode(), tenant.encode(), stable_material):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


class ModelRegistry:
    """Client-facing model name -> started backend. Built once at start-up; read-only afterwards."""

    def __init__(self, backends: Mapping[str, Backend]) -> None:
        self._backends = dict(backends)

    def get(self, name: str) -> Backend:
        """The backend serving ``name``.

        Raises:
            ModelNotFoundError: no model of that name is configured (404 ``model_not_found``).
        """
        backend = self._backends.get(name)
        if backend is None:
            raise ModelNotFoundError(name)
        return backend

    def names(self) -> list[str]:
        """Model names in config order."""
        return list(self._backends)

    def items(self) -> Iterable[tuple[str, Backend]]:
        """(name, backend) pairs in config order."""
        return self._backends.items()

    def __len__(self) -> int:
        return len(self._backends)
