"""The server processes of ``bench.overhead``: the stub upstream, prefixgate and LiteLLM's proxy, each its own
process with one worker on a free loopback port, started, waited for (a health URL) and stopped; and their
resident memory.

prefixgate runs as ``python -m gateway.cli serve`` with a config holding one ``backend: openai`` model on the
stub and the default rules; LiteLLM's proxy as its ``litellm`` script (``--num_workers 1``) with one
``openai/`` model on the stub, no database, its cost map read from the package (no network).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

MODEL = "bench-model"
"""The model name clients send to either gateway."""

CLIENT_KEY = "sk-bench-" + "5f0c" * 16
"""The bearer every request carries: LiteLLM's master key (it refuses to start open); prefixgate runs open and
the stub ignores it."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A started server process: its name, port, process and log file."""

    name: str
    port: int
    process: subprocess.Popen
    log: Path

    def rss_mb(self) -> float:
        """Resident memory (``VmRSS``) of the process and its children, MiB (0.0 once it is gone)."""
        return sum(_rss_kib(pid) for pid in [self.process.pid, *_children(self.process.pid)]) / 1024

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process and its children have used so far."""
        return sum(_cpu_ticks(pid) for pid in [self.process.pid, *_children(self.process.pid)]) / _TICKS

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (proc(5): fields 14 and 15)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            for child in map(int, text):
                found += [child, *_children(child)]
    except OSError:
        pass
    return found


def start(
    name: str,
    argv: list[str],
    port: int,
    health: str,
    workdir: Path,
    env: dict[str, str],
    cwd: Path | None = None,
) -> Server:
    """Start ``argv`` in ``cwd`` (stdout and stderr to ``workdir/name.log``) and wait up to 120 s for ``health``
    (a path) to answer 200.

    Raises:
        RuntimeError: the process exited or never answered (the log's tail in the message).
    """
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd
        )
    server = Server(name, port, process, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{name} did not start ({' '.join(argv)}):\n{tail}")


def start_stub(workdir: Path) -> Server:
    """The stub upstream (``bench.overhead.stub``)."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.overhead.stub", "--port", str(port)]
    return start("stub", argv, port, "/healthz", workdir, {})


def start_prefixgate(
    workdir: Path,
    stub_port: int,
    log_level: str = "info",
    tree: Path | None = None,
    name: str = "prefixgate",
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """prefixgate with one OpenAI upstream (the stub) and the default rules, at ``log_level``; from the checkout
    at ``tree`` (its ``gateway``, ``rules`` and ``engine`` packages first on the import path) when given, else
    from this one. ``name`` names the target (and its config and log files). ``launcher`` replaces
    ``python -m gateway.cli`` (``serve --config ...`` follows it; ``bench.overhead.phases`` wraps the server);
    ``env`` adds to the environment."""
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "rules": ["default"],
        "models": [
            {
                "name": MODEL,
                "backend": "openai",
                "base_url": f"http://127.0.0.1:{stub_port}/v1",
                "api_key": "sk-bench",
                "upstream_model": "stub-model",
                "retries": 0,
            }
        ],
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [*(launcher or [sys.executable, "-m", "gateway.cli"]), "serve", "--config", str(path)]
    argv += ["--log-level", log_level]
    extra = {**(env or {}), **({"PYTHONPATH": str(tree)} if tree is not None else {})}
    return start(name, argv, port, "/healthz", workdir, extra, cwd=tree)


def start_litellm(workdir: Path, stub_port: int, litellm: str) -> Server:
    """LiteLLM's proxy (the ``litellm`` script at ``litellm``) with one model on the stub, one worker."""
    port = free_port()
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": "openai/stub-model",
                    "api_base": f"http://127.0.0.1:{stub_port}/v1",
                    "api_key": "sk-bench",
                    "max_retries": 0,
                },
            }
        ],
        "litellm_settings": {"telemetry": False},
        "general_settings": {"master_key": CLIENT_KEY},
    }
    path = workdir / "litellm.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [litellm, "--config", str(path), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_SCHEMA_UPDATE": "True",
    }
    return start("litellm", argv, port, "/health/liveliness", workdir, env)


def find_litellm(given: str | None) -> str | None:
    """The ``litellm`` script to run: ``given`` (the script, or a venv / its ``bin`` folder holding it), else
    the one beside this Python, else ``bench/.peers/litellm/bin/litellm``; None when there is none."""
    candidates: list[Path] = []
    if given:
        path = Path(given)
        candidates += [path, path / "litellm", path / "bin" / "litellm"]
    else:
        candidates += [
            Path(sys.executable).parent / "litellm",
            Path(__file__).resolve().parents[1] / ".peers" / "litellm" / "bin" / "litellm",
        ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None
