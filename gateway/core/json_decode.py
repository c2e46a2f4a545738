"""``loads``: ``json.loads``'s result, parsed by msgspec's C decoder where that gives the same value.

The hot path parses the client's body and every SSE chunk of the upstream's answer (five per answer from an
OpenAI-compatible server); ``json.loads`` costs ~3 µs a chunk there, msgspec's decoder under 1
(docs/overhead.md, session 9). msgspec is already a dependency (KV event batches).

Invariant: ``loads(text)`` returns what ``json.loads(text)`` returns (the same types and values, floats bit
for bit, the last of duplicate keys) or raises what it raises. msgspec parses strict RFC 8259 UTF-8 JSON; where
``json.loads`` is more lenient (``NaN`` / ``Infinity``, numbers out of the float range, raw UTF-8 surrogates,
UTF-16/32 or a BOM in bytes) or refuses (malformed text, too deep), msgspec raises, and the text is parsed
again by ``json.loads``, which then decides. Checked against ``json.loads`` by property tests
(``tests/gateway/core/test_json_decode.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["loads"]

_DECODER = msgspec.json.Decoder()
_FALL_BACK = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)
"""What msgspec raises where ``json.loads`` may accept the text or must name the error itself."""


def loads(
    text: str | bytes | bytearray,
    *,
    parse_constant: Callable[[str], Any] | None = None,
    parse_float: Callable[[str], Any] | None = None,
) -> Any:
    """``json.loads(text, parse_constant=..., parse_float=...)``, faster on the strict JSON servers and clients
    send (module docstring). The hooks are ``json.loads``'s; msgspec's strict parse never meets a constant
    (``NaN``, ``Infinity``) or a float that overflows, so a hook that returns ``float(token)`` for finite
    numbers sees the same values either way (msgspec's floats are ``float(token)``'s, bit for bit).

    Raises:
        json.JSONDecodeError / ValueError / UnicodeDecodeError / RecursionError: what ``json.loads(text)``
            (with the hooks) raises for this text.
    """
    try:
        return _DECODER.decode(text)
    except _FALL_BACK:
        return json.loads(text, parse_constant=parse_constant, parse_float=parse_float)
