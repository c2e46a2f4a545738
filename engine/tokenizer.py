"""The checkpoint's own tokenizer and chat template.

Built with the ``tokenizers`` library from either

- a GGUF file's metadata (``tokenizer.ggml.*``, keys as llama.cpp writes them): ``tokenizer.ggml.model ==
  "gpt2"`` is byte-level BPE from the stored tokens and merges, with the pre-tokenizer that
  ``tokenizer.ggml.pre`` names (the regex sequences of llama.cpp's ``src/llama-vocab.cpp``; e.g. ``smollm`` =
  every digit on its own, then the GPT-2 split); control tokens become special added tokens; or
- a Hugging Face folder's ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``).

Chat templates render exactly as ``transformers``' ``apply_chat_template`` renders them
(``transformers/utils/chat_template_utils.py``): a jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag, transformers'
``tojson`` filter (no HTML escaping, ``ensure_ascii=False``), ``raise_exception``, ``strftime_now``, a plain
``dict`` and a ``namespace`` that refuses underscore names; the variables are ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...). Messages
are normalized the same way (keys whose value is None dropped, reasoning fields aliased); in addition, and
unlike transformers, a ``content`` given as a list of ``{"type": "text", "text": ...}`` parts is joined with
``"\\n"`` into one string first (as vLLM does), so string-only templates accept OpenAI content parts.
``render_chat`` encodes the rendered text without adding special tokens, as transformers does (the template
writes BOS itself when the model wants one), except that the text of a special token written inside a message or
tool string is encoded as text, never as that token, so no message can forge a turn (``engine.special_text``;
prompts whose strings hold none get the ids of the whole text, as before). ``encode(add_special_tokens=True)`` (raw prompts) follows the
checkpoint's BOS rule: ``tokenizer.json``'s post-processor (transformers v5 ignores ``add_bos_token`` in
``tokenizer_config.json`` when a ``tokenizer.json`` exists, and so do we), or GGUF's
``tokenizer.ggml.add_bos_token`` / ``add_eos_token``.

Tools for every model: when the template reads ``tools`` (``template_renders_tools``), tools, tool calls and
tool results go to it as given; when it does not (SmolLM2's), they are rendered in the generic format of
``engine.tool_calls`` (``docs/tools.md``) into plain system / assistant / user messages first, and
``tool_format`` is ``"generic"``: the model's calls are then parsed with ``engine.tool_calls.ToolCallParser``
and constrained with a ``"tool_calls"`` ``engine.api.Constraint``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine import backend_encode
from engine.chat_template import GenerationTag, compile_chat_template, normalize_message
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.piece_memo import PieceMemo
from engine.served_turns import ServedTurns
from engine.special_text import SpecialText
from engine.tool_calls import function_tools, render_messages_with_tools

# GPT-2's split (llama.cpp "gpt2"/"default" BPE; the ByteLevel pre-tokenizer's own regex).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
SUPPORTED_GGUF_PRE = ("default", "gpt2", "gpt-2", "smollm", *_LLAMA3_PRE, *_QWEN2_PRE)

# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE (Radford et al. 2019, ``encoder.py``)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer that llama.cpp's ``tokenizer.ggml.pre`` value stands for.

    Raises:
        UnsupportedModelError: a ``pre`` value not in ``SUPPORTED_GGUF_PRE``.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_PRE)})"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Post-processor adding BOS and/or EOS around one sequence (transformers' ``update_post_processor``)."""
    single = " ".join([*(f"{bos[0]}:0" for _ in [0] if bos), "$A:0", *(f"{eos[0]}:0" for _ in [0] if eos)])
    pair = (
        single
        + " "
        + " ".join([*(f"{bos[0]}:1" for _ in [0] if bos), "$B:1", *(f"{eos[0]}:1" for _ in [0] if eos)])
    )
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t]
    )


class Tokenizer:
    """A checkpoint's tokenizer plus its chat template. Build with ``from_gguf_metadata`` or ``from_hf_folder``.

    Args:
        backend: the ``tokenizers.Tokenizer`` (normalizer, pre-tokenizer, model, post-processor, decoder).
        chat_template: jinja2 source, a ``{name: source}`` dict (transformers' named templates), or None.
        special_tokens: ``{"bos_token": str, "eos_token": str, ...}`` passed to the template.
        eos_token_ids: token ids that end generation.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | dict[str, str] | None,
        special_tokens: dict[str, str],
        eos_token_ids: Sequence[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._compiled: dict[str, jinja2.Template] = {}
        self.served = ServedTurns(backend)
        """The turns the engine served whose ids are not their text's canonical encoding
        (``engine.served_turns``): the engine records them, ``pieces`` gives them back in prompts."""
        self.pieces = PieceMemo(backend, served=self.served)
        """The memo of encoded pieces between special tokens (``engine.piece_memo``) ``render_chat`` and
        ``encode_with_offsets`` use."""
        self.special_text = SpecialText(backend)
        """Finds the special tokens' texts in messages and encodes them as text (``engine.special_text``)."""

    # ----- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, object]) -> Tokenizer:
        """Tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Raises:
            UnsupportedModelError: no tokenizer in the file, a tokenizer model other than ``gpt2`` (byte-level
                BPE), or an unknown pre-tokenizer (named).
        """
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise UnsupportedModelError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        pre = meta.get("tokenizer.ggml.pre")
        pre_tok = gguf_pre_tokenizer(pre)
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        model = models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE
        )
        backend = BackendTokenizer(model)
        backend.pre_tokenizer = pre_tok
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == _CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == _USER_DEFINED and t in vocab
        ]
        backend.add_special_tokens(control)
        backend.add_tokens(user)

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        special = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
        }
        bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and special["bos_token"] is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and special["eos_token"] is not None
        backend.post_processor = bos_eos_processor(
            (special["bos_token"], int(bos_id)) if add_bos else None,
            (special["eos_token"], int(eos_id)) if add_eos else None,
        )
        eos = [
            meta.get(k)
            for k in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
        ]
        return cls(
            backend, meta.get("tokenizer.chat_template"), special, [int(e) for e in eos if e is not None]
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Tokenizer of a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``).

        ``eos_token_ids`` (e.g. from config.json / generation_config.json) are added to the EOS token's id.

        Raises:
            UnsupportedModelError: no ``tokenizer.json`` (slow-only tokenizers are not supported) or unreadable.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{folder} has no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:
            raise UnsupportedModelError(f"cannot read {path}: {e}") from e
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise UnsupportedModelError(f"cannot read {cfg_path}: {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # transformers' named templates
            template = {t["name"]: t["template"] for t in template}
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {name: _token_content(cfg.get(name)) for name in _SPECIAL_NAMES}
        # As transformers (v5) does: with a tokenizer.json, its post-processor alone decides BOS/EOS;
        # tokenizer_config's add_bos_token / add_eos_token are ignored.
        eos_ids = list(eos_token_ids)
        if special["eos_token"] is not None and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.insert(0, backend.token_to_id(special["eos_token"]))
        return cls(backend, template, special, eos_ids)

    # ----- tokens -------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the checkpoint's BOS/EOS rule. A long text is
        encoded with the GIL released (``engine.backend_encode``)."""
        return backend_encode.encode(self.backend, text, add_special_tokens).ids

    def encode_with_offsets(self, text: str, scope: str = "") -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added) and the start character of each, as
        ``backend.encode(text).offsets`` gives them; the pieces between special tokens memoized under ``scope``
        (the caller's tenant, ``engine.piece_memo``), served replies of ``scope`` with their served ids, as
        ``render_chat`` gives them for a chat whose strings hold no special token's text (the text alone does not
        say which special tokens came from messages: ``render_chat_text`` and ``encode_chat`` do)."""
        return self.pieces.encode(text, scope)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (incomplete UTF-8 sequences come out as U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level spelling), or None when out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (the EOS token first)."""
        return self._eos_token_ids

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (skipped by ``decode(skip_special_tokens=True)``)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # ----- chat ---------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def template_renders_tools(self) -> bool:
        """True when the chat template reads the ``tools`` variable (or has a ``tool_use`` named template).
        Worked out once per template source, so a changed ``chat_template`` is seen."""
        source = self.chat_template
        if isinstance(source, dict):
            if "tool_use" in source:
                return True
            source = source.get("default")
        if not source:
            return False
        cache = self.__dict__.setdefault("_renders_tools", {})
        if source not in cache:
            env = jinja2.Environment(extensions=[GenerationTag, jinja2.ext.loopcontrols])
            try:
                cache[source] = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
            except jinja2.TemplateSyntaxError:
                cache[source] = False
        return cache[source]

    @property
    def tool_format(self) -> str:
        """``"template"`` when the chat template renders tools itself, else ``"generic"`` (``engine.tool_calls``)."""
        return "template" if self.template_renders_tools else "generic"

    def _template(self, tools) -> jinja2.Template:
        source = self.chat_template
        if isinstance(source, dict):
            if tools is not None and "tool_use" in source:
                source = source["tool_use"]
            elif "default" in source:
                source = source["default"]
            else:
                raise InvalidRequestError(
                    f"the checkpoint has named chat templates {sorted(source)} but no default"
                )
        if not source:
            raise InvalidRequestError(
                "this model has no chat template; send a raw prompt (/v1/completions) instead of messages",
                "messages",
            )
        if source not in self._compiled:
            try:
                self._compiled[source] = compile_chat_template(source)
            except jinja2.TemplateSyntaxError as e:
                raise UnsupportedModelError(f"the checkpoint's chat template does not compile: {e}") from e
        return self._compiled[source]

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text the chat template renders for ``messages`` (and ``tools``, OpenAI JSON schemas).

        A template that does not read ``tools`` gets them, and any tool calls / results in ``messages``, in the
        generic format (module docstring).
        ``continue_final_message``: the last message (an assistant prefill) is left open: the text is cut right
        after its content, without the template's end-of-turn, so generation continues it (no generation
        prompt is added). Cut as ``transformers``' ``apply_chat_template(continue_final_message=True)``
        cuts: after the last occurrence of the content (its trailing spaces kept where the template keeps them).

        Raises:
            InvalidRequestError: no chat template, empty/ill-formed messages, or the template rejected them
                (its ``raise_exception``); a final message to continue whose content the template did not
                render verbatim.
        """
        if continue_final_message:
            rendered, _, end = self._continued(messages, tools)
            return rendered[:end]
        template = self._template(tools)
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        chat = [normalize_message(m, i) for i, m in enumerate(messages)]
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise InvalidRequestError("tools must be JSON schema objects", "tools")
        has_tool_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in chat)
        if (tools or has_tool_history) and not self.template_renders_tools:
            chat = render_messages_with_tools(chat, function_tools(list(tools)) if tools else None)
            tools = None
        try:
            return template.render(
                messages=chat,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from e
        except (TypeError, KeyError, AttributeError) as e:
            raise InvalidRequestError(
                f"the chat template could not render the messages: {e}", "messages"
            ) from e

    def continued_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The final message's text that ``apply_chat_template(..., continue_final_message=True)`` ends with: its
        content without leading whitespace, and without trailing whitespace where the template trims it (what
        a constrained continuation continues: ``engine.constrained.prefilled``).

        Raises:
            InvalidRequestError: as ``apply_chat_template`` with ``continue_final_message``.
        """
        rendered, start, end = self._continued(messages, tools)
        return rendered[start:end]

    def _continued(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> tuple[str, int, int]:
        """The chat rendered whole without a generation prompt, and where in it the final message's content
        is, ``[start, end)``, as ``transformers``' ``continue_final_message`` finds it: the last occurrence of
        the stripped content, its trailing spaces kept where the template keeps them."""
        rendered = self.apply_chat_template(messages, tools, add_generation_prompt=False)
        final = normalize_message(messages[-1], len(messages) - 1).get("content")
        final = final if isinstance(final, str) else ""
        if not final.strip() or final.strip() not in rendered:
            raise InvalidRequestError(
                "the final assistant message cannot be continued: the chat template does not render "
                "its content verbatim",
                f"messages[{len(messages) - 1}].content",
            )
        start = rendered.rindex(final.strip())
        kept = len(final.lstrip())
        if rendered[start : start + kept] != final.lstrip():  # the template trimmed trailing spaces
            kept = len(final.strip())
        return rendered, start, start + kept

    def render_chat(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        continue_final_message: bool = False,
        scope: str | None = "",
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered chat (generation prompt added unless ``add_generation_prompt`` is False, or
        the final message left open, see ``apply_chat_template``), encoded without adding special tokens: equal
        to ``encode(text)``, the pieces between special tokens (a system prompt, earlier turns) taken from the
        memo of ``scope`` (the caller's tenant) when they were encoded before (``engine.piece_memo``), except
        that a reply the engine served in ``scope`` keeps the ids it was served with (``engine.served_turns``;
        they decode to the same text), and that the text of a special token written inside a message or tool
        string is encoded as text, never as that token (``engine.special_text``). ``scope=None``: no memo nor
        served turns, the backend's encode.

        Raises:
            InvalidRequestError: as ``apply_chat_template``; messages holding a special token's text that the
                template does not render verbatim.
        """
        text, literal = self.render_chat_text(messages, tools, continue_final_message, add_generation_prompt)
        return self.encode_chat(text, literal, scope)

    def render_chat_text(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
    ) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The rendered chat (``apply_chat_template``) and the ``(start, end)`` character spans of the special
        tokens' texts in it that came from message or tool strings (``engine.special_text``; ``()`` for every
        prompt whose strings hold none: then the text is rendered once, as before).

        Raises:
            InvalidRequestError: as ``apply_chat_template``; messages holding a special token's text that the
                template does not render verbatim.
        """
        flags = {
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "continue_final_message": continue_final_message,
        }
        text = self.apply_chat_template(messages, tools, **flags)
        masked_messages, in_messages = self.special_text.mask(list(messages))
        masked_tools, in_tools = self.special_text.mask(tools)
        if not in_messages and not in_tools:
            return text, ()
        masked = self.apply_chat_template(masked_messages, masked_tools, **flags)
        return text, self.special_text.literal_spans(text, masked)

    def encode_chat(
        self, text: str, literal: Sequence[tuple[int, int]] = (), scope: str | None = ""
    ) -> list[int]:
        """Token ids of a rendered chat (``render_chat_text``): the special tokens' texts at ``literal`` encoded
        as text, the rest by the piece memo of ``scope`` (``scope=None``: the backend's encode)."""
        if scope is None:
            return self.special_text.encode_ids(text, literal, self.encode)
        return self.special_text.encode_ids(text, literal, lambda part: self.pieces.encode_ids(part, scope))

    def encode_chat_with_offsets(
        self, text: str, literal: Sequence[tuple[int, int]] = (), scope: str = ""
    ) -> tuple[list[int], list[int]]:
        """``encode_chat(text, literal, scope)`` and the start character of each token (``encode_with_offsets``)."""
        return self.special_text.encode(text, literal, lambda part: self.pieces.encode(part, scope))


def _token_content(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an ``AddedToken`` dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
