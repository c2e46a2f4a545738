"""The shipped packs: stability across every supported form, preservation of hoisted values, and no
hoists of ordinary text."""

from __future__ import annotations

import random
import uuid

import pytest

from rules import load_ruleset
from tests.rules.formats import (
    ANCHOR_OTHER_HOISTED,
    ANCHOR_REMAINDER,
    DATE_ANCHORS,
    DATE_FORMATS,
    OTHER_VOLATILE,
    random_datetime,
)
from tests.rules.helpers import all_text

DEFAULT = load_ruleset(["default"])
HEAD = "You are a helpful assistant for ACME.\n"
TAIL = "\nAnswer briefly and cite sources."


def request(line: str) -> list[dict]:
    return [
        {"role": "system", "content": HEAD + line + TAIL},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What day is it?"},
    ]


@pytest.mark.parametrize("anchor", sorted(DATE_ANCHORS))
@pytest.mark.parametrize("form", sorted(DATE_FORMATS))
def test_dates_in_every_form_and_anchor_give_identical_stable_prefix(anchor: str, form: str) -> None:
    rng = random.Random(f"{anchor}/{form}")
    values = [DATE_FORMATS[form](random_datetime(rng)) for _ in range(2)]
    assert values[0] != values[1]
    canons = [DEFAULT.apply(request(DATE_ANCHORS[anchor].format(v=v))) for v in values]
    assert canons[0].stable_prefix_material() == canons[1].stable_prefix_material()
    remainder = ANCHOR_REMAINDER.get(anchor)
    expected_system = HEAD + remainder + TAIL if remainder else HEAD.rstrip("\n") + TAIL
    for canon, value in zip(canons, values, strict=True):
        assert canon.messages[0]["content"] == expected_system
        assert canon.messages[2:] == request("")[2:]  # later turns untouched
        assert sum(value in h for h in canon.hoisted) == 1
        assert [h for h in canon.hoisted if value not in h] == ANCHOR_OTHER_HOISTED.get(anchor, [])
        assert value in canon.messages[1]["content"]  # preserved, at the end of the first turn
        assert canon.messages[1]["content"].endswith("\n</request_context>\n\nHi")


@pytest.mark.parametrize("kind", sorted(OTHER_VOLATILE))
def test_ids_epochs_nonces_locations_give_identical_stable_prefix(kind: str) -> None:
    rng = random.Random(kind)
    lines = [OTHER_VOLATILE[kind](rng) for _ in range(8)]
    lines = list(dict.fromkeys(lines))[:2]
    assert len(lines) == 2
    canons = [DEFAULT.apply(request(line)) for line in lines]
    assert canons[0].stable_prefix_material() == canons[1].stable_prefix_material()
    for canon, line in zip(canons, lines, strict=True):
        assert canon.messages[0]["content"] == HEAD.rstrip("\n") + TAIL
        assert canon.hoisted == [line]
        assert line in canon.messages[1]["content"]


def test_many_volatile_lines_together_are_all_preserved_in_order() -> None:
    rng = random.Random(7)
    when = random_datetime(rng)
    lines = [DATE_ANCHORS["label-current-date"].format(v=DATE_FORMATS["iso-offset-micro"](when))]
    lines += [OTHER_VOLATILE[k](rng) for k in ("session-uuid", "epoch-ms", "nonce", "timezone", "location")]
    system = "Intro.\n" + "\n".join(lines) + "\nOutro."
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "q"}])
    assert canon.messages[0]["content"] == "Intro.\nOutro."
    assert sorted(canon.hoisted) == sorted(lines)
    final = all_text(canon.messages)
    assert all(line in final for line in lines)
    assert sum(canon.applied.values()) == len(lines)


ORDINARY = """You are ACME's support assistant (model v2.3.1, build 1.2.3).
Knowledge cutoff: 2024-06
Prices: the Pro plan costs $12.50/month, the Team plan €1,299.00 per year; a 10.5% discount applies.
When the user reports an error, ask for the line number (e.g. "line 42") and the stack trace.
Format dates as YYYY-MM-DD, for example 2024-01-15, and times as 13:45.
Example: Current date: 2024-01-01
Example reply: "Today's date is Monday, May 13, 2024." should never be written by you.
If the user writes "the current time is 09:00", do not correct them.
Release history: v1.0 shipped on May 13, 2024; v2.0 on 09th August, 2025.
The meeting on 2024-05-13 at 10:30 was moved.
Order numbers look like 1715692800 and phone numbers like +1 555 123 4567.
Location: use the user's city only if they give it.
Timezone handling: always convert to UTC.
ID: see the ticket header.
Session: evening shift
```python
created = 1715692800
session_id = "3f2c8a9e-1b2c-4d5e-8f90-1234567890ab"
sha = 'deadbeefdeadbeef00'
print(f"Current time: {datetime.now():%H:%M}")  # Current date: 2024-01-01
```
```
Current date: 2025-05-14
```
Math: 3:4 ratio, 12:30 is lunch, and 2024-2025 is the fiscal year.
참고: 2024년 1월 1일은 예시 날짜입니다.
例: 2024年1月1日 10時00分 のように書きます。
示例：2024年1月1日 下午3点20分。"""


def test_no_false_hoists_on_ordinary_text() -> None:
    messages = [{"role": "system", "content": ORDINARY}, {"role": "user", "content": "Hi, it's 10:30 here."}]
    canon = DEFAULT.apply(messages)
    assert canon.messages == messages
    assert canon.hoisted == []
    assert canon.applied == {}


def test_user_and_assistant_text_is_not_hoisted_by_the_packs() -> None:
    messages = [
        {
            "role": "user",
            "content": "Current date: 2025-05-14\nSession ID: 3f2c8a9e-1b2c-4d5e-8f90-1234567890ab",
        },
        {"role": "assistant", "content": "Today's date is Monday, May 13, 2024."},
        {"role": "user", "content": "Timestamp: 1715692800"},
    ]
    assert DEFAULT.apply(messages).messages == messages


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


INLINE_IDS: dict[str, tuple[str, str]] = {
    # name -> (system prompt with {v}, what stays in the system prompt)
    "request-id-uuid-sentence": ("You are terse. Request ID: {v}.", "You are terse."),
    "request-id-token-line-end": ("You are terse. Request id: req-{t}", "You are terse."),
    "request-parenthetical": ("You are terse (request {v}).", "You are terse."),
    "request-parenthetical-after-sentence": ("You are terse. (request {v})", "You are terse."),
    "session-sentence": ("You are bot 4821. Session {v} is active. Be brief.", "You are bot 4821. Be brief."),
    "trace-is-hex": ("Answer in English. Your trace id is {h}. Be brief.", "Answer in English. Be brief."),
    "correlation-mid-line": ("Be kind; correlation-id={v}. Cite sources.", "Be kind; Cite sources."),
    "conversation-prefixed-token": (
        "Hi there. Conversation conv_{t} started. Be brief.",
        "Hi there. Be brief.",
    ),
    "bold-label": ("Be brief. **Session ID:** `{v}`. Cite sources.", "Be brief. Cite sources."),
    "item-separator": ("Assistant | Request-Id: {v} | English", "Assistant | English"),
    "developer-uuid-label": ("Help the user. UUID: {v}", "Help the user."),
    # a one-digit number before the period still ends the sentence before the id
    "after-one-digit": ("You are bot 5. Session {v} is active. Be brief.", "You are bot 5. Be brief."),
    "date-after-one-digit": ("You are helper 7. Request-Id: {v}", "You are helper 7."),
    # a bare label's plain number that ends its sentence or clause is an id
    "bare-label-number": ("You are terse. Session: {n}. Be brief.", "You are terse. Be brief."),
    "bare-label-number-clause": (
        "You are terse. Request #{n}, retried. Be brief.",
        "You are terse. Be brief.",
    ),
    "bare-label-mixed-token": (
        "You are terse. Session: s{n}x is active. Be brief.",
        "You are terse. Be brief.",
    ),
}


@pytest.mark.parametrize("name", sorted(INLINE_IDS))
@pytest.mark.parametrize("role", ["system", "developer"])
def test_ids_inside_a_line_are_hoisted_like_dates(name: str, role: str) -> None:
    template, stays = INLINE_IDS[name]
    rng = random.Random(name)
    systems = [
        template.format(
            v=_uuid(rng),
            t=f"{rng.randrange(16**8):08x}{rng.randrange(10)}",
            h=f"{rng.getrandbits(64):016x}",
            n=rng.randrange(10**3, 10**6),
        )
        for _ in range(2)
    ]
    assert systems[0] != systems[1]
    canons = [
        DEFAULT.apply([{"role": role, "content": s}, {"role": "user", "content": "Hi"}]) for s in systems
    ]
    assert canons[0].stable_prefix_material() == canons[1].stable_prefix_material()
    for canon, system in zip(canons, systems, strict=True):
        assert canon.messages[0]["content"] == stays
        assert len(canon.hoisted) == 1
        assert canon.hoisted[0] in system
        assert canon.hoisted[0] in canon.messages[1]["content"]  # preserved in the request context
        assert DEFAULT.apply(canon.messages).messages == canon.messages  # idempotent


def test_inline_id_forms_are_hoisted_as_on_their_own_line() -> None:
    value = "7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f"
    user = {"role": "user", "content": "Hi"}
    inline = DEFAULT.apply([{"role": "system", "content": f"You are terse. Request ID: {value}."}, user])
    own_line = DEFAULT.apply([{"role": "system", "content": f"You are terse.\nRequest ID: {value}."}, user])
    assert inline.messages[0]["content"] == own_line.messages[0]["content"] == "You are terse."
    assert inline.hoisted == own_line.hoisted == [f"Request ID: {value}."]


NOT_IDS = [
    # a UUID or hex without an id label, in prose, an example, a URL, JSON, key=value strings, code
    "The schema field holds a UUID like 7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f.",
    "Commit deadbeefdeadbeef00112233 introduced the bug. Be brief.",
    "Open https://example.com/?session=7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f to log in.",
    'Config: {"session_id": "7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f"} is a sample. Be brief.',
    "Send it as x_session=3f2c8a9e-1b2c-4d5e-8f90-1234567890ab in the form. Be brief.",
    "Use `req-1a2b3c` in code. Be brief.\n```\nRequest ID: 7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f\n```",
    # labels followed by ordinary words or numbers that are no ids
    "Session 2 is about math. The request is simple. Be brief.",
    "Request handling: be nice. The ID is required. Session time is short.",
    "Each user ID must be unique. Mention the session ID when asked.",
    "For example, Request ID: 7f3a9c21-5b2e-4c1d-9e8f-0a1b2c3d4e5f is what a log shows.",
    # a bare label before a quantity: the number is no id
    "You are a coach.\nSession: 45 minutes\nBe brief.",
    "Be brief. Session: 45 minutes, then stop.",
    "Conversation: 2 hours max. Be brief.",
    "Answer twice. Request: 3 of 10 allowed. Be brief.",
]


CREDENTIAL_LINES = [
    # a re-trial's forms: environment variables, header names, a provider named before "token" or "key", a
    # parenthetical after the label
    "OPENAI_API_KEY=sk-proj-{s}",
    "export GITHUB_TOKEN=ghp_{s}",
    "X-API-Key: {s}",
    "Hugging Face token: hf_{s}",
    "Stripe secret key: sk_live_{s}",
    "AWS secret access key: {s}",
    "GitHub token (for pushes): ghp_{s}",
]


@pytest.mark.parametrize("line", CREDENTIAL_LINES)
def test_credentials_in_their_common_forms_give_identical_stable_prefix(line: str) -> None:
    rng = random.Random(line)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    lines = [line.format(s="".join(rng.choice(alphabet) for _ in range(31)) + str(k)) for k in range(2)]
    canons = [DEFAULT.apply(request(value)) for value in lines]
    assert canons[0].stable_prefix_material() == canons[1].stable_prefix_material()
    for canon, value in zip(canons, lines, strict=True):
        assert canon.messages[0]["content"] == HEAD.rstrip("\n") + TAIL
        assert canon.hoisted == [value]


NOT_CREDENTIALS = [
    "You are a tokenizer expert.\nMAX_TOKENS=4096\nPassword reset links expire after 24 hours.",
    "Primary key: user_id_12345678901234\nThe secret is to be concise.",
    # placeholders hold no digit; limits and counts are no secrets; a credential in code or an example stays
    "You call the API.\nAuthorization: Bearer YOUR_API_KEY\nBe brief.",
    "Send `Authorization: Bearer <token>` with every call. Be brief.",
    "You are a tokenizer expert. Max tokens: 4096. Token budget: 128000 tokens.",
    "Count tokens with tiktoken before sending. The token limit is 8192. Be brief.",
    "Explain what a JWT is and how a bearer token differs from an API key. Be brief.",
    "You style the app.\nDesign token: color-primary-background-500\nUse the design token spacing-large-200 too.",
    "Use the API key from the environment. Be brief.\n```\nAPI key: sk-proj-4f9a8b7c6d5e4f3a2b1c\n```",
    "For example, Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc123def456 is a header.",
]


@pytest.mark.parametrize("system", NOT_CREDENTIALS)
def test_the_credential_rules_leave_placeholders_limits_and_examples(system: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == []
    assert canon.messages == messages


@pytest.mark.parametrize("system", NOT_IDS)
def test_inline_id_rules_leave_unlabelled_ids_and_ordinary_words(system: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == []
    assert canon.messages == messages


def test_a_date_after_a_sentence_ending_in_a_one_digit_number_is_hoisted() -> None:
    canon = DEFAULT.apply(
        [
            {"role": "system", "content": "You are helper 7. Current date: 2026-12-03."},
            {"role": "user", "content": "Hi"},
        ]
    )
    assert canon.messages[0]["content"] == "You are helper 7."
    assert canon.hoisted == ["Current date: 2026-12-03."]


CLAUDE_CODE_ENV = (
    "You are Claude Code, a coding agent. Be concise.\n\n"
    "Here is useful information about the environment you are running in:\n<env>\n"
    "Working directory: {cwd}\nIs directory a git repo: Yes\nPlatform: linux\nOS Version: Linux 6.8.0\n"
    "Today's date: {date}\n</env>\n\n"
    "gitStatus: This is the git status at the start of the conversation. Note that this status is a snapshot "
    "in time, and will not update during the conversation.\nCurrent branch: {branch}\n\n"
    "Main branch (you will usually use this for PRs): main\n\nStatus:\n{status}\n\nRecent commits:\n{commit}\n"
)


def test_a_claude_code_environment_and_git_status_leave_the_system_prompt_stable():
    """A fresh-user trial: in Claude Code's system prompt nothing of the <env> block was hoisted (the line
    "Here is useful information ..." was read as announcing a format: "information" holds "format", and the
    keep pack protected what followed), and the git status's file list stayed (a blank line ended the block)."""
    default = load_ruleset(["default"])
    values = [
        {
            "cwd": "/home/ann/proj",
            "date": "2026-12-05",
            "branch": "feat/x",
            "status": "M src/a.py\n?? notes1.txt",
            "commit": "abc1123 fix things",
        },
        {
            "cwd": "/home/bob/app",
            "date": "2026-12-06",
            "branch": "main",
            "status": "A b.py",
            "commit": "def4567 add b",
        },
    ]
    systems = []
    for v in values:
        out = default.apply(
            [{"role": "system", "content": CLAUDE_CODE_ENV.format(**v)}, {"role": "user", "content": "hi"}]
        )
        systems.append(out.messages[0]["content"])
        block = out.messages[-1]["content"]
        for value in v.values():
            assert value in block and value not in systems[-1]
    assert systems[0] == systems[1]
    assert (
        "Here is useful information about the environment" in systems[0] and "Platform: linux" in systems[0]
    )


def test_a_format_announcement_is_a_whole_word():
    keep = load_ruleset(["keep", "dates"])
    for lead in ("Output format:", "Examples:", "The log line looks like this:"):
        text = f"You are a bot.\n{lead}\nCurrent date: 2026-12-05\n"
        assert (
            keep.apply([{"role": "system", "content": text}, {"role": "user", "content": "x"}]).hoisted == []
        )
    for lead in ("Here is some information about the user:", "Performance notes:", "Transformation rules:"):
        text = f"You are a bot.\n{lead}\nCurrent date: 2026-12-05\n"
        out = keep.apply([{"role": "system", "content": text}, {"role": "user", "content": "x"}])
        assert out.hoisted == ["Current date: 2026-12-05"], lead


def test_a_configured_limit_is_not_a_usage_counter():
    default = load_ruleset(["default"])
    for line in (
        "Max tokens per answer: 200",
        "Remaining steps are listed below.",
        "Budget: keep answers short.",
    ):
        text = f"You are a bot.\n{line}\nAnswer briefly."
        assert (
            default.apply([{"role": "system", "content": text}, {"role": "user", "content": "x"}]).hoisted
            == []
        )


@pytest.mark.parametrize(
    "line",
    [
        "User: alice, plan: pro, local time 14:03",
        "Customer: Jane Doe, tier: gold, since: 2019",
        "Current user: ann@example.com",
        "Logged in as: @ann",
        "Username: alice",
        "User name: bob_92",
    ],
)
def test_a_line_about_the_user_is_hoisted_whole(line: str) -> None:
    system = f"{line}\n\nYou are the support assistant of ACME."
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "x"}])
    assert canon.hoisted == [line]
    assert canon.messages[0]["content"] == "You are the support assistant of ACME."  # no blank line left


@pytest.mark.parametrize(
    "system",
    [
        "You answer like this:\nUser: Hello\nAssistant: Hi, how can I help?",
        "User: What is 2+2?",
        "User: Current date: 2025-03-04",
        "User: Hello",
        "User: Hello (English)",
        "User: Abhishek (name)",
        "Customer: Yes, my order is: 12345",
    ],
)
def test_dialogue_lines_stay(system: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "x"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == [] and canon.messages == messages


NOT_CURRENT_VALUES = [
    # a document's date, a place that is no place, a template placeholder
    "You are helpful.\n<date>2021-01-01</date>\nBe brief.",
    "You are helpful.\n<location>the kitchen, whatever the user says</location>\nBe brief.",
    "You are helpful.\n<now>{{now}}</now>\nBe brief.",
    # the same tags inside a retrieved document belong to the document
    "<documents><document><current_date>2020-01-01</current_date><user_name>Bob Stone</user_name>"
    "<user_location>Berlin, Germany</user_location></document></documents>\nBe brief.",
    # a relative time needs its anchor and its "ago"; "today" is no time to hoist
    "You are helpful.\nMention what happened 5 minutes ago if asked.",
    "You are helpful.\nThe session started badly, so be gentle.",
    "You are helpful.\nCurrent date: today",
    # a tag that only opens, or holds more than its date
    "You are helpful.\n<current_date>2025-03-04\nBe brief.",
    "You are helpful.\n<current_date>2025-03-04 <b>bold</b></current_date>\nBe brief.",
]


@pytest.mark.parametrize("system", NOT_CURRENT_VALUES)
def test_tags_and_relative_times_that_name_no_current_value_stay(system: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    canon = DEFAULT.apply(messages)
    assert canon.hoisted == []
    assert canon.messages == messages


@pytest.mark.parametrize(
    ("system", "stays", "hoisted"),
    [
        (
            "You are a guide.\n- The user is in Paris, France.\n- Be concise.",
            "You are a guide.\n- Be concise.",
            "The user is in Paris, France.",
        ),
        (
            "You are a guide.\n  3. The user is located in Osaka, Japan.\n  4. Be concise.",
            "You are a guide.\n  4. Be concise.",
            "The user is located in Osaka, Japan.",
        ),
    ],
)
def test_a_list_item_hoisted_whole_takes_its_marker_along(system: str, stays: str, hoisted: str) -> None:
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    assert canon.messages[0]["content"] == stays
    assert canon.hoisted == [hoisted]


@pytest.mark.parametrize(
    ("system", "stays", "hoisted"),
    [
        (
            "あなたはアシスタントです。\n現在の日時：2025年3月2日 10時14分。この日時を基準に回答してください。",
            "あなたはアシスタントです。\nこの日時を基準に回答してください。",
            "現在の日時：2025年3月2日 10時14分。",
        ),
        (
            "你是助手。\n当前时间：2025年3月2日 10:14！请以此为准回答。",
            "你是助手。\n请以此为准回答。",
            "当前时间：2025年3月2日 10:14！",
        ),
    ],
)
def test_a_cjk_full_stop_ends_the_hoisted_sentence(system: str, stays: str, hoisted: str) -> None:
    """The instruction after a labelled date's 。 or ！ is the prompt's own and stays (it moved with the date)."""
    canon = DEFAULT.apply([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    assert canon.messages[0]["content"] == stays
    assert canon.hoisted == [hoisted]
