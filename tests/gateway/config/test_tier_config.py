"""The embedded model's tier settings (``engine.tiers``, ``tier_disk``, ``tier_redis``, ``tier_policies``, ...):
parsed into ``EngineConfig``, every bad value a ``ConfigError`` naming the file, key path and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.kv_tiers.policy import TierPolicy
from gateway.cli import EXIT_BAD_CONFIG, main
from gateway.config.loader import load_config, parse_config
from gateway.config.schema import ConfigError

SECRET = "s" * 32


def engine_of(section: dict):
    config = parse_config({"models": [{"name": "m", "path": "default", "engine": section}]}, source="c.yaml")
    return config.models[0].engine


def error_of(section: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        engine_of(section)
    return caught.value


def test_tier_sections_become_engine_config(tmp_path: Path):
    engine = engine_of(
        {
            "tiers": ["disk", "redis"],
            "tier_disk": {"directory": str(tmp_path / "kv"), "budget_bytes": 1 << 20},
            "tier_redis": {"url": "redis://127.0.0.1:6379/3", "prefix": "dep", "timeout_s": 0.5},
            "tier_policies": {
                "default_level": "documents",
                "disk": {"system": {"ttl_s": 7200, "budget_share": 0.3}, "history": {"ttl_s": None}},
            },
            "tier_writeback_capacity": 64,
            "tier_flush_on_close": False,
            "max_pinned_fraction": 0.1,
            "deployment_secret": SECRET,
        }
    )
    assert engine.tiers == ("disk", "redis")
    assert engine.tier_disk.directory == str(tmp_path / "kv") and engine.tier_disk.budget_bytes == 1 << 20
    assert (tmp_path / "kv").is_dir()
    assert (engine.tier_redis.url, engine.tier_redis.prefix, engine.tier_redis.timeout_s) == (
        "redis://127.0.0.1:6379/3",
        "dep",
        0.5,
    )
    assert engine.tier_redis.retry_s == 2.0
    assert engine.tier_policies.default_level == "documents"
    assert engine.tier_policies.policy("disk", "system") == TierPolicy(7200.0, 0.3)
    assert engine.tier_policies.policy("disk", "history") == TierPolicy(None, 0.25)
    assert engine.tier_policies.policy("redis", "system") == TierPolicy(86_400.0, 0.4)
    assert (engine.tier_writeback_capacity, engine.tier_flush_on_close, engine.max_pinned_fraction) == (
        64,
        False,
        0.1,
    )
    assert engine.deployment_secret == SECRET


def test_secret_from_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PG_TIER_SECRET", SECRET)
    engine = engine_of({"tiers": ["redis"], "deployment_secret": "env:PG_TIER_SECRET"})
    assert engine.deployment_secret == SECRET


@pytest.mark.parametrize(
    ("section", "key", "problem"),
    [
        ({"tiers": "disk"}, "tiers", "expected a list of tier names"),
        ({"tiers": ["tape"]}, "tiers[0]", "expected one of disk, redis, got 'tape'"),
        ({"tiers": ["disk", "disk"], "tier_disk": {"directory": "."}}, "tiers", "named twice"),
        ({"tiers": ["disk"]}, "tier_disk.directory", "a disk tier needs a directory"),
        ({"tier_disk": {"dir": "x"}}, "tier_disk.dir", "unknown key"),
        ({"tier_disk": {"budget_bytes": 0}}, "tier_disk.budget_bytes", "expected an integer >= 1"),
        ({"tier_redis": {"timeout_s": "fast"}}, "tier_redis.timeout_s", "expected a number"),
        ({"tier_redis": {"retry_s": 0}}, "tier_redis.retry_s", "expected a number > 0"),
        (
            {"tiers": ["redis"], "tier_redis": {"url": "http://127.0.0.1:6379"}, "deployment_secret": SECRET},
            "tier_redis.url",
            "not a Redis URL",
        ),
        ({"tiers": ["redis"]}, "deployment_secret", "a Redis tier needs it"),
        ({"deployment_secret": "short"}, "deployment_secret", "at least 16 bytes"),
        ({"tier_policies": {"tape": {}}}, "tier_policies.tape", "unknown key"),
        ({"tier_policies": {"disk": {"chat": {}}}}, "tier_policies.disk.chat", "unknown key"),
        ({"tier_policies": {"default_level": "x"}}, "tier_policies.default_level", "expected one of"),
        (
            {
                "tiers": ["disk"],
                "tier_disk": {"directory": "."},
                "tier_policies": {"disk": {"system": {"ttl_s": -5}}},
            },
            "tier_policies.disk.system.ttl_s",
            "must be > 0 and at most 3153600000 (100 years), or null (kept until the budget evicts it), got -5.0",
        ),
        (  # before: accepted, then every Redis write was refused (a TTL past Redis's 64-bit milliseconds)
            {
                "tiers": ["redis"],
                "deployment_secret": SECRET,
                "tier_policies": {"redis": {"system": {"ttl_s": 1.0e16}}},
            },
            "tier_policies.redis.system.ttl_s",
            "at most 3153600000 (100 years), or null",
        ),
        (  # PyYAML reads 1.0e16 (no sign in the exponent) as text
            {"tier_policies": {"redis": {"system": {"ttl_s": "1.0e16"}}}},
            "tier_policies.redis.system.ttl_s",
            "got a string '1.0e16' (YAML reads 1.0e16 as text: write it as 1.0e+16)",
        ),
        (
            {"tier_policies": {"disk": {"history": {"budget_share": 1.5}}}},
            "tier_policies.disk.history.budget_share",
            "must be in (0, 1], got 1.5",
        ),
        (
            {"tier_policies": {"redis": {"system": {"budget_share": 0.9}, "history": {"budget_share": 0.5}}}},
            "tier_policies",
            "budget shares sum to",
        ),
        (  # before: "budget shares sum to 1.500 > 1", without the defaults that made up the rest
            {
                "tiers": ["disk"],
                "tier_disk": {"directory": "."},
                "tier_policies": {"disk": {"system": {"budget_share": 0.9}}},
            },
            "tier_policies",
            "(system 0.9, documents 0.35 (default), history 0.25 (default)); levels not set keep their default",
        ),
        (  # before: accepted, the tiers did nothing
            {"tiers": ["disk"], "tier_disk": {"directory": "."}, "enable_prefix_caching": False},
            "tiers",
            "needs prefix caching, and models[0].engine.enable_prefix_caching is false",
        ),
        (  # before: accepted, database 0 used
            {
                "tiers": ["redis"],
                "tier_redis": {"url": "redis://127.0.0.1:6379/abc"},
                "deployment_secret": SECRET,
            },
            "tier_redis.url",
            "the database (path 'abc') must be a non-negative integer",
        ),
        (
            {
                "tiers": ["redis"],
                "tier_redis": {"url": "redis://127.0.0.1:6379/-2"},
                "deployment_secret": SECRET,
            },
            "tier_redis.url",
            "must be a non-negative integer",
        ),
        ({"max_pinned_fraction": 1.5}, "max_pinned_fraction", "expected a number in [0, 1]"),
        ({"tier_writeback_capacity": 0}, "tier_writeback_capacity", "expected an integer >= 1"),
    ],
)
def test_bad_tier_settings_name_file_key_and_expectation(section: dict, key: str, problem: str):
    error = error_of(section)
    assert error.source == "c.yaml"
    assert error.key == f"models[0].engine.{key}"
    assert problem in error.problem


def test_disk_directory_that_cannot_be_created_stops_the_start(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    error = error_of({"tiers": ["disk"], "tier_disk": {"directory": str(blocker / "kv")}})
    assert error.key == "models[0].engine.tier_disk.directory"
    assert "cannot create" in error.problem


def warm_config(warm, **top):
    return parse_config(
        {
            "models": [
                {"name": "m", "path": "default"},
                {"name": "up", "backend": "openai", "base_url": "http://x"},
            ],
            "warm": warm,
            **top,
        },
        source="c.yaml",
        base_dir=Path("/etc/pg"),
    )


def test_warm_entries_parse_with_defaults_and_files():
    config = warm_config(
        [{"system": "be brief", "tenant": "acme", "pin": True}, {"messages_file": "w.json", "model": "m"}],
        warm_before_ready=False,
    )
    first, second = config.warm
    assert (first.model, first.tenant, first.pin, first.system) == ("m", "acme", True, "be brief")
    assert second.files == (("messages", "/etc/pg/w.json"),)
    assert config.warm_before_ready is False
    assert parse_config({}).warm == () and parse_config({}).warm_before_ready is True


@pytest.mark.parametrize(
    ("warm", "key", "problem"),
    [
        ("system", "warm", "expected a list of entries"),
        (["x"], "warm[0]", "expected a mapping"),
        ([{"tenant": "a"}], "warm[0]", "expected one of system, documents, messages"),
        ([{"system": "a", "prompt": "b"}], "warm[0].prompt", "unknown key"),
        ([{"system": "a", "model": "up"}], "warm[0].model", "expected an embedded model (m), got 'up'"),
        ([{"system": "a", "system_file": "s.txt"}], "warm[0].system_file", "not both"),
        ([{"messages": [], "documents": "d"}], "warm[0]", "give it alone"),
        ([{"system": "a", "pin": "yes"}], "warm[0].pin", "expected a boolean"),
        ([{"system": 3}], "warm[0].system", "expected a string"),
    ],
)
def test_bad_warm_entries_name_file_key_and_expectation(warm, key: str, problem: str):
    with pytest.raises(ConfigError) as caught:
        warm_config(warm)
    assert (caught.value.source, caught.value.key) == ("c.yaml", key)
    assert problem in caught.value.problem


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            {"tiers": ["redis"], "tier_redis": {"url": "localhost:6379"}, "deployment_secret": SECRET},
            "not a Redis URL",
        ),
        ({"tiers": ["disk"], "tier_disk": {"directory": "/dev/null/kv"}}, "cannot create /dev/null/kv"),
    ],
)
def test_prefixgate_serve_refuses_a_misconfigured_tier(tmp_path: Path, capsys, engine: dict, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "path": "default", "engine": engine}]}))
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    key = "tier_redis.url" if "redis" in engine["tiers"] else "tier_disk.directory"
    assert f"{path}: models[0].engine.{key}: " in err and message in err


@pytest.mark.parametrize(
    ("section", "key", "problem"),
    [
        (
            {"tier_redis": {"url": "redis://127.0.0.1:6379/3"}},
            "tier_redis",
            "configures the redis tier, which models[0].engine.tiers does not name (no tiers)",
        ),
        (
            {"tiers": ["disk"], "tier_disk": {"directory": "."}, "tier_redis": {"prefix": "p"}},
            "tier_redis",
            "configures the redis tier, which models[0].engine.tiers does not name (tiers: [disk])",
        ),
        ({"tier_disk": {"directory": "."}}, "tier_disk", "configures the disk tier"),
        (
            {"tiers": ["disk"], "tier_disk": {"directory": "."}, "tier_policies": {"redis": {}}},
            "tier_policies.redis",
            "configures the redis tier",
        ),
        ({"tier_policies": {"default_level": "system"}}, "tier_policies", "names none"),
        ({"tier_writeback_capacity": 64}, "tier_writeback_capacity", "names none"),
        ({"tier_flush_on_close": False}, "tier_flush_on_close", "names none"),
    ],
)
def test_tier_settings_of_a_tier_not_in_tiers_are_refused(section: dict, key: str, problem: str):
    # Before: accepted and ignored without a word (tier_redis given, tiers: [disk])
    error = error_of(section)
    assert error.key == f"models[0].engine.{key}"
    assert problem in error.problem


def test_a_tier_named_twice_is_listed_without_a_python_list():
    assert error_of({"tiers": ["disk", "disk"]}).problem == "a tier is named twice in [disk, disk]"


def test_a_relative_disk_directory_is_relative_to_the_config_file(tmp_path: Path, monkeypatch):
    """Before: resolved against the working directory, while every other relative path of the config (a rule
    file, a model path, a warm ``messages_file``) is relative to the config file."""
    folder = tmp_path / "etc"
    folder.mkdir()
    path = folder / "gateway.yaml"
    engine = {"tiers": ["disk"], "tier_disk": {"directory": "kv"}}
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "path": "default", "engine": engine}]}))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    assert config.models[0].engine.tier_disk.directory == str(folder / "kv")
    assert (folder / "kv").is_dir() and not (elsewhere / "kv").exists()
    absolute = tmp_path / "abs"
    assert engine_of(
        {"tiers": ["disk"], "tier_disk": {"directory": str(absolute)}}
    ).tier_disk.directory == str(absolute)


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        (
            "engine.tier_redis.url: the Redis server at 127.0.0.1:6379 db 99 refused the connection "
            "(DB index is out of range)",
            "tier_redis.url",
        ),
        ("engine.tier_disk.budget_bytes: 4000 leaves the history level 1000 bytes", "tier_disk.budget_bytes"),
    ],
)
def test_a_tier_refused_at_start_is_a_config_error_naming_the_key(reason: str, key: str):
    """What only the engine can tell (the server's answer, one block's size in bytes) names the key too."""
    from engine.kv_tiers.disk import TierConfigError
    from gateway.config.engine_section import model_start_error

    config = parse_config({"models": [{"name": "m", "path": "default"}]}, source="c.yaml")
    name, _, rest = reason.partition(": ")
    error = model_start_error(config, "m", TierConfigError(name, rest))
    assert error is not None and error.key == f"models[0].engine.{key}" and error.problem == rest
