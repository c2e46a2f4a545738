"""The prefixgate command: config errors, listen-address overrides, and `serve` as a real process."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.cli import (
    EXIT_BAD_CONFIG,
    bind_listener,
    event_loop,
    limit_malloc_arenas,
    main,
    parse_args,
    resolve_config,
    serving_url,
)
from tests.gateway.conftest import TINY_MODEL, tiny_config_data
from tests.gateway.server import write_config


def test_parser_knows_the_commands():
    args = parse_args(["serve", "--config", "c.yaml", "--host", "0.0.0.0", "--port", "9000"])
    assert (args.command, args.config, args.host, args.port) == ("serve", "c.yaml", "0.0.0.0", 9000)
    args = parse_args(["rules", "apply", "--rules", "a.yaml", "b.yaml", "req.json"])
    assert (args.rules_command, args.rules, args.request) == ("apply", ["a.yaml", "b.yaml"], "req.json")
    args = parse_args(["rules", "apply", "req.json", "--rules", "a.yaml"])
    assert (args.rules, args.request) == (["a.yaml"], "req.json")
    assert parse_args(["rules", "apply", "req.json"]).rules is None
    for bad in (["rules", "check"], ["rules", "apply"], ["rules", "apply", "--rules", "req.json"]):
        with pytest.raises(SystemExit):
            parse_args(bad, stdin_piped=False)


def test_rules_apply_reads_piped_stdin_when_no_request_is_named():
    assert parse_args(["rules", "apply"], stdin_piped=True).request == "-"
    args = parse_args(["rules", "apply", "--rules", "a.yaml", "default"], stdin_piped=True)
    assert (args.rules, args.request) == (["a.yaml", "default"], "-")
    args = parse_args(["rules", "apply", "--rules", "a.yaml", "req.json"], stdin_piped=True)
    assert (args.rules, args.request) == (["a.yaml"], "req.json")  # a named .json is still the request
    args = parse_args(["rules", "apply", "--rules", "a.yaml", "b.yaml"], stdin_piped=False)
    assert (args.rules, args.request) == (["a.yaml"], "b.yaml")  # a terminal: the last word, as before


def test_rules_apply_from_a_pipe_prints_the_canonical_form(monkeypatch, capsys):
    body = {
        "messages": [{"role": "system", "content": "Current time: 10:00"}, {"role": "user", "content": "hi"}]
    }
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(body)))
    monkeypatch.setattr("gateway.cli._stdin_piped", lambda: True)
    assert main(["rules", "apply"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "10:00" in out["messages"][-1]["content"] and "10:00" not in out["messages"][0]["content"]


def test_bad_config_exits_2_naming_file_and_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("server: {port: eighty}\n")
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"{path}: server.port: expected an integer" in err


def test_listen_address_precedence(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("server: {host: 10.0.0.1, port: 7000}\n")
    monkeypatch.delenv("PREFIXGATE_HOST", raising=False)
    monkeypatch.delenv("PREFIXGATE_PORT", raising=False)
    assert (
        resolve_config(str(path), None, None).server.host,
        resolve_config(str(path), None, None).server.port,
    ) == ("10.0.0.1", 7000)
    monkeypatch.setenv("PREFIXGATE_HOST", "0.0.0.0")
    monkeypatch.setenv("PREFIXGATE_PORT", "7100")
    env = resolve_config(str(path), None, None).server
    assert (env.host, env.port) == ("0.0.0.0", 7100)
    flags = resolve_config(str(path), "127.0.0.2", 7200).server
    assert (flags.host, flags.port) == ("127.0.0.2", 7200)
    monkeypatch.setenv("PREFIXGATE_PORT", "http")
    with pytest.raises(Exception, match="PREFIXGATE_PORT"):
        resolve_config(str(path), None, None)
    monkeypatch.delenv("PREFIXGATE_PORT")
    monkeypatch.delenv("PREFIXGATE_HOST")
    default = resolve_config(None, None, None)
    assert (default.server.host, default.server.port, default.models[0].path) == (
        "127.0.0.1",
        8000,
        "default",
    )


def test_rules_commands_dispatch_to_the_rules_cli(tmp_path, capsys):
    assert main(["rules", "check", "default"]) == 0
    assert "OK default" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: broken\n    action: explode\n")
    assert main(["rules", "check", str(bad)]) != 0
    assert str(bad) in capsys.readouterr().err
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Current time: 2025-05-14 09:45:12\nBe brief."},
                    {"role": "user", "content": "hi"},
                ]
            }
        )
    )
    assert main(["rules", "apply", str(request)]) == 0
    canonical = json.loads(capsys.readouterr().out)
    assert canonical["messages"][0]["content"] == "Be brief."
    assert "Current time: 2025-05-14 09:45:12" in canonical["messages"][1]["content"]
    assert canonical["stable_prefix_end"] == {"message": 1, "part": 0, "char": 0}


def test_bad_rule_file_in_config_exits_2_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: broken\n    action: explode\n")
    config = tmp_path / "c.yaml"
    config.write_text(
        "rules: [bad.yaml]\nmodels: [{name: m, backend: openai, base_url: 'http://127.0.0.1:9/v1'}]\n"
    )
    # port 0: the rules load after the bind, which must not depend on 8000 being free on the test machine
    assert main(["serve", "--config", str(config), "--port", "0"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "broken" in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_process(config_path: Path, port: int) -> subprocess.Popen:
    """``prefixgate serve`` on ``config_path`` and ``port`` in a child process, its output in one text pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_healthy(process: subprocess.Popen, base: str) -> None:
    """Poll ``/healthz`` until it answers 200 (the model loaded); fails with the output if the process ends."""
    for _ in range(600):
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.1)
    raise AssertionError("the gateway did not become healthy")


def test_serve_runs_the_gateway_and_logs_one_line_per_request(tiny_checkpoint, tmp_path):
    config_path = tmp_path / "prefixgate.yaml"
    write_config(config_path, tiny_config_data(tiny_checkpoint))
    port = free_port()
    process = serve_process(config_path, port)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(process, base)
        secret = "SECRET-PROMPT-TEXT-do-not-log"
        response = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": TINY_MODEL,
                "messages": [{"role": "user", "content": secret}],
                "max_tokens": 2,
                "user": "u-secret",
            },
            headers={"Authorization": "Bearer sk-client-key-never-logged"},
            timeout=60,
        )
        assert response.status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    lines = [line for line in output.splitlines() if "prefixgate.request" in line]
    assert len(lines) == 1, output
    assert "status=200" in lines[0] and f"model={TINY_MODEL}" in lines[0] and "prompt_tokens=" in lines[0]
    assert "cached_tokens=" in lines[0] and "completion_tokens=2" in lines[0] and "ttft_ms=" in lines[0]
    assert secret not in output and "sk-client-key" not in output and "u-secret" not in output
    assert "prefixgate.server: event loop: uvloop" in output  # uvloop is a dependency
    # Before: no line said where the gateway listens (uvicorn writes "running on" only for sockets it binds)
    assert f"prefixgate.server: ready: serving {base} (OpenAI SDK base_url {base}/v1" in output, output
    assert process.returncode == 0


@pytest.mark.parametrize(("host", "shown"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_the_serving_url_is_the_bound_address_with_the_port_it_got(host, shown):
    try:
        sock = bind_listener(host, 0)
    except OSError:
        pytest.skip(f"this machine cannot bind {host}")
    with sock:
        assert serving_url(sock) == f"http://{shown}:{sock.getsockname()[1]}"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_on_a_port_in_use_fails_at_once_naming_it_before_any_model_loads(host, monkeypatch, capsys):
    # Before: the bind came after the ~25 s model load (uvicorn binds once the app's lifespan started)
    import gateway.http.app

    def no_model_load(config):
        raise AssertionError("the app (and its models) must not be built when the port is taken")

    monkeypatch.setattr(gateway.http.app, "create_app", no_model_load)
    monkeypatch.delenv("PREFIXGATE_HOST", raising=False)
    monkeypatch.delenv("PREFIXGATE_PORT", raising=False)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        held = socket.socket(family, socket.SOCK_STREAM)
        held.bind((host, 0))
    except OSError:
        pytest.fail(f"this machine cannot bind {host}: the test needs loopback on it")
    with held:
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--host", host, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on {host}:{port}: Address already in use" in err, err
    assert "--port" in err and "PREFIXGATE_PORT" in err


def test_rules_replay_runs_the_configured_canonicalizer_and_names_broken_lines(tmp_path, capsys):
    system = "You are Nova, the assistant of ACME Corp. Answer politely.\nCurrent time: 09:45:{s}\nBe brief."
    lines, history = [], [{"role": "user", "content": "Question 0?"}]
    for turn in range(3):
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system.format(s=10 + turn)}, *history],
        }
        lines.append(json.dumps(body))
        history += [
            {"role": "assistant", "content": f"Answer {turn}: refunds are possible within 30 days."},
            {"role": "user", "content": f"Question {turn + 1}?"},
        ]
    lines.insert(1, "{not json")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["rules", "replay", "--tokenizer", "cl100k", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "line 2: skipped" in out
    totals = json.loads(out.strip().splitlines()[-1])
    assert totals["requests"] == 3 and totals["broken"] == 1
    assert totals["turns_worse_than_off"] == 0
    # the memory keeps the history byte-identical while the time changes: more is shared than without it
    from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer
    from gateway.service.canonicalize.replay import replay, rules_canonicalizer
    from rules import load_ruleset

    stateless = replay(lines, rules_canonicalizer(load_ruleset(["default"])), Cl100kTokenizer()).totals()
    assert totals["common_tokens_on"] > stateless["common_tokens_on"] >= totals["common_tokens_off"]


def test_rules_replay_of_a_missing_trace_exits_2(tmp_path, capsys):
    assert main(["rules", "replay", "--tokenizer", "cl100k", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_rules_learned_without_a_gateway_exits_1(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["rules", "learned", "--url", f"http://127.0.0.1:{port}"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def _make_run_line(*assignments: str, env: dict[str, str] | None = None) -> str:
    """The ``prefixgate serve`` command ``make run`` would execute (dry run: nothing is installed or run), with
    ``env`` added to a copy of this process's environment."""
    assert shutil.which("make"), "make is needed to check the Makefile"
    root = Path(__file__).resolve().parents[2]
    environment = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "CONFIG", "MAKEFLAGS")}
    out = subprocess.run(
        ["make", "-n", "-C", str(root), "run", *assignments],
        capture_output=True,
        text=True,
        check=True,
        env={**environment, **(env or {})},
    ).stdout
    return next(line for line in out.splitlines() if "prefixgate serve" in line)


def test_make_run_with_a_config_leaves_the_address_to_the_config():
    line = _make_run_line("CONFIG=x.yaml")
    assert "--config x.yaml" in line
    assert "--host" not in line and "--port" not in line
    line = _make_run_line("CONFIG=x.yaml", "HOST=0.0.0.0", "PORT=9001")
    assert "--host 0.0.0.0" in line and "--port 9001" in line


def test_make_run_ignores_an_exported_host_or_port():
    # Before: `HOST=myworkstation PORT=3000 make -n run` printed `serve --host myworkstation --port 3000`
    shell = {"HOST": "myworkstation", "PORT": "3000", "CONFIG": "stray.yaml"}
    line = _make_run_line(env=shell)
    assert line.split() == [".venv/bin/prefixgate", "serve"]
    # make's own command line still counts, over the environment
    line = _make_run_line("HOST=0.0.0.0", "PORT=9000", env=shell)
    assert line.split() == [".venv/bin/prefixgate", "serve", "--host", "0.0.0.0", "--port", "9000"]
    # the documented PREFIXGATE_* variables are left to prefixgate (resolve_config reads them)
    line = _make_run_line(env={"PREFIXGATE_HOST": "0.0.0.0", "PREFIXGATE_PORT": "9000"})
    assert "--host" not in line and "--port" not in line


def test_malloc_arenas_are_capped_on_glibc_unless_the_environment_says(monkeypatch):
    """glibc's mallopt(M_ARENA_MAX) accepts the cap (returns 1); an operator's MALLOC_ARENA_MAX wins."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_malloc_arenas() is True  # this project runs on glibc Linux (Debian)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False


def test_serve_runs_on_uvloop_when_it_imports_else_asyncio(monkeypatch):
    assert event_loop() == "uvloop"
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it raises ImportError
    assert event_loop() == "asyncio"


def test_a_rules_command_whose_reader_left_exits_quietly(tmp_path):
    """Before: ``prefixgate rules apply req.json | head -3`` ended in a ``BrokenPipeError`` traceback."""
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 2000}]}))
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "rules", "apply", str(request)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    process.stdout.close()  # the reader leaves before the first write
    stderr = process.stderr.read()
    process.stderr.close()
    assert process.wait(timeout=60) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_serve_freezes_start_up_objects_while_serving_and_unfreezes_after(tmp_path, monkeypatch):
    """Full collections skip what start-up built (gc.freeze) while uvicorn runs; nothing stays frozen after."""
    import gc

    import uvicorn

    seen: list[int] = []

    def fake_run(self, sockets=None):
        seen.append(gc.get_freeze_count())

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    config = tmp_path / "c.yaml"
    config.write_text(
        "server: {host: 127.0.0.1, port: 0}\n"
        "models: [{name: m, backend: openai, base_url: 'http://127.0.0.1:9/v1', upstream_model: u}]\n"
    )
    gc.unfreeze()
    main(["serve", "--config", str(config)])
    assert seen and seen[0] > 1000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_port_out_of_range_is_a_usage_error_not_a_crash(port, capsys):
    # Before: --port was a plain int: bind() raised OverflowError (a traceback, exit 1) for 99999 and -1
    with pytest.raises(SystemExit) as caught:
        parse_args(["serve", "--port", port])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: prefixgate serve ")
    assert f"prefixgate serve: error: argument --port: expected a TCP port 0..65535, got '{port}'" in err
    assert (
        parse_args(["serve", "--port", "0"]).port == 0
        and parse_args(["serve", "--port", "65535"]).port == 65535
    )


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--bogus"], "usage: prefixgate serve "),
        (["serve", "extra"], "usage: prefixgate serve "),
        (["rules", "apply", "--bogus", "r.json"], "usage: prefixgate rules apply "),
        (["rules", "replay", "t.jsonl", "--bogus"], "usage: prefixgate rules replay "),
    ],
)
def test_an_unknown_argument_shows_the_commands_usage(argv, usage, capsys):
    # Before: argparse's top-level parser reported it, with "usage: prefixgate [-h] {serve,rules} ..."
    with pytest.raises(SystemExit) as caught:
        parse_args(argv, stdin_piped=False)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: " in err


def test_rules_apply_without_a_request_shows_the_apply_usage(capsys):
    with pytest.raises(SystemExit):
        parse_args(["rules", "apply"], stdin_piped=False)
    err = capsys.readouterr().err
    assert err.startswith("usage: prefixgate rules apply ") and "REQUEST.json is required" in err


def test_a_host_that_does_not_resolve_is_named_as_the_host(monkeypatch, capsys):
    # Before: "(is another server using that port? ...)" for a host name that does not resolve
    import gateway.http.app

    def unresolvable(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr("gateway.cli.bind_listener", unresolvable)
    monkeypatch.setattr(gateway.http.app, "create_app", lambda config: pytest.fail("no app without a socket"))
    monkeypatch.delenv("PREFIXGATE_PORT", raising=False)
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot listen on no-such-host.invalid:0: Name or service not known" in err
    assert "--host, PREFIXGATE_HOST or server.host" in err and "another server" not in err


def test_rules_commands_exit_2_for_bad_files_and_options(tmp_path, capsys):
    # Before: rules check of a missing file (or an invalid rule) and --placement bogus exited 1, while rules
    # apply of a missing request exited 2; the documented meaning of 2 is bad usage or bad config
    request = tmp_path / "r.json"
    request.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: broken\n    action: explode\n")
    assert main(["rules", "check", str(tmp_path / "missing.yaml")]) == EXIT_BAD_CONFIG
    assert main(["rules", "check", str(bad)]) == EXIT_BAD_CONFIG
    assert main(["rules", "apply", "--placement", "bogus", str(request)]) == EXIT_BAD_CONFIG
    assert "unknown hoist placement 'bogus'" in capsys.readouterr().err
    assert main(["rules", "apply", "--rules", str(bad), str(request)]) == EXIT_BAD_CONFIG
    assert main(["rules", "apply", str(tmp_path / "missing.json")]) == EXIT_BAD_CONFIG
    assert main(["rules", "apply", "--placement", "tail_end", str(request)]) == 0
    assert main(["rules", "check", "default"]) == 0


def test_serve_with_a_config_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe bad")
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_CONFIG
    assert f"prefixgate: bad config: {path}: cannot read the file (not UTF-8 text" in capsys.readouterr().err


def test_rules_replay_never_touches_the_configs_redis_nor_needs_its_secrets(tmp_path, monkeypatch, capsys):
    # Before: replay built the config's Redis transcript store (writing into the memory running gateways share)
    # and refused to start unless the admin token, client keys and provider keys of the config were set
    import gateway.service.canonicalize as canonicalize

    def no_redis(**kwargs):
        raise AssertionError("rules replay must not use the config's Redis")

    monkeypatch.setattr(canonicalize, "RedisTranscriptStore", no_redis)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    redis_only = tmp_path / "redis.yaml"
    redis_only.write_text("transcript: {redis_url: 'redis://127.0.0.1:6379/0'}\n")
    assert main(["rules", "replay", "--config", str(redis_only), "--tokenizer", "cl100k", str(trace)]) == 0
    capsys.readouterr()
    monkeypatch.delenv("PG_UNSET_SECRET", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(
        "admin: {token: env:PG_UNSET_SECRET}\n"
        "models: [{name: m, backend: openai, base_url: 'http://x', api_key: env:PG_UNSET_SECRET}]\n"
        "keys: [{key: env:PG_UNSET_SECRET, tenant: t}]\n"
        "transcript: {redis_url: 'redis://127.0.0.1:6379/0'}\n"
    )
    assert main(["rules", "replay", "--config", str(config), "--tokenizer", "cl100k", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["requests"] == 1
    with pytest.raises(SystemExit):
        main(["rules", "replay", "--help"])
    assert "never read or written" in " ".join(capsys.readouterr().out.split())


def _serve_refused(config_path) -> str:
    """``prefixgate serve`` on ``config_path``, which must stop at start with a bad-config exit and no traceback:
    its stderr."""
    process = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == EXIT_BAD_CONFIG, process.stderr
    assert "Traceback" not in process.stderr and "Application startup failed" not in process.stderr
    return process.stderr


def test_a_model_setting_only_the_checkpoint_refuses_is_one_line_and_exit_2(tiny_checkpoint, tmp_path):
    # Before: max_model_len beyond the checkpoint's context failed in the lifespan: uvicorn logged a
    # traceback and the process exited 3
    config_path = tmp_path / "long.yaml"
    data = tiny_config_data(tiny_checkpoint, max_model_len=99_999_999)
    write_config(config_path, data)
    stderr = _serve_refused(config_path)
    assert (
        f"prefixgate: bad config: {config_path}: models[0].engine.max_model_len: 99999999 is not in [1, 512] "
        "(the checkpoint's context window)"
    ) in stderr, stderr


def test_a_block_pool_larger_than_the_machine_is_one_line_naming_num_blocks(tiny_checkpoint, tmp_path):
    """A trial: ``num_blocks: 10000000`` died in torch's allocator after the model loaded (a traceback naming no
    setting), and ``1000000000000`` grew the process without bound while the pool's block list was built."""
    config_path = tmp_path / "huge.yaml"
    write_config(config_path, tiny_config_data(tiny_checkpoint, num_blocks=10**12))
    stderr = _serve_refused(config_path)
    assert (
        f"prefixgate: bad config: {config_path}: models[0].engine.num_blocks: 1000000000000 blocks of 16 tokens "
        "need "
    ) in stderr, stderr
    assert "GiB of KV cache (torch.bfloat16), more than this machine's" in stderr


def test_sigterm_ends_a_stream_in_flight_with_an_error_event_and_a_clean_end(tiny_checkpoint, tmp_path):
    """An operator trial: SIGTERM during a stream left the engine generating until uvicorn's graceful timeout,
    then cut the client off mid-body (no error, no end) and logged it 499 as if the client had left. After
    ``server.shutdown_grace_s`` (0 here) a stream still running gets the protocol's error event and its clean
    end, a JSON answer not yet sent a 503, both logged 503, and the process exits."""
    data = tiny_config_data(tiny_checkpoint)
    data["server"]["shutdown_grace_s"] = 0
    config_path = tmp_path / "prefixgate.yaml"
    write_config(config_path, data)
    port = free_port()
    process = serve_process(config_path, port)
    base = f"http://127.0.0.1:{port}"
    # one forced token, never the end of turn: the answer runs until max_tokens or the shutdown
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 400}
    body["logit_bias"] = {"5": 100}
    try:
        wait_healthy(process, base)
        events = []
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"content"' in line:
                    break  # the answer is under way
            process.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]  # ends cleanly, or raises here
        errors = [json.loads(line[6:])["error"] for line in events if line.startswith('data: {"error"')]
        assert len(errors) == 1 and "shutting down" in errors[0]["message"], events[-3:]
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode in (0, -signal.SIGTERM), output  # uvicorn re-raises the signal it stopped on
    assert "Finished server process" in output
    lines = [line for line in output.splitlines() if "prefixgate.request" in line]
    assert len(lines) == 1 and "status=503" in lines[0] and "error_code=service_unavailable" in lines[0], (
        lines
    )
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_make_remakes_a_venv_left_without_pip(tmp_path):
    """Before: a ``python -m venv`` whose ensurepip failed left ``.venv/bin/python`` without pip, and every later
    ``make`` failed on ``.venv/bin/pip: No such file`` until ``.venv`` was deleted by hand. A venv without pip
    is now made again (and installed again); a complete one costs ``make run`` nothing."""
    assert shutil.which("make"), "make is needed to check the Makefile"
    root = Path(__file__).resolve().parents[2]
    shutil.copy(root / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (tmp_path / ".venv" / ".run-installed").write_text("")  # even with the install marked done
    environment = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "CONFIG", "MAKEFLAGS")}

    def planned() -> list[str]:
        return subprocess.run(
            ["make", "-n", "--no-print-directory", "-C", str(tmp_path), "run"],
            capture_output=True,
            text=True,
            check=True,
            env=environment,
        ).stdout.splitlines()

    lines = planned()
    assert lines[0] == "rm -rf .venv" and any(" -m venv .venv" in line for line in lines)
    assert any(line.startswith(".venv/bin/pip install --quiet -e .") for line in lines)
    (bin_dir / "pip").write_text("")
    os.utime(bin_dir / "pip", (1_000_000, 1_000_000))  # made before the install, as a real venv's is
    assert planned() == [".venv/bin/prefixgate serve   "]
