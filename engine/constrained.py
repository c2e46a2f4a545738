"""Constrained decoding: an ``engine.api.Constraint`` becomes an llguidance grammar, and each constrained sequence
a ``ConstraintState`` whose token mask sends every forbidden logit to ``-inf`` before sampling.

**Library choice (measured).** Per-token cost of computing the next-token mask and advancing by the sampled
token, alone, with SmolLM2-135M's tokenizer (49,152 tokens) on a 48-token JSON document of a nested 4-property
schema, 5 passes, on this machine's CPU (2 cores shared with other jobs, load ~14), by ``python -m
bench.constrained`` (``*_mask_us_*``):

=====================  ==========  ===========  =========  ====================================
library                p50 (us)    mean (us)    p99 (us)   dependencies
=====================  ==========  ===========  =========  ====================================
llguidance 1.9.1       11.8        16.9         67.5       none (Rust wheel)
xgrammar 0.2.9         5.6         8.0          14.8       torch, triton, transformers
=====================  ==========  ===========  =========  ====================================

Both are far under 1% of a SmolLM2 decode step on this CPU (tens of ms or more), so the mask cost does not
decide; we use **llguidance**: it installs without pulling a second torch (xgrammar requires ``torch`` and ``triton``, which
would replace the project's CPU torch), and its Lark grammars with embedded ``%json`` schemas express the
tool-call format ("text, or calls of these tools") directly.

**Off the critical path.** A state computes its next mask in a worker thread (llguidance releases the GIL) as
soon as it has consumed a token, i.e. during the output processing of one step, so the mask is ready while the
next step is scheduled and its forward runs; sampling only waits for the (normally finished) future and
applies it (one ``masked_fill``). Measured by ``bench.constrained`` in the engine at batch 1: 262 us per token
computing masks in the worker (contended by the forward), 22 us per token waited for on the critical path.

Invariants: a state consumes exactly the tokens its sequence generated, in order; a sampled token is always
allowed by the mask it was sampled under, so consuming it never fails; when the grammar allows no token at
all (complete and unable to continue), only EOS is allowed, so the sequence ends with ``"stop"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import torch

from engine.api import Constraint
from engine.closed_schema import closed_schema
from engine.errors import InvalidRequestError
from engine.openmp_threads import serial_torch_thread
from engine.schema_instances import UNSATISFIABLE, has_finite_instance
from engine.schema_relaxation import relaxed, unsupported_only, without_trivial_keywords
from engine.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    CALL_TAIL,
    FunctionTool,
    call_head,
    function_tools,
)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options: no free whitespace (a small model otherwise loops on newlines), and
``json.dumps``' separators, so constrained JSON looks like what models were trained on."""

log = logging.getLogger(__name__)

_FORMAT_REFUSED = "Invalid 'response_format': the JSON schema is not supported by constrained decoding: "
"""The start of every refusal of a response format's schema (the Anthropic face renames the field)."""

ANY_OBJECT = {"type": "object"}
"""The arguments schema of a non-strict tool whose own schema llguidance cannot compile: any JSON object."""

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per engine (keyed by the constraint's canonical JSON)."""


def _json_schema(schema: dict) -> dict:
    """``schema`` as llguidance compiles it: trivially satisfied keywords dropped (``without_trivial_keywords``),
    objects closed by default (``engine.closed_schema``), then the JSON options (``JSON_OPTIONS``)."""
    return {**closed_schema(without_trivial_keywords(schema)), "x-guidance": JSON_OPTIONS}


def _object_root(schema: dict) -> dict:
    """A tool's parameters schema with its root typed ``object`` (arguments are an object: ``{}``, or a root of
    only ``$ref`` / ``anyOf``, admits any JSON value, and the parser drops a call whose arguments are not an
    object). ``engine.tool_calls.function_tools`` refuses a root typed otherwise."""
    return schema if "type" in schema else {"type": "object", **schema}


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def tool_call_grammar(constraint: Constraint, loose: frozenset[str] = frozenset()) -> str:
    """The Lark grammar (llguidance dialect) of a ``"tool_calls"`` constraint.

    ``auto``: text that never contains ``<tool_call>``, or text followed by calls; ``required``: calls only;
    ``function``: exactly one call, of ``tool_name`` (as vLLM's and SGLang's named function calling: a forced
    call is one call; letting a small model repeat it ran identical calls until ``max_tokens``). Calls are
    separated by ``\\n``; one at most when ``parallel_tool_calls`` is False.

    ``auto`` with the constraint's ``json_schema`` set (a response format sent with tools): calls (no text
    before them), or an answer that is an instance of that schema, its own ``%json`` sub-grammar with the same
    JSON options as a ``"json_schema"`` constraint. The two never share a first byte (a call opens with ``<``,
    which no JSON value does), so the first token decides which one the output is
    (``engine.tool_calls.ToolCallParser``'s ``json_answer``).

    A call body is Lark text around the arguments, ``{"name": NAME, "arguments": `` ARGS ``}`` (the bytes
    ``render_call`` writes), and each tool's ARGS is its own ``%json`` sub-grammar whose root is the tool's
    ``parameters`` schema exactly as the client sent it. So llguidance resolves the schema's references as
    written: ``#/$defs/X`` and ``#/definitions/X`` at any depth, ``#`` (the tool's own schema), recursive ones
    (a tree type referencing itself), and tools whose ``$defs`` share names do not see each other's. (Embedding
    each schema under a ``properties.arguments`` of one call schema, as before, moved its root and broke every
    root-relative pointer.) A pointer that does not resolve, or a remote ``$ref``, fails to compile; see
    ``ConstraintCompiler.grammar`` for the 400 naming the tool.

    ``loose`` names tools whose arguments are any JSON object (``ANY_OBJECT``) instead of their schema: the
    non-strict tools whose schema llguidance cannot compile (``ConstraintCompiler.grammar``).

    Raises:
        InvalidRequestError: no tools, bad tools, an unknown ``tool_choice``, ``tool_name`` not among them, or
            a ``json_schema`` that is not an object (``param="response_format"``).
    """
    tools = function_tools(list(constraint.tools))
    if not tools:
        raise InvalidRequestError("a tool-call constraint needs at least one tool", "tools")
    choice = constraint.tool_choice
    if choice == "function":
        tools = [t for t in tools if t.name == constraint.tool_name]
        if not tools:
            raise InvalidRequestError(
                f"tool_choice names {constraint.tool_name!r}, which is not a tool", "tool_choice"
            )
    elif choice not in ("auto", "required"):
        raise InvalidRequestError(f"unknown tool_choice {choice!r}", "tool_choice")
    parallel = constraint.parallel_tool_calls and choice != "function"
    more = f"({lark_string(CALL_SEPARATOR)} call)*" if parallel else ""
    close = lark_string(CALL_CLOSE)
    lines = [
        f"call: {lark_string(CALL_OPEN)} body {close}",
        "body: " + " | ".join(f"body_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        if not has_finite_instance(_object_root(tool.parameters)):
            raise InvalidRequestError(
                f"Invalid 'tools': the schema of tool '{tool.name}' is not supported by constrained decoding: "
                + UNSATISFIABLE,
                "tools",
            )
        head = lark_string(call_head(tool.name))
        args = ANY_OBJECT if tool.name in loose else _object_root(tool.parameters)
        lines += [
            f"body_{i}: {head} args_{i} {lark_string(CALL_TAIL)}",
            f"args_{i}: %json {json.dumps(_json_schema(args))}",
        ]
    if choice == "auto" and constraint.json_schema is not None:
        if not isinstance(constraint.json_schema, dict):
            raise InvalidRequestError("json_schema must be a JSON Schema object", "response_format")
        if not has_finite_instance(constraint.json_schema):
            raise InvalidRequestError(_FORMAT_REFUSED + UNSATISFIABLE, "response_format")
        lines += [
            f"start: answer | call {more}",
            f"answer: %json {json.dumps(_json_schema(constraint.json_schema))}",
        ]
    elif choice == "auto":
        lines += [
            f"start: TEXT | lead body {close} {more}",
            f"lead[suffix={lark_string(CALL_OPEN)}]: /(.|\\n)*/",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_regex_escape(CALL_OPEN)}(.|\\n)*/",
        ]
    else:
        lines.append(f"start: call {more}")
    return "\n".join(lines) + "\n"


def _regex_escape(text: str) -> str:
    return "".join("\\n" if c == "\n" else ("\\" + c if c in ".^$*+?()[]{}|\\/" else c) for c in text)


def grammar_for(constraint: Constraint) -> str:
    """The llguidance grammar (serialized) of a constraint.

    Raises:
        InvalidRequestError: an unknown kind, a schema that is not an object, bad tools (``param`` names the
            request field: ``response_format``, ``tools`` or ``tool_choice``).
    """
    if not isinstance(constraint, Constraint):
        raise InvalidRequestError("constraint must be an engine.api.Constraint", "response_format")
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_json_schema({"type": "object"}))
    if constraint.kind == "json_schema":
        if not isinstance(constraint.json_schema, dict):
            raise InvalidRequestError("json_schema must be a JSON Schema object", "response_format")
        if not has_finite_instance(constraint.json_schema):
            raise InvalidRequestError(_FORMAT_REFUSED + UNSATISFIABLE, "response_format")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(constraint.json_schema))
        except (ValueError, TypeError) as e:
            # llguidance's own conversion of the schema failed (an integer past 64 bits: "Value is not JSON
            # serializable"); worded as every other refused format, which the Anthropic face renames
            raise InvalidRequestError(f"{_FORMAT_REFUSED}{e}", "response_format") from e
    if constraint.kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(constraint))
    raise InvalidRequestError(f"unknown constraint kind {constraint.kind!r}", "response_format")


_LISTING_LINE = re.compile(r"\s*\d+ \| ")


def schema_problem(errors: str) -> str:
    """llguidance's reason for refusing a grammar, without its grammar listing (numbered ``N | ...`` lines and
    what follows) or the position prefix: ``Unimplemented keys: ["not"]``, ``Unknown format: x``, a regex's
    parse error... One line."""
    text = errors.split("failed to compile JSON schema: ", 1)[-1]
    kept = []
    for line in text.splitlines():
        if _LISTING_LINE.match(line):
            break
        line = line.strip()
        if line and set(line) != {"^"}:
            kept.append(line)
    return " ".join(kept) or "the schema cannot be compiled"


def _tool_refused(name: str, problem: str) -> str:
    """The message of a 400 for tool ``name``'s schema."""
    return (
        f"Invalid 'tools': the schema of tool '{name}' is not supported by constrained decoding: "
        f"{schema_problem(problem)}"
    )


def _grammar_tools(constraint: Constraint) -> list[FunctionTool]:
    """The tools a tool-call constraint's grammar holds (the named one only for a named ``tool_choice``)."""
    tools = function_tools(list(constraint.tools))
    if constraint.tool_choice == "function":
        tools = [t for t in tools if t.name == constraint.tool_name]
    return tools


class ConstraintCompiler:
    """Grammars and their states for one engine (one tokenizer, one vocabulary).

    Args:
        tokenizer_json: the checkpoint tokenizer's ``tokenizers`` JSON (``Tokenizer.backend.to_str()``).
        vocab_size: the model's vocabulary (logits width; masks cover it, ids past the tokenizer's are banned).
        eos_token_ids: the checkpoint's EOS ids (the first is the grammar's end token).

    The llguidance tokenizer is built on first use (about 0.7 s for SmolLM2) and kept.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        if not eos_token_ids:
            raise ValueError("constrained decoding needs an EOS token")
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lltok: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixgate-mask", initializer=serial_torch_thread
        )

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built once)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids[0]
                )
            return self._lltok

    def grammar(self, constraint: Constraint) -> str:
        """The constraint's grammar, checked against the tokenizer; cached by the constraint's canonical JSON.

        Raises:
            InvalidRequestError: see ``grammar_for``; or llguidance rejects the grammar (its message).
        """
        key = json.dumps(
            [
                constraint.kind,
                constraint.json_schema,
                list(constraint.tools),
                constraint.tool_choice,
                constraint.tool_name,
                constraint.parallel_tool_calls,
            ],
            sort_keys=True,
            default=repr,
        )
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = grammar_for(constraint)
        ok, errors = self._validate(grammar)
        loose: frozenset[str] = frozenset()
        if not ok and constraint.kind == "tool_calls":
            loose = self._loose_tools(constraint)
            if loose:
                grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(constraint, loose))
                ok, errors = self._validate(grammar)
        if not ok:
            # the client gets which schema and what in it; the grammar text (internals) goes to the log only
            log.info("constraint compile failed (%s): %s", constraint.kind, errors)
            raise InvalidRequestError(*self._explain(constraint, errors, loose))
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def _loose_tools(self, constraint: Constraint) -> frozenset[str]:
        """The tools of a tool-call constraint whose arguments fall back to any JSON object (``ANY_OBJECT``):
        each schema llguidance cannot compile alone only because it uses what llguidance does not implement
        (``unsupported_only``), of a tool that is not ``strict`` (Anthropic and OpenAI's non-strict functions
        accept any JSON Schema and promise no conformance; a strict tool does). One log line (info) each.

        Raises:
            InvalidRequestError: ``param="tools"``, naming the first tool whose schema fails otherwise: a strict
                tool's, an unsatisfiable one (also when an unimplemented keyword hides it: ``relaxed``), or a
                wrong one (a pointer that does not resolve...).
        """
        loose: dict[str, str] = {}
        for tool in _grammar_tools(constraint):
            schema = _object_root(tool.parameters)
            problem = self._schema_errors(schema)
            if problem is None:
                continue
            reason = schema_problem(problem)
            if not tool.strict and unsupported_only(reason):
                hidden = self._schema_errors(relaxed(schema), close=False)
                if hidden is None or "unsatisfiable" not in hidden.lower():
                    loose[tool.name] = reason
                    continue
                problem = hidden  # what the unimplemented keyword hid: no instance at all
            raise InvalidRequestError(_tool_refused(tool.name, problem), "tools")
        for name, reason in loose.items():
            log.info(
                "tool '%s': its arguments are constrained to any JSON object, its schema is not supported by "
                "constrained decoding: %s",
                name,
                reason,
            )
        return frozenset(loose)

    def _explain(
        self, constraint: Constraint, errors: str, loose: frozenset[str] = frozenset()
    ) -> tuple[str, str]:
        """The client's message and the field it names, for a grammar llguidance refused: for tool calls, the
        first tool (not among ``loose``, which take any object) whose parameters schema alone fails, by name
        (``tools``), else the answer's schema of a response format sent with tools (``response_format``);
        llguidance's reason without the grammar listing."""
        if constraint.kind == "tool_calls":
            for tool in _grammar_tools(constraint):
                problem = None if tool.name in loose else self._schema_errors(tool.parameters)
                if problem is not None:
                    return _tool_refused(tool.name, problem), "tools"
            answer = constraint.json_schema if constraint.tool_choice == "auto" else None
            if answer is None or (problem := self._schema_errors(answer)) is None:
                return (
                    f"Invalid 'tools': the tool-call constraint cannot be compiled: {schema_problem(errors)}",
                    "tools",
                )
            errors = problem
        return _FORMAT_REFUSED + schema_problem(errors), "response_format"

    def _schema_errors(self, schema: Any, close: bool = True) -> str | None:
        """llguidance's errors for ``schema`` compiled alone (None: it compiles); as it is, not closed
        (``engine.closed_schema``), without ``close``."""
        try:
            compiled = _json_schema(schema) if close else {**schema, "x-guidance": JSON_OPTIONS}
            ok, errors = self._validate(llguidance.LLMatcher.grammar_from_json_schema(compiled))
        except (ValueError, TypeError) as exc:
            ok, errors = False, str(exc)
        return None if ok else errors

    def _validate(self, grammar: str) -> tuple[bool, str]:
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar)
        if matcher.is_error():
            return False, matcher.get_error()
        return True, ""

    def check(self, constraint: Constraint) -> None:
        """Raise unless ``constraint`` compiles and its ``prefix`` starts an output it allows (nothing kept).

        Raises:
            InvalidRequestError: see ``grammar`` and ``start``.
        """
        if constraint.prefix:  # a matcher only to try the prefix; otherwise the cached grammar says it all
            self._matcher(constraint)
        else:
            self.grammar(constraint)

    def start(self, constraint: Constraint) -> ConstraintState:
        """A state at the start of the output, after the constraint's ``prefix``; its first mask is being
        computed when this returns.

        Raises:
            InvalidRequestError: see ``grammar``; or the ``prefix`` is not the start of any output the grammar
                allows (param ``messages``: it is the request's assistant prefill).
        """
        return ConstraintState(self._matcher(constraint), self)

    def _matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A matcher of the constraint's grammar that has consumed its ``prefix`` (tokenized by llguidance: the
        grammar reads the bytes, so any tokenization of the same text is accepted alike)."""
        matcher = llguidance.LLMatcher(self.lltokenizer, self.grammar(constraint))
        if constraint.prefix:
            tokens = self.lltokenizer.tokenize_str(constraint.prefix)
            if matcher.try_consume_tokens(tokens) != len(tokens) or matcher.is_error():
                raise InvalidRequestError(
                    "Invalid 'messages': the final assistant message (a prefill the answer continues) is not "
                    f"the start of an answer the response format allows: {_quoted_start(constraint.prefix)}",
                    "messages",
                )
        return matcher


def _quoted_start(text: str, limit: int = 40) -> str:
    """``text`` quoted, cut to ``limit`` characters with an ellipsis (for error messages)."""
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")


def prefilled(constraint: Constraint, text: str) -> Constraint:
    """``constraint`` for an output that continues ``text``, the assistant prefill of a continued final message
    (Anthropic's prefill; ``GenerationRequest.continue_final_message``): the format then covers prefill and
    continuation together, so that joined they are valid.

    - ``json_object`` / ``json_schema``: the same constraint with ``prefix=text``.
    - ``tool_calls`` with ``tool_choice="auto"`` and an answer format (``json_schema``): the answer has begun, so
      no call can follow; the answer's schema alone, with ``prefix=text``.
    - other ``tool_calls`` constraints: unchanged; the prefill is text the calls or text of the output follow,
      as without a constraint.

    Returns:
        the constraint to decode with (``text`` empty: ``constraint`` itself).
    """
    if not text:
        return constraint
    if constraint.kind in ("json_object", "json_schema"):
        return dataclasses.replace(constraint, prefix=text)
    if (
        constraint.kind == "tool_calls"
        and constraint.tool_choice == "auto"
        and constraint.json_schema is not None
    ):
        return Constraint(kind="json_schema", json_schema=constraint.json_schema, prefix=text)
    return constraint


class ConstraintState:
    """One sequence's place in its grammar, and its next-token mask (computed in the compiler's worker).

    Args:
        matcher: the llguidance matcher (owned by this state).
        compiler: the engine's compiler (vocabulary, EOS, worker thread).

    ``mask_compute_s`` sums the worker's time computing masks, ``mask_wait_s`` the time sampling waited for
    them (what the mask cost on the critical path); both in seconds, for benchmarks.
    """

    def __init__(self, matcher: llguidance.LLMatcher, compiler: ConstraintCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self.num_tokens = 0
        self.mask_wait_s = 0.0
        self.mask_compute_s = 0.0
        self._stopped = False
        self._mask: Future[torch.Tensor] | None = None
        self._start_mask()

    def _start_mask(self) -> None:
        self._mask = self.compiler.executor.submit(self._compute_banned)

    def _compute_banned(self) -> torch.Tensor:
        """bool ``[vocab]``: True for tokens the grammar forbids next (EOS alone allowed if nothing is)."""
        t0 = time.perf_counter()
        vocab = self.compiler.vocab_size
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
        if not allowed.any():
            allowed[list(self.compiler.eos_token_ids)] = True
        banned = torch.from_numpy(~allowed)
        self.mask_compute_s += time.perf_counter() - t0
        return banned

    def fork(self) -> ConstraintState:
        """An independent copy at the same place (choices of one prompt start at the same place)."""
        state = ConstraintState.__new__(ConstraintState)
        if self._mask is not None:
            self._mask.result()  # deep_copy reads the matcher the worker may be using
        state.matcher = self.matcher.deep_copy()
        state.compiler = self.compiler
        state.num_tokens = self.num_tokens
        state.mask_wait_s = state.mask_compute_s = 0.0
        state._stopped = self._stopped
        state._mask = None
        state._start_mask()
        return state

    def advance(self, token_id: int) -> None:
        """Consume the sampled token and start computing the next mask in the worker."""
        if self._mask is not None:
            self._mask.result()  # the worker reads the matcher; never let it race the consume
        self.matcher.consume_token(token_id)
        self.num_tokens += 1
        self._stopped = self.matcher.is_stopped()
        self._start_mask()

    def banned(self) -> torch.Tensor:
        """bool ``[vocab]`` mask of forbidden next tokens (waits for the worker if it is still computing)."""
        assert self._mask is not None
        t0 = time.perf_counter()
        banned = self._mask.result()
        self.mask_wait_s += time.perf_counter() - t0
        return banned

    def apply_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (float32 ``[vocab]``) with every forbidden token at ``-inf`` (in place; returned)."""
        banned = self.banned()
        n = min(banned.shape[0], logits.shape[0])
        logits[:n].masked_fill_(banned[:n], float("-inf"))
        if logits.shape[0] > n:
            logits[n:] = float("-inf")
        return logits

    @property
    def is_stopped(self) -> bool:
        """True once the grammar is complete and can take no further token (EOS consumed or nothing allowed)."""
        return self._stopped

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete instance of the grammar."""
        if self._mask is not None:
            self._mask.result()
        return self.matcher.is_accepting()
