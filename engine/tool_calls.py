"""The generic tool-call format: tools rendered into the prompt for checkpoints whose chat template has no tool
section, tool calls and results in history rendered back the same way, and the parser of the model's calls.

The format is Hermes' (NousResearch Hermes 2 Pro function calling; Qwen2.5's chat template uses the same tags),
spelled out in ``docs/tools.md``:

- tools: a ``# Tools`` preamble with one canonical JSON line per tool inside ``<tools></tools>``, placed before
  the system text (in the first system message, created when there is none);
- a call: ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``; several calls are separated by
  ``\\n``; text may come before the first call;
- a result: a user turn holding ``<tool_response>\\nCONTENT\\n</tool_response>``, one per ``tool`` message
  (consecutive ones in one turn, in call order).

Invariants: the same tools render to the same bytes every time (``canonical_json``: keys sorted, ``", "`` and
``": "`` separators, no ASCII escaping; tool order kept, as the client sent it or as the rules sorted it), and an
assistant turn with calls renders exactly as the constrained model writes it (``render_call``), so a resent
conversation reproduces the tokens the model generated.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jiter

from engine.errors import InvalidRequestError

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
CALL_MARKERS = (CALL_SEPARATOR + CALL_OPEN, CALL_OPEN)
"""Where the text of an answer ends and call markup begins (the separator before the first call included): stop
strings apply to the text before the earliest of them, never to calls (``engine.detokenizer``)."""
RESPONSE_OPEN = "<tool_response>\n"
RESPONSE_CLOSE = "\n</tool_response>"

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def canonical_json(value: object) -> str:
    """The canonical JSON text of ``value``: keys sorted, ``", "`` / ``": "`` separators, non-ASCII kept."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def call_json(value: object) -> str:
    """JSON text as the constrained model writes it: key order kept, ``", "`` / ``": "`` separators."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class FunctionTool:
    """One function tool: ``name``, ``description`` (may be empty), ``parameters`` (a JSON Schema object) and
    ``strict`` (OpenAI's ``function.strict``: calls must conform to the schema, so a schema constrained decoding
    cannot enforce is refused rather than loosened, ``engine.constrained.ConstraintCompiler.grammar``; the
    Anthropic face carries its tools' ``strict`` there). ``strict`` is not rendered into the prompt."""

    name: str
    description: str
    parameters: dict
    strict: bool = False

    def as_openai(self) -> dict:
        """``{"type": "function", "function": {...}}``, the form rendered into the prompt."""
        fn: dict = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def function_tools(tools: Sequence[object]) -> list[FunctionTool]:
    """Normalize OpenAI tools (``{"type": "function", "function": {...}}``) or bare function objects.

    A missing ``parameters`` means no arguments (``{"type": "object", "properties": {}}``, as OpenAI). A schema
    whose root ``type`` is not ``"object"`` is refused, as OpenAI and Anthropic refuse it (arguments are an
    object; before, a forced call under ``{"type": "array"}`` was written, dropped by the parser, and answered
    as a stop with neither call nor text); one with no root ``type`` is kept as sent (the grammar adds it).

    Raises:
        InvalidRequestError: ``param="tools"``: not a list of objects, a tool of another type, a missing or
            non-string name, ``parameters`` that is not an object or types its root as anything but an object;
            ``param="tools[i].function.name"``: the
            second tool of a name.
    """
    if not isinstance(tools, list | tuple):
        raise InvalidRequestError("tools must be a list of function tools", "tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"tools[{i}] must be an object", "tools")
        fn = tool
        if "function" in tool or "type" in tool:
            if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
                raise InvalidRequestError(f"tools[{i}] must be a function tool", "tools")
            fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}] needs a function name", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].parameters must be a JSON Schema object", "tools")
        if "type" in params and params["type"] != "object":  # arguments are an object (both providers' rule)
            raise InvalidRequestError(
                f"Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"', "
                f"got 'type: {json.dumps(params['type'])}'.",
                "tools",
            )
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise InvalidRequestError(f"tools[{i}].description must be a string", "tools")
        out.append(FunctionTool(name, desc, params, strict=fn.get("strict") is True))
    seen: dict[str, int] = {}
    for i, tool in enumerate(out):
        if tool.name in seen:
            raise InvalidRequestError(
                f"tool names must be unique: tools[{i}] is named {tool.name!r}, as tools[{seen[tool.name]}] is",
                f"tools[{i}].function.name",
            )
        seen[tool.name] = i
    return out


def render_tools_prompt(tools: Sequence[FunctionTool]) -> str:
    """The tool preamble: one canonical JSON line per tool, in order, then the call instructions."""
    lines = "\n".join(canonical_json(t.as_openai()) for t in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS


CALL_TAIL = "}"
"""What closes a call body after its arguments (``call_head`` opens it)."""


def call_head(name: str) -> str:
    """The text of a call body before its arguments: ``{"name": NAME, "arguments": `` (NAME as ``call_json``)."""
    return '{"name": ' + call_json(name) + ', "arguments": '


def render_call(name: str, arguments: object) -> str:
    """One call block, byte for byte what the constrained model writes (``engine.constrained`` builds its
    grammar from the same ``call_head`` / ``CALL_TAIL``)."""
    return CALL_OPEN + call_head(name) + call_json(arguments) + CALL_TAIL + CALL_CLOSE


def _history_call(call: object, index: int) -> str:
    """One earlier call of an assistant turn as its call block (``render_call``). Arguments that are not valid
    JSON are a call cut by ``max_tokens`` as this engine returns it (``ToolCall.complete`` False: the
    arguments' text as far as the model wrote it): its text goes in verbatim after ``call_head``, so the
    resent turn renders the tokens the model wrote and their KV stays cached, then ``CALL_TAIL`` closes it.

    Raises:
        InvalidRequestError: a call that is not an object, or without a function name.
    """
    if not isinstance(call, dict):
        raise InvalidRequestError(f"tool_calls[{index}] must be an object", "messages")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"tool_calls[{index}] needs a function name", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return CALL_OPEN + call_head(name) + args + CALL_TAIL + CALL_CLOSE
    return render_call(name, args)


def render_messages_with_tools(messages: Sequence[dict], tools: Sequence[FunctionTool] | None) -> list[dict]:
    """Messages for a chat template without a tool section: the tool preamble before the system text, an
    assistant turn's ``tool_calls`` appended to its content as call blocks, and ``tool`` messages as user turns
    of ``<tool_response>`` blocks (consecutive results merged into one turn).

    Args:
        messages: OpenAI chat messages (already checked to be objects; ``content`` may be None or text).
        tools: the tools, or None/empty when the request has none (history may still hold calls).

    Raises:
        InvalidRequestError: a malformed tool call in history.
    """
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        text = content if isinstance(content, str) else ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_history_call(c, i) for i, c in enumerate(m["tool_calls"])]
            body = CALL_SEPARATOR.join(calls)
            msg = {k: v for k, v in m.items() if k != "tool_calls"}
            msg["content"] = (text + CALL_SEPARATOR if text else "") + body
            out.append(msg)
        elif role == "tool":
            block = RESPONSE_OPEN + text + RESPONSE_CLOSE
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        preamble = render_tools_prompt(tools)
        if out and out[0].get("role") == "system":
            system = out[0].get("content")
            system = system if isinstance(system, str) else ""
            out[0] = {**out[0], "content": preamble + ("\n\n" + system if system else "")}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# ---- parsing the model's output ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``id`` (``call_`` + 24 hex digits), function ``name``, ``arguments`` (parsed JSON object)
    and ``arguments_json`` (its JSON text, as OpenAI's ``function.arguments``).

    ``complete`` is False for a call ``max_tokens`` cut inside its arguments (``ToolCallParser.finish``):
    ``arguments_json`` is then the arguments' text as far as the model wrote it (not valid JSON; empty when
    the cut came right after the name), and ``arguments`` what of it parses in jiter's partial mode, as the
    OpenAI and Anthropic SDKs read a cut stream (an unfinished string, number or literal is left out; ``{}``
    when nothing is complete)."""

    id: str
    name: str
    arguments: dict
    arguments_json: str
    complete: bool = True


@dataclass(frozen=True)
class ContentDelta:
    """Plain text of the answer (OpenAI ``content``, Anthropic ``text`` block)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call began: its place among the answer's calls, its id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """More JSON text of call ``index``'s arguments (the concatenation is ``ToolCall.arguments_json``'s source)."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``index`` is complete and parsed."""

    index: int
    call: ToolCall


ParseEvent = ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
"""The head of a call cut after its complete name but before its arguments began."""


def new_call_id() -> str:
    """A fresh call id: ``call_`` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """Incremental parser of the model's output in the generic format: text, then call blocks.

    Feed text deltas as they stream (``feed``), then ``finish``; each returns the events of the text seen so
    far. Text that may be the start of ``<tool_call>`` is held back until it is decided. Inside a call, the
    function name is announced once the head ``{"name": ..., "arguments": `` is complete, and the arguments
    stream as they arrive (a JSON-aware brace count finds their end). A block whose JSON does not parse, or is
    not ``{"name": str, "arguments": object}``, is given back as content when it closes (possible only for
    unconstrained output; constrained output always parses).

    With ``json_answer`` (a response format sent with tools: the grammar allows calls, or a JSON answer and
    nothing else, ``engine.constrained.tool_call_grammar``) the output's first character decides: ``<`` opens a
    call and the output is calls, parsed as above; anything else begins the JSON answer, which is all content,
    passed on as it arrives (nothing held back: it never holds call markup, a JSON string cannot hold the raw
    newline of ``<tool_call>\\n``), cut by ``max_tokens`` or not.

    Args:
        new_id: makes call ids (tests pass a deterministic one).
        json_answer: the output is either calls or a JSON answer (see above).
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id, json_answer: bool = False) -> None:
        self.new_id = new_id
        self.json_answer = json_answer
        self._answering = False  # json_answer and the output began as an answer: all of it is content
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False
        self._opened = False  # a call block began (text after one is never more than further calls)
        self._started: ToolCallStart | None = None
        self._args_sent = 0  # characters of the arguments already emitted
        self._args_done = False

    def feed(self, text: str) -> list[ParseEvent]:
        """Events for ``text`` appended to the output."""
        if self.json_answer and not self._opened and not self._buf and text and not text.startswith("<"):
            self._answering = True
        if self._answering:
            return [ContentDelta(text)] if text else []
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if not self._in_call:
                i = self._buf.find(CALL_OPEN)
                if i < 0:
                    keep = max(
                        _partial_suffix(self._buf, CALL_SEPARATOR + CALL_OPEN),
                        _partial_suffix(self._buf, CALL_OPEN),
                    )
                    emit = self._buf[: len(self._buf) - keep]
                    if emit:
                        events.append(ContentDelta(emit))
                    self._buf = self._buf[len(emit) :]
                    return events
                before = self._buf[:i]
                if before.endswith(CALL_SEPARATOR):
                    before = before[: -len(CALL_SEPARATOR)]
                if before:
                    events.append(ContentDelta(before))
                self._buf = self._buf[i + len(CALL_OPEN) :]
                self._opened = True
                self._in_call, self._started, self._args_sent, self._args_done = True, None, 0, False
            j = self._buf.find(CALL_CLOSE)
            if j < 0:
                events.extend(self._stream_call(self._buf))
                return events
            block, self._buf = self._buf[:j], self._buf[j + len(CALL_CLOSE) :]
            events.extend(self._stream_call(block))
            events.extend(self._close_call(block))
            self._in_call = False

    def finish(self, cut: bool = False) -> list[ParseEvent]:
        """Events for the end of the output.

        An unclosed call whose arguments are complete (a JSON object: only the closing ``}`` and
        ``</tool_call>`` are missing, as when ``max_tokens`` cut the output there) ends as a call. When
        ``cut``, a call cut after its name but inside (or before) its arguments also ends as a call, marked
        ``complete=False``, its ``arguments_json`` the text written so far (OpenAI returns a cut call so, with
        finish reason ``length``). A call cut before its name is complete is no call (``calls`` does not list
        it); no unclosed call is ever content: the constrained grammar (``engine.constrained.tool_call_grammar``)
        lets only a call follow ``<tool_call>``, so its text is always a cut call's markup.

        Held-back text that may begin a call tag (a proper prefix of ``\n<tool_call>\n``) is content only
        when the output ended by itself (``cut`` False) before any call began (the grammar allows nothing but
        further calls after one); otherwise it is the cut start of the next call's markup, and dropped.

        Args:
            cut: the output was cut by ``max_tokens`` (finish reason ``length``).
        """
        events: list[ParseEvent] = []
        if self._in_call:
            if self._started is None and cut:
                events.extend(self._start_cut_call())
            if self._started is not None and self._args_done:
                events.extend(self._end_unclosed_call())
            elif self._started is not None and cut:
                events.extend(self._end_cut_call())
            self._in_call = False
        elif self._buf and not cut and not self._opened:
            events.append(ContentDelta(self._buf))
        self._buf = ""
        return events

    def _stream_call(self, body: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._started is None:
            head = _HEAD.match(body)
            if head is None:
                return events
            try:
                name = json.loads('"' + head.group(1) + '"')
            except json.JSONDecodeError:
                return events
            self._started = ToolCallStart(len(self.calls), self.new_id(), name)
            self._args_start = head.end()
            events.append(self._started)
        if self._args_done:
            return events
        args = body[self._args_start :]
        end = _json_value_end(args)
        upto = end if end is not None else len(args)
        if upto > self._args_sent:
            events.append(ToolCallArgumentsDelta(self._started.index, args[self._args_sent : upto]))
            self._args_sent = upto
        self._args_done = end is not None
        return events

    def _start_cut_call(self) -> list[ParseEvent]:
        """Announce a call cut after its name, before its arguments (``"arguments": `` not yet complete)."""
        head = _NAME.match(self._buf)
        if head is None:
            return []
        try:
            name = json.loads('"' + head.group(1) + '"')
        except json.JSONDecodeError:
            return []
        self._started = ToolCallStart(len(self.calls), self.new_id(), name)
        self._args_start = len(self._buf)  # no arguments text
        return [self._started]

    def _end_cut_call(self) -> list[ParseEvent]:
        """End a call cut inside its arguments: the text so far, and what of it parses (partial mode)."""
        start = self._started
        assert start is not None
        raw = self._buf[self._args_start :]
        try:
            arguments = jiter.from_json(raw.encode(), partial_mode=True) if raw.strip() else {}
        except ValueError:
            arguments = {}
        call = ToolCall(
            start.id, start.name, arguments if isinstance(arguments, dict) else {}, raw, complete=False
        )
        self.calls.append(call)
        return [ToolCallEnd(start.index, call)]

    def _end_unclosed_call(self) -> list[ParseEvent]:
        start = self._started
        assert start is not None
        args = self._buf[self._args_start :]
        end = _json_value_end(args)
        try:
            arguments = json.loads(args[:end]) if end is not None else None
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return []
        call = ToolCall(start.id, start.name, arguments, call_json(arguments))
        self.calls.append(call)
        return [ToolCallEnd(start.index, call)]

    def _close_call(self, block: str) -> list[ParseEvent]:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            obj = None
        ok = (
            isinstance(obj, dict)
            and set(obj) == {"name", "arguments"}
            and isinstance(obj["name"], str)
            and isinstance(obj["arguments"], dict)
            and self._started is not None
        )
        if not ok:
            if self._started is not None:
                return []  # announced already: the call stays open-ended; ``calls`` does not list it
            return [ContentDelta(CALL_OPEN + block + CALL_CLOSE)]
        start = self._started
        call = ToolCall(start.id, obj["name"], obj["arguments"], call_json(obj["arguments"]))
        self.calls.append(call)
        return [ToolCallEnd(start.index, call)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _json_value_end(text: str) -> int | None:
    """End offset of the JSON object or array that starts ``text`` (after optional whitespace), or None while
    it is incomplete (or ``text`` does not start with one). Counts brackets outside strings, escapes honoured."""
    depth = 0
    in_string = escaped = False
    started = False
    for k, ch in enumerate(text):
        if not started:
            if ch.isspace():
                continue
            if ch not in "{[":
                return None
            started = True
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def parse_tool_calls(
    text: str, new_id: Callable[[], str] = new_call_id, cut: bool = False, json_answer: bool = False
) -> tuple[str, list[ToolCall]]:
    """The whole output at once: ``(content, calls)`` (content is the text outside call blocks; ``cut``: the
    output was cut by ``max_tokens``, see ``ToolCallParser.finish``; ``json_answer``: calls or a JSON answer,
    see ``ToolCallParser``)."""
    parser = ToolCallParser(new_id, json_answer=json_answer)
    events = parser.feed(text) + parser.finish(cut=cut)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, parser.calls
