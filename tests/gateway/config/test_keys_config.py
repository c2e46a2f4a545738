"""``keys:`` and ``shared_prefixes:`` in the config: hashed keys, and start-up errors with file and line that
never quote a key."""

from __future__ import annotations

import hashlib

import pytest

from gateway.config.loader import load_config
from gateway.config.schema import ConfigError, SharedPrefix

MODELS = "models:\n  - name: m1\n    backend: openai\n    base_url: http://127.0.0.1:9\n"


def write(tmp_path, text: str, name: str = "prefixgate.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_keys_are_stored_as_digests(tmp_path, monkeypatch):
    monkeypatch.setenv("BOB_KEY", "sk-bob-secret")
    digest = hashlib.sha256(b"sk-carol-secret").hexdigest()
    config = load_config(
        write(
            tmp_path,
            MODELS
            + "keys:\n"
            + "  - {name: alice, key: sk-alice-secret, tenant: acme, models: [m1], rpm: 10, tpm: 1000}\n"
            + "  - {name: bob, key: 'env:BOB_KEY', trusted: true, budget_usd: 2.5}\n"
            + f"  - {{key_sha256: {digest}}}\n",
        )
    )
    alice, bob, carol = config.keys
    assert alice.digest == hashlib.sha256(b"sk-alice-secret").digest()
    assert (alice.tenant, alice.models, alice.rpm, alice.tpm) == ("acme", frozenset({"m1"}), 10, 1000)
    assert (bob.tenant, bob.trusted, bob.budget_usd, bob.models) == ("bob", True, 2.5, None)
    assert carol.name == f"key-{digest[:12]}" and carol.digest.hex() == digest
    assert "secret" not in repr(config)


@pytest.mark.parametrize(
    ("entry", "field", "problem"),
    [
        ("{name: b, key: sk-dup-secret}", "", "duplicate key"),
        ("{name: b, key: sk-2-secret, models: [nope]}", ".models", "unknown model 'nope'"),
        ("{name: b, key: sk-2-secret, rpm: fast}", ".rpm", "positive integer"),
        ("{name: b, key: sk-2-secret, rpm: 0}", ".rpm", "positive integer"),
        ("{name: b, key: sk-2-secret, tpm: 1.5}", ".tpm", "positive integer"),
        ("{name: b, key: sk-2-secret, budget_usd: -1}", ".budget_usd", "positive number"),
        ("{name: b, key: sk-2-secret, colour: red}", ".colour", "unknown field"),
        ("{name: b}", ".key", "exactly one of"),
        ("{name: a, key: sk-2-secret}", ".name", "duplicate name"),
    ],
)
def test_bad_entries_stop_the_start_with_file_and_line(tmp_path, entry, field, problem):
    path = write(tmp_path, MODELS + "keys:\n  - {name: a, key: sk-dup-secret}\n  - " + entry + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: keys[1] (line 7){field}: ")
    assert problem in message
    assert "secret" not in message


def test_key_file_errors_name_the_key_file_and_its_line(tmp_path):
    write(tmp_path, "keys:\n  - {key: sk-one-secret}\n\n  - {key: sk-one-secret}\n", name="keys.yaml")
    path = write(tmp_path, MODELS + "keys: keys.yaml\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{tmp_path / 'keys.yaml'}: keys[1] (line 4): duplicate key")
    write(tmp_path, "- {key: sk-one-secret, tenant: t}\n", name="keys.yaml")
    assert load_config(path).keys[0].tenant == "t"
    missing = write(tmp_path, MODELS + "keys: nowhere.yaml\n", name="other.yaml")
    with pytest.raises(ConfigError, match="cannot read the key file"):
        load_config(missing)


def test_shared_prefixes(tmp_path):
    digest = "ab" * 32
    text = MODELS + f"shared_prefixes:\n  - segment: tools_system\n  - rule: r1\n  - content_hash: {digest}\n"
    config = load_config(write(tmp_path, text))
    assert config.shared_prefixes == (
        SharedPrefix("segment", "1"),
        SharedPrefix("rule", "r1"),
        SharedPrefix("content_hash", digest),
    )
    for bad in ("  - segment: history\n", "  - content_hash: xyz\n", "  - colour: red\n"):
        with pytest.raises(ConfigError, match=r"shared_prefixes\[0\]"):
            load_config(write(tmp_path, MODELS + "shared_prefixes:\n" + bad))
