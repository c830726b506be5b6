"""A real browser on the chat page: ask, watch the answer stream in, reload and see the conversation."""

from __future__ import annotations

import pytest

from tests.stack import ARTIFACTS

# Records every length the streaming answer passes through, from inside the page.
WATCH_STREAM = """
window.__lengths = [];
new MutationObserver(() => {
  const el = document.querySelector('#messages [data-role="assistant"][data-streaming="true"] .msg__text');
  if (el) window.__lengths.push(el.textContent.length);
}).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true});
"""


def newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@pytest.fixture(scope="module")
def long_answers_url(stack):
    return stack.start_web(MAX_NEW_TOKENS="200")   # long enough to watch it stream


def test_ask_watch_it_stream_reload_and_see_the_history(browser, long_answers_url):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    try:
        page.goto(long_answers_url)
        page.wait_for_selector('#status[data-state="connected"]')
        page.evaluate(WATCH_STREAM)
        page.fill("#input", "Where is my parcel? <b>It was due Monday</b>")
        page.press("#input", "Enter")
        answer = page.wait_for_selector('#messages [data-role="assistant"][data-finish-reason]', timeout=60_000)
        text = answer.query_selector(".msg__text").text_content()
        lengths = page.evaluate("window.__lengths")
        assert text.strip()
        assert len(set(lengths)) > 3 and max(lengths) <= len(text), "the answer should appear piece by piece"
        user_text = page.text_content('#messages [data-role="user"] .msg__text')
        assert user_text == "Where is my parcel? <b>It was due Monday</b>", "text must not become HTML"
        assert "?c=" in page.url
        page.screenshot(path=str(ARTIFACTS / "chat.png"))

        page.reload()
        page.wait_for_selector('#messages [data-role="assistant"]')
        roles = page.eval_on_selector_all("#messages [data-role]", "els => els.map(e => e.dataset.role)")
        assert roles == ["user", "assistant"]
        # Server-rendered HTML turns CR and CRLF into LF; the tiny random model does emit CRs.
        reloaded = page.text_content('#messages [data-role="assistant"] .msg__text')
        assert newlines(reloaded) == newlines(text)
        page.screenshot(path=str(ARTIFACTS / "chat-reloaded.png"))
    finally:
        page.close()


def test_an_order_lookup_end_to_end_in_the_page(browser, stack, db):
    """The customer types an order number; the page shows the order's status from the shop's data, as the answer's
    first sentence, and a reload shows the same conversation without the lookup behind it."""
    from models import demo_orders

    with db() as s:
        demo_orders.seed(s)
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    try:
        page.goto(stack.web_urls[0])
        page.wait_for_selector('#status[data-state="connected"]')
        page.fill("#input", "Where is my order NW-10043?")
        page.press("#input", "Enter")
        answer = page.wait_for_selector('#messages [data-role="assistant"][data-finish-reason]', timeout=60_000)
        text = answer.query_selector(".msg__text").text_content()
        assert text.startswith("Order NW-10043 is out for delivery (status: out for delivery): 1 x Walnut chopping "
                               "board. Carrier: UPS, tracking number 1Z999AA10123456784."), text
        page.screenshot(path=str(ARTIFACTS / "chat-order.png"))
        page.reload()
        page.wait_for_selector('#messages [data-role="assistant"]')
        roles = page.eval_on_selector_all("#messages [data-role]", "els => els.map(e => e.dataset.role)")
        assert roles == ["user", "assistant"]
        assert page.text_content('#messages [data-role="assistant"] .msg__text').startswith("Order NW-10043")
    finally:
        page.close()
