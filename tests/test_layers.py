"""Import direction between the gateway's layers, and between ``gateway``, ``engine`` and ``rules``.

The order is written down here (from issue 10 and docs/architecture.md), not read from today's imports:

    core -> config -> {protocols, transport} -> backends -> service -> http -> cli

A gateway module imports only modules of its own layer and of lower layers; ``protocols`` and ``transport``
are peers and import neither each other. Every import counts, including those inside functions and under
``if TYPE_CHECKING:`` (a lazy import is still a dependency). Also:
- only ``gateway/service/canonicalize*`` imports ``rules``;
- only ``gateway/backends/embedded*`` imports ``torch`` or an engine module that imports torch (found here by
  reading ``engine/``'s module-level imports); torch-free engine modules (``engine.api``, ``engine.errors``,
  ...) may be imported anywhere;
- ``core`` and ``protocols`` import neither Starlette nor httpx (they are unit-testable without a server);
- ``engine`` and ``rules`` never import ``gateway`` nor each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYER_ORDER: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("config",),
    ("protocols", "transport"),
    ("backends",),
    ("service",),
    ("http",),
    ("cli",),
)
"""Gateway layers, lowest first; layers in one tuple are peers (neither imports the other)."""

RANK = {layer: rank for rank, peers in enumerate(LAYER_ORDER) for layer in peers}
RULES_IMPORTERS = ("gateway.service.canonicalize",)
TORCH_IMPORTERS = ("gateway.backends.embedded",)
SERVER_FREE_LAYERS = ("core", "protocols")
SERVER_LIBRARIES = ("starlette", "httpx", "uvicorn")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``gateway/http/app.py`` -> ``gateway.http.app``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(module: str, source: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` imports, anywhere in it. ``from a import b`` yields
    ``a.b`` (``b`` may be a submodule; a name inside ``a`` is harmless: it is checked as ``a``'s layer).
    Relative imports are resolved against ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            for alias in node.names:
                yield node.lineno, f"{stem}.{alias.name}" if alias.name != "*" else stem


def layer_of(module: str) -> str | None:
    """The layer of a ``gateway`` module (``gateway.cli`` is ``cli``), None for ``gateway`` itself."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) == 1:
        return None
    return parts[1]


def torch_side(engine_sources: Mapping[str, str]) -> set[str]:
    """Engine modules that import torch when imported: ``torch`` at module level (outside functions and
    ``if TYPE_CHECKING:``), directly or through another engine module."""
    direct: dict[str, set[str]] = {}
    for module, source in engine_sources.items():
        names: set[str] = set()
        for node in _module_level(ast.parse(source).body):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        direct[module] = names
    heavy = {m for m, names in direct.items() if any(n == "torch" or n.startswith("torch.") for n in names)}
    changed = True
    while changed:
        changed = False
        for module, names in direct.items():
            if module not in heavy and names & heavy:
                heavy.add(module)
                changed = True
    return heavy


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _module_level(node.orelse)
            continue
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _module_level(child.body if isinstance(child, ast.ExceptHandler) else [child])
            continue
        yield node


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    """``module`` is one of ``prefixes`` or below one; a prefix ending in a name stem (``canonicalize``)
    also matches longer names (``canonicalize_x``), the ``*`` of the issue's ``service/canonicalize*``."""
    return any(module == p or module.startswith(p + ".") or module.startswith(p + "_") for p in prefixes)


def violations(
    sources: Mapping[str, str], heavy_engine: set[str], packages: frozenset[str] = frozenset()
) -> list[str]:
    """Every import in ``sources`` (module name -> source text) that breaks the rules of this module's
    docstring, as ``"<module>:<line> imports <name>: <rule>"``. ``heavy_engine`` is ``torch_side``'s result;
    ``packages`` names the modules that are packages (``__init__.py``), for relative imports."""
    found: list[str] = []
    for module, source in sorted(sources.items()):
        top = module.split(".")[0]
        for line, name in imported_modules(module, source, module in packages):
            target_top = name.split(".")[0]
            where = f"{module}:{line} imports {name}"
            if top in ("engine", "rules"):
                if target_top in ("gateway", "engine", "rules") and target_top != top:
                    found.append(f"{where}: {top} never imports {target_top}")
                continue
            if top != "gateway":
                continue
            layer = layer_of(module)
            if layer is not None and layer not in RANK:
                found.append(f"{module}: not in any layer of {LAYER_ORDER}")
            if target_top == "gateway":
                target_layer = layer_of(name)
                if layer is None or target_layer is None or target_layer == layer:
                    continue
                if target_layer not in RANK:
                    found.append(f"{where}: {target_layer!r} is not a layer")
                elif RANK[target_layer] >= RANK.get(layer, -1):
                    found.append(f"{where}: {layer} may import only lower layers, not {target_layer}")
            elif target_top == "rules" and not _within(module, RULES_IMPORTERS):
                found.append(f"{where}: only {', '.join(RULES_IMPORTERS)} imports rules")
            elif (target_top == "torch" or _engine_module(name, heavy_engine)) and not _within(
                module, TORCH_IMPORTERS
            ):
                found.append(f"{where}: only {', '.join(TORCH_IMPORTERS)} imports the torch side of engine")
            elif target_top in SERVER_LIBRARIES and layer in SERVER_FREE_LAYERS:
                found.append(f"{where}: {layer} imports no server or HTTP client library")
    return found


def _engine_module(name: str, heavy_engine: set[str]) -> bool:
    """``name`` (``engine.x`` or ``engine.x.Symbol``) is or lies inside a torch-side engine module."""
    return any(name == m or name.startswith(m + ".") for m in heavy_engine)


def repo_sources() -> tuple[dict[str, str], frozenset[str]]:
    sources: dict[str, str] = {}
    packages: set[str] = set()
    for package in ("gateway", "engine", "rules"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            sources[name] = path.read_text(encoding="utf-8")
            if path.name == "__init__.py":
                packages.add(name)
    return sources, frozenset(packages)


def engine_torch_side() -> set[str]:
    sources, _ = repo_sources()
    return torch_side({m: s for m, s in sources.items() if m.split(".")[0] == "engine"})


# ---- the repository ------------------------------------------------------------------------------------


def test_the_repository_follows_the_layer_order():
    sources, packages = repo_sources()
    assert violations(sources, engine_torch_side(), packages) == []


def test_every_gateway_module_lies_in_a_layer():
    sources, _ = repo_sources()
    layers = {layer_of(m) for m in sources if m.startswith("gateway.")}
    assert layers == set(RANK)


def test_engine_api_and_errors_are_torch_free_and_the_engine_proper_is_not():
    heavy = engine_torch_side()
    assert {"engine.api", "engine.errors"}.isdisjoint(heavy)
    assert "engine.async_engine" in heavy


# ---- the checker -----------------------------------------------------------------------------------------


def test_a_back_import_inside_a_function_is_reported():
    fake = {
        "gateway.core.fake": "def build():\n    from gateway.http.app import create_app\n    return "
        "create_app\n",
        "gateway.http.fine": "from gateway.core.request import ChatRequest\n",
    }
    assert violations(fake, set()) == [
        "gateway.core.fake:2 imports gateway.http.app.create_app: core may import only lower layers, not http"
    ]


def test_peer_layers_and_relative_back_imports_are_reported():
    fake = {
        "gateway.protocols.openai.fake": "from gateway.transport import sse\n",
        "gateway.backends.fake": "from ..service import pipeline\n",
    }
    assert violations(fake, set()) == [
        "gateway.backends.fake:1 imports gateway.service.pipeline: backends may import only lower layers, "
        "not service",
        "gateway.protocols.openai.fake:1 imports gateway.transport.sse: protocols may import only lower "
        "layers, "
        "not transport",
    ]


def test_rules_torch_and_server_imports_outside_their_module_are_reported():
    heavy = {"engine.async_engine"}
    fake = {
        "gateway.http.fake": "import rules\n",
        "gateway.service.canonicalize": "from rules import RuleSet\n",
        "gateway.service.fake": "from engine.async_engine import AsyncEngine\nimport engine.api\n",
        "gateway.backends.embedded": "def f():\n    from engine.async_engine import AsyncEngine\n",
        "gateway.core.fake": "from starlette.requests import Request\n",
        "engine.fake": "import gateway\nfrom rules import RuleSet\n",
        "rules.fake": "from engine import api\n",
    }
    assert violations(fake, heavy) == [
        "engine.fake:1 imports gateway: engine never imports gateway",
        "engine.fake:2 imports rules.RuleSet: engine never imports rules",
        "gateway.core.fake:1 imports starlette.requests.Request: core imports no server or HTTP client "
        "library",
        "gateway.http.fake:1 imports rules: only gateway.service.canonicalize imports rules",
        "gateway.service.fake:1 imports engine.async_engine.AsyncEngine: only gateway.backends.embedded "
        "imports "
        "the torch side of engine",
        "rules.fake:1 imports engine.api: rules never imports engine",
    ]


def test_torch_side_follows_module_level_imports_only():
    engine = {
        "engine.api": "from dataclasses import dataclass\n",
        "engine.model": "import torch\n",
        "engine.runner": "from engine.model import Model\n",
        "engine.lazy": "def load():\n    import torch\n",
        "engine.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    }
    assert torch_side(engine) == {"engine.model", "engine.runner"}


def test_the_gateway_app_and_cli_load_without_torch():
    """A gateway serving only upstreams never loads torch (~200 MB of RSS and seconds of start-up): the embedded
    backend's module may import the torch side of ``engine`` only inside functions. A module-level import of
    a torch-side engine module anywhere on the app's import path (e.g. a constant from
    ``engine.input_processor``) fails here."""
    import subprocess
    import sys

    code = (
        "import sys, gateway.cli, gateway.http.app, gateway.backends.registry; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
