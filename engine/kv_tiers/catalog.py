"""The prefix catalog: which prefixes an engine has cached, under which prefix key, for listing and dropping.

A *prefix* is the stable head of a prompt (DESIGN.md: tools + system, documents, history), named by the
gateway's prefix key (or, when none is given, by the hex chain hash of its last full block). The engine
records one when it warms a prompt or serves a request that names its prefix key; a record keeps the chain
hashes of the prefix's full blocks, the model id, the tenant (cache salt), the longest level it carries,
its token count, its last use and its pin. Where the blocks are (RAM, disk, Redis) is read live when
listing, never stored: a record cannot claim blocks that were evicted or expired.

The catalog is bounded (``max_entries``, least recently used dropped first); dropping a record never drops
blocks, ``LLMEngine.drop_cached`` does that.

With tiers, each record is also kept in them (``encode_record``, ``TierStack.save_record``: a small JSON entry
under the record's level, so it lives as long as its blocks' policy keeps them), and an engine that starts on
tiers holding blocks reads its model's records back (``TierStack.load_records``): a restarted gateway lists
and drops by prefix key what its tiers still serve. A record is written when it is new or its blocks, level or
tenant change, and again at a use ``RECORD_REFRESH_S`` or more after its last write (its blocks are written
down again each time the pool evicts them, which renews their TTL; the record's must keep up): its
``last_use`` after a restart is the one last written. A record the bound pushes out of the catalog is
forgotten in the tiers too, so the tiers never hold more records than the catalog (``max_entries``) and a
start reads at most that many. A tier's byte budget never evicts a record (``is_record_key``): the budget
evicts a level's oldest entries first, and the record, written when its prefix was first served, was older
than every block written down after it, so a trimmed chain's head went on being served with no row to list
or drop it by (a trial); records are bounded by ``max_entries`` instead, and expire with their level.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.block_hash import BlockHash

RECORD_KEY_PREFIX = "catalog-"
"""Tier keys of prefix records (``TierStack.record_key``); block entries' keys are bare hex digests."""
RECORD_REFRESH_S = 60.0
"""A record in use is written down again when its last write is at least this old (seconds)."""


def is_record_key(key: str) -> bool:
    """Whether a tier key names a prefix record (never evicted by a byte budget), not a block entry."""
    return key.startswith(RECORD_KEY_PREFIX)


@dataclass
class PrefixRecord:
    """One cached prefix.

    Attributes:
        prefix_key: the gateway's prefix key, or the hex chain hash of the last full block.
        model_id: the model it was computed by.
        tenant: its cache salt ("" = shared).
        level: the longest level among its blocks (``system``, ``documents``, ``history``).
        block_hashes: chain hashes of its full blocks, in order (tier keys derive from them).
        num_tokens: tokens of those blocks.
        last_use: wall-clock seconds of its last warm or request.
        pin_id: the pin holding it in RAM, or None.
        saved_at: the tier clock's seconds when it was last queued for the tiers (0: never; not kept down).
    """

    prefix_key: str
    model_id: str
    tenant: str
    level: str
    block_hashes: list[BlockHash] = field(repr=False)
    num_tokens: int
    last_use: float
    pin_id: str | None = None
    saved_at: float = 0.0


@dataclass(frozen=True)
class CachedPrefix:
    """A row of ``LLMEngine.list_cached`` (never any text).

    Attributes:
        prefix_key, model_id, tenant, level, last_use: as in ``PrefixRecord``.
        tokens: tokens of its full blocks.
        tiers: tokens of its leading blocks found in each place now: ``{"ram": n, "disk": m, "redis": k}``.
        expires_at: per tier, the soonest any of its leading blocks held there expires (clock seconds: from
            then on the tier serves less of it; None = none of them expires, or none is there).
        pinned: held in RAM by a pin.
    """

    prefix_key: str
    model_id: str
    tenant: str
    level: str
    tokens: int
    tiers: dict[str, int]
    last_use: float
    expires_at: dict[str, float | None]
    pinned: bool


class PrefixCatalog:
    """Prefix records by prefix key, least recently used first out when full.

    Args:
        max_entries: most records kept (>= 1).
    """

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._records: OrderedDict[str, PrefixRecord] = OrderedDict()

    def record(self, rec: PrefixRecord) -> list[PrefixRecord]:
        """Add or refresh a record (a pin already held under the key is kept).

        Returns:
            the records the bound pushed out (least recently used first), for the caller to forget where it
            kept them too (the tiers: ``TierStack.forget_record``).
        """
        old = self._records.pop(rec.prefix_key, None)
        if old is not None and rec.pin_id is None:
            rec.pin_id = old.pin_id
        self._records[rec.prefix_key] = rec
        evicted: list[PrefixRecord] = []
        while len(self._records) > self.max_entries:  # pinned records stay (pins are capped by the pool)
            victim = next((k for k, r in self._records.items() if r.pin_id is None), None)
            if victim is None:
                break
            evicted.append(self._records.pop(victim))
        return evicted

    def get(self, prefix_key: str) -> PrefixRecord | None:
        """The record of ``prefix_key``, or None."""
        return self._records.get(prefix_key)

    def select(
        self, *, prefix_key: str | None = None, tenant: str | None = None, model_id: str | None = None
    ) -> list[PrefixRecord]:
        """Records matching every filter given (all records when none is)."""
        return [
            r
            for r in self._records.values()
            if (prefix_key is None or r.prefix_key == prefix_key)
            and (tenant is None or r.tenant == tenant)
            and (model_id is None or r.model_id == model_id)
        ]

    def remove(self, prefix_key: str) -> PrefixRecord | None:
        """Forget a record (its blocks stay). Returns it, or None."""
        return self._records.pop(prefix_key, None)

    def __len__(self) -> int:
        return len(self._records)


RECORD_VERSION = 1


def encode_record(rec: PrefixRecord) -> bytes:
    """``rec`` (its pin left out: pins do not outlive the process) as the JSON bytes the tiers keep."""
    return json.dumps(
        {
            "v": RECORD_VERSION,
            "prefix_key": rec.prefix_key,
            "model_id": rec.model_id,
            "tenant": rec.tenant,
            "level": rec.level,
            "block_hashes": [bytes(h).hex() for h in rec.block_hashes],
            "num_tokens": rec.num_tokens,
            "last_use": rec.last_use,
        },
        separators=(",", ":"),
    ).encode()


def decode_record(data: bytes) -> PrefixRecord | None:
    """The record ``encode_record`` wrote, or None for bytes that are not one (another version, a block entry,
    damage): a tier entry is never trusted to be well formed."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("v") != RECORD_VERSION:
            return None
        text = ("prefix_key", "model_id", "tenant", "level")
        if not all(isinstance(doc.get(k), str) for k in text):
            return None
        hashes = doc.get("block_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            return None
        num_tokens, last_use = doc.get("num_tokens"), doc.get("last_use")
        if (
            not isinstance(num_tokens, int)
            or isinstance(num_tokens, bool)
            or not isinstance(last_use, int | float)
        ):
            return None
        return PrefixRecord(
            doc["prefix_key"],
            doc["model_id"],
            doc["tenant"],
            doc["level"],
            [bytes.fromhex(h) for h in hashes],
            num_tokens,
            float(last_use),
        )
    except (ValueError, UnicodeDecodeError):
        return None
