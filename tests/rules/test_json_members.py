"""Per-request values inside a JSON (or Python literal) context object in the system prompt: the members
naming the current time or a per-request id are hoisted (``dates.json-member``, ``ids.json-member`` and their
``-last-member`` forms), the object left behind stays valid and equal to the original minus those members,
and everything else in JSON (documents' dates, bare ``id`` fields, code, examples) stays."""

from __future__ import annotations

import ast
import json
import random
import re
import uuid

import pytest

from rules import load_ruleset
from rules.actions import apply_span_action
from rules.model import Rule
from rules.patterns import compile_pattern

DEFAULT = load_ruleset(["default"])
USER = {"role": "user", "content": "What is my plan?"}


def _volatile(rng: random.Random) -> dict[str, object]:
    """Fresh per-request values: a time, ids and an epoch, different on every call."""
    moment = f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z"
    return {
        "now": moment,
        "session_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        "requestId": f"req-{rng.randrange(16**6):06x}{rng.randrange(10)}",
        "current_time": f"{rng.randrange(24):02d}:{rng.randrange(60):02d}",
        "trace-id": f"{rng.getrandbits(128):032x}",
        "timestamp": rng.randrange(1_700_000_000, 1_800_000_000),
        # credentials an agent framework dumps with its tool configuration (refreshed per request)
        "api_key": f"sk-proj-{rng.getrandbits(96):024x}",
        "accessToken": f"ghp_{rng.getrandbits(144):036x}",
        "Authorization": f"Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOi{rng.getrandbits(64):016x}.{rng.getrandbits(64):016x}",
    }


STABLE = {"plan": "pro", "locale": "en-US", "tier": 2}

# (name, keys of the volatile members used, how the object is written)
LAYOUTS = {
    "inline-json-middle": (["now", "session_id"], "json-inline", "middle"),
    "inline-json-first": (["requestId", "current_time"], "json-inline", "first"),
    "inline-json-last": (["trace-id", "timestamp"], "json-inline", "last"),
    "pretty-json-last": (["now", "requestId", "timestamp"], "json-pretty", "last"),
    "pretty-json-middle": (["session_id"], "json-pretty", "middle"),
    "python-literal-last": (["session_id", "timestamp"], "python", "last"),
    "python-literal-first": (["now"], "python", "first"),
    "inline-json-credentials-middle": (["api_key", "Authorization"], "json-inline", "middle"),
    "pretty-json-credential-last": (["accessToken"], "json-pretty", "last"),
    "python-literal-credential-first": (["api_key"], "python", "first"),
}


def _object(volatile: dict[str, object], keys: list[str], where: str) -> dict[str, object]:
    members = {k: volatile[k] for k in keys}
    stable = list(STABLE.items())
    if where == "first":
        return {**members, **dict(stable)}
    if where == "last":
        return {**dict(stable), **members}
    return {**dict(stable[:1]), **members, **dict(stable[1:])}


def _write(obj: dict[str, object], style: str) -> str:
    if style == "json-inline":
        return json.dumps(obj)
    if style == "json-pretty":
        return json.dumps(obj, indent=2)
    return repr(obj)


def _read(text: str, style: str) -> dict[str, object]:
    return json.loads(text) if style.startswith("json") else ast.literal_eval(text)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_volatile_members_are_hoisted_and_the_object_stays_valid(layout: str) -> None:
    keys, style, where = LAYOUTS[layout]
    rng = random.Random(layout)
    canons, objects = [], []
    for _ in range(2):
        obj = _object(_volatile(rng), keys, where)
        system = f"You are Acme's support bot.\nUser context:\n{_write(obj, style)}\nAnswer briefly."
        canons.append(DEFAULT.apply([{"role": "system", "content": system}, USER]))
        objects.append(obj)
    assert canons[0].stable_prefix_material() == canons[1].stable_prefix_material()
    for canon, obj in zip(canons, objects, strict=True):
        system = canon.messages[0]["content"]
        left = system.split("User context:\n", 1)[1].rsplit("\nAnswer briefly.", 1)[0]
        assert _read(left, style) == STABLE  # valid, and the original minus the hoisted members
        assert len(canon.hoisted) == len(keys)
        context = canon.messages[1]["content"]
        for key in keys:
            member = [h for h in canon.hoisted if key in h]
            assert len(member) == 1
            assert _read("{" + member[0] + "}", style) == {key: obj[key]}  # the member as it was written
            assert member[0] in context
        assert context.endswith("</request_context>\n\nWhat is my plan?")
        assert DEFAULT.apply(canon.messages).messages == canon.messages  # idempotent


NOT_HOISTED = [
    # documents: their dates and bare ids are content, not the current request
    'Documents:\n[{"title": "Q3 report", "date": "2024-10-01", "created_at": "2024-10-02T10:00:00Z", "id": "doc-17"}]',
    # an object whose only member is volatile: removing it would leave "{}"
    'Context: {"now": "2026-12-05T15:02:28Z"} Be brief.',
    # values without a digit are no ids or times
    'Context: {"user_id": "alice", "now": "today", "plan": "pro"}',
    # code blocks and examples are kept
    '```json\n{"now": "2026-12-05T15:02:28Z", "session_id": "sess-42ab", "a": 1}\n```',
    'The request looks like this:\n{"now": "2026-12-05T15:02:28Z", "session_id": "sess-42ab", "a": 1}',
    # a format the answer must follow, or an example of one: its values are placeholders
    'Respond in this format: {"answer": "...", "timestamp": "2024-01-01T00:00:00Z", "confidence": 0.9}',
    'Reply with JSON like {"status": "ok", "request_id": "req-123", "items": []}.',
    'Output schema: {"event": "login", "timestamp": 1700000000, "user": "x"}',
    'Each log entry looks like {"level": "info", "ts": "2024-05-01T10:00Z", "trace_id": "abc123", "m": 1}',
    'Respond in this format:\n{\n  "answer": "...",\n  "timestamp": "2024-01-01T00:00:00Z",\n  "id": 1\n}',
    # credentials' placeholders, counts and budgets are no secrets
    'Tool config: {"api_key": "YOUR_API_KEY", "plan": "pro"}',
    'Tool config: {"plan": "pro", "access_token": "sk-xxxxxxxxxxxxxxxxxxxx"}',
    'Tool config: {"max_tokens": 4096, "token_budget": "12345678901234567890", "plan": "pro"}',
    # escaped JSON inside a JSON string is not a member of the object around it
    'Payload: {"body": "{\\"now\\": \\"2026-12-05T15:02:28Z\\", \\"a\\": 1}"}',
]


@pytest.mark.parametrize("system", NOT_HOISTED)
def test_json_that_is_content_stays(system: str) -> None:
    messages = [{"role": "system", "content": system}, USER]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == []
    assert canon.messages == messages


def test_user_messages_keep_their_json() -> None:
    user = {"role": "user", "content": '{"now": "2026-12-05T15:02:28Z", "session_id": "sess-42ab", "a": 1}'}
    canon = DEFAULT.apply([{"role": "system", "content": "Be brief."}, user])
    assert canon.hoisted == []
    assert canon.messages[1] == user


def test_a_quoted_sentence_is_still_kept_and_a_json_key_is_no_sentence() -> None:
    quoted = 'Never say "Today\'s date is 2026-12-05" unless asked. Be brief.'
    assert DEFAULT.apply([{"role": "system", "content": quoted}, USER]).hoisted == []
    keyed = 'Context: {"now": "2026-12-05T15:02:28Z", "plan": "pro"}'
    assert DEFAULT.apply([{"role": "system", "content": keyed}, USER]).hoisted == [
        '"now": "2026-12-05T15:02:28Z"'
    ]


def test_a_hoisted_group_moves_its_text_and_the_rule_group_is_what_goes() -> None:
    pattern = compile_pattern(r"(?P<item>(?P<hoisted>T-[0-9]+)[ \t]*;[ \t]*)", {})
    rule = Rule(id="t", action="hoist", pattern=pattern, group="item")
    text, count, values = apply_span_action(rule, "a; T-12; b; T-7; c")
    assert (text, count, values) == ("a; b; c", 2, ["T-12", "T-7"])
    # without the hoisted group the removed span itself is the value
    plain = Rule(
        id="p", action="hoist", pattern=compile_pattern(r"(?P<item>T-[0-9]+;[ \t]*)", {}), group="item"
    )
    assert apply_span_action(plain, "a; T-12; b")[2] == ["T-12;"]


def test_every_json_member_rule_names_a_hoisted_group() -> None:
    rules = [r for r in DEFAULT.rules if re.search(r"\.json-(last-)?member$", r.id)]
    assert {r.id for r in rules} == {
        "credentials.json-member",
        "credentials.json-last-member",
        "dates.json-member",
        "dates.json-last-member",
        "ids.json-member",
        "ids.json-last-member",
    }
    assert all("hoisted" in r.pattern.groupindex for r in rules)
