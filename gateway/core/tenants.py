"""Tenant names: how a request's tenant (its cache salt) is composed, and which tenants a request can have.

A configured tenant (``keys[].tenant``) is one name without ``/`` (``configured_tenant_problem``). A request
only ever narrows it, with ``/`` (``sub_tenant``): a trusted key's ``x-prefixgate-tenant`` header makes
``<tenant>/<header>``, a body's ``cache_salt`` appends ``/<salt>`` to the tenant chosen so far. So the text
before the first ``/`` of any request's tenant is its key's configured tenant (``root_tenant``): a derived
tenant never equals another key's configured tenant, nor lies inside one (key ``acme`` with salt ``vip`` is
``acme/vip``, inside ``acme``; a key configured ``acme/vip`` is refused at start). Inside its own tenant a
key narrows freely: ``acme/vip`` is reachable by every key of ``acme`` (a salt), as the docs promise.

Per-tenant usage (``/admin/stats`` ``tenants``) is counted under ``accounting_tenant``: the tenant without
the body's salt, so salts a client invents do not each take a row of the bounded table. ``reachable_tenant``
says whether a tenant can be any request's (``POST /admin/cache/warm`` and ``warm:`` refuse others).
"""

from __future__ import annotations

from collections.abc import Collection

from gateway.core.headers import MAX_TENANT_CHARS
from gateway.core.keys import ClientKey

SEPARATOR = "/"
"""Joins a tenant and the part that narrows it (``<tenant>/<header>``, ``<tenant>/<salt>``)."""


def sub_tenant(tenant: str, part: str) -> str:
    """``tenant`` narrowed by ``part`` (a trusted header or a body's ``cache_salt``): ``<tenant>/<part>``."""
    return f"{tenant}{SEPARATOR}{part}"


def root_tenant(tenant: str) -> str:
    """The configured tenant a keyed request's tenant was derived from: the text before its first ``/``."""
    return tenant.partition(SEPARATOR)[0]


def accounting_tenant(tenant: str, cache_salt: str) -> str:
    """The tenant a request's usage is counted under: ``tenant`` less the ``/<cache_salt>`` the body's salt
    appended (``tenant`` itself when it has none)."""
    suffix = SEPARATOR + cache_salt
    if cache_salt and tenant.endswith(suffix):
        return tenant[: -len(suffix)]
    return tenant


def configured_tenant_problem(tenant: object) -> str | None:
    """What is wrong with ``tenant`` as a key's configured tenant, or None when it may be one: a non-empty
    string of at most ``MAX_TENANT_CHARS`` characters, without ``/`` (which marks a sub-tenant) and without
    control characters."""
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        return f"expected a non-empty string of at most {MAX_TENANT_CHARS} characters"
    if SEPARATOR in tenant:
        return (
            f"{tenant!r} contains '/', which marks a sub-tenant (a trusted key's header or a cache_salt narrows "
            f"a tenant to <tenant>/<part>), so another key could land in it: use a name without '/'"
        )
    if not tenant.isprintable():
        return f"{tenant!r} contains control characters"
    return None


def reachable_tenant(tenant: str, keys: Collection[ClientKey]) -> bool:
    """Whether some request can have ``tenant`` as its cache salt.

    Open (no ``keys``): the ``x-prefixgate-tenant`` header (at most ``MAX_TENANT_CHARS`` characters, "" when
    absent), optionally narrowed by a ``cache_salt`` (1 to ``MAX_TENANT_CHARS`` characters). With keys: a
    configured tenant; narrowed by a salt (any key); for a tenant with a trusted key also by a header, then
    optionally a salt. "" (no tenant) is always accepted: it is the open gateway's tenant without a header, and
    what warming a declared public prefix for every tenant uses.
    """
    if not tenant:
        return True
    if not keys:
        return len(tenant) <= MAX_TENANT_CHARS or _splits(tenant, 2, first_may_be_empty=True)
    root, separator, tail = tenant.partition(SEPARATOR)
    owners = [key for key in keys if key.tenant == root]
    if not owners:
        return False
    if not separator:
        return True
    return _splits(tail, 2 if any(key.trusted for key in owners) else 1, first_may_be_empty=False)


def _splits(text: str, parts: int, first_may_be_empty: bool) -> bool:
    """Whether ``text`` is 1 to ``parts`` pieces of 1 to ``MAX_TENANT_CHARS`` characters joined by ``/`` (a
    piece may hold ``/`` itself); ``first_may_be_empty``: of two pieces, the first may be "" (no header)."""
    if 0 < len(text) <= MAX_TENANT_CHARS:
        return True
    if parts < 2:
        return False
    lowest = 0 if first_may_be_empty else 1
    for index in range(lowest, min(len(text), MAX_TENANT_CHARS + 1)):
        if text[index] == SEPARATOR and 0 < len(text) - index - 1 <= MAX_TENANT_CHARS:
            return True
    return False


def unreachable_tenant_problem(tenant: str, keys: Collection[ClientKey]) -> str | None:
    """Why no request can have ``tenant`` (``reachable_tenant``), or None when one can."""
    if reachable_tenant(tenant, keys):
        return None
    shown = tenant if len(tenant) <= 40 else tenant[:40] + "..."
    if not keys:
        return (
            f"no request can have tenant {shown!r} ({len(tenant)} characters): a request's tenant is its "
            f"x-prefixgate-tenant header (at most {MAX_TENANT_CHARS} characters), optionally followed by "
            f"'/<cache_salt>' (at most {MAX_TENANT_CHARS})"
        )
    names = sorted({key.tenant for key in keys})
    configured = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return (
        f"no key can reach tenant {shown!r} ({len(tenant)} characters): a request's tenant is its key's "
        f"tenant ({configured}), or a sub-tenant <tenant>/<header or cache_salt> of it (parts of at most "
        f"{MAX_TENANT_CHARS} characters; a header only for a trusted key); '' warms declared public prefixes"
    )
