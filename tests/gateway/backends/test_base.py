"""The Backend base's capabilities and the config entry -> backend table (no model, no network)."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.backends.base import Backend, TokenCount, estimate_tokens
from gateway.backends.embedded import EmbeddedBackend
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.backends.registry import create_backend
from gateway.config.schema import AnthropicUpstream, EmbeddedModel, OpenAIUpstream
from gateway.core.events import Delta, Finish
from gateway.core.request import ChatRequest
from gateway.protocols.anthropic.prompt import UnsupportedContentError


class EchoBackend(Backend):
    """The smallest backend: only ``stream``."""

    def __init__(self) -> None:
        self.name = "echo"

    async def stream(self, request):
        yield Delta(text="hi")
        yield Finish("stop", usage=None)  # type: ignore[arg-type]


def request(content) -> ChatRequest:
    return ChatRequest(model="echo", messages=[{"role": "user", "content": content}], params=SamplingParams())


async def test_a_backend_gets_every_capability_from_the_base():
    backend = EchoBackend()
    await backend.start()
    count = await backend.count_tokens(request("hello there"))
    assert count == estimate_tokens(request("hello there"), "this") and count.estimate is True
    assert isinstance(count, TokenCount) and count.input_tokens > 0
    assert (backend.engine_stats(), backend.replicas(), backend.system_fingerprint()) == (None, None, None)
    await backend.close()


async def test_the_default_count_refuses_what_the_backend_cannot_take_naming_it():
    document = {"type": "x-anthropic", "block": {"type": "document", "source": {"type": "text", "data": "d"}}}
    with pytest.raises(UnsupportedContentError, match="cannot be sent to this model"):
        await EchoBackend().count_tokens(request([document]))


def test_a_backend_without_stream_cannot_be_built():
    class Incomplete(Backend):
        pass

    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]


@pytest.mark.parametrize(
    ("entry", "backend_class"),
    [
        (EmbeddedModel(name="e"), EmbeddedBackend),
        (OpenAIUpstream(name="o", base_url=("http://o.test/v1",)), OpenAIUpstreamBackend),
        (AnthropicUpstream(name="a", base_url=("http://a.test",)), AnthropicUpstreamBackend),
    ],
)
def test_each_config_entry_class_builds_its_backend(entry, backend_class):
    backend = create_backend(entry)
    assert type(backend) is backend_class and backend.name == entry.name


def test_capabilities_of_the_real_backends():
    embedded = create_backend(EmbeddedModel(name="e"))
    upstream = create_backend(OpenAIUpstream(name="o", base_url=("http://user:pw@o.test/v1",)))
    assert embedded.system_fingerprint().startswith("fp_") and embedded.engine_stats() is None
    assert embedded.replicas() is None and upstream.system_fingerprint() is None
    assert list(upstream.replicas()) == ["http://o.test/v1"]  # credentials never shown


def test_an_unknown_entry_class_is_a_type_error():
    with pytest.raises(TypeError, match="no backend for a str entry"):
        create_backend("e")  # type: ignore[arg-type]
