"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
Selenium) against a running gateway with traffic on an embedded and an upstream model.

Logged out, ``/admin/`` redirects to the login form; a wrong token is refused with a message (after the
wrong-token delay, counted) and no hint of the real one; the right one opens the page, whose every panel
gets data and draws its chart (the panel's own screenshot holds pixels of its series' colours), without a
console error, polling at most once per second, and readable on a phone's width. A forged or expired cookie
is a redirect to the login form. ``.ci/run`` installs Chromium where it is missing; without it this test
fails (never skips).
"""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import pytest
from PIL import Image

from gateway.http.dashboard_session import SESSION_COOKIE, DashboardAuth, sign_session
from tests.gateway.http.dashboard_traffic import VALUES, dashboard_gateway, send_traffic
from tests.gateway.server import ADMIN_TOKEN

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PANELS = (
    "panel-hit-rate",
    "panel-requests",
    "panel-saved",
    "panel-money",
    "panel-misses",
    "panel-pool",
    "panel-tiers",
    "panel-ttft",
    "panel-decode",
    "panel-prefixes",
    "panel-replicas",
)
SERIES_COLOURS = tuple(
    (int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16))
    for c in (
        "#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f", "#92400e",
        "#475569",
    )
)  # fmt: skip
"""Every series colour of ``gateway/http/static/dashboard.js`` (RGB): a panel of seven miss causes whose
non-zero lines coincide is drawn in whichever colour comes last."""


def browser():
    """Headless Chromium through Debian's chromedriver (Selenium Manager downloads nothing)."""
    if not (shutil.which("chromium") or Path(CHROMIUM).exists()) or not Path(CHROMEDRIVER).exists():
        pytest.fail(
            "the dashboard browser test needs Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver; .ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def colour_pixels(png: bytes) -> int:
    """Pixels of a PNG within a small distance of one of the series colours."""
    data = Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    count = 0
    for i in range(0, len(data), 3):
        r, g, b = data[i], data[i + 1], data[i + 2]
        if any(abs(r - cr) + abs(g - cg) + abs(b - cb) < 60 for cr, cg, cb in SERIES_COLOURS):
            count += 1
    return count


def log_in(driver, base_url: str, token: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    old_page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login-submit").click()
    from selenium.common.exceptions import WebDriverException

    def old_page_gone(d) -> bool:
        # expected_conditions.staleness_of, also taking Chromium's other word for a detached node: mid-navigation
        # it can answer "Node with given id does not belong to the document" instead of a stale element
        try:
            return expected_conditions.staleness_of(old_page)(d)
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return True
            raise

    # the click can return before the form's response replaces the page: wait for the new document, or a
    # lookup right after may find the old page's elements (stale once the navigation lands)
    WebDriverWait(driver, 30, poll_frequency=0.05).until(old_page_gone)
    WebDriverWait(driver, 30, poll_frequency=0.05).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def test_dashboard_in_headless_chromium(tiny_checkpoint, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with dashboard_gateway(tiny_checkpoint, tmp_path) as server:
        auth = DashboardAuth(failure_delay_s=0.05)
        server.app.state.dashboard_auth = auth
        send_traffic(server)
        time.sleep(1.2)  # a second sample interval with traffic, so every rate has a value
        send_traffic(server)
        driver = browser()
        try:
            # logged out: the page redirects to the login form
            driver.get(f"{server.base_url}/admin/")
            assert driver.current_url == f"{server.base_url}/admin/login"

            # a wrong token: refused after the delay, with a message and no hint of the real token
            log_in(driver, server.base_url, "not-the-token")
            message = driver.find_element(By.ID, "login-message").text
            assert message == "Wrong admin token." and auth.failed_logins == 1
            assert ADMIN_TOKEN not in driver.page_source and driver.current_url.endswith("/admin/login")
            # the console's only error so far: the wrong token's 401 (reading the log empties it)
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert len(errors) == 1 and "/admin/login" in errors[0] and "401" in errors[0], errors

            log_in(driver, server.base_url, ADMIN_TOKEN)
            assert driver.current_url == f"{server.base_url}/admin/"
            cookie = driver.get_cookie(SESSION_COOKIE)
            assert (
                cookie["httpOnly"] and cookie["sameSite"] == "Strict" and ADMIN_TOKEN not in cookie["value"]
            )

            def panel_states(d) -> dict[str, str]:
                return {p: d.find_element(By.ID, p).get_attribute("data-state") for p in PANELS}

            WebDriverWait(driver, 60, poll_frequency=0.25).until(
                lambda d: all(state == "ready" for state in panel_states(d).values())
            )
            assert not any(value in driver.page_source for value in VALUES)  # no prompt text on the page
            driver.set_window_size(1400, 3600)  # the whole page in one screenshot
            time.sleep(0.5)
            driver.save_screenshot(str(tmp_path / "dashboard.png"))
            assert (tmp_path / "dashboard.png").stat().st_size > 0
            for panel in PANELS:
                canvas = driver.find_element(By.CSS_SELECTOR, f"#{panel} canvas")
                driver.execute_script("arguments[0].scrollIntoView()", canvas)
                assert colour_pixels(canvas.screenshot_as_png) > 20, f"{panel} drew no series"
            rows = driver.find_elements(By.CSS_SELECTOR, "#prefix-table tbody tr")
            assert (
                len(rows) >= 2 and len(driver.find_elements(By.CSS_SELECTOR, "#replica-table tbody tr")) == 2
            )
            assert driver.find_element(By.ID, "learned-count").text == "1"

            # polling: one request at a time, the next at least a second after the previous started
            time.sleep(3.5)
            starts = driver.execute_script(
                "return performance.getEntriesByType('resource')"
                ".filter(e => e.name.endsWith('/admin/dashboard/data')).map(e => e.startTime)"
            )
            assert len(starts) >= 3
            assert all(b - a >= 990 for a, b in zip(starts, starts[1:], strict=False)), starts

            # a phone's width: one column, nothing wider than the screen
            driver.set_window_size(390, 844)
            time.sleep(1.5)
            overflow = driver.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 1 and all(state == "ready" for state in panel_states(driver).values())
            driver.save_screenshot(str(tmp_path / "dashboard-phone.png"))

            errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
            assert errors == []  # the dashboard itself logged no error (a CSP violation would be one)

            # a forged cookie, then an expired one: back to the login form
            for value in (
                "9999999999.nonce." + "0" * 64,
                sign_session(ADMIN_TOKEN, time.time() - 10, ttl_s=1),
            ):
                driver.delete_all_cookies()
                driver.add_cookie({"name": SESSION_COOKIE, "value": value, "path": "/admin"})
                driver.get(f"{server.base_url}/admin/")
                assert driver.current_url == f"{server.base_url}/admin/login"
        finally:
            driver.quit()


CAPTURE_PLOTS = """
window.__plots = [];
let captured;
Object.defineProperty(window, "uPlot", {
  configurable: true,
  get() { return captured; },
  set(real) {
    captured = Object.assign(function (opts, data, el) {
      const plot = new real(opts, data, el);
      window.__plots.push(plot);
      return plot;
    }, real);
  },
});
"""
"""Run before the page's scripts: keeps every chart the dashboard makes in ``window.__plots`` (the vendored
uPlot declares a global ``uPlot``, whose assignment lands in this setter)."""

READ_TICKS = """
const ticks = {};
for (const plot of window.__plots) {
  const panel = plot.root.closest("article").id;
  for (const axis of plot.axes) {
    if (axis.scale !== "x" && axis._show && axis._values) ticks[panel + ":" + axis.scale] = axis._values.map(String);
  }
}
return ticks;
"""
"""Panel id and scale -> the tick labels its y axis drew last."""


def test_axes_of_whole_units_tick_whole_numbers_when_no_tier_is_configured():
    """The KV tiers panel of a gateway without tiers drew its bytes axis from 0 to 1 B with ticks at quarters,
    labelled "1 B, 1 B, 1 B, 0 B, 0 B"; whole units (bytes, tokens, blocks, requests, counts) now tick at whole
    numbers only, and no axis repeats a label."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from gateway.config.loader import parse_config
    from tests.gateway.server import RunningServer
    from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub

    stub = StubServer(openai_stub(StubState("R0"))).start()
    config = parse_config(  # no keys, no admin token: the dashboard is open (the local open mode)
        {
            "rules": [],
            "models": [{"name": "oa", "backend": "openai", "base_url": f"{stub.base_url}/v1", "retries": 0}],
        }
    )
    server = RunningServer(config).start()
    driver = browser()
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": CAPTURE_PLOTS})
        driver.get(f"{server.base_url}/admin/")
        WebDriverWait(driver, 30, poll_frequency=0.1).until(
            lambda d: d.find_element(By.ID, "panel-tiers").get_attribute("data-state") != "waiting"
        )
        ticks = driver.execute_script(READ_TICKS)
        assert ticks["panel-tiers:bytes"] == ["0 B", "1 B"], ticks
        assert ticks["panel-tiers:n"] == ["0 ", "1 "], ticks
        repeated = {axis: labels for axis, labels in ticks.items() if len(set(labels)) != len(labels)}
        assert repeated == {}, ticks
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        driver.quit()
        server.stop()
        stub.stop()
