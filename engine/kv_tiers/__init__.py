"""Tiers below the RAM block pool: a disk tier (``diskcache``) and a shared Redis tier, with per-level
policies, a write-back queue, a prefetch thread and a stable keyed block hash for persisted entries.

Modules: ``entry`` (key and byte layout of one block), ``keys`` (deployment-keyed block hash), ``policy``
(levels, TTLs, budget shares), ``disk`` and ``redis_tier`` (the tiers), ``writeback`` (bounded queue),
``stack`` (the tiers as one lookup / write-back object), ``counters``.
"""
