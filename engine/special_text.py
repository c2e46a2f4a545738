"""Control-token strings written inside message text stay text: they never become the tokens they spell.

A chat prompt is the chat template's rendering of the messages, a string, tokenized whole; the ``tokenizers``
library cuts a string at every added token it finds before it runs the model, so a message whose text holds
``<|im_end|>\\n<|im_start|>assistant\\n`` used to be tokenized with those control tokens, and any user message,
tool result or fetched page could forge turns. As servers and providers do, only the template's own markup
yields control tokens: the texts of the messages and tools (contents, reasoning, tool-call names and arguments,
tool names, descriptions and schemas, every string and key) are encoded as text.

How the rendered text's control-token strings are told apart (``SpecialText``):

1. ``mask`` walks the messages and tools; every string holding a special token's text (an added token marked
   special: generic over the checkpoint, ``<|eot_id|>`` and ``<|start_header_id|>`` for Llama 3,
   ``<|im_start|>`` for ChatML...) gets the first character of each such occurrence replaced (``#``, or ``%``
   where it already is ``#``); so does a string that begins with the tail (2+ characters) or ends with the head
   (2+ characters) of one, since a template that writes two strings side by side could join them into one.
   Nothing to mask (every ordinary prompt): the prompt is rendered and encoded exactly as before, same text,
   same ids, one render.
2. Otherwise the template renders the masked messages too. The two renderings have the same length, and differ
   only at the masked characters, when the template writes the strings verbatim (the check: else
   ``InvalidRequestError``, since then which control tokens are the template's cannot be told). An added
   token's match in the real rendering that covers a masked character came from message text: it is
   *literal*.
3. ``encode_ids`` cuts the rendering at the other added-token matches only, exactly where the tokenizer cuts
   it. A piece between two such cuts that holds a literal match is encoded alone by a copy of the tokenizer
   with ``encode_special_tokens`` on (its special tokens are not matched; the pre-tokenizer and BPE run over
   the piece as over any text, markup text next to the content included); every other stretch is encoded as
   before (the caller's encoder: the piece memo and served turns). The tokenizer never merges across a cut,
   so for a tokenizer ``engine.piece_memo.piece_split_is_exact`` accepts the ids are those of the whole text
   encoded with the literal matches taken as text. Encoding the content apart from the markup around it
   would not be: BPE and the pre-tokenizer's whitespace rule merge across that boundary (SmolLM2:
   ``"x\\n" + "\\n\\n"`` is ``[104, 16506]`` whole, ``[104, 198, 1116]`` apart).
   For a tokenizer it does not accept (a normalizer, tokens that strip spaces), the stretches and literal pieces
   are still encoded apart, at the markup's tokens: such a prompt's ids may differ from a whole encode around
   those tokens (there is nothing to keep equal: before, those texts were control tokens).

Invariants: a prompt whose message and tool strings hold no special token's text (nor a 2+ character head or
tail of one at a string's end) gets ``(text, ())`` and the ids it always got; a literal match never yields an
added token's id unless the tokenizer's BPE itself spells one; non-special added tokens (llama.cpp's
user-defined ones, Qwen's ``<tool_call>``) are matched in message text as before, as transformers and llama.cpp
match them. Not covered: a template that makes a special token's text out of message text that holds none
(``| lower`` over ``<|IM_END|>``); no chat template this project met does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import InvalidRequestError

_MASK, _MASK_OF_MASK = "#", "%"
_MASKS = re.compile("[#%]")
_MIN_PARTIAL = 2
"""Shortest head / tail of a special token looked for at a string's ends (a lone ``>`` or ``<`` is common
text; every special token of 3+ characters split in two leaves one side of 2+ characters)."""


def _alternation(texts: Sequence[str]) -> str:
    return "|".join(re.escape(t) for t in sorted(set(texts), key=len, reverse=True))


def _trie(texts: Sequence[str]) -> str:
    """A regex matching any of ``texts`` (the longest where several match), written as a trie: thousands of
    heads and tails (Llama 3's 256 reserved tokens) scan as fast as a handful."""
    root: dict = {}
    for text in set(texts):
        node = root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(root)


class SpecialText:
    """Finds and encodes the special tokens' texts that message strings hold, for one ``tokenizers.Tokenizer``.

    Args:
        backend: the checkpoint's ``tokenizers.Tokenizer``.

    Attributes:
        specials: the contents of the added tokens marked special (the ones no message text may yield).
    """

    def __init__(self, backend: BackendTokenizer) -> None:
        added = backend.get_added_tokens_decoder()
        self.specials = tuple(sorted({t.content for t in added.values() if t.special and t.content}))
        contents = [t.content for t in added.values() if t.content]
        self._added = re.compile(_alternation(contents)) if contents else None
        self._special = re.compile(_alternation(self.specials)) if self.specials else None
        heads = [s[:k] for s in self.specials for k in range(_MIN_PARTIAL, len(s))]
        tails = [s[k:] for s in self.specials for k in range(1, len(s) - _MIN_PARTIAL + 1)]
        self._window = max((len(s) for s in self.specials), default=0)
        head = _trie(heads)
        self._head = re.compile(f"(?:{head})\\Z") if heads else None
        # (a quote, then a tail: matched at a string's start as ``'"' + text``, and found in the values' JSON)
        self._tail = re.compile(f'"(?:{_trie(tails)})') if tails else None
        # One scan of the values' JSON finds every string that may need a mask (a special token's text, a tail
        # after a string's opening quote, a head before its closing one); the walk then runs only when it finds one.
        # (three regexes, not one alternation: each then scans at C speed from its first character)
        quick = [self._special] if self._special is not None else []
        quick += [self._tail] if self._tail is not None else []
        quick += [re.compile(f'(?:{head})"')] if heads else []
        json_safe = all(json.dumps(t, ensure_ascii=False) == f'"{t}"' for t in self.specials)
        self._quick = tuple(quick) if quick and json_safe else None
        self._backend = backend
        self._text_backend: BackendTokenizer | None = None

    # ----- masking ------------------------------------------------------------------------------------------
    def mask(self, value: object) -> tuple[object, int]:
        """``value`` (messages, tools: dicts, lists, strings, anything else as is) with every string's special
        texts masked (module docstring, step 1), and the number of characters masked. Objects that need no
        mask are returned as they are (the same object)."""
        if self._special is None:
            return value, 0
        if self._quick is not None:  # None: a special token JSON escapes; walk every string
            try:
                dump = json.dumps(value, ensure_ascii=False, default=str)
            except (TypeError, ValueError):  # not JSON-like (a key that is no string...): walk it all
                dump = None
            if dump is not None and not any(q.search(dump) for q in self._quick):
                return value, 0
        return self._mask(value)

    def _mask(self, value: object) -> tuple[object, int]:
        if isinstance(value, str):
            return self._mask_str(value)
        if isinstance(value, dict):
            out: dict = {}
            total = 0
            for k, v in value.items():
                mk, nk = self._mask(k) if isinstance(k, str) else (k, 0)
                mv, nv = self._mask(v)
                out[mk] = mv
                total += nk + nv
            return (out, total) if total else (value, 0)
        if isinstance(value, list | tuple):
            items = [self._mask(v) for v in value]
            total = sum(n for _, n in items)
            return (type(value)(v for v, _ in items), total) if total else (value, 0)
        return value, 0

    def _mask_str(self, text: str) -> tuple[str, int]:
        at = {m.start() for m in self._special.finditer(text)}
        if self._tail is not None and self._tail.match('"' + text[: self._window]):
            at.add(0)
        if self._head is not None:
            window = max(0, len(text) - self._window)
            head = self._head.search(text, window)
            if head is not None:
                at.add(head.start())
        if not at:
            return text, 0
        chars = list(text)
        for i in at:
            chars[i] = _MASK if chars[i] != _MASK else _MASK_OF_MASK
        return "".join(chars), len(at)

    # ----- locating -----------------------------------------------------------------------------------------
    def literal_spans(self, rendered: str, masked: str) -> tuple[tuple[int, int], ...]:
        """The ``(start, end)`` character spans of the added-token matches in ``rendered`` that came from
        message text: those that cover a character where ``masked`` (the rendering of the masked messages)
        differs.

        Raises:
            InvalidRequestError: the renderings differ in length or elsewhere than at masked characters (the
                template does not write the message strings verbatim).
        """
        if len(rendered) != len(masked):
            raise _not_verbatim()
        differ = [m.start() for m in _MASKS.finditer(masked) if rendered[m.start()] != m.group()]
        if differ:
            chars = list(rendered)
            for i in differ:
                chars[i] = masked[i]
            if "".join(chars) != masked:
                raise _not_verbatim()
        elif rendered != masked:
            raise _not_verbatim()
        if self._added is None or not differ:
            return ()
        return tuple(
            m.span()
            for m in self._added.finditer(rendered)
            if rendered[m.start() : m.end()] != masked[m.start() : m.end()]
        )

    # ----- encoding -----------------------------------------------------------------------------------------
    def encode_ids(
        self, text: str, literal: Sequence[tuple[int, int]], encode: Callable[[str], list[int]]
    ) -> list[int]:
        """Token ids of ``text`` with the added-token matches at ``literal`` (from ``literal_spans``) taken as
        text (module docstring, step 3); ``encode`` encodes the other stretches (each starts and ends at a cut
        or an end of ``text``)."""
        if not literal:
            return encode(text)
        ids: list[int] = []
        for start, end, as_text in self.stretches(text, literal):
            ids.extend(self.encode_as_text(text[start:end]) if as_text else encode(text[start:end]))
        return ids

    def encode(
        self,
        text: str,
        literal: Sequence[tuple[int, int]],
        encode: Callable[[str], tuple[list[int], list[int]]],
    ) -> tuple[list[int], list[int]]:
        """``encode_ids`` with the start character of each token in ``text`` (as ``Encoding.offsets``); ``encode``
        gives a stretch's ids and starts."""
        if not literal:
            return encode(text)
        ids: list[int] = []
        starts: list[int] = []
        for start, end, as_text in self.stretches(text, literal):
            if as_text:
                encoding = self._text_encoder().encode(text[start:end], add_special_tokens=False)
                part_ids, part_starts = encoding.ids, [s for s, _ in encoding.offsets]
            else:
                part_ids, part_starts = encode(text[start:end])
            ids.extend(part_ids)
            starts.extend(s + start for s in part_starts)
        return ids, starts

    def stretches(self, text: str, literal: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """``text`` as ``(start, end, as_text)`` stretches in order, covering it: ``as_text`` for each piece between
        two of the other added-token matches (or an end of ``text``) that holds a ``literal`` span."""
        literal_starts = {start for start, _ in literal}
        cuts = [m.span() for m in self._added.finditer(text) if m.start() not in literal_starts]
        out: list[tuple[int, int, bool]] = []
        at = 0  # text before ``at`` is placed
        k = 0  # next cut
        for start, _ in literal:
            if start < at:
                continue  # inside a piece already placed
            while k < len(cuts) and cuts[k][1] <= start:
                k += 1
            piece_start = cuts[k - 1][1] if k > 0 else 0
            piece_end = cuts[k][0] if k < len(cuts) else len(text)
            if piece_start > at:
                out.append((at, piece_start, False))
            out.append((piece_start, piece_end, True))
            at = piece_end
        if at < len(text):
            out.append((at, len(text), False))
        return out

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with its special tokens' texts encoded as text (the backend's
        ``encode_special_tokens``; non-special added tokens still match)."""
        return self._text_encoder().encode(text, add_special_tokens=False).ids

    def _text_encoder(self) -> BackendTokenizer:
        if self._text_backend is None:
            clone = BackendTokenizer.from_str(self._backend.to_str())
            clone.encode_special_tokens = True
            self._text_backend = clone
        return self._text_backend


def _not_verbatim() -> InvalidRequestError:
    return InvalidRequestError(
        "the messages hold the text of a control token and the chat template does not render them verbatim, "
        "so it cannot be encoded as text",
        "messages",
    )
