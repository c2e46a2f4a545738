"""Client keys: the key table the gateway authenticates requests against, and how a client presents a key.

A client key is stored only as its SHA-256 digest (``key_digest``); the plain key is dropped as soon as the
config is read, so it cannot appear in a memory dump, a log line, a stats label or an error message. Each
key carries its ``tenant`` (the cache salt of its requests), the models it may use, optional limits
(``rpm``, ``tpm``, ``budget_usd``) and ``trusted`` (its ``x-prefixgate-tenant`` header is honoured).

Lookup (``KeyTable.lookup``) hashes the presented key, finds the entry by digest and confirms it with
``hmac.compare_digest``: the time taken does not depend on how many characters of a stored key a guess
shares (the dictionary is indexed by a SHA-256 digest, which reveals nothing usable about the key). An
invalid key costs one hash and one dictionary probe, and leaves no state behind.

Clients send the key as ``Authorization: Bearer <key>`` (OpenAI SDKs) or ``x-api-key: <key>`` (Anthropic
SDKs); ``presented_key`` reads either.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

AUTHORIZATION_HEADER = "authorization"
API_KEY_HEADER = "x-api-key"
MAX_KEY_CHARS = 512
"""Longer presented keys are refused without hashing (a flood of huge headers stays cheap)."""


def key_digest(key: str) -> bytes:
    """SHA-256 digest (32 bytes) of a client key's UTF-8 bytes; ``printf %s KEY | sha256sum`` gives its hex."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ClientKey:
    """One client key, as stored (never the key itself).

    Attributes:
        name: label in stats, metrics and logs (``key-<first 12 hex digits of the digest>`` when unnamed).
        digest: SHA-256 of the key (``key_digest``); ``repr`` shows only its first 12 hex digits.
        tenant: cache salt of this key's requests (non-empty, no ``/``: ``gateway.core.tenants``).
        models: model names the key may use; None = every configured model.
        rpm: requests per minute, or None for no limit.
        tpm: tokens (prompt + completion) per minute, or None for no limit.
        budget_usd: spend allowed in USD (priced models only), or None for no budget.
        trusted: the key's ``x-prefixgate-tenant`` header picks a sub-tenant ``<tenant>/<header>`` (a
            platform multiplexing its own users); an untrusted key's header is ignored and counted.
    """

    name: str
    digest: bytes
    tenant: str
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    trusted: bool = False

    def __repr__(self) -> str:
        return f"ClientKey(name={self.name!r}, digest={self.digest.hex()[:12]}..., tenant={self.tenant!r})"

    def allows(self, model: str) -> bool:
        """Whether this key may use ``model``."""
        return self.models is None or model in self.models


class KeyTable:
    """The configured client keys, by digest. Empty: the gateway runs open (no authentication).

    Args:
        keys: the keys; digests and names must be unique.

    Raises:
        ValueError: two keys with the same digest or the same name.
    """

    def __init__(self, keys: Iterable[ClientKey] = ()) -> None:
        self._by_digest: dict[bytes, ClientKey] = {}
        names: set[str] = set()
        for key in keys:
            if key.digest in self._by_digest:
                raise ValueError(
                    f"client key {key.name!r} duplicates key {self._by_digest[key.digest].name!r}"
                )
            if key.name in names:
                raise ValueError(f"two client keys are named {key.name!r}")
            self._by_digest[key.digest] = key
            names.add(key.name)

    def __len__(self) -> int:
        return len(self._by_digest)

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def __iter__(self):
        return iter(self._by_digest.values())

    def lookup(self, presented: str | None) -> ClientKey | None:
        """The key entry for a presented key, or None (absent, over-long, or unknown). Stores nothing."""
        if not presented or len(presented) > MAX_KEY_CHARS:
            return None
        digest = key_digest(presented)
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            return None
        return entry

    def tenants(self) -> list[str]:
        """The tenants of the configured keys, sorted, without repeats."""
        return sorted({key.tenant for key in self._by_digest.values()})


def tenant_cache_key(tenant: str, value: str) -> str:
    """A client's own upstream ``prompt_cache_key`` salted with its tenant: 32 hex digits of BLAKE2b-128
    (RFC 7693, personalized) over the length-prefixed tenant and value, so two tenants choosing the same
    value never share a provider's cache placement, and the tenant cannot be read back."""
    digest = hashlib.blake2b(digest_size=16, person=b"prefixgate-tpck1")
    for part in (tenant.encode("utf-8"), value.encode("utf-8")):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client sent: ``Authorization: Bearer <key>`` (scheme case-insensitive), else ``x-api-key``.

    Returns:
        The key with surrounding whitespace removed, or None when neither header carries one.
    """
    header = headers.get(AUTHORIZATION_HEADER)
    if header:
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    value = headers.get(API_KEY_HEADER, "").strip()
    return value or None
