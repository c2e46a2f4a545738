"""The operator dashboard: ``GET /admin/`` (the page), ``GET|POST /admin/login``, ``POST /admin/logout``,
``GET /admin/dashboard/data`` (the JSON the page polls, ``gateway.service.dashboard_data``) and the vendored
static files under ``/admin/static/`` (the page's script and style, uPlot; no build step).

With ``admin.token`` configured the page and its data need a login: the form posts the token once and gets a
signed session cookie (``gateway.http.dashboard_session``); the token is never put in a URL. Without a token
the dashboard is open like the other admin endpoints when no client keys are configured (a gateway bound to
127.0.0.1), and closed like them (403, ``gateway.http.admin.admin_closed``) when client keys are. Either way the data
endpoint refuses cross-origin use (403), and every page is sent with a Content-Security-Policy that allows
only this origin's scripts and styles.
"""

from __future__ import annotations

import html
import secrets
from pathlib import Path
from string import Template
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.core.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from gateway.http.admin import has_session, refuse_when_closed, require_admin_read
from gateway.http.body import read_body
from gateway.http.dashboard_session import (
    COOKIE_PATH,
    CSRF_COOKIE,
    SESSION_COOKIE,
    dashboard_auth_of,
    same_origin,
    sign_session,
    token_matches,
)
from gateway.http.request_context import gateway_of
from gateway.service.dashboard_data import dashboard_document
from gateway.service.timeseries import StatsHistory

STATIC_DIR = Path(__file__).with_name("static")
"""The page's script and style and the vendored uPlot (served to anyone: they hold no data)."""
PAGES_DIR = Path(__file__).with_name("pages")
"""The dashboard and login HTML (served only through their handlers)."""
MAX_LOGIN_BODY = 4096
"""Bytes a login form may have."""

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",  # "no-referrer" would make Chromium send "Origin: null" on the login POST
    "cache-control": "no-store",
}


def _admin_token(http_request: Request) -> str | None:
    return gateway_of(http_request).config.admin.token or None


def logged_in(http_request: Request) -> bool:
    """Whether the request may see the dashboard: no admin token configured, or a valid session cookie."""
    return _admin_token(http_request) is None or has_session(http_request)


def _to_login() -> Response:
    return RedirectResponse("/admin/login", status_code=303, headers={"cache-control": "no-store"})


async def dashboard_page(http_request: Request) -> Response:
    """``GET /admin/``: the page, or a redirect to the login form (no, expired or forged session).

    Raises:
        PermissionDeniedError: client keys configured and no admin token (403).
    """
    refuse_when_closed(http_request)
    if not logged_in(http_request):
        return _to_login()
    return FileResponse(PAGES_DIR / "dashboard.html", media_type="text/html", headers=SECURITY_HEADERS)


async def admin_root(http_request: Request) -> Response:
    """``GET /admin``: to ``/admin/``."""
    return RedirectResponse("/admin/", status_code=308)


def _login_form(message: str, status_code: int) -> Response:
    csrf = secrets.token_urlsafe(24)
    page = Template((PAGES_DIR / "login.html").read_text(encoding="utf-8")).substitute(
        csrf=html.escape(csrf), message=html.escape(message), message_class="error" if message else "hidden"
    )
    response = HTMLResponse(page, status_code=status_code, headers=SECURITY_HEADERS)
    response.set_cookie(CSRF_COOKIE, csrf, path="/admin/login", httponly=True, samesite="strict")
    return response


async def login_form(http_request: Request) -> Response:
    """``GET /admin/login``: the login form (straight to the page when no admin token is configured).

    Raises:
        PermissionDeniedError: client keys configured and no admin token (403).
    """
    refuse_when_closed(http_request)
    if _admin_token(http_request) is None or logged_in(http_request):
        return RedirectResponse("/admin/", status_code=303)
    return _login_form("", 200)


async def login(http_request: Request) -> Response:
    """``POST /admin/login`` (form ``token``, ``csrf``): on the right token a session cookie and a redirect to
    the page; on a wrong one, after ``DashboardAuth.failure_delay_s``, the form again with "Wrong admin
    token." (401). A cross-origin post or a missing / wrong CSRF value is 403 without checking the token; a
    form over ``MAX_LOGIN_BODY`` bytes is 413 (counted while read, ``gateway.http.body.read_body``).

    Raises:
        PermissionDeniedError: client keys configured and no admin token (403).
    """
    refuse_when_closed(http_request)
    token = _admin_token(http_request)
    if token is None:
        return RedirectResponse("/admin/", status_code=303)
    if not same_origin(http_request):
        return _login_form("Cross-origin login refused.", 403)
    try:
        body = await read_body(http_request, MAX_LOGIN_BODY)
    except PayloadTooLargeError:
        return _login_form("Login form too large.", 413)
    except InvalidRequestError:
        return _login_form("Invalid login request.", 400)
    try:
        form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than the form has
        return _login_form("Invalid login request.", 400)
    presented = (form.get("token") or [""])[0]
    csrf = (form.get("csrf") or [""])[0]
    expected_csrf = http_request.cookies.get(CSRF_COOKIE, "")
    if not csrf or not expected_csrf or not secrets.compare_digest(csrf.encode(), expected_csrf.encode()):
        return _login_form("The login form expired; please try again.", 403)
    auth = dashboard_auth_of(http_request)
    if not token_matches(token, presented):
        await auth.punish()
        return _login_form("Wrong admin token.", 401)
    response = RedirectResponse("/admin/", status_code=303, headers={"cache-control": "no-store"})
    response.set_cookie(
        SESSION_COOKIE,
        sign_session(token, auth.clock(), auth.session_ttl_s),
        max_age=int(auth.session_ttl_s),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=http_request.url.scheme == "https",
    )
    response.delete_cookie(CSRF_COOKIE, path="/admin/login")
    return response


async def logout(http_request: Request) -> Response:
    """``POST /admin/logout``: clears the session cookie; back to the login form."""
    if not same_origin(http_request):
        raise PermissionDeniedError("Cross-origin requests to the dashboard are refused.")
    response = _to_login()
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response


def history_of(http_request: Request) -> StatsHistory:
    """The gateway's stats history (made on first use when the app was built without one)."""
    gateway = gateway_of(http_request)
    if gateway.history is None:
        gateway.history = StatsHistory(gateway.stats_snapshot)
    return gateway.history


async def dashboard_data(http_request: Request) -> Response:
    """``GET /admin/dashboard/data``: the page's JSON (``gateway.service.dashboard_data``).

    Raises:
        PermissionDeniedError: a cross-origin request (403).
        AuthenticationError: no valid session cookie and no valid ``Authorization: Bearer`` (401).
    """
    if not same_origin(http_request):
        raise PermissionDeniedError("Cross-origin requests to the dashboard are refused.")
    require_admin_read(http_request)
    document = dashboard_document(gateway_of(http_request), history_of(http_request))
    return JSONResponse(document, headers={"cache-control": "no-store", "vary": "cookie"})


def routes() -> list[BaseRoute]:
    """The dashboard's route table."""
    return [
        Route("/admin", admin_root, methods=["GET"]),
        Route("/admin/", dashboard_page, methods=["GET"]),
        Route("/admin/login", login_form, methods=["GET"]),
        Route("/admin/login", login, methods=["POST"]),
        Route("/admin/logout", logout, methods=["POST"]),
        Route("/admin/dashboard/data", dashboard_data, methods=["GET"]),
        Mount("/admin/static", app=StaticFiles(directory=STATIC_DIR), name="admin-static"),
    ]
