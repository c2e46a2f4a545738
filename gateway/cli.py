"""The ``prefixgate`` command.

::

    prefixgate serve [--config FILE] [--host H] [--port P] [--log-level debug|info|warning|error]
    prefixgate rules check FILE...
    prefixgate rules apply [--rules FILE...] [--placement WHERE] REQUEST.json
    prefixgate rules replay [--config FILE] [--tokenizer smollm2|cl100k] TRACE.jsonl
    prefixgate rules learned [--url URL] [--token TOKEN] [--model M] [--tenant T] > learned.yaml

``serve`` without ``--config`` runs the embedded default (SmolLM2-135M-Instruct, rules ``[default]``).
Listen address precedence: ``--host``/``--port``, then ``PREFIXGATE_HOST``/``PREFIXGATE_PORT``, then the
config's ``server:``, then 127.0.0.1:8000. (The Makefile's ``HOST``/``PORT`` reach us as flags.) ``serve`` binds
its listening socket before it loads any model: an address already in use fails at once (exit 1, naming
host:port), not after the model load.

``rules replay`` runs a request log through the canonicalizer the config builds (its rules, transcript memory
bounds and learning mode; the default config without ``--config``), as the gateway would, but with the transcript
memory in this process only: it never reads or writes the config's Redis (``transcript.redis_url``, ``redis:``),
and reads no other section, so their ``env:`` secrets need not be set. ``rules
learned`` asks a running gateway (``GET /admin/rules/learned`` at ``--url``, default
``http://127.0.0.1:8000``, with ``--token`` or ``PREFIXGATE_ADMIN_TOKEN`` as the admin bearer token) for the
slots it learned and prints them as a rule file.
Exit status: 0 success, 1 runtime failure, 2 bad usage or bad config. Bad usage is an unknown option, a bad
option value (``--port 99999``, ``--placement nowhere``) or a file named on the command line that is missing or
unreadable; bad config is any config or rule error, so ``rules check`` exits 2 for an invalid rule file as
``serve`` does for the config's rules, and ``rules apply`` exits 2 for a bad rule file or request. ``serve``
exits 2 for a model setting only its checkpoint can refuse (``models[0].engine.max_model_len`` beyond the
checkpoint's context window), and 1 when it cannot listen or a model fails to start for another reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import gc
import logging
import os
import socket
import sys
from collections.abc import Sequence
from types import FrameType

from gateway.config.loader import default_config, load_canonicalizer_config, load_config
from gateway.config.schema import ConfigError, GatewayConfig

EXIT_BAD_CONFIG = 2
EXIT_CANNOT_LISTEN = 1
SHUTDOWN_MARGIN_S = 2.0
"""Seconds uvicorn's graceful shutdown waits past ``server.shutdown_grace_s``: the requests the drain ends then
still write their error event and close before uvicorn cancels what is left."""
EXIT_RUNTIME_FAILURE = 1
_RULES_ERROR = 1
"""What ``rules.cli.check`` / ``apply`` return for a rule error (a missing, unreadable or invalid rule file, an
unknown pack or placement): ``prefixgate`` exits ``EXIT_BAD_CONFIG`` for it (see the module docstring)."""


def tcp_port(text: str) -> int:
    """``--port``'s type: a TCP port 0..65535 (0: any free port).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it with the command's usage, exit 2).
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``prefixgate``."""
    parser = argparse.ArgumentParser(prog="prefixgate", description="A prompt-prefix-caching LLM gateway.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--config", help="YAML config file (default: the embedded SmolLM2 with default rules)")
    serve.add_argument("--host", help="listen address (default: config server.host, 127.0.0.1)")
    serve.add_argument(
        "--port", type=tcp_port, help="listen port 0..65535 (default: config server.port, 8000)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    rules = commands.add_parser("rules", help="validate or try rule files")
    rule_commands = rules.add_subparsers(dest="rules_command", required=True)
    check = rule_commands.add_parser("check", help="validate rule files (file, line and rule id on error)")
    check.add_argument("files", nargs="+", metavar="FILE")
    apply = rule_commands.add_parser("apply", help="print the canonical form of a request JSON")
    apply.add_argument(
        "--rules", nargs="+", default=None, metavar="FILE", help="rule files or pack names (default: default)"
    )
    apply.add_argument("--placement", default=None, help="override every hoist rule's placement")
    apply.add_argument(
        "request",
        metavar="REQUEST.json",
        nargs="?",
        help="the request body (- or no file with piped input: standard input)",
    )
    replay = rule_commands.add_parser(
        "replay",
        help="replay a request log (JSON lines) and print the prefix each request shares",
        description="Replay a request log (JSON lines) through the canonicalizer a config builds and print the "
        "prefix each request shares. The transcript memory lives in this process only: the config's Redis "
        "(transcript.redis_url, redis:) is never read or written, and sections other than rules, transcript "
        "and rules_learning are not read (their env: secrets need not be set).",
    )
    replay.add_argument("trace", metavar="TRACE.jsonl")
    replay.add_argument(
        "--config",
        help="YAML config whose rules, transcript memory bounds and learning to use (never its Redis)",
    )
    replay.add_argument("--tokenizer", choices=("smollm2", "cl100k"), default=None)
    learned = rule_commands.add_parser(
        "learned", help="print a running gateway's learned slots as a rule file"
    )
    learned.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    learned.add_argument("--token", default=None, help="admin token (default: $PREFIXGATE_ADMIN_TOKEN)")
    learned.add_argument("--model", default=None)
    learned.add_argument("--tenant", default=None)
    for command in (serve, check, apply, replay, learned):
        command.set_defaults(command_parser=command)  # the innermost command's, for its usage on errors
    return parser


def parse_args(argv: Sequence[str] | None = None, stdin_piped: bool | None = None) -> argparse.Namespace:
    """Parse the command line. ``--rules A B REQUEST.json``: argparse's ``+`` takes every word, so the last
    one is the request when no separate positional is left, unless input is piped and that word does not end
    in ``.json`` (``--rules A B < req.json``). With no request named and input piped, the request is read from
    standard input (``-``).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        stdin_piped: whether standard input is not a terminal (default: asked of ``sys.stdin``).
    """
    parser = build_parser()
    # not ``parse_args``: its error for an unknown argument shows the top-level usage, not the command's
    args, unknown = parser.parse_known_args(argv)
    command = args.command_parser
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "rules" and args.rules_command == "apply" and args.request is None:
        piped = _stdin_piped() if stdin_piped is None else stdin_piped
        if args.rules and not (piped and not args.rules[-1].endswith(".json")):
            args.request = args.rules.pop()
            if not args.rules:
                command.error("--rules needs at least one FILE before REQUEST.json")
        elif piped:
            args.request = "-"
        else:
            command.error("REQUEST.json is required (or - to read it from standard input)")
    return args


def _stdin_piped() -> bool:
    try:
        return not sys.stdin.isatty()
    except (AttributeError, ValueError):  # no stdin, or a closed one
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status. A ``rules`` command whose reader went away
    (``prefixgate rules apply req.json | head``) exits 1 quietly, as other Unix tools do, not with a
    ``BrokenPipeError`` traceback (the recipe of the Python docs' "Note on SIGPIPE")."""
    args = parse_args(argv)
    if args.command == "serve":
        return serve(args.config, args.host, args.port, args.log_level)
    try:
        return rules_main(args)
    except BrokenPipeError:
        # Later writes (the interpreter's final flush) would fail again: point stdout at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


def rules_main(args: argparse.Namespace) -> int:
    """The ``prefixgate rules ...`` commands (``check``, ``apply``, ``replay``, ``learned``)."""
    from gateway.service.canonicalize import run_rules_command

    if args.rules_command == "replay":
        return replay(args.trace, args.config, args.tokenizer)
    if args.rules_command == "learned":
        return learned(args.url, args.token, args.model, args.tenant)
    if args.rules_command == "check":
        status = run_rules_command("check", args.files)
    else:
        status = run_rules_command("apply", args.rules, args.request, args.placement)
    return EXIT_BAD_CONFIG if status == _RULES_ERROR else status


def replay(trace: str, config_path: str | None, tokenizer: str | None) -> int:
    """``prefixgate rules replay``: the config's canonicalizer over the trace (see the module docstring). Only
    the config's ``rules``, ``transcript`` and ``rules_learning`` are read (``load_canonicalizer_config``), and
    the transcript memory is this process's own: the config's Redis is never touched, so a replay cannot write
    into (or read from) the memory a running gateway shares."""
    from gateway.service.canonicalize import Canonicalizer, RuleError, run_replay

    try:
        config = load_canonicalizer_config(config_path) if config_path else default_config()
        transcript = dataclasses.replace(config.transcript, redis_url=None)
        canonicalizer = Canonicalizer(config.rules, transcript, config.rules_learning)
    except (ConfigError, RuleError) as exc:
        print(f"prefixgate: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        return run_replay(trace, canonicalizer, tokenizer)
    finally:
        canonicalizer.close()


def learned(url: str, token: str | None, model: str | None, tenant: str | None) -> int:
    """``prefixgate rules learned``: GET ``/admin/rules/learned`` and print the YAML; 1 when the gateway cannot
    be reached or refuses (the reason on stderr)."""
    import httpx

    token = token or os.environ.get("PREFIXGATE_ADMIN_TOKEN") or None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    params = {key: value for key, value in (("model", model), ("tenant", tenant)) if value is not None}
    try:
        response = httpx.get(
            url.rstrip("/") + "/admin/rules/learned", headers=headers, params=params, timeout=30
        )
    except httpx.HTTPError as exc:
        print(f"prefixgate: cannot reach the gateway at {url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"prefixgate: {url} answered {response.status_code}: {response.text[:200]}", file=sys.stderr)
        return 1
    sys.stdout.write(response.text)
    return 0


def resolve_config(config_path: str | None, host: str | None, port: int | None) -> GatewayConfig:
    """The config to serve: the file (or the default) with listen-address overrides applied.

    Raises:
        ConfigError: a bad file, or a bad ``PREFIXGATE_PORT``.
    """
    config = load_config(config_path) if config_path else default_config()
    host = host or os.environ.get("PREFIXGATE_HOST") or None
    if port is None and os.environ.get("PREFIXGATE_PORT"):
        raw = os.environ["PREFIXGATE_PORT"]
        if not raw.isdigit() or int(raw) > 65535:
            raise ConfigError("PREFIXGATE_PORT", "", f"expected a TCP port 0..65535, got {raw!r}")
        port = int(raw)
    server = dataclasses.replace(
        config.server, host=host or config.server.host, port=config.server.port if port is None else port
    )
    return dataclasses.replace(config, server=server)


_M_ARENA_MAX = -8  # glibc malloc.h: mallopt parameter number of M_ARENA_MAX
DEFAULT_MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = DEFAULT_MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process (``mallopt(M_ARENA_MAX, arenas)``), unless the operator set
    ``MALLOC_ARENA_MAX`` in the environment (glibc reads that itself at start).

    Why: the 10-minute soak (bench/fleet/soak.py) saw a gateway's RSS grow ~8 MB/min while its Python heap and
    live tensors stayed flat; memory maps put the growth in glibc's per-thread arenas (the engine's and the
    event loop's worker threads), and the gateway started with ``MALLOC_ARENA_MAX=2`` levelled off. Call it
    before threads start. Returns True when the cap was applied; False where the C library is not glibc
    or the environment variable is set. Never raises.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return False


def event_loop() -> str:
    """uvicorn's ``loop`` for ``serve``: ``"uvloop"`` when it imports (a dependency: its loop costs less CPU per
    request than asyncio's, see docs/overhead.md), else ``"asyncio"``."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: connections are refused until the server
    starts accepting, once its models are loaded), as uvicorn binds one: IPv6 when ``host`` has a colon,
    ``SO_REUSEADDR`` (a port in TIME_WAIT is free; one with a listener is not), inheritable.

    Raises:
        OSError: the address is in use, not local, or not permitted (the socket is closed).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serving_url(sock: socket.socket) -> str:
    """The ``http://`` URL a bound socket serves, from its own address (the port it really got; an IPv6 host
    in brackets), e.g. ``http://127.0.0.1:8000`` or ``http://[::1]:8000``."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def log_ready(url: str) -> None:
    """The start-up line that says where the gateway answers, once its models are loaded (uvicorn's own
    "running on" line is not written for a socket it did not bind itself)."""
    logging.getLogger("prefixgate.server").info(
        "ready: serving %s (OpenAI SDK base_url %s/v1, Anthropic SDK base_url %s; admin %s/admin/)",
        url,
        url,
        url,
        url,
    )


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The gateway's log line; it names no thread, process, multiprocessing or caller field (see ``quiet_log_records``)."""


def quiet_log_records() -> None:
    """Turn off the documented ``logging`` switches for ``LogRecord`` fields ``LOG_FORMAT`` does not use
    (``logThreads``: thread and threadName, ``logProcesses``: process, ``logMultiprocessing``: processName), so
    each record skips those look-ups: ~0.6 µs of ~7 µs per line (``python -m bench.logging_flags``); and
    ``logging._srcfile = None`` (the logging HOWTO's "Optimization" section), so no record walks the stack for
    its caller's file, line and function, which the format does not name either."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None


def serve(config_path: str | None, host: str | None, port: int | None, log_level: str = "info") -> int:
    """Load the config, bind the listening socket (before any model loads: an address in use fails at once,
    exit 1 naming host:port), build the app and run uvicorn on that socket until interrupted.

    While it serves, the objects start-up made are frozen (``gc.freeze``): the cyclic collector's full
    collections then skip them (~80,000 objects: modules, rule sets, tables; a full collection went from ~67
    to ~2 ms, docs/overhead.md session 9). They stay alive either way; ``gc.unfreeze`` when serving ends."""
    limit_malloc_arenas()
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    quiet_log_records()
    # httpx logs every upstream call at INFO; prefixgate.request already logs one line per request
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(log_level.upper())))
    from gateway.service.canonicalize import RuleError

    try:
        config = resolve_config(config_path, host, port)
    except ConfigError as exc:
        print(f"prefixgate: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    address = f"{config.server.host}:{config.server.port}"
    try:
        listener = bind_listener(config.server.host, config.server.port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            hint = (
                "is the host a name this machine can resolve, or one of its own addresses? choose another with "
                "--host, PREFIXGATE_HOST or server.host"
            )
        else:
            hint = "is another server using that port? choose another with --port, PREFIXGATE_PORT or server.port"
        print(f"prefixgate: cannot listen on {address}: {reason} ({hint})", file=sys.stderr)
        return EXIT_CANNOT_LISTEN
    try:
        from gateway.http.app import create_app

        app = create_app(config)
    except ConfigError as exc:
        listener.close()
        print(f"prefixgate: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except RuleError as exc:  # names file, line and rule id
        listener.close()
        print(f"prefixgate: bad rules: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except BaseException:
        listener.close()
        raise
    import uvicorn

    from gateway.http.server_protocol import coalescing_protocol

    loop = event_loop()
    protocol = coalescing_protocol()
    logging.getLogger("prefixgate.server").info(
        "event loop: %s; HTTP protocol: %s",
        loop,
        "httptools, head and body in one write" if protocol else "auto",
    )
    url = serving_url(listener)

    grace_s = config.server.shutdown_grace_s

    class Server(uvicorn.Server):
        """uvicorn's server, saying where it answers once the lifespan (the model loads) has started, and
        starting the gateway's shutdown drain (``gateway.service.shutdown``) when told to exit."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self.serving_loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started:
                log_ready(url)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            gateway = getattr(app.state, "gateway", None)
            loop = getattr(self, "serving_loop", None)
            if gateway is not None and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(gateway.drain.begin, grace_s)

    server = Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            loop=loop,
            http=protocol or "auto",
            log_config=None,
            log_level=log_level,
            access_log=False,  # gateway.service.request_log writes one line per request instead
            # past the drain's grace period: the requests it ends still write their error and end
            timeout_graceful_shutdown=grace_s + SHUTDOWN_MARGIN_S,
        )
    )
    quiet = _QuietStartFailure(app)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    gc.freeze()  # what start-up built (modules, rule sets, tables) is skipped by every later collection
    try:
        server.run(sockets=[listener])  # the models load in the app's lifespan, after the bind above
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on (as ``uvicorn.run`` does)
        pass
    except SystemExit:  # uvicorn's exit (3) when the lifespan failed: ours below
        pass
    finally:
        gc.unfreeze()
        listener.close()
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    error = getattr(app.state, "start_error", None)
    if error is not None:  # a model setting its checkpoint refused (gateway.http.app's lifespan)
        print(f"prefixgate: bad config: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # any other failed start-up (a model that did not load) was logged by uvicorn
    return 0 if server.started else EXIT_RUNTIME_FAILURE


class _QuietStartFailure(logging.Filter):
    """Drops uvicorn's error records (the lifespan's traceback, "Application startup failed") once the app's
    start failed on a config error (``app.state.start_error``), which ``serve`` prints as one line instead."""

    def __init__(self, app: object) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for an error record after a config error at start."""
        failed = getattr(self.app.state, "start_error", None) is not None
        return not (failed and record.levelno >= logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
