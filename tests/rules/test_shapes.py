"""The shape families of issue 11 hoisted by the default rules: for each family several values give the same
stable prefix, each value is hoisted once and kept in the prompt, and the text around it stays."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest

from rules import load_ruleset
from tests.rules.helpers import all_text

DEFAULT = load_ruleset(["default"])
HEAD = "You are a helpful assistant for ACME. Keep answers short.\n"
TAIL = "\nAlways cite your sources."


def _times(seed: str, n: int = 4) -> list[datetime]:
    rng = random.Random(seed)
    start = datetime(2019, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    return [start + timedelta(seconds=rng.randrange(0, 12 * 365 * 86400)) for _ in range(n)]


def _h12(d: datetime) -> str:
    return f"{d.hour % 12 or 12}"


def _ampm(d: datetime) -> str:
    return "AM" if d.hour < 12 else "PM"


Family = tuple[str, Callable[[datetime], str]]

# name -> (line template with {v} for the volatile value, render(datetime) -> value). The whole line is hoisted.
DATE_FAMILIES: dict[str, Family] = {
    "date-inside-sentence": ("Use the actual current date, {v}.", lambda d: f"{d:%A, %B} {d.day}, {d.year}"),
    "date-inside-sentence-iso": ("For reference, the current date is {v}.", lambda d: f"{d:%Y-%m-%d}"),
    "date-after-current-date-colon": (
        "Keep in mind the current date: {v}.",
        lambda d: f"{d:%B} {d.day}, {d.year}",
    ),
    "weekday-first-iso-offset": (
        "The current date and time is {v}",
        lambda d: f"{d:%A, %Y-%m-%d %H:%M:%S %z}",
    ),
    "weekday-first-short": ("The current date and time is: {v}", lambda d: f"{d:%a} {d.day} {d:%b %Y}"),
    "weekday-first-dotted": ("Current date: {v}", lambda d: f"{d:%a %d.%m.%Y}"),
    "month-year": ("It is currently {v}.", lambda d: f"{d:%B %Y}"),
    "month-year-plain-it-is": ("It is {v}.", lambda d: f"{d:%B %Y}"),
    "month-year-label": ("Current month: {v}", lambda d: f"{d:%B %Y}"),
    "no-year-label": ("Current date: {v}", lambda d: f"{d:%A, %B} {d.day}"),
    "no-year-sentence": ("Today is {v}.", lambda d: f"{d:%B} {d.day}"),
    "no-year-ordinal": ("Today is {v}.", lambda d: f"{d:%A}, the {d.day}th of {d:%B}"),
    "lowercase-month": ("today's date: {v}", lambda d: f"{d:%B}".lower() + f" {d.day}, {d.year}"),
    "lowercase-weekday-month": (
        "Current date: {v}",
        lambda d: f"{d:%A}".lower() + f", {d.day} {d:%B}".lower() + f" {d.year}",
    ),
    "iso-week": ("Current week: {v}", lambda d: f"{d.isocalendar().year}-W{d.isocalendar().week:02d}"),
    "iso-week-day": ("Current date: {v}", lambda d: "{}-W{:02d}-{}".format(*d.isocalendar())),
    "ydm-unambiguous": ("Current date: {v}", lambda d: f"{d:%Y}-{max(d.day, 13)}-{d:%m}"),
    "time-without-minutes": ("Current time: {v}", lambda d: f"{_h12(d)} {_ampm(d)}"),
    "time-without-minutes-compact": ("Local time: {v}", lambda d: f"{_h12(d)}{_ampm(d).lower()}"),
    "time-without-minutes-dots": (
        "Assume the current time is {v}.",
        lambda d: f"{_h12(d)} " + ("a.m." if d.hour < 12 else "p.m."),
    ),
    "time-offset-paren": ("Current time: {v}", lambda d: f"{d:%H:%M} (UTC+1)"),
    "time-gmt-offset": ("Current time: {v}", lambda d: f"{d:%H:%M} GMT+01:00"),
    "time-zone-name": ("Current time: {v}", lambda d: f"{d:%H:%M} Europe/Berlin"),
    "time-zone-long-name": (
        "The current time is {v}.",
        lambda d: f"{_h12(d)}:{d:%M} {_ampm(d)} Pacific Time",
    ),
    "time-abbrev": ("Local time: {v}", lambda d: f"{_h12(d)} {_ampm(d)} CET"),
    "datetime-iso-z": ("It is now {v}.", lambda d: f"{d:%Y-%m-%dT%H:%M:%S}Z"),
    "right-now-its": ("Right now it's {v}.", lambda d: f"{d:%H:%M}"),
    "weekday-alone-sentence": ("Today is {v}.", lambda d: f"{d:%A}"),
    "weekday-alone-label": ("Current day: {v}", lambda d: f"{d:%A}"),
    "weekday-alone-phrase": ("The current day is {v}.", lambda d: f"{d:%A}"),
    "conversation-on": ("This conversation is happening on {v}.", lambda d: f"{d:%A, %B} {d.day}, {d.year}"),
    "date-and-time-clause": (
        "The current date is {v}.",
        lambda d: f"{d:%A}, {d.day} {d:%B %Y}, and the time is {d:%H:%M}",
    ),
    "label-with-zone-paren": ("Today's date (UTC): {v}", lambda d: f"{d:%Y-%m-%d}"),
    "bare-date-label": ("Date: {v}", lambda d: f"{d:%Y-%m-%d}"),
    "js-date-sentence": (
        "Today is {v}.",
        lambda d: f"{d:%a %b %d %Y %H:%M:%S} GMT+0100 (Central European Standard Time)",
    ),
    "year-remember": ("Remember it is {v} this year.", lambda d: f"{d.year}"),
    "year-sentence": ("The current year is {v}.", lambda d: f"{d.year}"),
    "year-it-is": ("It is {v}.", lambda d: f"{d.year}"),
    "year-label": ("Current year: {v}", lambda d: f"{d.year}"),
    "date-mid-sentence-with-tail": (
        "Please keep in mind that the current date is {v} when answering.",
        lambda d: f"{d:%Y-%m-%d}",
    ),
    "phrase-with-joined-clause": (
        "The current date is {v} and you should use it.",
        lambda d: f"{d:%A, %B} {d.day}, {d.year}",
    ),
    "phrase-with-semicolon-clause": (
        "Today's date is {v}; use it for relative dates.",
        lambda d: f"{d:%Y-%m-%d}",
    ),
    "year-month-label": ("Current month: {v}", lambda d: f"{d:%Y-%m}"),
    "week-of-year": (
        "It is currently {v}.",
        lambda d: f"week {d.isocalendar().week} of {d.isocalendar().year}",
    ),
    "a-weekday": ("Today is {v}.", lambda d: f"a {d:%A}"),
    "time-now-is": ("The time now is {v}.", lambda d: f"{_h12(d)}:{d:%M} {_ampm(d)}"),
}


def _request(line: str) -> list[dict]:
    return [{"role": "system", "content": HEAD + line + TAIL}, {"role": "user", "content": "What now?"}]


def _check_hoisted(lines: list[str], expected_system: str, expected_hoisted: list[str] | None = None) -> None:
    canons = [DEFAULT.apply(_request(line)) for line in lines]
    assert len({c.stable_prefix_material() for c in canons}) == 1
    for canon, line in zip(canons, lines, strict=True):
        assert canon.messages[0]["content"] == expected_system
        assert canon.hoisted == (expected_hoisted if expected_hoisted is not None else [line])
        text = all_text(canon.messages)
        for value in canon.hoisted:
            assert text.count(value) == 1


@pytest.mark.parametrize("family", sorted(DATE_FAMILIES))
def test_date_families_are_hoisted_with_several_values(family: str) -> None:
    template, render = DATE_FAMILIES[family]
    values = list(dict.fromkeys(render(d) for d in _times(family, 6)))[:4]
    assert len(values) >= 2
    _check_hoisted([template.format(v=v) for v in values], HEAD.rstrip("\n") + TAIL)


def test_knowledge_cutoff_on_the_same_line_stays_in_either_order() -> None:
    for d in _times("cutoff"):
        for line, left in (
            (f"Current date: {d:%Y-%m-%d}. Knowledge cutoff: 2024-06.", "Knowledge cutoff: 2024-06."),
            (f"Knowledge cutoff: 2024-06. Current date: {d:%Y-%m-%d}.", "Knowledge cutoff: 2024-06."),
        ):
            canon = DEFAULT.apply(_request(line))
            assert canon.messages[0]["content"] == HEAD + left + TAIL
            assert canon.hoisted == [f"Current date: {d:%Y-%m-%d}."]


def test_date_inside_a_paragraph_hoists_only_its_sentence() -> None:
    for d in _times("paragraph"):
        date = f"{d:%A, %B} {d.day}, {d.year}"
        line = (
            "When the user asks about recent events, check the cutoff and says so. "
            f"Use the actual current date, {date}."
        )
        canon = DEFAULT.apply(_request(line))
        assert canon.messages[0]["content"] == HEAD + line.split(" Use the")[0] + TAIL
        assert canon.hoisted == [f"Use the actual current date, {date}."]


PLACE_FAMILIES: dict[str, tuple[str, list[str]]] = {
    "timezone-after-colon": (
        "Very important: The user's timezone is {v}.",
        ["Europe/Berlin", "Asia/Seoul", "America/Argentina/Buenos_Aires", "UTC"],
    ),
    "configured-timezone": (
        "The user's configured timezone is {v}.",
        ["Europe/Berlin", "America/New_York", "Asia/Kolkata"],
    ),
    "location-is-in": (
        "The user's current location is in {v}.",
        ["Berlin, DE", "São Paulo, BR", "Osaka, JP"],
    ),
    "remember-location": (
        "Remember the current location is {v}.",
        ["Berlin, Germany", "Lyon, France", "Austin, TX, United States"],
    ),
    "lives-in": ("The user lives in {v}.", ["Berlin", "the Netherlands", "Rio de Janeiro, Brazil"]),
    "locale-upper": ("User locale: {v}", ["de-DE", "pt-BR", "ja-JP", "zh-Hant-TW"]),
    "locale-lower": ("User locale: {v}", ["de-de", "pt-br", "en_us.UTF-8", "fr-ca"]),
    "locale-sentence": ("The user's locale is {v}.", ["fr-CA", "de-DE", "ko-KR"]),
    "language-tag": ("Preferred language: {v}", ["de-DE", "pt-br", "en-US"]),
    "location-the": ("User location: {v}", ["the Netherlands", "the United Kingdom", "the Czech Republic"]),
    "windows-zone": (
        "Timezone: {v}",
        ["(UTC+01:00) Berlin", "(UTC-05:00) Eastern Time (US & Canada)", "(UTC+09:00) Osaka, Sapporo, Tokyo"],
    ),
    "zone-long-name": (
        "User timezone: {v}",
        ["Pacific Standard Time", "Central European Standard Time", "Tokyo Standard Time"],
    ),
    "zone-offset": ("Time zone: {v}", ["GMT+2", "+09:00", "UTC-03:30", "utc"]),
    "located-at-coordinates": ("The user is located at {v}.", ["52.52, 13.40", "-33.87, 151.21"]),
    "user-timezone-is": ("User timezone is {v}.", ["Europe/Berlin", "Asia/Tokyo"]),
    "your-user-located": ("Your user is located in {v}.", ["Berlin, Germany", "Lima, Peru"]),
    "label-with-paren": ("Location (approximate): {v}", ["Berlin, Germany", "Lima, Peru"]),
    "two-facts-one-sentence": (
        "The user's city is {v} and their timezone is Europe/Berlin.",
        ["Berlin", "Bonn"],
    ),
    "location-appears": ("The user's location appears to be {v}.", ["Lyon, France", "Kyoto, Japan"]),
    "coordinates-sentence": (
        "The user's location is {v}.",
        ["-23.55, -46.63", "52.52, 13.40", "34.69, 135.50"],
    ),
    "coordinates-label": ("Coordinates: {v}", ["52.5200° N, 13.4050° E", "35.6762° N, 139.6503° E"]),
    "ip-label": ("User IP: {v}", ["203.0.113.5", "198.51.100.23", "192.0.2.77"]),
    "bold-bullet-location": ("- **Location:** {v}", ["Berlin, Germany", "Seoul, South Korea", "Zürich"]),
}


@pytest.mark.parametrize("family", sorted(PLACE_FAMILIES))
def test_location_locale_and_zone_families(family: str) -> None:
    template, values = PLACE_FAMILIES[family]
    _check_hoisted([template.format(v=v) for v in values], HEAD.rstrip("\n") + TAIL)


PER_USER_FAMILIES: dict[str, tuple[str, list[str]]] = {
    "name-label": ("User's name: {v}", ["Ann Lee", "Jonas Becker", "María José García"]),
    "name-bold": ("- **User name:** {v}", ["Ann Lee", "Kenji Watanabe", "Ole Hansen"]),
    "name-sentence": ("The user's name is {v}.", ["Ann Lee", "Priya Nair", "Tomás Ruiz"]),
    "talking-with": ("You are talking with {v}.", ["Ann Lee", "Jonas Becker"]),
    "preferred-name": ("The user's preferred name is {v}.", ["Annie", "Jo", "Mari"]),
    "email-sentence": (
        "The user's email is {v}.",
        ["ann.lee@contoso.com", "jb@fabrikam.de", "k.w@example.jp"],
    ),
    "time-of-day": ("Approximate time of day: {v}.", ["morning", "afternoon", "evening", "night"]),
    "time-of-day-sentence": ("It is currently {v} for the user.", ["morning", "late evening", "afternoon"]),
    "working-directory": (
        "Working directory: {v}",
        ["/home/ann/app", "/Users/jonas/src/app", "C:\\src\\app"],
    ),
    "cwd-primary": ("Primary working directory: {v}", ["/workspace/app", "~/code/app", "/srv/app"]),
    "branch": ("Current branch: {v}", ["main", "feature/login", "fix/JIRA-123-typo"]),
    "path-with-id": (
        "Scratchpad directory: {v}",
        ["/tmp/agent-3f2c8a9e1b/", "/tmp/agent-77ab01cd92/", "/tmp/session-8f3a2b91/work"],
    ),
    "path-with-uuid": (
        "Session folder: {v}",
        [
            "/home/u/.app/sessions/3f2c8a9e-1b2c-4d5e-8f90-1234567890ab",
            "/home/u/.app/sessions/77ab01cd-9200-4e11-a3b4-5c6d7e8f9a0b",
        ],
    ),
    "path-with-id-sentence": (
        "Your uploads are in {v}.",
        ["/mnt/user-data/uploads/abc123def456", "/mnt/user-data/uploads/9f8e7d6c5b4a"],
    ),
}


@pytest.mark.parametrize("family", sorted(PER_USER_FAMILIES))
def test_per_user_line_families(family: str) -> None:
    template, values = PER_USER_FAMILIES[family]
    _check_hoisted([template.format(v=v) for v in values], HEAD.rstrip("\n") + TAIL)


MEMORIES = [
    "- Prefers vegetarian food\n- Has a dog named Pixel",
    "- Training for a half marathon\n- Works night shifts\n  (mostly on weekends)",
    "1. Learning Japanese\n2. Allergic to peanuts",
]


@pytest.mark.parametrize(
    "header",
    [
        "## Memory",
        "# Saved memories",
        "### What you know about the user",
        "Memories:",
        "User memory:",
        "**Memories:**",
    ],
)
def test_memory_sections_with_a_list_are_hoisted_whole(header: str) -> None:
    blocks = [f"{header}\n{m}" for m in MEMORIES]
    _check_hoisted(blocks, HEAD.rstrip("\n") + TAIL)


@pytest.mark.parametrize("tag", ["memory", "memories", "user_memories", "userMemories", "user_profile"])
def test_memory_tag_blocks_are_hoisted_whole(tag: str) -> None:
    blocks = [f"<{tag}>\n{m}\n</{tag}>" for m in MEMORIES]
    _check_hoisted(blocks, HEAD.rstrip("\n") + TAIL)


def test_a_one_line_memory_tag_is_hoisted_but_a_tag_inside_an_instruction_stays() -> None:
    _check_hoisted(
        [f"<user_memory>{m}</user_memory>" for m in ("Likes tea.", "Has two kids.", "Vegan.")],
        HEAD.rstrip("\n") + TAIL,
    )
    instruction = "Write each new fact as <memory>fact</memory> at the end of your reply."
    assert DEFAULT.apply(_request(instruction)).hoisted == []


def test_git_status_and_recent_commits_blocks_are_hoisted_up_to_a_blank_line() -> None:
    variants = [
        ("Git status:\n M src/app.py\n?? notes.txt", "Recent commits:\na1b2c3d Fix pager"),
        ("Git status:\nclean", "Recent commits:\n0c1d2e3 Bump httpx\n4f5a6b7 Drop 3.9"),
        ("gitStatus: snapshot at the start\n D old.py", "Recent commits:\nbeefcaf Initial import"),
    ]
    lines = [f"{status}\n\n{commits}" for status, commits in variants]
    canons = [DEFAULT.apply(_request(line)) for line in lines]
    assert len({c.stable_prefix_material() for c in canons}) == 1
    for canon, (status, commits) in zip(canons, variants, strict=True):
        assert canon.hoisted == [status, commits]


def test_environment_block_keeps_its_stable_lines() -> None:
    for d in _times("env"):
        env = (
            f"<env>\nWorking directory: /home/ann/p{d.minute}\nIs directory a git repo: Yes\nPlatform: linux\n"
            f"Today's date: {d:%Y-%m-%d}\n</env>"
        )
        canon = DEFAULT.apply(_request(env))
        assert (
            canon.messages[0]["content"]
            == HEAD + "<env>\nIs directory a git repo: Yes\nPlatform: linux\n</env>" + TAIL
        )
        assert canon.hoisted == [f"Today's date: {d:%Y-%m-%d}", f"Working directory: /home/ann/p{d.minute}"]
