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
    config.write_text("rules: [bad.yaml]\nmodels: [{name: m, path: /nonexistent}]\n")
    # port 0: the rules load after the bind, which must not depend on 8000 being free on the test machine
    assert main(["serve", "--config", str(config), "--port", "0"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "broken" in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_the_gateway_and_logs_one_line_per_request(tiny_checkpoint, tmp_path):
    config_path = tmp_path / "prefixgate.yaml"
    write_config(config_path, tiny_config_data(tiny_checkpoint))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stdout.read()
            time.sleep(0.1)
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
