"""The dashboard's login session: a signed, expiring cookie derived from the admin token, the login form's
CSRF token, the wrong-token delay, and the same-origin check of the dashboard's endpoints.

Cookie value: ``<expiry>.<nonce>.<mac>`` where ``mac = HMAC-SHA256(key, "<expiry>.<nonce>")`` (RFC 2104,
``hmac`` of the standard library) and ``key = HMAC-SHA256(admin token, "prefixgate-dashboard-session-v1")``:
the token itself is never in the cookie, a forged or altered cookie fails the constant-time comparison, an
expired one is refused by its expiry, and changing the admin token ends every session. The cookie is
``HttpOnly`` (scripts cannot read it), ``SameSite=Strict`` (no cross-site request carries it) and ``Secure``
when the page was served over HTTPS; its ``Path`` is ``/admin``.

The login form's CSRF token is a double-submit value: the same random value in a ``SameSite=Strict``
cookie and in the form, compared in constant time; the form's POST must also come from the same origin.

Wrong tokens: each costs ``failure_delay_s`` seconds, served one at a time under a lock, so guesses run at
most one per delay whatever the concurrency; ``failed_logins`` counts them (tests assert the delay path by
that count, never by wall-clock time).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

SESSION_COOKIE = "prefixgate_admin"
CSRF_COOKIE = "prefixgate_csrf"
COOKIE_PATH = "/admin"
SESSION_TTL_S = 12 * 3600
"""Seconds a login lasts."""
FAILURE_DELAY_S = 1.0
"""Seconds a wrong token costs before the answer."""

_KEY_LABEL = b"prefixgate-dashboard-session-v1"


def session_key(admin_token: str) -> bytes:
    """The HMAC key of session cookies: ``HMAC-SHA256(admin token, label)`` (32 bytes)."""
    return hmac.new(admin_token.encode(), _KEY_LABEL, hashlib.sha256).digest()


def sign_session(admin_token: str, now: float, ttl_s: float = SESSION_TTL_S) -> str:
    """A fresh session cookie value expiring ``ttl_s`` seconds after ``now`` (Unix seconds)."""
    payload = f"{int(now + ttl_s)}.{secrets.token_urlsafe(16)}"
    mac = hmac.new(session_key(admin_token), payload.encode(), hashlib.sha256).hexdigest()
    return f"{payload}.{mac}"


def session_valid(admin_token: str, value: str | None, now: float) -> bool:
    """Whether ``value`` is a cookie ``sign_session`` made with this token and not expired at ``now``."""
    if not value or value.count(".") != 2:
        return False
    expiry, nonce, mac = value.split(".")
    expected = hmac.new(session_key(admin_token), f"{expiry}.{nonce}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        return False
    return expiry.isdigit() and int(expiry) > now


def token_matches(admin_token: str, presented: str) -> bool:
    """Constant-time comparison of a presented token with the admin token."""
    return hmac.compare_digest(presented.encode(), admin_token.encode())


def same_origin(http_request: Request) -> bool:
    """False when the browser says the request comes from another site: ``Sec-Fetch-Site`` other than
    ``same-origin`` / ``none`` (Fetch Metadata), or an ``Origin`` that is not this server's
    ``<scheme>://<host>``. Requests without either header (curl, scripts) pass: they carry no cookie of a
    victim's browser."""
    site = http_request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = http_request.headers.get("origin")
    if origin is not None:
        host = http_request.headers.get("host", "")
        return origin == f"{http_request.url.scheme}://{host}"
    return True


@dataclass
class DashboardAuth:
    """Login state of one app: the wrong-token delay and its count.

    Attributes:
        failure_delay_s: seconds each wrong token waits before its answer (>= 0).
        session_ttl_s: seconds a login lasts.
        failed_logins: wrong tokens answered so far.
        sleep: the coroutine that waits (``asyncio.sleep``).
        clock: Unix seconds.
    """

    failure_delay_s: float = FAILURE_DELAY_S
    session_ttl_s: float = SESSION_TTL_S
    failed_logins: int = 0
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.time
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def punish(self) -> None:
        """Wait out a wrong token: one at a time, ``failure_delay_s`` each; counted in ``failed_logins``."""
        async with self._lock:
            self.failed_logins += 1
            await self.sleep(self.failure_delay_s)


def dashboard_auth_of(http_request: Request) -> DashboardAuth:
    """The app's ``DashboardAuth`` (made on first use, kept in ``app.state.dashboard_auth``)."""
    state = http_request.app.state
    auth = getattr(state, "dashboard_auth", None)
    if auth is None:
        auth = DashboardAuth()
        state.dashboard_auth = auth
    return auth
