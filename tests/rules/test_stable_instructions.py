"""Shapes of real products' system prompts that hold stable instructions looking like volatile values: an audit
of the default packs over ~2,800 public system prompts found them hoisted (each case below is written for this
test, after the shape found). Each must stay where it is, and the volatile value beside it must still move."""

from __future__ import annotations

import pytest

from rules import load_ruleset

DEFAULT = load_ruleset(["default"])

STAY = {
    "memory-instructions": "You help with code.\n### What NOT to save in memory\n- Code style\n- Build steps\n",
    "memory-when": "### When to save memories\n- When the user asks you to\n- When a fact will matter later\n",
    "memory-user-context-heading": "## User Context\n- ALWAYS read the time from the <now> tag\n",
    "bare-context-tag": "Use this format:\n<new_task>\n<context>\ncontext to start the task with\n</context>\n</new_task>",
    "empty-context-tag": "<context>\n</context>\nAnswer briefly.",
    "model-id": "The exact model ID is example-model-4-2. Mention it when asked.",
    "option-id": "Environments:\n- Default (id: env_0123abcd, kind: cloud)\nUse the id value.",
    "git-label-over-code": "GIT STATUS:\n```\nM a.py\n```",
    "git-label-placeholder": "Recent commits:\n<RECENT_COMMITS>",
    "git-command-template": "- Recent commits: !`git log --oneline -10`",
    "url-with-id": "Watch the demo: https://video.example.com/share/abc?sid=30e5cdb8-1234-4a5b-9c8d-0123456789ab",
    "file-path-sentence": "Contents of /var/folders/xy/2f601f852181255a/NOTES.md (the user's own notes, read first):",
    "hypothetical-date": "Assuming today's date is 2024-12-30, show how a relative range is written.",
    "comment-date": "// if today's date is 2024-11-10, the range starts on 2024-11-03",
    "dialogue-with-parenthesis": "User: Hello (English)\nAssistant: Hi!",
    # a session, request or conversation described by a quantity: the id rules read "is 30" as an id
    "session-length": "You are a tutor. Each session is 30 minutes long.",
    "conversation-length": "The conversation is 5 turns at most. Keep answers short.",
    "request-size": "Your request is 2 lines. Answer in one.",
}


@pytest.mark.parametrize("name", sorted(STAY))
def test_stable_instructions_stay(name: str) -> None:
    messages = [{"role": "system", "content": STAY[name]}, {"role": "user", "content": "hi"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == [] and canon.messages == messages


MOVE = {
    "memory-section": ("## Saved memories\n- Likes tea\n- Lives in Oslo", "## Saved memories"),
    "user-memories-tag": ("<user_context>\nPlan: pro\n</user_context>", "<user_context>"),
    "git-status": ("Recent commits:\nabc1234 fix the parser\ndef5678 add tests", "Recent commits:"),
    "path-sentence": ("Save files in /tmp/session-8f3a2b91/ only.", "Save files in"),
    "session-id-sentence": ("Your session ID is 7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f.", "session ID"),
    "request-id-number": ("Your request ID is 42.", "request ID"),
    # Claude Code's attribution line (before: kept, and each session's first prompt changed its last characters)
    "client-attribution": (
        "x-anthropic-billing-header: cc_version=2.1.197.7b2; cc_entrypoint=sdk-cli;",
        "x-anthropic-billing-header",
    ),
}


@pytest.mark.parametrize("name", sorted(MOVE))
def test_the_volatile_neighbours_still_move(name: str) -> None:
    text, marker = MOVE[name]
    system = f"You are helpful.\n{text}\nBe brief."
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
    assert canon.messages[0]["content"] == "You are helpful.\nBe brief."
    assert any(marker in h for h in canon.hoisted)


def test_claude_codes_sessions_share_one_system_prompt_whatever_their_attribution_line() -> None:
    """The attribution block is Claude Code's first system block, alone; two sessions differ only there."""
    forms = []
    for suffix in ("7b2", "84c"):
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;",
            },
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK."},
        ]
        canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
        forms.append(canon.messages[0])
    assert forms[0] == forms[1]
    assert "billing" not in str(forms[0])
