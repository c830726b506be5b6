"""A real browser on the chat page: script and HTML from the customer or the model stay inert text."""

from __future__ import annotations

from flask_socketio import SocketIO

from models import Message
from tests.stack import ARTIFACTS

INJECTION = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
FROM_THE_MODEL = 'Sure! <img src=x onerror="window.__pwned=2"><script>window.__pwned=2</script><b>bold?</b>'
STREAMED = '<svg onload="window.__pwned=3"></svg><iframe src="javascript:window.__pwned=3"></iframe>'

# Before any page script: every CSP violation the page reports, whatever triggers it.
WATCH_CSP = """
window.__violations = [];
document.addEventListener('securitypolicyviolation', e => {
  window.__violations.push(e.violatedDirective + ' ' + e.blockedURI);
});
"""


def message_texts(page, role: str) -> list[str]:
    return page.eval_on_selector_all(f'#messages [data-role="{role}"] .msg__text', "els => els.map(e => e.textContent)")


def assert_inert(page, console: list[str]) -> None:
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.eval_on_selector_all("#messages img, #messages script, #messages svg:not(.notice__icon), "
                                     "#messages iframe, #messages b", "els => els.length") == 0
    assert page.evaluate("window.__violations") == []
    assert [line for line in console if "Content Security Policy" in line or "Refused to" in line] == []


def test_injected_markup_is_shown_as_text_and_never_runs(browser, stack, db):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1000, "height": 760})
    try:
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))
        page.on("pageerror", lambda e: console.append(f"page error: {e}"))
        page.add_init_script(WATCH_CSP)
        page.goto(stack.web_urls[0])
        page.wait_for_selector('#status[data-state="connected"]')

        # From the customer: typed, sent, echoed and answered.
        page.fill("#input", INJECTION)
        page.press("#input", "Enter")
        page.wait_for_selector('#messages [data-role="assistant"][data-finish-reason]', timeout=60_000)
        assert message_texts(page, "user") == [INJECTION]
        assert_inert(page, console)
        conversation = page.evaluate("new URL(location.href).searchParams.get('c')")
        assert conversation

        # From the model side while streaming: a token and a final text sent to the conversation's room.
        emitter = SocketIO(message_queue=stack.env["REDIS_URL"])
        request_id = "e" * 32
        emitter.emit("token", {"request_id": request_id, "text": STREAMED}, to=conversation)
        emitter.emit("done", {"request_id": request_id, "conversation_id": conversation, "text": STREAMED,
                              "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}, to=conversation)
        page.wait_for_selector(f'#messages [data-request-id="{request_id}"][data-finish-reason]')
        assert message_texts(page, "assistant")[-1] == STREAMED
        assert_inert(page, console)

        # From the model side in the stored history: rendered by the server on reload.
        with db() as s:
            s.add(Message(conversation_id=conversation, role="assistant", content=FROM_THE_MODEL))
            s.commit()
        page.goto(f"{stack.web_urls[0]}/?c={conversation}")
        page.wait_for_selector('#status[data-state="connected"]')
        assert message_texts(page, "user") == [INJECTION]
        assert message_texts(page, "assistant")[-1] == FROM_THE_MODEL
        assert_inert(page, console)
        page.screenshot(path=str(ARTIFACTS / "chat-injection.png"))
    finally:
        page.close()
