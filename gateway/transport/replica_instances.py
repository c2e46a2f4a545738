"""Replica restarts seen in the answers: every model answer of a prefixgate replica names the instance that
served it (``x-prefixgate-instance``, ``gateway.core.headers.INSTANCE_HEADER``: new at each start). A name a
replica's base URL has not answered with before means a new process behind it, whose RAM prefix cache starts
empty; ``ReplicaInstances.observe`` says so, and the upstream backend then forgets what its cache-aware index
credited to that replica (``CacheAwarePolicy.replica_restarted``), here and, through ``routing_share``, in the
other gateways.

Invariants:
- a replica's first answer with the header, and any answer without it (vLLM, SGLang, a provider), is no restart;
- a name seen before at the same URL is no restart either: a URL that balances over several live instances (a
  Kubernetes Service in front of two pods) alternates between known names, and clearing the index at each
  switch would throw away every placement; each URL keeps its last ``KNOWN_PER_REPLICA`` names;
- a value longer than ``MAX_INSTANCE_CHARS`` or holding anything but ``[0-9A-Za-z_-]`` is ignored (a header
  no prefixgate sent);
- a name another gateway reported through ``routing_share`` (``learn``) is known here too: one restart is one
  renewal across the gateways, not one per gateway (a trial: the second gateway's renewal erased the placements
  the first had made on the new instance since).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping

from gateway.core.headers import INSTANCE_HEADER

KNOWN_PER_REPLICA = 8
"""Instance names remembered per replica URL (the most recent ones)."""
MAX_INSTANCE_CHARS = 64
"""Longest header value taken as an instance name (prefixgate sends 12 hex characters)."""
_NAME = re.compile(r"[0-9A-Za-z_-]+")


class ReplicaInstances:
    """The instance names each replica URL has answered with, and how many restarts that showed.

    Attributes:
        restarts: replica URL -> answers that named an instance new to that URL after it had named another.
    """

    def __init__(self) -> None:
        self._known: dict[str, OrderedDict[str, None]] = {}
        self.restarts: dict[str, int] = {}

    def observe(self, replica: str, headers: Mapping[str, str]) -> str | None:
        """Note the instance named by one answer's ``headers`` from ``replica`` (its base URL).

        Returns:
            The instance's name when ``replica`` had answered before with other names only: it restarted since
            (counted in ``restarts``); None otherwise, including an absent or malformed header.
        """
        value = headers.get(INSTANCE_HEADER)
        known = self._known.get(replica)
        if not value or (known is not None and value in known):  # the common case: a name known here
            if value:
                known.move_to_end(value)  # type: ignore[union-attr]
            return None
        if not self.learn(replica, value) or known is None:  # malformed, or the URL's first name
            return None
        self.restarts[replica] = self.restarts.get(replica, 0) + 1
        return value

    def learn(self, replica: str, name: str) -> bool:
        """Know ``name`` as an instance of ``replica`` (its answers are no restart from now on): one this gateway
        saw, or one whose restart another gateway reported. Returns False, learning nothing, for a malformed
        name (longer than ``MAX_INSTANCE_CHARS``, or not ``[0-9A-Za-z_-]+``)."""
        if not name or len(name) > MAX_INSTANCE_CHARS or not _NAME.fullmatch(name):
            return False
        known = self._known.setdefault(replica, OrderedDict())
        known[name] = None
        known.move_to_end(name)
        if len(known) > KNOWN_PER_REPLICA:
            known.popitem(last=False)
        return True
