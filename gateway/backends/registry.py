"""Backend registry: a config ``backend:`` kind -> the factory that builds a ``Backend`` from its model entry.

A backend module registers its factory at import time::

    @register_backend("openai")
    def create_openai_backend(model: ModelConfig) -> Backend: ...

``create_backend`` imports the module named for a kind in ``BACKEND_MODULES`` on first use (so the embedded
engine's torch import is only paid when an embedded model is configured), then calls the factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gateway.backends.base import Backend
from gateway.config.schema import ConfigError, ModelConfig

BackendFactory = Callable[[ModelConfig], Backend]

BACKEND_MODULES: dict[str, str] = {
    "embedded": "gateway.backends.embedded",
    "openai": "gateway.backends.openai_upstream",
    "anthropic": "gateway.backends.anthropic_upstream",
}
"""The module that registers each kind's factory when imported."""

_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(kind: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make ``factory`` build the backends of config kind ``kind`` (a later registration wins)."""

    def decorate(factory: BackendFactory) -> BackendFactory:
        _FACTORIES[kind] = factory
        return factory

    return decorate


def backend_factory(kind: str) -> BackendFactory:
    """The factory of ``kind``, importing its module first if needed.

    Raises:
        ConfigError: no module provides that kind (names ``backend`` and the kinds available).
    """
    if kind not in _FACTORIES and kind in BACKEND_MODULES:
        module = BACKEND_MODULES[kind]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    factory = _FACTORIES.get(kind)
    if factory is None:
        raise ConfigError(
            "<config>",
            "backend",
            f"no backend of kind {kind!r} is installed (have: {', '.join(sorted(_FACTORIES)) or 'none'})",
        )
    return factory


def create_backend(model: ModelConfig) -> Backend:
    """Build (not start) the backend for one model entry."""
    return backend_factory(model.backend)(model)
