"""Which backend serves a config model entry: one factory per entry class, written out in ``create_backend``.

Each backend module has a ``create_*_backend(entry)`` factory that reads its own entry class
(``EmbeddedModel``, ``OpenAIUpstream``, ``AnthropicUpstream``). Importing the embedded backend does not import
torch (the engine is imported when the backend starts), so the table needs no lazy module loading.
"""

from __future__ import annotations

from gateway.backends.anthropic_upstream import create_anthropic_backend
from gateway.backends.base import Backend
from gateway.backends.embedded import create_embedded_backend
from gateway.backends.openai_upstream import create_openai_backend
from gateway.config.schema import AnthropicUpstream, EmbeddedModel, ModelEntry, OpenAIUpstream


def create_backend(model: ModelEntry) -> Backend:
    """Build (not start) the backend for one model entry.

    Raises:
        TypeError: ``model`` is not one of the ``ModelEntry`` classes (a programming error: the loader builds
            only those).
    """
    match model:
        case EmbeddedModel():
            return create_embedded_backend(model)
        case OpenAIUpstream():
            return create_openai_backend(model)
        case AnthropicUpstream():
            return create_anthropic_backend(model)
    raise TypeError(f"no backend for a {type(model).__name__} entry")
