"""Config loading: defaults, env: values, and errors that name file, key path and expectation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from engine.api import EngineConfig
from gateway.config.loader import default_config, load_config, parse_config
from gateway.config.schema import (
    AnthropicUpstream,
    CacheAwareConfig,
    ConfigError,
    KVEventsConfig,
    OpenAIUpstream,
    RingConfig,
    RoutingShareConfig,
)

OPENAI = "models: [{name: a, backend: openai, base_url: http://x,"
ANTHROPIC = "models: [{name: a, backend: anthropic, base_url: http://x,"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prefixgate.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_default_config_is_embedded_smollm2_with_default_rules(monkeypatch):
    monkeypatch.delenv("PREFIXGATE_ADMIN_TOKEN", raising=False)
    config = default_config()
    assert config.rules == ("default",)
    assert [(m.name, m.backend, m.path) for m in config.models] == [
        ("smollm2-135m-instruct", "embedded", "default")
    ]
    assert (config.server.host, config.server.port, config.server.max_body_bytes) == (
        "127.0.0.1",
        8000,
        4194304,
    )
    assert config.server.unknown_fields == "refuse"
    assert config.admin.token is None


@pytest.mark.parametrize(("value", "token"), [("s3cret-token-123", "s3cret-token-123"), ("", None)])
def test_default_config_takes_the_admin_token_from_the_environment(monkeypatch, value, token):
    # README: the embedded default is `admin: {token: env:PREFIXGATE_ADMIN_TOKEN}`, optional: a user who sets
    # the variable without a config file must get the admin endpoints guarded, not open
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", value)
    assert default_config().admin.token == token


def test_issue_example_config_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", "s3cret")
    path = write(
        tmp_path,
        """
        server: {host: 127.0.0.1, port: 8000, max_body_bytes: 4194304}
        admin: {token: env:PREFIXGATE_ADMIN_TOKEN}
        rules: [default]
        models:
          - name: smollm2-135m-instruct
            backend: embedded
            path: default
            engine: {block_size: 16, num_blocks: 1024, dtype: float32, max_batch: 16}
        """,
    )
    config = load_config(path)
    assert config.admin.token == "s3cret"
    assert config.models[0].engine == EngineConfig(
        block_size=16, num_blocks=1024, dtype="float32", max_batch=16
    )
    assert config.source == str(path)


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    path = write(
        tmp_path,
        """
        rules: [default, my-rules.yaml]
        models: [{name: tiny, path: ckpt/tiny}]
        """,
    )
    (tmp_path / "ckpt" / "tiny").mkdir(parents=True)
    config = load_config(path)
    assert config.rules == ("default", str(tmp_path / "my-rules.yaml"))
    assert config.models[0].path == str(tmp_path / "ckpt" / "tiny")


def test_partial_prefix_hits_are_on_by_default_and_switch_off(tmp_path):
    (tmp_path / "x").mkdir()
    on = load_config(write(tmp_path, "models: [{name: a, path: x}]\n")).models[0].engine
    assert on.enable_partial_prefix_hits is True
    text = "models: [{name: a, path: x, engine: {enable_partial_prefix_hits: false}}]\n"
    off = load_config(write(tmp_path, text)).models[0].engine
    assert off.enable_partial_prefix_hits is False and off.enable_prefix_caching is True
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "models: [{name: a, engine: {enable_partial_prefix_hits: 1}}]\n"))
    assert caught.value.key == "models[0].engine.enable_partial_prefix_hits"


def test_empty_rules_list_turns_rewriting_off(tmp_path):
    assert load_config(write(tmp_path, "rules: []\n")).rules == ()


def test_upstream_model_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-test")
    path = write(
        tmp_path,
        """
        models:
          - name: gpt
            backend: openai
            base_url: [https://a.example/v1/, https://b.example/v1]
            api_key: env:UPSTREAM_KEY
            upstream_model: gpt-4o-mini
            timeout_s: 30
            retries: 1
            prices: {input: 0.15, cached_input: 0.075}
        """,
    )
    model = load_config(path).models[0]
    assert model.base_url == ("https://a.example/v1", "https://b.example/v1")
    assert (model.api_key, model.upstream_model, model.timeout_s, model.retries) == (
        "sk-test",
        "gpt-4o-mini",
        30.0,
        1,
    )
    # the old shape (cached_input) is converted over the shipped table's gpt-4o-mini entry
    assert (model.prices.input, model.prices.cache_read, model.prices.source) == (0.15, 0.075, "config")


def test_upstream_tuning_fields(tmp_path):
    path = write(
        tmp_path,
        """
        models:
          - name: gpt
            backend: openai
            base_url: https://a.example/v1
            prompt_cache_key: false
            ring: {load_factor: 1.5, vnodes: 40, cooldown_s: 2, max_cooldown_s: 30}
          - name: claude
            backend: anthropic
            base_url: https://api.anthropic.test
            anthropic_version: "2024-01-01"
            auto_breakpoints: false
            min_cacheable_tokens: {claude-sonnet: 512, claude-sonnet-4-5: 3000}
        """,
    )
    gpt, claude = load_config(path).models
    assert gpt.prompt_cache_key is False
    assert (gpt.ring.load_factor, gpt.ring.vnodes, gpt.ring.cooldown_s, gpt.ring.max_cooldown_s) == (
        1.5,
        40,
        2.0,
        30.0,
    )
    assert (claude.anthropic_version, claude.auto_breakpoints) == ("2024-01-01", False)
    assert claude.min_cacheable_tokens == (("claude-sonnet", 512), ("claude-sonnet-4-5", 3000))
    assert claude.ring == RingConfig()  # defaults
    # one class per backend kind: an entry holds only the settings of its kind
    assert isinstance(gpt, OpenAIUpstream) and isinstance(claude, AnthropicUpstream)
    assert not hasattr(claude, "prompt_cache_key") and not hasattr(gpt, "anthropic_version")
    hash(claude)  # a model entry stays hashable (frozen, tuples only)


def test_ring_max_cooldown_defaults_to_at_least_the_cooldown():
    config = parse_config(
        {"models": [{"name": "g", "backend": "openai", "base_url": "http://x", "ring": {"cooldown_s": 90}}]}
    )
    assert (config.models[0].ring.cooldown_s, config.models[0].ring.max_cooldown_s) == (90.0, 90.0)


def test_transcript_and_learning_settings(tmp_path):
    config = parse_config(
        yaml.safe_load(
            "transcript: {max_entries: 50, max_bytes: 4096, ttl_s: 60, socket_timeout_s: 0.2}\n"
            "redis: {url: 'redis://127.0.0.1:6379/1'}\n"
            "rules_learning: off\n"
        )
    )
    t = config.transcript
    assert (t.max_entries, t.max_bytes, t.ttl_s, t.socket_timeout_s) == (50, 4096, 60.0, 0.2)
    assert t.redis_url == "redis://127.0.0.1:6379/1"  # the shared redis: section
    assert config.rules_learning.mode == "off"
    own = parse_config(
        {
            "transcript": {"redis_url": "redis://a:1/0"},
            "redis": {"url": "redis://b:2/0"},
            "rules_learning": {"mode": "apply", "min_distinct": 4},
        }
    )
    assert own.transcript.redis_url == "redis://a:1/0"
    assert (own.rules_learning.mode, own.rules_learning.min_distinct) == ("apply", 4)
    default = parse_config({})
    assert default.transcript.redis_url is None and default.rules_learning.mode == "suggest"


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("serverr: {}\n", "serverr", "unknown key"),
        ("server: {port: '8000'}\n", "server.port", "expected an integer"),
        ("server: {port: 70000}\n", "server.port", "TCP port"),
        ("server: {max_body_bytes: 0}\n", "server.max_body_bytes", "positive"),
        ("server: {unknown_fields: warn}\n", "server.unknown_fields", "'refuse' or 'ignore'"),
        ("server: [1]\n", "server", "expected a mapping"),
        ("admin: {token: 5}\n", "admin.token", "expected a string"),
        ("rules: default\n", "rules", "expected a list"),
        ("models: []\n", "models", "non-empty list"),
        ("models: [{backend: embedded}]\n", "models[0].name", "missing required key"),
        (
            "models: [{name: a, backend: vllm}]\n",
            "models[0].backend",
            "expected one of embedded, openai, anthropic",
        ),
        ("models: [{name: a, engine: {block_size: 0}}]\n", "models[0].engine.block_size", ">= 1"),
        ("models: [{name: a, engine: {blocksize: 16}}]\n", "models[0].engine.blocksize", "unknown key"),
        ("models: [{name: a, engine: {dtype: 32}}]\n", "models[0].engine.dtype", "expected a string"),
        (
            "models: [{name: a, engine: {max_model_len: nope}}]\n",
            "models[0].engine.max_model_len",
            "an integer or null",
        ),
        (
            "models: [{name: a, engine: {enable_prefix_caching: 1}}]\n",
            "models[0].engine.enable_prefix_caching",
            "a boolean",
        ),
        ("models: [{name: a}, {name: a}]\n", "models[1].name", "unique"),
        (
            "models: [{name: a, base_url: http://x}]\n",
            "models[0].base_url",
            "not a setting of backend 'embedded'",
        ),
        ("models: [{name: a, backend: openai}]\n", "models[0].base_url", "URL"),
        ("models: [{name: a, backend: openai, base_url: ftp://x}]\n", "models[0].base_url", "http://"),
        # before: one URL's errors named base_url[0], a list the file does not have (a trial)
        ("models: [{name: a, backend: openai, base_url: ''}]\n", "models[0].base_url", "got ''"),
        (
            "models: [{name: a, backend: openai, base_url: [http://h/v1, '']}]\n",
            "models[0].base_url[1]",
            "got ''",
        ),
        (
            "models: [{name: a, backend: openai, base_url: 'http://[::1'}]\n",
            "models[0].base_url",
            "not a valid URL",
        ),
        ("models: [{name: a, backend: openai, base_url: 'http://'}]\n", "models[0].base_url", "no host"),
        (  # before: accepted, then every request failed with "the request could not be sent" (a trial)
            "models: [{name: a, backend: openai, base_url: 'http://127.0.0.1:99999/v1'}]\n",
            "models[0].base_url",
            "the port 99999 is outside 1-65535",
        ),
        (  # before: a traceback from the replica ring (a trial); a trailing slash is the same replica
            "models: [{name: a, backend: openai, base_url: [http://h:1/v1, http://g/v1, 'http://h:1/v1/']}]\n",
            "models[0].base_url[2]",
            "the same replica as base_url[0]",
        ),
        (  # before: accepted, then every request failed with "the request could not be sent"
            "models: [{name: a, backend: openai, base_url: 'http://u:s3cret@h/v1', api_key: sk-x}]\n",
            "models[0].base_url",
            "holds credentials",
        ),
        (
            f"{OPENAI} api_key: 'sk-abc def'}}]\n",
            "models[0].api_key",
            "whitespace, control or non-ASCII characters",
        ),
        (f"{OPENAI} api_key: '  '}}]\n", "models[0].api_key", "empty"),
        (f"{OPENAI} api_key: 'sk-caf\u00e9'}}]\n", "models[0].api_key", "non-ASCII"),
        (
            "models: [{name: a, backend: openai, base_url: http://x, engine: {}}]\n",
            "models[0].engine",
            "not a setting",
        ),
        (
            "models: [{name: a, backend: openai, base_url: http://x, prices: {input: -1}}]\n",
            "models[0].prices.input",
            ">= 0",
        ),
        (
            "admin: {token: env:PREFIXGATE_TEST_UNSET_VARIABLE}\n",
            "admin.token",
            "PREFIXGATE_TEST_UNSET_VARIABLE",
        ),
        (f"{OPENAI} prompt_cache_key: 'yes'}}]\n", "models[0].prompt_cache_key", "expected a boolean"),
        (
            f"{OPENAI} auto_breakpoints: true}}]\n",
            "models[0].auto_breakpoints",
            "not a setting of backend 'openai'",
        ),
        (
            f"{ANTHROPIC} prompt_cache_key: true}}]\n",
            "models[0].prompt_cache_key",
            "not a setting of backend 'anthropic'",
        ),
        (f"{ANTHROPIC} auto_breakpoints: 1}}]\n", "models[0].auto_breakpoints", "expected a boolean"),
        (f"{ANTHROPIC} anthropic_version: 2023}}]\n", "models[0].anthropic_version", "expected a string"),
        (f"{ANTHROPIC} anthropic_version: ''}}]\n", "models[0].anthropic_version", "API version"),
        (
            f"{ANTHROPIC} min_cacheable_tokens: [1]}}]\n",
            "models[0].min_cacheable_tokens",
            "mapping of model-name prefix",
        ),
        (
            f"{ANTHROPIC} min_cacheable_tokens: {{claude: 0}}}}]\n",
            "models[0].min_cacheable_tokens.claude",
            ">= 1",
        ),
        (
            f"{ANTHROPIC} min_cacheable_tokens: {{claude: many}}}}]\n",
            "models[0].min_cacheable_tokens.claude",
            "an integer",
        ),
        (
            f"{ANTHROPIC} min_cacheable_tokens: {{1: 5}}}}]\n",
            "models[0].min_cacheable_tokens",
            "non-empty model-name prefixes",
        ),
        (f"{OPENAI} ring: [1]}}]\n", "models[0].ring", "expected a mapping"),
        (f"{OPENAI} ring: {{vnode: 3}}}}]\n", "models[0].ring.vnode", "unknown key"),
        (f"{OPENAI} ring: {{load_factor: 1}}}}]\n", "models[0].ring.load_factor", "> 1"),
        (f"{OPENAI} ring: {{vnodes: 0}}}}]\n", "models[0].ring.vnodes", ">= 1"),
        (f"{OPENAI} ring: {{cooldown_s: 0}}}}]\n", "models[0].ring.cooldown_s", "positive"),
        (
            f"{OPENAI} ring: {{cooldown_s: 10, max_cooldown_s: 5}}}}]\n",
            "models[0].ring.max_cooldown_s",
            ">= cooldown_s",
        ),
        ("models: [{name: a, ring: {}}]\n", "models[0].ring", "not a setting of backend 'embedded'"),
        (f"{OPENAI} routing: random}}]\n", "models[0].routing", "cache_aware"),
        (f"{OPENAI} routing: 3}}]\n", "models[0].routing", "expected a string"),
        (f"{OPENAI} kv_events: true}}]\n", "models[0].kv_events", "needs routing: cache_aware"),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{tokenizer: gpt2}}}}]\n",
            "models[0].kv_events.tokenizer",
            "cl100k_base",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{message_format: '{{role}}'}}}}]\n",
            "models[0].kv_events.message_format",
            "{content}",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{path: kv}}}}]\n",
            "models[0].kv_events.path",
            "starting with '/'",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{block_size: 0}}}}]\n",
            "models[0].kv_events.block_size",
            ">= 1",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: nats}}}}]\n",
            "models[0].kv_events.transport",
            "http, zmq",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq}}}}]\n",
            "models[0].kv_events.endpoints",
            "one publisher endpoint per base_url",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: ['tcp://*:5557']}}}}]\n",
            "models[0].kv_events.endpoints[0]",
            "to connect to",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: ['http://h:1']}}}}]\n",
            "models[0].kv_events.endpoints[0]",
            "tcp://host:port",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: {{a: 1}}}}}}]\n",
            "models[0].kv_events.endpoints",
            "a list of ZeroMQ endpoints",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: ['tcp://h:1', 'tcp://h:2']}}}}]\n",
            "models[0].kv_events.endpoints",
            "one endpoint per base_url (1), got 2",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: ['tcp://h:1'],"
            f" replay_endpoints: ['tcp://h:2', 'tcp://h:3']}}}}]\n",
            "models[0].kv_events.replay_endpoints",
            "one endpoint per base_url",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{endpoints: ['tcp://h:1']}}}}]\n",
            "models[0].kv_events.endpoints",
            "transport: zmq setting",
        ),
        (
            f"{OPENAI} routing: cache_aware, kv_events: {{transport: zmq, endpoints: ['tcp://h:1'], topic: 3}}}}]\n",
            "models[0].kv_events.topic",
            "expected a string",
        ),
        (f"{OPENAI} cache_aware: {{index_blocks: 9}}}}]\n", "models[0].cache_aware", "routing: cache_aware"),
        (
            f"{OPENAI} routing: cache_aware, cache_aware: {{index_blocks: 0}}}}]\n",
            "models[0].cache_aware.index_blocks",
            ">= 1",
        ),
        (
            f"{OPENAI} routing: cache_aware, cache_aware: {{cache_threshold: 2}}}}]\n",
            "models[0].cache_aware.cache_threshold",
            "in [0.0, 1.0]",
        ),
        (
            f"{OPENAI} routing: cache_aware, cache_aware: {{load_weight: -1}}}}]\n",
            "models[0].cache_aware.load_weight",
            ">= 0.0",
        ),
        (
            f"{OPENAI} routing: cache_aware, cache_aware: {{balance: 3}}}}]\n",
            "models[0].cache_aware.balance",
            "unknown key",
        ),
        (
            f"{OPENAI} routing: cache_aware, routing_share: http://x}}]\n",
            "models[0].routing_share.redis_url",
            "redis://",
        ),
        (
            f"{OPENAI} routing: cache_aware, routing_share: {{interval_s: 0}}}}]\n",
            "models[0].routing_share.interval_s",
            "positive",
        ),
        (
            f"{OPENAI} routing: cache_aware, routing_share: {{redis: x}}}}]\n",
            "models[0].routing_share.redis",
            "unknown key",
        ),
        ("transcript: {max_entries: 0}\n", "transcript.max_entries", "positive"),
        ("transcript: {ttl_s: soon}\n", "transcript.ttl_s", "a number"),
        ("transcript: {redis_url: 'http://x'}\n", "transcript.redis_url", "redis://"),
        # a trial: a port or database redis-py cannot read was a traceback at start, a path it cannot read as a
        # number silently ran on database 0
        (
            f"{OPENAI} routing: cache_aware, routing_share: 'redis://127.0.0.1:notaport/0'}}]\n",
            "models[0].routing_share.redis_url",
            "not a Redis URL",
        ),
        (
            f"{OPENAI} routing: cache_aware, routing_share: 'redis://127.0.0.1:6379/3?db=abc'}}]\n",
            "models[0].routing_share.redis_url",
            "not a Redis URL",
        ),
        (
            f"{OPENAI} routing_share: {{redis_url: 'redis://127.0.0.1:6379/abc'}}}}]\n",
            "models[0].routing_share.redis_url",
            "non-negative integer",
        ),
        (
            f"{OPENAI} routing_share: 'redis://127.0.0.1:6379/-1'}}]\n",
            "models[0].routing_share.redis_url",
            "non-negative integer",
        ),
        ("transcript: {redis_url: 'redis://h:6379/abc'}\n", "transcript.redis_url", "non-negative integer"),
        ("redis: {url: 'redis://h:x/0'}\n", "transcript.redis_url", "not a Redis URL"),
        ("transcript: {redis: x}\n", "transcript.redis", "unknown key"),
        ("redis: {host: x}\n", "redis.host", "unknown key"),
        ("rules_learning: always\n", "rules_learning.mode", "off, suggest, apply"),
        ("rules_learning: {min_distinct: 1}\n", "rules_learning.min_distinct", ">= 2"),
    ],
)
def test_bad_config_names_file_key_and_expectation(tmp_path, monkeypatch, text, key, expected):
    monkeypatch.delenv("PREFIXGATE_TEST_UNSET_VARIABLE", raising=False)
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.source == str(path)
    assert caught.value.key == key
    assert expected in caught.value.problem
    assert str(caught.value).startswith(f"{path}: {key}: ")


def test_invalid_yaml_reports_the_line(tmp_path):
    path = write(tmp_path, "server:\n  port: [1,\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+: invalid YAML"):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "absent.yaml")


def test_env_values_are_parsed_for_numbers(monkeypatch):
    monkeypatch.setenv("PG_PORT", "9001")
    monkeypatch.setenv("PG_BLOCKS", "64")
    config = parse_config(
        {
            "server": {"port": "env:PG_PORT"},
            "models": [{"name": "m", "engine": {"num_blocks": "env:PG_BLOCKS"}}],
        }
    )
    assert config.server.port == 9001
    assert config.models[0].engine.num_blocks == 64


def test_empty_document_is_the_default(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config.models == default_config().models and config.rules == ("default",)


def test_example_config_loads_and_matches_the_default_model():
    example = load_config(Path(__file__).resolve().parents[3] / "examples" / "config.yaml")
    assert example.models == default_config().models and example.rules == ("default",)


def test_example_configs_commented_upstreams_load_with_the_documented_price_form(monkeypatch):
    # examples/config.yaml showed the old `prices: {input, cached_input, cache_write}` while the README documents
    # `{input, cache_read, cache_write: {5m, 1h}, output}`: uncomment its upstream models and load them
    monkeypatch.setenv("OPENAI_API_KEY", "sk-example")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-example")
    text = (Path(__file__).resolve().parents[3] / "examples" / "config.yaml").read_text()
    lines = text.splitlines()
    models, block = [], None
    for line in lines:
        if line.startswith("  # - name:"):
            block = [line.replace("  # ", "  ", 1)]
            models.append(block)
        elif block is not None and line.startswith("  #   "):
            block.append(line.replace("  # ", "  ", 1))
        else:
            block = None
    raw = yaml.safe_load("models:\n" + "\n".join("\n".join(b) for b in models))
    assert {m["backend"] for m in raw["models"]} == {"openai", "anthropic"}
    documented = {"input", "cache_read", "cache_write", "output", "storage_per_hour", "min_cacheable_tokens"}
    for model in raw["models"]:
        assert set(model["prices"]) <= documented, model["prices"]
        assert not isinstance(model["prices"].get("cache_write", {}), (int, float))
    config = parse_config(raw)
    assert [m.backend for m in config.models] == ["openai", "anthropic"]


def test_readme_config_examples_load(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", "t")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-readme")
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    configs = [
        parse_config(yaml.safe_load(b)) for b in blocks if b.lstrip().startswith(("server:", "models:"))
    ]
    assert len(configs) >= 2
    remote = next(m for c in configs for m in c.models if m.backend == "anthropic")
    assert remote.min_cacheable_tokens == (("claude-sonnet-4-5", 1024),) and remote.ring.vnodes == 160


def test_an_api_key_read_with_a_trailing_newline_is_stripped_and_a_bad_one_never_echoed(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PREFIXGATE_TEST_KEY", "sk-from-a-secret-file\n")
    path = write(tmp_path, f"{OPENAI} api_key: env:PREFIXGATE_TEST_KEY}}]\n")
    assert load_config(path).models[0].api_key == "sk-from-a-secret-file"
    monkeypatch.setenv("PREFIXGATE_TEST_KEY", "sk-two\nlines")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key == "models[0].api_key" and "sk-two" not in str(caught.value)


def test_routing_per_upstream():
    config = parse_config(
        {
            "models": [
                {"name": "a", "backend": "openai", "base_url": "http://x", "routing": "round_robin"},
                {
                    "name": "b",
                    "backend": "anthropic",
                    "base_url": "http://y",
                    "routing": "cache_aware",
                    "routing_share": "redis://127.0.0.1:6379/2",
                },
                {
                    "name": "c",
                    "backend": "openai",
                    "base_url": "http://z",
                    "routing": "cache_aware",
                    "routing_share": {"interval_s": 0.5, "retry_after_s": 2},
                    "kv_events": {"path": "/v1/kv_events", "block_size": 32},
                    "cache_aware": {"index_blocks": 670, "balance_abs_threshold": 0, "load_weight": 0},
                },
                {"name": "d", "backend": "openai", "base_url": "http://w"},
                {
                    "name": "e",
                    "backend": "openai",
                    "base_url": "http://v",
                    "routing": "least_load",
                    "routing_share": "redis://127.0.0.1:6379/0",
                },
                {
                    "name": "f",
                    "backend": "openai",
                    "base_url": "http://u",
                    "routing": "cache_aware",
                    "kv_events": True,
                },
                {
                    "name": "g",
                    "backend": "openai",
                    "base_url": ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"],
                    "routing": "cache_aware",
                    "kv_events": {
                        "transport": "zmq",
                        "endpoints": ["tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557"],
                        "replay_endpoints": ["tcp://10.0.0.1:5558", "tcp://10.0.0.2:5558"],
                        "topic": "kv",
                    },
                },
            ]
        }
    )
    a, b, c, d, e, f, g = config.models
    assert (a.routing, a.routing_share, a.kv_events) == ("round_robin", None, None)
    assert c.kv_events == KVEventsConfig(path="/v1/kv_events", block_size=32)
    assert c.cache_aware == CacheAwareConfig(index_blocks=670, balance_abs_threshold=0, load_weight=0.0)
    assert f.cache_aware is None  # the policy's defaults
    assert e.routing_share is not None  # load is shared by every policy
    assert f.kv_events == KVEventsConfig()
    assert g.kv_events == KVEventsConfig(
        transport="zmq",
        endpoints=("tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557"),
        replay_endpoints=("tcp://10.0.0.1:5558", "tcp://10.0.0.2:5558"),
        topic="kv",
    )
    assert b.routing_share == RoutingShareConfig(redis_url="redis://127.0.0.1:6379/2")
    assert (c.routing_share.interval_s, c.routing_share.retry_after_s) == (0.5, 2.0)
    assert (d.routing, d.routing_share) == ("consistent_hash", None)  # today's ring walk by default


def test_a_file_that_is_not_utf8_is_a_bad_config_not_a_crash(tmp_path):
    # Before: UnicodeDecodeError escaped load_config (only OSError was caught): a traceback at start
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"server: {port: 80}\n\xff\xfe bad")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert (caught.value.source, caught.value.key) == (str(path), "")
    assert caught.value.problem == "cannot read the file (not UTF-8 text: byte 0xff on line 2)"
    (tmp_path / "keys.yaml").write_bytes(b"- {key: \xe9t\xe9}\n")
    (tmp_path / "x").mkdir()
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "models: [{name: a, path: x}]\nkeys: keys.yaml\n"))
    assert caught.value.source == str(tmp_path / "keys.yaml")
    assert caught.value.problem == "cannot read the key file (not UTF-8 text: byte 0xe9 on line 1)"


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("server: {port: 8001}\nrules: []\nserver:\n  host: 0.0.0.0\n", "server", (1, 3)),
        (f"{OPENAI} retries: 1,\n  retries: 2}}]\n", "models[0].retries", (1, 2)),
        ("transcript:\n  ttl_s: 60\n  max_entries: 5\n  ttl_s: 90\n", "transcript.ttl_s", (2, 4)),
    ],
)
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, key, lines):
    # Before: PyYAML kept the last one without a word (a second server: block replaced the first)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    assert caught.value.key == key
    assert caught.value.problem.startswith(f"duplicate key (lines {lines[0]} and {lines[1]})")


def test_merge_keys_may_be_overridden_and_a_key_file_is_checked_for_duplicates_too(tmp_path):
    text = "redis: &r {url: 'redis://a:6379/0'}\ntranscript: {<<: *r, ttl_s: 60}\n"
    with pytest.raises(ConfigError, match="transcript.url: unknown key"):  # merged, not a duplicate
        load_config(write(tmp_path, text))
    (tmp_path / "keys.yaml").write_text("- name: a\n  key: sk-1234567890\n  name: b\n")
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "keys: keys.yaml\n"))
    assert (caught.value.source, caught.value.key) == (str(tmp_path / "keys.yaml"), "keys[0].name")
    assert "duplicate key (lines 1 and 3)" in caught.value.problem
    assert "sk-1234567890" not in str(caught.value)


def test_a_config_without_an_admin_token_takes_the_environment_variable(tmp_path, monkeypatch):
    # Before: only the embedded default read PREFIXGATE_ADMIN_TOKEN; with --config it was ignored, so the
    # admin endpoints stayed open (or closed, with keys) though the 403 message and docs name the variable
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", "from-the-environment")
    assert load_config(write(tmp_path, "rules: [default]\n")).admin.token == "from-the-environment"
    assert load_config(write(tmp_path, "admin: {token: null}\n")).admin.token == "from-the-environment"
    # the config's own token wins when both are set
    assert load_config(write(tmp_path, "admin: {token: in-the-config}\n")).admin.token == "in-the-config"
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", "")
    assert load_config(write(tmp_path, "rules: [default]\n")).admin.token is None


def test_an_embedded_model_path_that_does_not_exist_is_refused_before_any_load(tmp_path):
    # Before: accepted here; the load at start then failed with a traceback (exit 3)
    with pytest.raises(ConfigError) as caught:
        load_config(
            write(tmp_path, "models: [{name: m, backend: embedded, path: /nonexistent/model.gguf}]\n")
        )
    assert caught.value.key == "models[0].path"
    assert caught.value.problem == "no such model file or folder: /nonexistent/model.gguf"
    assert load_config(write(tmp_path, "models: [{name: m, path: default}]\n")).models[0].path == "default"


def test_the_canonicalizer_config_reads_only_rules_transcript_and_learning(tmp_path, monkeypatch):
    from gateway.config.loader import load_canonicalizer_config

    monkeypatch.delenv("PG_UNSET_SECRET", raising=False)
    text = """
        admin: {token: env:PG_UNSET_SECRET}
        rules: [default, mine.yaml]
        models: [{name: m, path: /nonexistent.gguf}, {name: u, backend: openai, base_url: http://x, api_key: env:PG_UNSET_SECRET}]
        keys: [{key: env:PG_UNSET_SECRET, tenant: t}]
        transcript: {redis_url: "redis://127.0.0.1:6379/0", max_entries: 7}
        rules_learning: apply
        """
    path = write(tmp_path, text)
    with pytest.raises(ConfigError):
        load_config(path)  # the whole config needs its secrets and model paths
    config = load_canonicalizer_config(path)
    assert config.rules == ("default", str(tmp_path / "mine.yaml"))
    assert (config.transcript.max_entries, config.transcript.redis_url) == (7, "redis://127.0.0.1:6379/0")
    assert config.rules_learning.mode == "apply"
    assert config.admin.token is None and config.keys == ()
    with pytest.raises(ConfigError, match="transcript.max_entries: expected a positive number"):
        load_canonicalizer_config(write(tmp_path, "transcript: {max_entries: 0}\n"))
    with pytest.raises(ConfigError, match="bogus: unknown key"):
        load_canonicalizer_config(write(tmp_path, "bogus: 1\n"))


def test_a_base_url_with_credentials_is_refused_without_echoing_them(tmp_path):
    path = write(
        tmp_path, "models: [{name: a, backend: openai, base_url: 'http://u:s3cret@h/v1', api_key: sk-x}]\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "s3cret" not in str(caught.value) and "api_key" in caught.value.problem
    alone = write(tmp_path, "models: [{name: a, backend: openai, base_url: 'http://u:s3cret@h/v1'}]\n")
    with pytest.raises(ConfigError, match="holds credentials"):  # without api_key too: never sent either
        load_config(alone)


def test_a_base_url_scheme_in_capitals_is_taken_and_a_bad_port_never_echoes_credentials(tmp_path):
    # a URL's scheme is case-insensitive (RFC 3986 3.1); a trial saw "HTTP://host/v1" refused as not http://
    path = write(
        tmp_path, "models: [{name: a, backend: openai, base_url: ['HTTP://a.example/v1', Https://b/v1]}]\n"
    )
    assert load_config(path).models[0].base_url == ("http://a.example/v1", "https://b/v1")
    bad = write(tmp_path, "models: [{name: a, backend: openai, base_url: 'http://u:s3cret@h:70000/v1'}]\n")
    with pytest.raises(ConfigError, match="the port 70000 is outside 1-65535") as caught:
        load_config(bad)
    assert "s3cret" not in str(caught.value)
