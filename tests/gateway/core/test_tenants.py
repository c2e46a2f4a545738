"""Tenant names (``gateway.core.tenants``): a derived tenant never equals another key's configured tenant,
salts are counted under the tenant they narrow, and which tenants a request can have."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.keys import ClientKey, key_digest
from gateway.core.tenants import (
    accounting_tenant,
    configured_tenant_problem,
    reachable_tenant,
    root_tenant,
    sub_tenant,
)

PART = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
CONFIGURED = PART.filter(lambda name: configured_tenant_problem(name) is None)


def key(name: str, tenant: str, trusted: bool = False) -> ClientKey:
    return ClientKey(name=name, digest=key_digest(f"sk-{name}"), tenant=tenant, trusted=trusted)


@given(mine=CONFIGURED, header=st.none() | PART, salt=st.none() | PART, data=st.data())
def test_a_derived_tenant_never_is_another_configured_tenant(mine, header, salt, data):
    """What ``gateway.http.auth.authorize`` composes: ``<tenant>[/<header>][/<salt>]``. Before, a configured
    tenant could hold ``/``, so ``acme`` + salt ``vip`` equalled gina's configured ``acme/vip``."""
    derived = mine
    for part in (header, salt):
        if part is not None:
            derived = sub_tenant(derived, part)
    assert root_tenant(derived) == mine
    other = data.draw(
        st.sampled_from([derived, mine + "x"]) | PART
    )  # another key's tenant, if the config takes it
    if other != mine and configured_tenant_problem(other) is None:
        assert derived != other and root_tenant(derived) != other


def test_a_configured_tenant_refuses_a_slash():
    assert configured_tenant_problem("acme") is None and configured_tenant_problem("租户") is None
    assert "contains '/'" in configured_tenant_problem("acme/vip")
    assert (
        configured_tenant_problem("")
        and configured_tenant_problem("x" * 257)
        and configured_tenant_problem(3)
    )


def test_usage_counts_a_salted_sub_tenant_under_the_tenant_it_narrows():
    assert accounting_tenant("acme/front-1", "front-1") == "acme"
    assert accounting_tenant("plat/user-1/s", "s") == "plat/user-1"
    assert accounting_tenant("plat/user-1", "") == "plat/user-1"
    assert accounting_tenant("/s", "s") == ""  # open mode, no header


def test_reachable_tenants():
    keys = [key("alice", "acme"), key("platform", "plat", trusted=True)]
    assert all(reachable_tenant(t, keys) for t in ("", "acme", "acme/s", "acme/a/b", "plat/u/" + "s" * 256))
    for tenant in ("no-such-tenant", "acme-x", "acme/", "acme/" + "h" * 100 + "/" + "s" * 200, "x" * 300):
        assert not reachable_tenant(tenant, keys), tenant
    assert reachable_tenant("anyone", []) and reachable_tenant("h" * 256, [])
    assert reachable_tenant("h" * 256 + "/" + "s" * 256, []) and not reachable_tenant("h" * 300, [])
