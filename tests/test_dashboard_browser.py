"""The dashboard in a real browser: log in, see every chart drawn, watch the figures move as requests finish."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
import pytest
import requests

from models import RequestRecord
from tests.stack import ARTIFACTS

HOSTILE = '<img src=x onerror="window.__pwned = 1"><b>not bold</b>'

playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (make test does)")
expect = playwright.expect

# Counts the pixels each chart's canvas has painted: axes alone would pass, so series points are checked apart.
PAINTED = """
() => [...document.querySelectorAll('.chart canvas')].map((c) => {
  const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i] > 0) n++;
  return n;
})
"""

CATCH_CSP = """
document.addEventListener('securitypolicyviolation',
  (e) => (window.__csp = window.__csp || []).push(`${e.violatedDirective} ${e.blockedURI} ${e.sample}`));
"""


def ask(url: str, i: int) -> None:
    requests.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": f"Can I return item {i}?"}], "max_tokens": 8}).raise_for_status()


def number(text: str) -> int:
    return int("".join(ch for ch in text if ch.isdigit()))


def test_the_dashboard_draws_its_charts_and_updates_live(browser, stack, db):
    url = stack.web_urls[0]
    now = datetime.now(UTC)
    with db() as s:
        s.add(RequestRecord(request_id=f"dashboard-test-{uuid.uuid4().hex[:8]}", source="api",
                            enqueued_at=now - timedelta(seconds=2), finished_at=now, finish_reason="error",
                            prompt_tokens=0, completion_tokens=0, error=HOSTILE))
        # An answer handed back mid-stream: the slowest of the window, and it says how much came before.
        s.add(RequestRecord(request_id=f"dashboard-test-{uuid.uuid4().hex[:8]}", source="chat",
                            enqueued_at=now - timedelta(seconds=600), admitted_at=now - timedelta(seconds=599),
                            first_token_at=now - timedelta(seconds=598), finished_at=now, finish_reason="stop",
                            prompt_tokens=40, completion_tokens=300, continued_tokens=120))
        s.commit()
    for i in range(3):
        ask(stack.web_urls[i % 2], i)

    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.add_init_script(CATCH_CSP)
        script_errors = []
        page.on("pageerror", lambda exc: script_errors.append(str(exc)))
        page.goto(url + "/dashboard")
        assert "/login" in page.url, "logged out, the dashboard sends you to the login form"
        page.fill("#username", "operator")
        page.fill("#password", "not the password")
        page.click("button[type=submit]")
        assert "Wrong username or password" in page.text_content("#login-error")
        page.screenshot(path=str(ARTIFACTS / "login.png"))
        page.fill("#password", stack.env["OPERATOR_PASSWORD"])
        page.click("button[type=submit]")
        page.wait_for_url("**/dashboard**")
        page.wait_for_selector("#dashboard[data-generated-at]")
        assert page.get_attribute("#status", "data-state") == "live"

        assert page.locator(".chart canvas").count() == 6
        for name in ("queue_wait", "ttft", "tpot", "e2e", "tokens", "requests"):
            page.wait_for_selector(f'.chart[data-chart="{name}"][data-points]:not([data-points="0"])')
        assert all(n > 500 for n in page.evaluate(PAINTED)), "every chart is drawn"
        assert page.locator("#slowest tbody tr").count() >= 3
        assert "40 / 300 (120 before a hand-back)" in page.text_content("#slowest tbody tr:first-child")
        assert number(page.text_content("#now-workers")) >= 1
        assert page.text_content("#latency-table tr[data-metric=ttft] [data-q=p90]") != "–"

        # Text from the database stays text.
        errors = page.locator("#recent-errors .errors__text")
        assert HOSTILE in errors.all_text_contents()
        assert page.locator("#recent-errors img, #recent-errors b").count() == 0
        assert page.evaluate("window.__pwned") is None
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        violations = page.evaluate("window.__csp")
        assert violations is None, f"the page must run under its CSP, without inline code: {violations}"

        # The 24 h window only grows while this test runs, so new requests must show up in it.
        page.click('.segmented__btn[data-window="24h"]')
        # Playwright's expect() polls without eval, which the page's CSP (rightly) forbids.
        expect(page.locator("#window-label")).to_have_text("24 h")
        assert "window=24h" in page.url
        before = number(page.text_content("#kpi-requests"))
        page.evaluate("window.__same_page = true")
        for i in range(2):
            ask(url, 10 + i)
        deadline = time.monotonic() + 30
        while number(page.text_content("#kpi-requests")) < before + 2:
            assert time.monotonic() < deadline, "the dashboard did not show the new requests"
            page.wait_for_timeout(250)
        assert page.evaluate("window.__same_page") is True, "updated by polling, without a reload"
        page.screenshot(path=str(ARTIFACTS / "dashboard-24h.png"), full_page=True)

        assert not script_errors, script_errors
        page.click(".logout button")
        page.wait_for_url("**/login**")
        assert requests.get(url + "/dashboard/data", cookies={c["name"]: c["value"] for c in
                                                              page.context.cookies()}).status_code == 401
    finally:
        page.close()
