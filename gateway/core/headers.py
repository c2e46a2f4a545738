"""The prefixgate request headers every face reads: ``x-prefixgate-tenant`` (cache salt) and
``x-prefixgate-rules: on|off`` (rules opt-out). Bad values raise ``InvalidRequestError`` naming the header.
And the one answer header a front gateway reads from prefixgate replicas: ``x-prefixgate-instance``.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.errors import InvalidRequestError

RULES_HEADER = "x-prefixgate-rules"


TENANT_HEADER = "x-prefixgate-tenant"
MAX_TENANT_CHARS = 256

INSTANCE_HEADER = "x-prefixgate-instance"
"""Every model answer names the gateway instance that served it (12 random hex characters, new at each start):
a front gateway that routes to prefixgate replicas sees a restarted replica, whose RAM prefix cache is empty,
by a name it has not seen there before (``gateway.transport.replica_instances``)."""


def rules_enabled(headers: Mapping[str, str]) -> bool:
    """Whether a request wants rules: header absent or ``on`` -> True, ``off`` -> False (case-insensitive).

    Raises:
        InvalidRequestError: any other header value (param ``x-prefixgate-rules``).
    """
    value = headers.get(RULES_HEADER)
    if value is None:
        return True
    value = value.strip().lower()
    if value in ("on", "off"):
        return value == "on"
    raise InvalidRequestError(
        f"Invalid header {RULES_HEADER}: expected 'on' or 'off'.", param=RULES_HEADER, code="invalid_value"
    )


def tenant(headers: Mapping[str, str]) -> str:
    """The ``x-prefixgate-tenant`` value as sent ("" when absent). It becomes a cache salt only once
    ``check_tenant`` accepted it: in open mode, or for a trusted key (``gateway.http.auth.authorize``); an
    untrusted key's header is ignored whatever it holds.

    HTTP header values arrive as bytes, which the server hands over decoded as Latin-1 (RFC 9110 section 5.5);
    a value that is valid UTF-8 (``"租户"`` sent by any HTTP client) is read as UTF-8, so stats, metrics and the
    dashboard show the tenant as the client wrote it; other bytes stay as Latin-1 decoded them."""
    value = headers.get(TENANT_HEADER, "")
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:  # not UTF-8 (or not from a Latin-1 decode): as it came
        return value


def check_tenant(value: str) -> str:
    """``value`` when it may be used as a cache salt.

    Raises:
        InvalidRequestError: longer than 256 characters.
    """
    if len(value) > MAX_TENANT_CHARS:
        raise InvalidRequestError(
            f"Header {TENANT_HEADER} is longer than {MAX_TENANT_CHARS} characters.",
            param=TENANT_HEADER,
            code="invalid_value",
        )
    return value
