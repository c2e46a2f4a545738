"""Start-up errors that keep tenants apart and the gateway closed: a configured tenant with ``/`` (a derived
sub-tenant could equal it), an explicit empty ``keys`` list (it started the gateway open), a ``warm`` tenant
no request can have, and a ``shared_prefixes`` rule id no loaded rule has."""

from __future__ import annotations

import pytest

from gateway.cli import EXIT_BAD_CONFIG, main
from gateway.config.loader import load_config, parse_config
from gateway.config.schema import ConfigError

MODELS = "models:\n  - name: m1\n    backend: openai\n    base_url: http://127.0.0.1:9\n"


def write(tmp_path, text: str, name: str = "prefixgate.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_a_configured_tenant_with_a_slash_stops_the_start(tmp_path):
    """Before: ``tenant: acme/vip`` was accepted, and key alice (tenant ``acme``) with ``cache_salt: vip`` (or
    a trusted key of ``acme`` with header ``vip``) landed in gina's private tenant and hit her prompts."""
    path = write(
        tmp_path,
        MODELS
        + "keys:\n"
        + "  - {name: alice, key: sk-alice-secret, tenant: acme}\n"
        + "  - {name: gina, key: sk-gina-secret, tenant: acme/vip}\n",
    )
    message = error_of(path)
    assert message.startswith(f"{path}: keys[1] (line 7).tenant: 'acme/vip' contains '/'")
    assert "sub-tenant" in message and "secret" not in message


def test_a_tenant_defaulting_to_a_name_with_a_slash_says_so(tmp_path):
    message = error_of(write(tmp_path, MODELS + "keys:\n  - {name: team/a, key: sk-a-secret}\n"))
    assert "keys[0] (line 6).tenant: the tenant defaults to the name" in message and "'team/a'" in message
    ok = load_config(
        write(tmp_path, MODELS + "keys:\n  - {name: team/a, key: sk-a-secret, tenant: team-a}\n")
    )
    assert ok.keys[0].tenant == "team-a"


def test_a_control_character_in_a_tenant_stops_the_start(tmp_path):
    message = error_of(write(tmp_path, MODELS + 'keys:\n  - {key: sk-a-secret, tenant: "a\\0b"}\n'))
    assert ".tenant: 'a\\x00b' contains control characters" in message


@pytest.mark.parametrize("section", ["keys: []\n", "keys:\n", "keys: null\n"])
def test_an_explicit_empty_keys_section_stops_the_start(tmp_path, section):
    """Before: ``keys: []`` started the gateway OPEN (no authentication; without an admin token the admin
    endpoints opened too), while an empty key file was refused."""
    path = write(tmp_path, MODELS + section)
    message = error_of(path)
    assert message.startswith(f"{path}: keys: an empty list of keys would start the gateway open")
    assert "remove the keys key to run open" in message
    assert load_config(write(tmp_path, MODELS)).keys == ()  # no keys key at all: open, as documented


@pytest.mark.parametrize("content", ["[]\n", "keys: []\n"])
def test_an_empty_list_in_a_key_file_stops_the_start(tmp_path, content):
    write(tmp_path, content, name="keys.yaml")
    message = error_of(write(tmp_path, MODELS + "keys: keys.yaml\n"))
    assert message.startswith(f"{tmp_path / 'keys.yaml'}: keys: an empty list of keys")


def test_an_empty_keys_section_exits_2(tmp_path, capsys, monkeypatch):
    def no_listener(*args):  # an accepted config would go on to listen: never serve from a test
        raise OSError("the test does not listen")

    monkeypatch.setattr("gateway.cli.bind_listener", no_listener)
    path = write(tmp_path, MODELS + "keys: []\n")
    assert main(["serve", "--config", str(path), "--port", "0"]) == EXIT_BAD_CONFIG
    assert f"{path}: keys: an empty list of keys" in capsys.readouterr().err


def warm_config(tenant: str, keys: list[dict] | None) -> None:
    data = {
        "models": [{"name": "m", "path": "default"}],
        "warm": [{"system": "be brief", "tenant": tenant}],
    }
    if keys is not None:
        data["keys"] = keys
    parse_config(data, source="c.yaml")


KEYS = [
    {"name": "alice", "key": "sk-alice-secret", "tenant": "acme"},
    {"name": "platform", "key": "sk-platform-secret", "tenant": "plat", "trusted": True},
]


@pytest.mark.parametrize(
    ("tenant", "keys"),
    [
        ("no-such-tenant", KEYS),
        ("acme" + "x" * 296, KEYS),  # 300 characters
        ("acme/" + "s" * 257, KEYS),  # a salt is at most 256 characters
        ("acme/" + "h" * 200 + "/" + "s" * 200, KEYS),  # header and salt: only for a trusted key
        ("t" * 300, None),  # open: a header is at most 256 characters
    ],
)
def test_a_warm_tenant_no_request_can_have_stops_the_start(tenant, keys):
    with pytest.raises(ConfigError) as caught:
        warm_config(tenant, keys)
    assert (caught.value.source, caught.value.key) == ("c.yaml", "warm[0].tenant")
    assert f"({len(tenant)} characters)" in caught.value.problem


@pytest.mark.parametrize(
    ("tenant", "keys"),
    [
        ("", KEYS),
        ("acme", KEYS),
        ("acme/a/salt", KEYS),
        ("plat/" + "h" * 200 + "/" + "s" * 200, KEYS),
        ("anyone", None),
        ("h" * 256 + "/salt", None),
    ],
)
def test_a_warm_tenant_a_request_can_have_is_accepted(tenant, keys):
    warm_config(tenant, keys)


def test_a_shared_prefix_rule_no_loaded_rule_has_stops_the_start(tmp_path):
    """Before: ``shared_prefixes: [{rule: no-such-rule-id}]`` started without a word, and the prefix it meant
    to share silently stayed private. The rules load in ``create_app``, whose ``ConfigError`` ``prefixgate
    serve`` prints and exits 2 for."""
    from gateway.http.app import create_app
    from rules.loader import load_ruleset

    known = load_ruleset(["default"]).rule_ids[0]
    base = MODELS + "rules: [default]\nshared_prefixes:\n  - segment: 1\n"
    bad = load_config(write(tmp_path, base + "  - rule: no-such-rule-id\n"))
    with pytest.raises(ConfigError) as caught:
        create_app(bad, backends={})
    assert str(caught.value).startswith(
        f"{tmp_path / 'prefixgate.yaml'}: shared_prefixes[1].rule: unknown rule id 'no-such-rule-id'"
    )
    create_app(load_config(write(tmp_path, base + f"  - rule: {known}\n", "ok.yaml")), backends={})
    rules_off = load_config(
        write(tmp_path, MODELS + f"rules: []\nshared_prefixes:\n  - rule: {known}\n", "off.yaml")
    )
    with pytest.raises(ConfigError, match=r"shared_prefixes\[0\]\.rule: .*no rules are loaded"):
        create_app(rules_off, backends={})
