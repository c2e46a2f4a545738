"""Two users of one app whose system prompts differ only in hoisted values (their names, e-mails, memories,
user ids) share a stable form. The transcript memory must never hand one of them the other's stored history,
whose old blocks hold the other's values: its keys name the values that tell whose conversation it is
(``conversation_scope``), while per-request values (a time, a request id) still change freely between the
turns of one conversation (``Rule.per_request``)."""

from __future__ import annotations

import pytest

from rules import load_ruleset
from rules.errors import RuleError
from rules.transcript import USER_MARK, InProcessTranscriptStore, TranscriptMemory, conversation_scope
from tests.rules.helpers import all_text, ruleset_from

DEFAULT = load_ruleset(["default"])
OPENER = "Hi! What should I eat today?"
REPLY = "Something tasty."

USERS = {
    "alice": ("Alice Smith", "alice@example.com", "Alice Smith is vegetarian", "u_1a2b3c4d"),
    "bob": ("Bob Jones", "bob@example.com", "Bob Jones is allergic to peanuts", "u_9f8e7d6c"),
}


def _system(user: str, minute: int, request: int) -> dict:
    name, email, memory, user_id = USERS[user]
    return {
        "role": "system",
        "content": (
            "You are Chef, a cooking assistant.\n"
            f"Current time: 2026-12-05 12:{minute:02d}\n"
            f"Request ID: req-{request:06d}a\n"
            f"User's name: {name}\n"
            f"User email: {email}\n"
            f"User ID: {user_id}\n"
            f"<user_memories>\n- {memory}\n</user_memories>\n"
            "Answer in two sentences."
        ),
    }


def _turn1(user: str, minute: int, request: int) -> list[dict]:
    return [_system(user, minute, request), {"role": "user", "content": OPENER}]


def _turn2(user: str, minute: int, request: int) -> list[dict]:
    return _turn1(user, minute, request) + [
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "And tomorrow?"},
    ]


def _turn3(user: str, minute: int, request: int) -> list[dict]:
    return _turn2(user, minute, request) + [
        {"role": "assistant", "content": "Soup."},
        {"role": "user", "content": "And after that?"},
    ]


def _foreign(user: str) -> list[str]:
    other = "bob" if user == "alice" else "alice"
    return [v for v in USERS[other]]


def test_a_users_next_turn_never_holds_another_users_values_and_still_reuses_its_own_history() -> None:
    memory = TranscriptMemory(InProcessTranscriptStore())
    first_a = DEFAULT.apply(_turn1("alice", 1, 1), memory=memory, scope="m\0t")
    DEFAULT.apply(_turn1("bob", 2, 2), memory=memory, scope="m\0t")  # same opener, same stable form
    second_a = DEFAULT.apply(_turn2("alice", 3, 3), memory=memory, scope="m\0t")
    second_b = DEFAULT.apply(_turn2("bob", 4, 4), memory=memory, scope="m\0t")
    for canon, user in ((second_a, "alice"), (second_b, "bob")):
        text = all_text(canon.messages)
        assert not [v for v in _foreign(user) if v in text], user
        assert all(v in text for v in USERS[user])
        assert canon.history.reused_turns == 1  # its own first turn, old time and request id included
    # Alice's history is byte for byte what was sent for her first turn
    assert second_a.messages[: len(first_a.messages)] == first_a.messages
    assert "12:01" in all_text(second_a.messages[:2]) and "12:03" in all_text(second_a.messages[2:])
    # a third turn goes on from the rules' memo of the later turns, which is keyed the same way
    third_a = DEFAULT.apply(_turn3("alice", 5, 5), memory=memory, scope="m\0t")
    third_b = DEFAULT.apply(_turn3("bob", 6, 6), memory=memory, scope="m\0t")
    for canon, second, user in ((third_a, second_a, "alice"), (third_b, second_b, "bob")):
        assert not [v for v in _foreign(user) if v in all_text(canon.messages)], user
        assert canon.history.reused_turns == 2
        assert canon.messages[: len(second.messages)] == second.messages


def test_only_per_request_values_differing_still_reuse_the_history() -> None:
    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(_turn1("alice", 1, 1), memory=memory, scope="m\0t")
    later = DEFAULT.apply(_turn2("alice", 9, 77), memory=memory, scope="m\0t")  # new time, new request id
    assert later.history.reused_turns == 1
    assert memory.stats.hits == 1


def test_a_user_id_alone_tells_conversations_apart() -> None:
    def turn(user_id: str, request: int, more: bool) -> list[dict]:
        system = f"You are terse.\nUser ID: {user_id}\nRequest ID: req-{request}x"
        return customer_chat(system, more, (OPENER, REPLY, "More?"))

    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(turn("u_111a", 1, False), memory=memory, scope="s")
    DEFAULT.apply(turn("u_222b", 2, False), memory=memory, scope="s")
    canon = DEFAULT.apply(turn("u_111a", 3, True), memory=memory, scope="s")
    assert "u_222b" not in all_text(canon.messages)
    assert canon.history.reused_turns == 1 and "req-1x" in all_text(canon.messages)


@pytest.mark.parametrize(
    ("value", "per_request"),
    [
        ("Request ID: req-42ab", True),
        ("The trace id is 4bf92f3577b34da6.", True),
        ('"requestId": "req-42"', True),
        ("traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("Session ID: 3f9c2b1e-7d4a-4c1b-9a0e-2b7f6d8c1e55", False),
        ("User ID: u_83f2a91c", False),
        ('"session_id": "sess-42ab"', False),
        ("Conversation: conv-88213", False),
        ("Account ID: ACC-1079190", False),
        ("Order number: ORD-2231", False),
    ],
)
def test_ids_are_per_request_by_their_label(value: str, per_request: bool) -> None:
    rules = [r for r in DEFAULT.rules if r.id.startswith("ids.")]
    assert rules and {r.value_per_request(value) for r in rules} == {per_request}


@pytest.mark.parametrize(
    ("line", "hoisted"),
    [
        ("Account ID: ACC-1079190", True),
        ("Customer ID: C-88213", True),
        ("Order number: ORD-2231", True),
        ("Ticket ID: T-1", True),
        ('{"account_id": "acc_77f1", "plan": "pro"}', True),
        ("Version number: 1.2.3", False),  # the same for every user: no id
        ("Use the order ID the user gives.", False),
    ],
)
def test_a_customers_own_record_ids_are_hoisted(line: str, hoisted: bool) -> None:
    """A fresh-user trial: account, customer and order ids stayed in the system prompt, so two customers shared
    nothing after them (and rules on cached fewer tokens than rules off where a hoisted block came first)."""
    canon = DEFAULT.apply([{"role": "system", "content": f"You are helpful.\n{line}\nBe brief."}])
    assert bool(canon.hoisted) is hoisted


def test_conversation_scope_names_only_the_values_that_hold_for_a_conversation() -> None:
    assert conversation_scope("s", []) == "s"
    # a per-request value counts by what is left of it once its time (its digits, days, months) is masked
    noon = conversation_scope("s", [("tail_end", "Current time: 12:00", True)])
    assert noon == conversation_scope("s", [("tail_end", "Current time: Tuesday 18:45", True)]) != "s"
    assert noon != conversation_scope("s", [("tail_end", "Current time: 12:00 for Ann", True)])
    one = conversation_scope("s", [("tail_end", "User's name: Ann", False), ("tail_end", "t1", True)])
    assert one.startswith("s\0conversation:") and one != "s"
    assert one == conversation_scope(
        "s", [("tail_end", "t2", True), ("system_end", "User's name: Ann", False)]
    )
    assert one != conversation_scope("s", [("tail_end", "User's name: Bo", False)])
    assert one != conversation_scope("other", [("tail_end", "User's name: Ann", False)])


def test_per_request_is_read_from_rule_files(tmp_path) -> None:
    rules = ruleset_from(
        tmp_path,
        """
rules:
  - id: ticket
    match: {role: system, pattern: '(?m)^Ticket: T-[0-9]+$'}
    action: hoist
    per_request: true
  - id: shift
    match: {role: system, pattern: '(?m)^Shift: [a-z]+ [0-9]+$'}
    action: hoist
    per_request: '^Shift: night'
    private: true
  - id: customer
    match: {role: system, pattern: '(?m)^Customer: [A-Z][a-z]+$'}
    action: hoist
""",
    )
    by_id = {r.id: r for r in rules.rules}
    assert by_id["ticket"].value_per_request("Ticket: T-1") is True
    assert by_id["shift"].value_per_request("Shift: night 3") is True
    assert by_id["shift"].value_per_request("Shift: day 3") is False
    assert by_id["customer"].value_per_request("Customer: Ann") is False
    assert by_id["shift"].private and not by_id["ticket"].private and not by_id["customer"].private


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3", "'per_request' must be true, false or a pattern"),
        ("''", "'per_request' must be true, false or a pattern"),
        ("'(unclosed'", "'per_request':"),
        ("true\n    private: 'yes please'", "'private' must be true or false"),
    ],
)
def test_a_bad_per_request_or_private_is_refused_by_name(tmp_path, value: str, message: str) -> None:
    source = f"""
rules:
  - id: ticket
    match: {{role: system, pattern: 'Ticket: T-[0-9]+'}}
    action: hoist
    per_request: {value}
"""
    with pytest.raises(RuleError, match=message):
        ruleset_from(tmp_path, source)


def test_per_request_belongs_to_hoist_only(tmp_path) -> None:
    source = """
rules:
  - id: ticket
    match: {role: system, pattern: 'Ticket: T-[0-9]+'}
    action: drop
    per_request: true
"""
    with pytest.raises(RuleError, match="does not apply to action 'drop'"):
        ruleset_from(tmp_path, source)


def test_a_users_line_that_holds_a_time_names_the_conversation_by_the_rest() -> None:
    def scope(line: str) -> str:
        return conversation_scope("s", [("tail_end", line, False)])

    first = scope("User: alice, plan: pro, local time 14:03")
    assert first == scope("User: alice, plan: pro, local time 14:09")  # the next turn, a new time
    assert first != scope("User: bob, plan: pro, local time 14:03")
    assert scope("Seen 2026-12-05T10:00:00Z") == scope("Seen 2026-12-06T11:30:00Z")
    assert scope("Customer: Jane (since Dec 5, 2026)") == scope("Customer: Jane (since Dec 6, 2026)")

    # through the rules: the time in the user's line changes every turn, the history is still reused
    def turn(minute: int, more: bool) -> list[dict]:
        system = f"User: alice, plan: pro, local time 14:{minute:02d}\n\nBe brief."
        return customer_chat(system, more, (OPENER, REPLY, "More?"))

    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(turn(3, False), memory=memory, scope="s")
    assert DEFAULT.apply(turn(9, True), memory=memory, scope="s").history.reused_turns == 1


GREETING = ("Hi", "Hello! How can I help you today?", "What did we say?")
"""A customer's opening exchange, the same for every customer: (first question, reply, follow-up)."""


def customer_chat(system: str, more: bool, exchange: tuple[str, str, str] = GREETING) -> list[dict]:
    """A chat under ``system`` that opens with ``exchange``'s first question (by default as every other
    customer's: "Hi"); with ``more``, its second turn (the reply and the follow-up)."""
    question, reply, follow_up = exchange
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if more:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    return messages


@pytest.mark.parametrize(
    ("line", "first", "second", "private"),
    [
        (
            "Last login: 2025-03-02 22:{minute:02d} from {who}",
            "203.0.113.7 (Paris, iPhone)",
            "198.51.100.4 (Oslo, Android)",
            "Paris",
        ),
        ("Current time: 10:{minute:02d} for the patient {who}.", "Alice Martin", "Bob Jones", "Alice Martin"),
        ("Last login: 2025-03-02 22:{minute:02d} from {who}", "203.0.113.7", "198.51.100.4", "203.0.113.7"),
        (
            "Session started at: 09:{minute:02d} by {who}",
            "alice@example.com",
            "bob@example.com",
            "alice@example.com",
        ),
    ],
)
def test_a_per_request_line_names_the_conversation_by_what_is_not_its_time(
    line, first, second, private
) -> None:
    """A re-check of the trial's leak: the date rules hoist a whole line or sentence as one per-request value, and
    such a line can hold the customer's own data besides its time. The memory's scope keeps what is left once
    the time is masked: another customer never gets the line, the same customer's next turn (a new time) still
    reuses its history."""

    def request(who: str, minute: int, more: bool) -> list[dict]:
        clinic = "You are the clinic assistant. Be brief.\n"
        return customer_chat(clinic + line.format(minute=minute, who=who) + "\nBe kind.", more)

    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(request(first, 0, False), memory=memory, scope="clinic")
    own = DEFAULT.apply(request(first, 5, True), memory=memory, scope="clinic")
    assert own.hoisted and own.history.reused_turns == 1  # hoisted, and its time moved: still its history
    other = DEFAULT.apply(request(second, 6, True), memory=memory, scope="clinic")
    assert private not in all_text(other.messages) and other.history.reused_turns == 0


def test_an_agents_git_status_changing_between_turns_keeps_its_history_for_a_named_user() -> None:
    """A git status is per request and private (``Rule.private``): with the end user named in the scope (the
    gateway's ``USER_MARK``, from OpenAI ``user`` or Anthropic ``metadata.user_id``, which Claude Code sends) a
    new status keeps the history; without it the status names the conversation, so the history is not reused
    (and cannot be another user's)."""

    def turn(status: str, more: bool) -> list[dict]:
        system = f"You are a coding agent.\ngitStatus:\n{status}\n\nBe careful."
        return customer_chat(system, more, ("Fix the parser.", "Edited parser.py.", "Tests?"))

    for scope, reused in (("s" + USER_MARK + "user_7f3a", 1), ("s", 0)):
        memory = TranscriptMemory(InProcessTranscriptStore())
        DEFAULT.apply(turn(" M README.md", False), memory=memory, scope=scope)
        later = DEFAULT.apply(turn(" M README.md\n M parser.py", True), memory=memory, scope=scope)
        assert later.history.reused_turns == reused
        same = DEFAULT.apply(turn(" M README.md", True), memory=memory, scope=scope)
        assert same.history.reused_turns == 1  # the same status: the same conversation either way


@pytest.mark.parametrize(
    ("first", "second", "private"),
    [
        ("Account balance: $12,840.22", "Account balance: $3.50", "12,840.22"),
        (
            "gitStatus:\n M src/app.py\n?? salaries_2025_confidential.csv",
            "gitStatus:\n M src/app.py\n?? notes.txt",
            "salaries_2025_confidential.csv",
        ),
    ],
)
def test_a_customers_private_values_never_reach_another_customers_prompt(first, second, private) -> None:
    """The fresh-user trial's leak: two customers of one app (one tenant, no ``user`` field) open with the same
    exchange; their system prompts differ in a per-request value that is the customer's own data. The second
    customer's next turn was built from the first one's stored history, the first one's balance (or the files
    of their git status) in its first block."""

    def request(line: str, minute: int, more: bool) -> list[dict]:
        time = f"Current time: 2025-03-03T10:{minute:02d}:00Z"
        return customer_chat(
            f"You are the Globex assistant. Be brief.\n{time}\n{line}\nNever discuss others.", more
        )

    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(request(first, 0, False), memory=memory, scope="bank")
    DEFAULT.apply(request(first, 1, True), memory=memory, scope="bank")
    other = DEFAULT.apply(request(second, 2, True), memory=memory, scope="bank")
    assert private not in all_text(other.messages)
    assert other.history.reused_turns == 0
    again = DEFAULT.apply(request(first, 3, True), memory=memory, scope="bank")
    assert again.history.reused_turns == 1  # the first customer's own conversation still finds its history


def test_a_refreshed_token_keeps_the_history_of_a_named_user_and_never_reaches_another() -> None:
    """A re-trial: an agent's access token refreshed mid-conversation re-rendered its history from the first turn
    (``miss=volatile; at=history``). A credential is per request and private, as a git status is: with the end
    user named the history is kept; without it the token names the conversation; another user's history,
    holding their token, is never reused."""

    def turn(token: str, more: bool) -> list[dict]:
        system = f"You are the CRM agent.\nAccess token: {token}\nBe careful."
        return customer_chat(system, more, ("List my open deals.", "You have three.", "The biggest?"))

    old, new = "ghp_16C7e42F292c6912E7710c838347Ae178B4a", "ghp_9aB7c3D1e5F2a8B4c6D0e9F1a3B5c7D2e4F6"
    for scope, reused in (("s" + USER_MARK + "user_7f3a", 1), ("s", 0)):
        memory = TranscriptMemory(InProcessTranscriptStore())
        first = DEFAULT.apply(turn(old, False), memory=memory, scope=scope)
        assert first.hoisted == [f"Access token: {old}"]
        refreshed = DEFAULT.apply(turn(new, True), memory=memory, scope=scope)
        assert refreshed.history.reused_turns == reused
        assert new in all_text(refreshed.messages)  # the current token is what the model reads last
    memory = TranscriptMemory(InProcessTranscriptStore())
    DEFAULT.apply(turn(old, False), memory=memory, scope="s")
    other = DEFAULT.apply(turn(new, True), memory=memory, scope="s")  # another user of the app, no user id
    assert old not in all_text(other.messages) and other.history.reused_turns == 0
