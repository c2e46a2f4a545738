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
    # what ICU 72+ prints (Node 20, Chrome 110 toLocaleString): a narrow no-break space before AM / PM
    "us-locale-icu": lambda d: (
        f"{d.month}/{d.day}/{d.year}, {_h12(d)[0]}:" + d.strftime("%M:%S") + "\u202f" + _h12(d)[1]
    ),
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
    "label-no-break-spaces": "Current\u00a0date:\u00a0{v}",
    "tag-current-date": "<current_date>{v}</current_date>",
    "tag-current-time-block": "<current_time>\n{v}\n</current_time>",
    "tag-inline": "You are a careful assistant. <currentDateTime>{v}</currentDateTime> Use it for relative dates.",
    "label-bold-bullet": "- **Current date:** {v}",
    "label-session": "Session: {v}",
    "label-last-login": "Last login: {v}",
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
    "tag-inline": "You are a careful assistant. Use it for relative dates.",
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


def _b64(rng: random.Random, n: int) -> str:
    """``n`` base64url characters holding a digit."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
    return "".join(rng.choice(alphabet) for _ in range(n - 1)) + rng.choice("0123456789")


def _jwt(rng: random.Random) -> str:
    """A JSON Web Token's shape: base64url header (``{"`` -> ``eyJ``), payload and signature."""
    return f"eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJ{_b64(rng, 40)}.{_b64(rng, 43)}"


OTHER_VOLATILE: dict[str, Callable[[random.Random], str]] = {
    "session-uuid": lambda r: f"Session ID: {uuid.UUID(int=r.getrandbits(128), version=4)}",
    "request-id": lambda r: f"Request-Id: req_{_hex(r, 12)}",
    "trace-id": lambda r: f"trace_id = {_hex(r, 32)}",
    "traceparent": lambda r: f"traceparent: 00-{_hex(r, 32)}-{_hex(r, 16)}-01",
    "conversation-id": lambda r: f"Conversation ID: conv-{r.randrange(10**6, 10**9)}",
    "user-id-bold": lambda r: f"- **User ID:** {r.randrange(1, 10**8)}",
    "tokens-remaining": lambda r: f"Tokens remaining: {r.randrange(1, 10**6)}",
    "credits-used": lambda r: f"Credits used: {r.randrange(0, 500)} of 500",
    "message-number": lambda r: f"Message number: {r.randrange(1, 100)}",
    "account-balance": lambda r: f"- Account balance: ${r.randrange(0, 10**4)}.{r.randrange(0, 100):02d}",
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
    "relative-last-login": lambda r: (
        f"Last login: {r.randrange(2, 59)} {r.choice(['minutes', 'hours', 'days'])} ago"
    ),
    "relative-conversation-started": lambda r: f"The conversation started {r.randrange(2, 59)} minutes ago.",
    "relative-session-started-at": lambda r: f"Session started at: about {r.randrange(2, 23)} hours ago",
    "client-ip": lambda r: f"Client IP: 203.0.{r.randrange(0, 256)}.{r.randrange(1, 255)}",
    "location-tag": lambda r: (
        "<user_location>" + r.choice(["Berlin, Germany", "Osaka, Japan", "Austin, TX"]) + "</user_location>"
    ),
    "timezone-tag-block": lambda r: (
        "<timezone>\n" + r.choice(["Europe/Berlin", "Asia/Seoul", "America/New_York"]) + "\n</timezone>"
    ),
    "user-name-tag": lambda r: (
        "<user_name>" + r.choice(["Ann Lee", "Bo Kim", "Jean Dupont"]) + "</user_name>"
    ),
    "user-email-tag": lambda r: f"<user_email>user{r.randrange(10**6)}@example.com</user_email>",
    "location-ko": lambda r: "현재 위치: " + r.choice(["서울", "부산"]),
    "location-ja": lambda r: "タイムゾーン: " + r.choice(["Asia/Tokyo", "UTC+9"]),
    "location-zh": lambda r: "用户位置：" + r.choice(["北京", "上海"]),
    # credentials an agent framework puts in the system prompt (the user's current token)
    "authorization-bearer-jwt": lambda r: f"Authorization: Bearer {_jwt(r)}",
    "access-token-jwt": lambda r: f"Access token: {_jwt(r)}",
    "api-key": lambda r: f"API key: sk-proj-{_b64(r, 24)}",
    "github-token": lambda r: f"- **GitHub token:** `ghp_{_b64(r, 36)}`",
    "session-token-sentence": lambda r: f"Use the session token {_b64(r, 32)} for every tool call.",
    "access-token-is": lambda r: f"Your access token is {_jwt(r)}.",
}
"""Other volatile lines (ids, epochs, nonces, location): name -> render(rng)."""


# --- German, French, Spanish, Portuguese and Italian -------------------------------------------------------

WEEKDAYS_EU: dict[str, list[str]] = {
    "de": ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag", "Sonntag"],
    "fr": ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"],
    "es": ["lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo"],
    "pt": [
        "segunda-feira",
        "terça-feira",
        "quarta-feira",
        "quinta-feira",
        "sexta-feira",
        "sábado",
        "domingo",
    ],
    "it": ["lunedì", "martedì", "mercoledì", "giovedì", "venerdì", "sabato", "domenica"],
}
MONTHS_EU: dict[str, list[str]] = {
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember".split(),
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre".split(),
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split(),
    "pt": "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro".split(),
    "it": "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre".split(),
}
MONTHS_ABBR_DE = "Jan. Feb. März Apr. Mai Juni Juli Aug. Sept. Okt. Nov. Dez.".split()
_ASCII = str.maketrans("áàâäçéèêíìîóôöúùûü", "aaaaceeeiiiooouuuu")


def _wd(lang: str, d: datetime) -> str:
    return WEEKDAYS_EU[lang][d.weekday()]


def _mo(lang: str, d: datetime) -> str:
    return MONTHS_EU[lang][d.month - 1]


def _fr_day(d: datetime) -> str:
    return "1er" if d.day == 1 else str(d.day)


def _de_long(d: datetime) -> str:
    return f"{_wd('de', d)}, {d.day}. {_mo('de', d)} {d.year}"


def _fr_long(d: datetime) -> str:
    return f"{_wd('fr', d)} {_fr_day(d)} {_mo('fr', d)} {d.year}"


def _es_long(d: datetime) -> str:
    return f"{_wd('es', d)}, {d.day} de {_mo('es', d)} de {d.year}"


def _pt_long(d: datetime) -> str:
    return f"{_wd('pt', d)}, {d.day} de {_mo('pt', d)} de {d.year}"


def _it_long(d: datetime) -> str:
    return f"{_wd('it', d)} {d.day} {_mo('it', d)} {d.year}"


EU_DATE_FORMATS: dict[str, dict[str, Callable[[datetime], str]]] = {
    "de": {
        "long": _de_long,
        "long-der-um-uhr": lambda d: f"{_wd('de', d)}, der {d.day}. {_mo('de', d)} {d.year} um {d:%H:%M} Uhr",
        "abbrev": lambda d: f"{d.day}. {MONTHS_ABBR_DE[d.month - 1]} {d.year}",
        "lower-ascii": lambda d: _de_long(d).lower().replace("ä", "ae"),
        "dotted": lambda d: d.strftime("%d.%m.%Y"),
        "dotted-weekday-uhr": lambda d: f"{_wd('de', d)}, {d:%d.%m.%Y}, {d:%H:%M} Uhr",
        "iso": lambda d: d.strftime("%Y-%m-%d %H:%M"),
        "no-year": lambda d: f"{_wd('de', d)}, {d.day}. {_mo('de', d)}",
    },
    "fr": {
        "long": _fr_long,
        "le": lambda d: f"le {_fr_day(d)} {_mo('fr', d)} {d.year}",
        "long-a-h": lambda d: f"{_fr_long(d)} à {d.hour}h{d.minute:02d}",
        "upper-ascii": lambda d: _fr_long(d).upper().translate(_ASCII).replace("AOÛT", "AOUT"),
        "slashed": lambda d: d.strftime("%d/%m/%Y %H:%M"),
        "iso": lambda d: d.strftime("%Y-%m-%d"),
        "no-year": lambda d: f"{_wd('fr', d)} {_fr_day(d)} {_mo('fr', d)}",
    },
    "es": {
        "long": _es_long,
        "long-a-las": lambda d: f"{_es_long(d)} a las {d:%H:%M}",
        "ascii-del": lambda d: f"{_wd('es', d)}, {d.day} de {_mo('es', d)} del {d.year}".translate(_ASCII),
        "el": lambda d: f"el {d.day} de {_mo('es', d)} de {d.year}",
        "slashed": lambda d: d.strftime("%d/%m/%Y"),
        "no-year": lambda d: f"{_wd('es', d)}, {d.day} de {_mo('es', d)}",
    },
    "pt": {
        "long": _pt_long,
        "as-h": lambda d: f"{d.day} de {_mo('pt', d)} de {d.year} às {d.hour}h{d.minute:02d}",
        "ascii": lambda d: _pt_long(d).translate(_ASCII),
        "slashed": lambda d: d.strftime("%d/%m/%Y %H:%M"),
        "no-year": lambda d: f"{d.day} de {_mo('pt', d)}",
    },
    "it": {
        "long": _it_long,
        "alle": lambda d: f"{_it_long(d)} alle {d:%H:%M}",
        "ascii": lambda d: _it_long(d).translate(_ASCII),
        "slashed": lambda d: d.strftime("%d/%m/%Y"),
        "il": lambda d: f"il {d.day} {_mo('it', d)} {d.year}",
        "no-year": lambda d: f"{_wd('it', d)} {d.day} {_mo('it', d)}",
    },
}
"""European date forms (with an optional time): language -> name -> render(aware datetime)."""

EU_TIME_FORMATS: dict[str, dict[str, Callable[[datetime], str]]] = {
    "de": {"uhr": lambda d: f"{d:%H:%M} Uhr", "clock": lambda d: d.strftime("%H:%M:%S")},
    "fr": {"h": lambda d: f"{d.hour}h{d.minute:02d}", "clock": lambda d: d.strftime("%H:%M")},
    "es": {"clock": lambda d: d.strftime("%H:%M"), "horas": lambda d: f"{d:%H:%M} horas"},
    "pt": {"clock": lambda d: d.strftime("%H:%M"), "h": lambda d: f"{d.hour}h{d.minute:02d}"},
    "it": {"clock": lambda d: d.strftime("%H:%M")},
}
"""European time forms: language -> name -> render(aware datetime)."""

EU_DATE_ANCHORS: dict[str, list[str]] = {
    "de": [
        "Aktuelles Datum: {v}",
        "Heutiges Datum: {v}",
        "Datum: {v}",
        "- **Aktuelles Datum:** {v}",
        "Heute ist {v}.",
        "Das heutige Datum ist {v}.",
        "Das aktuelle Datum ist {v}, bitte beachte das.",
        "Wir haben heute {v}.",
    ],
    "fr": [
        "Date actuelle : {v}",
        "Date du jour : {v}",
        "Date : {v}",
        "Nous sommes {v}.",
        "Aujourd'hui, nous sommes {v}.",
        "Aujourd'hui est {v}.",
        "La date d'aujourd'hui est {v}.",
        "La date actuelle est {v}, tiens-en compte.",
    ],
    "es": [
        "Fecha actual: {v}",
        "Fecha de hoy: {v}",
        "Fecha: {v}",
        "Hoy es {v}.",
        "La fecha de hoy es {v}.",
        "La fecha actual es {v}.",
        "Estamos a {v}.",
    ],
    "pt": [
        "Data atual: {v}",
        "Data de hoje: {v}",
        "Data: {v}",
        "Hoje é {v}.",
        "A data de hoje é {v}.",
        "A data atual é {v}.",
    ],
    "it": [
        "Data attuale: {v}",
        "Data odierna: {v}",
        "Data di oggi: {v}",
        "Data: {v}",
        "Oggi è {v}.",
        "La data di oggi è {v}.",
        "La data odierna è {v}.",
    ],
}
"""Anchors that make a European date current: language -> templates with {v} (each hoisted whole)."""

EU_TIME_ANCHORS: dict[str, list[str]] = {
    "de": [
        "Aktuelle Uhrzeit: {v}",
        "Uhrzeit: {v}",
        "Es ist {v}.",
        "Es ist jetzt {v}.",
        "Die aktuelle Uhrzeit ist {v}.",
    ],
    "fr": ["Heure actuelle : {v}", "Heure : {v}", "Il est {v}.", "L'heure actuelle est {v}."],
    "es": ["Hora actual: {v}", "Hora: {v}", "Son las {v}.", "La hora actual es {v}."],
    "pt": ["Hora atual: {v}", "Hora: {v}", "São {v}.", "A hora atual é {v}."],
    "it": ["Ora attuale: {v}", "Ora: {v}", "Sono le {v}.", "L'ora attuale è {v}."],
}
"""Anchors that make a European time current: language -> templates with {v} (each hoisted whole)."""

EU_NOT_CURRENT: dict[str, list[str]] = {
    "de": [
        "Wissensstand: April 2024.",
        "Stand der Daten: 2024-06.",
        "Dein Wissensstand reicht bis Dezember 2023.",
        "Version 2.0 wurde am 5. Dezember 2024 veröffentlicht.",
        "Öffnungszeiten: 9:00-17:00",
        "Öffnungszeiten: Mo.–Fr. 9:00 bis 17:00 Uhr.",
        "Beispiel: Heute ist Montag, der 1. Januar 2024.",
        "Schreibe Daten z. B. als Aktuelles Datum: 05.12.2026.",
        "Aktuelles Datum: 01.01.2024 (Beispiel)",
        "Von: Anna Schmidt\nDatum: 05.12.2024\nBetreff: Rechnung",
        "Es ist wichtig, das Datum 05.12.2024 zu nennen.",
        "Der Termin am 5. Dezember 2024 um 10:00 Uhr wurde verschoben.",
    ],
    "fr": [
        "Date limite des connaissances : avril 2024.",
        "Tes connaissances s'arrêtent en avril 2024.",
        "La version 2.0 est sortie le 5 décembre 2024.",
        "Horaires : du lundi au vendredi de 9h00 à 17h00.",
        "Horaires : 9:00-17:00",
        "Par exemple : Nous sommes le 1er janvier 2024.",
        "Exemple : Date actuelle : 1er janvier 2024",
        "Il est important de citer le 5 décembre 2024.",
        "De : Marie Dupont\nDate : 05/12/2024\nObjet : Facture",
    ],
    "es": [
        "Fecha de corte del conocimiento: abril de 2024.",
        "Tus conocimientos llegan hasta abril de 2024.",
        "La versión 2.0 se publicó el 5 de diciembre de 2024.",
        "Horario: de 9:00 a 17:00.",
        "Por ejemplo: Hoy es lunes, 1 de enero de 2024.",
        "Escribe las fechas así, p. ej. Fecha actual: 01/01/2024.",
        "De: Ana García\nFecha: 05/12/2024\nAsunto: Factura",
    ],
    "pt": [
        "Data de corte do conhecimento: abril de 2024.",
        "Seu conhecimento vai até abril de 2024.",
        "A versão 2.0 foi lançada em 5 de dezembro de 2024.",
        "Horário: das 9h às 17h.",
        "Horário: 9:00-17:00",
        "Por exemplo: Hoje é segunda-feira, 1 de janeiro de 2024.",
        "De: João Silva\nData: 05/12/2024\nAssunto: Fatura",
    ],
    "it": [
        "Conoscenze aggiornate ad aprile 2024.",
        "Data di cutoff: 2024-06.",
        "La versione 2.0 è stata rilasciata il 5 dicembre 2024.",
        "Orari: dalle 9:00 alle 17:00.",
        "Ad esempio: Oggi è lunedì 1 gennaio 2024.",
        "Esempio: Data attuale: 1 gennaio 2024",
        "Da: Marco Rossi\nData: 05/12/2024\nOggetto: Fattura",
    ],
}
"""Dates in European system prompts that are NOT the current date (cutoffs, releases, schedules, examples,
mail headers): language -> lines the default pack leaves alone."""
