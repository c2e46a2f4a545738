"""Chat templates as ``transformers`` renders them, and chat messages as a template sees them.

Owns the jinja2 environment of ``transformers/utils/chat_template_utils.py``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` tag, transformers' ``tojson`` filter (no HTML escaping, ``ensure_ascii=False``),
``raise_exception``, ``strftime_now``, a plain ``dict`` and a ``namespace`` that refuses underscore names
(``compile_chat_template``); and the normalization of one message (``normalize_message``). Used by
``engine.tokenizer.Tokenizer``, whose docstring says how a chat is rendered.

Invariant: a template can read the variables it is given and nothing else (the sandbox), and cannot set an
underscore attribute on a namespace.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses it to mark assistant spans)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2 ``namespace`` that refuses underscore-prefixed attributes (as transformers')."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (module docstring)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def normalize_message(message: object, index: int) -> dict:
    """A chat message as the template sees it: None-valued keys dropped, text parts joined, reasoning aliased.

    Raises:
        InvalidRequestError: not a dict, or a content part that is not text.
    """
    if not isinstance(message, dict):
        raise InvalidRequestError(
            f"messages[{index}] must be an object, got {type(message).__name__}", "messages"
        )
    msg = {k: v for k, v in message.items() if v is not None}
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}] has type {kind!r}; only text parts are supported",
                    "messages",
                )
        msg["content"] = "\n".join(texts)
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg
