"""Run the real gateway (uvicorn on a free port, in a background thread) for end-to-end tests."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn
import yaml

from gateway.config.loader import load_config
from gateway.config.schema import GatewayConfig
from gateway.http.app import create_app
from gateway.http.server_protocol import coalescing_protocol

ADMIN_TOKEN = "test-admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bound_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port (its port known before a config naming it is written)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RunningServer:
    """uvicorn serving ``create_app(config)`` on 127.0.0.1:<free port> until ``stop``.

    Attributes:
        base_url: ``http://127.0.0.1:<port>``.
        app: the Starlette app (``app.state.gateway`` is the live gateway).
    """

    def __init__(
        self,
        config: GatewayConfig,
        backends: dict | None = None,
        extra_routes: tuple = (),
        sock: socket.socket | None = None,
    ) -> None:
        self.app = create_app(config, backends=backends, extra_routes=extra_routes)
        self._sock = sock or bound_socket()
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_config=None,
                access_log=False,
                lifespan="on",
                http=coalescing_protocol() or "auto",  # what `prefixgate serve` runs
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 120.0) -> RunningServer:
        """Start and wait until the lifespan finished (models loaded)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the gateway failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit (runs the lifespan shutdown: engines stop) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def stats(self) -> dict:
        """``GET /admin/stats`` with the admin token."""
        response = httpx.get(f"{self.base_url}/admin/stats", headers=ADMIN_HEADERS, timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_blocks_released(self, model: str, attempts: int = 200) -> dict:
        """Poll ``/admin/stats`` until ``model`` has no block in use and no running/waiting request (an abort
        is processed by the engine asynchronously); return the last snapshot. Bounded by ``attempts``
        polls."""
        doc = {}
        for _ in range(attempts):
            doc = self.stats()
            m = doc["models"][model]
            if m["blocks"]["used"] == 0 and m["engine"]["running"] == 0 and m["engine"]["waiting"] == 0:
                return doc
            time.sleep(0.05)
        return doc


def write_config(path: Path, data: dict) -> GatewayConfig:
    """Write ``data`` as YAML at ``path`` and load it the way ``prefixgate serve --config`` does."""
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path)
