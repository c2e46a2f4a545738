"""Generators of volatile values in every form the shipped packs support, and the anchors that make
them volatile. Used by the stability, preservation and idempotence tests."""

from __future__ import annotations

import email.utils
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

KO_WEEKDAYS = "월화수목금토일"
JA_WEEKDAYS = "月火水木金土日"
ZH_WEEKDAYS = "一二三四五六日"


def _h12(dt: datetime) -> tuple[int, str]:
    hour = dt.hour % 12 or 12
    return hour, "AM" if dt.hour < 12 else "PM"


def _ko_time(dt: datetime) -> str:
    hour, ampm = _h12(dt)
    return f"{'오전' if ampm == 'AM' else '오후'} {hour}시 {dt.minute}분"


def _ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day:02d}{suffix}"


DATE_FORMATS: dict[str, Callable[[datetime], str]] = {
    "iso-date": lambda d: d.strftime("%Y-%m-%d"),
    "iso-minutes": lambda d: d.strftime("%Y-%m-%dT%H:%M"),
    "iso-utc": lambda d: d.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "iso-offset-micro": lambda d: d.isoformat(),
    "iso-space": lambda d: d.strftime("%Y-%m-%d %H:%M:%S"),
    "iso-space-utc": lambda d: d.strftime("%Y-%m-%d %H:%M:%S UTC"),
    "rfc2822": lambda d: email.utils.format_datetime(d),
    "rfc2822-gmt": lambda d: email.utils.format_datetime(d.astimezone(UTC), usegmt=True),
    "js-date": lambda d: d.strftime("%a %b %d %Y %H:%M:%S GMT%z") + " (Central European Summer Time)",
    "long-us": lambda d: d.strftime("%A, %B ") + f"{d.day}, {d.year}",
    "long-us-at-12h": lambda d: (
        d.strftime("%A, %B ") + f"{d.day}, {d.year} at {_h12(d)[0]}:" + d.strftime("%M:%S ") + _h12(d)[1]
    ),
    "long-us-12h-zone-name": lambda d: (
        d.strftime("%A, %B ")
        + f"{d.day}, {d.year} at {_h12(d)[0]}:"
        + d.strftime("%M:%S ")
        + _h12(d)[1]
        + " Central European Summer Time"
    ),
    "ordinal-dmy": lambda d: f"{_ordinal(d.day)} {d.strftime('%B')}, {d.year}",
    "dmy": lambda d: f"{d.day} {d.strftime('%B %Y')}",
    "us-numeric-gmt": lambda d: d.strftime("%m/%d/%Y, %H:%M GMT"),
    "us-locale": lambda d: f"{d.month}/{d.day}/{d.year}, {_h12(d)[0]}:" + d.strftime("%M:%S ") + _h12(d)[1],
    "eu-dotted": lambda d: d.strftime("%d.%m.%Y %H:%M"),
    "clock-24": lambda d: d.strftime("%H:%M:%S"),
    "clock-12-on-weekday": lambda d: f"{_h12(d)[0]}:{d.minute:02d} {_h12(d)[1]} on " + d.strftime("%A"),
    "clock-12-on-date-no-year": lambda d: (
        f"{_h12(d)[0]}:{d.minute:02d} {_h12(d)[1]} on " + d.strftime("%A, %B ") + str(d.day)
    ),
    "clock-24-zone": lambda d: d.strftime("%H:%M %Z") or d.strftime("%H:%M CEST"),
    "clock-12": lambda d: f"{_h12(d)[0]}:{d.minute:02d} {_h12(d)[1]}",
    "clock-12-dots": lambda d: f"{_h12(d)[0]}:{d.minute:02d} {'a.m.' if d.hour < 12 else 'p.m.'}",
    "ko-full": lambda d: f"{d.year}년 {d.month}월 {d.day}일 {_ko_time(d)}",
    "ko-weekday-24h": lambda d: f"{d.year}년 {d.month}월 {d.day}일 ({KO_WEEKDAYS[d.weekday()]}) {d:%H:%M}",
    "ko-locale": lambda d: (
        f"{d.year}. {d.month}. {d.day}. {'오전' if d.hour < 12 else '오후'} {_h12(d)[0]}:{d:%M:%S}"
    ),
    "ja-full": lambda d: f"{d.year}年{d.month}月{d.day}日 {d.hour}時{d.minute}分",
    "ja-weekday-12h": lambda d: (
        f"{d.year}年{d.month}月{d.day}日({JA_WEEKDAYS[d.weekday()]}) "
        f"{'午前' if d.hour < 12 else '午後'}{_h12(d)[0]}時{d.minute}分"
    ),
    "ja-locale": lambda d: f"{d.year}/{d.month}/{d.day} {d:%H:%M:%S}",
    "zh-full": lambda d: (
        f"{d.year}年{d.month}月{d.day}日 {'上午' if d.hour < 12 else '下午'}{_h12(d)[0]}点{d.minute}分"
    ),
    "zh-weekday-24h": lambda d: f"{d.year}年{d.month}月{d.day}日 星期{ZH_WEEKDAYS[d.weekday()]} {d:%H:%M}",
}
"""Every date/time form of the dates pack: name -> render(aware datetime)."""

DATE_ANCHORS: dict[str, str] = {
    "label-current-date": "Current date: {v}",
    "label-current-time": "Current time: {v}",
    "label-current-date-and-time": "Current date and time: {v}",
    "label-todays-date": "Today's date: {v}",
    "label-bold-bullet": "- **Current date:** {v}",
    "label-session": "Session: {v}",
    "env-block": "<env>\nWorking directory: /home/user/project\nIs git repo: yes\nToday's date: {v}\n</env>",
    "sentence-todays-date": "Today's date is {v}.",
    "sentence-current-time": "The current time is {v}.",
    "sentence-current-date": "The current date is {v}.",
    "sentence-it-is-currently": "It is currently {v}.",
    "sentence-conversation-started": "This conversation started at {v}.",
    "sentence-conversation-started-bare": "Conversation started on {v}.",
    "sentence-mid-paragraph": "You are a careful assistant. The current date is {v}. Use it for relative dates.",
    "ko-label": "현재 시각: {v}",
    "ko-sentence": "오늘은 {v}입니다.",
    "ja-label": "現在の日時: {v}",
    "ja-sentence": "現在の日時は{v}です。",
    "zh-label": "当前时间：{v}",
    "zh-sentence": "今天是{v}。",
}
"""Anchors that make a date volatile: name -> template with {v}."""

ANCHOR_REMAINDER: dict[str, str] = {
    "env-block": "<env>\nIs git repo: yes\n</env>",
    "sentence-mid-paragraph": "You are a careful assistant. Use it for relative dates.",
}
"""What an anchor line becomes after hoisting (absent: nothing is left)."""

ANCHOR_OTHER_HOISTED: dict[str, list[str]] = {
    "env-block": ["Working directory: /home/user/project"],
}
"""Per-user lines of an anchor hoisted besides the date (the per_user pack's environment lines)."""


def random_datetime(rng: random.Random) -> datetime:
    """An aware datetime in 2001-2033 at +02:00, any microsecond."""
    start = datetime(2001, 1, 1, tzinfo=timezone(timedelta(hours=2)))
    return start + timedelta(seconds=rng.randrange(0, 32 * 365 * 86400), microseconds=rng.randrange(1, 10**6))


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


OTHER_VOLATILE: dict[str, Callable[[random.Random], str]] = {
    "session-uuid": lambda r: f"Session ID: {uuid.UUID(int=r.getrandbits(128), version=4)}",
    "request-id": lambda r: f"Request-Id: req_{_hex(r, 12)}",
    "trace-id": lambda r: f"trace_id = {_hex(r, 32)}",
    "traceparent": lambda r: f"traceparent: 00-{_hex(r, 32)}-{_hex(r, 16)}-01",
    "conversation-id": lambda r: f"Conversation ID: conv-{r.randrange(10**6, 10**9)}",
    "user-id-bold": lambda r: f"- **User ID:** {r.randrange(1, 10**8)}",
    "uuid-sentence": lambda r: f"Your session ID is {uuid.UUID(int=r.getrandbits(128), version=4)}.",
    "epoch-seconds": lambda r: f"Timestamp: {r.randrange(1_000_000_000, 2_000_000_000)}",
    "epoch-ms": lambda r: f"ts={r.randrange(1_000_000_000_000, 2_000_000_000_000)}",
    "epoch-sentence": lambda r: f"The current Unix timestamp is {r.randrange(1_000_000_000, 2_000_000_000)}.",
    "nonce": lambda r: f"Nonce: {_hex(r, r.randrange(16, 65))}",
    "cache-buster": lambda r: f"Cache-buster: {_hex(r, 24).upper()}",
    "location": lambda r: (
        "User location: "
        + r.choice(
            [
                "Berlin, Germany",
                "Seoul, South Korea",
                "San Francisco, CA, United States",
                "Zürich, Switzerland",
            ]
        )
    ),
    "timezone": lambda r: (
        "Timezone: " + r.choice(["Europe/Berlin", "Asia/Seoul", "America/New_York", "UTC+09:00"])
    ),
    "location-sentence": lambda r: (
        "The user is located in " + r.choice(["Berlin, Germany", "Osaka, Japan"]) + "."
    ),
    "location-ko": lambda r: "현재 위치: " + r.choice(["서울", "부산"]),
    "location-ja": lambda r: "タイムゾーン: " + r.choice(["Asia/Tokyo", "UTC+9"]),
    "location-zh": lambda r: "用户位置：" + r.choice(["北京", "上海"]),
}
"""Other volatile lines (ids, epochs, nonces, location): name -> render(rng)."""
