"""Headers, cookies, production mode, rate limits and conversations bound to their session."""

from __future__ import annotations

import queue
import re
import time
from html.parser import HTMLParser

import pytest
import redis
import requests
import socketio

from bench.socketio_client import InOrderClient
from models import Message, RequestRecord
from models.db import upgrade
from tests import audit
from tests.clients import ChatClient
from tests.stack import wait_for
from webapp import config, create_app, limits
from webapp.config import ConfigError
from messaging.contract import cancelled_key
from worker.local_redis import start_redis

PASSWORD = "correct horse battery staple"
INJECTION = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'


# ---- the app on its own (test client, private Redis) ------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("security-redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def database_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'security.db'}"
    upgrade(url)
    return url


@pytest.fixture()
def make_app(database_url, redis_url):
    redis.Redis.from_url(redis_url).flushdb()

    def make(**overrides):
        return create_app({"DATABASE_URL": database_url, "REDIS_URL": redis_url, "OPERATOR_PASSWORD": PASSWORD,
                           **overrides})
    return make


def csrf_from(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def login(client, password: str = PASSWORD, username: str = "operator", **environ):
    token = csrf_from(client.get("/login", environ_base=environ).text)
    return client.post("/login", data={"username": username, "password": password, "csrf_token": token},
                       environ_base=environ)


def logged_in_client(app):
    client = app.test_client()
    assert login(client).status_code == 302
    return client


class InlineCode(HTMLParser):
    """Collects whatever a strict CSP would block: inline scripts and styles, event-handler attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        names = {name for name, _ in attrs}
        if tag == "script" and "src" not in names:
            self.found.append("inline <script>")
        if tag == "style":
            self.found.append("<style> block")
        self.found += [f"{tag} {name}=" for name in names if name == "style" or name.startswith("on")]


def inline_code(html: str) -> list[str]:
    parser = InlineCode()
    parser.feed(html)
    return parser.found


def html_pages(app):
    operator = logged_in_client(app)
    return {"/": app.test_client().get("/"), "/login": app.test_client().get("/login"),
            "/dashboard": operator.get("/dashboard"), "/dashboard/keys": operator.get("/dashboard/keys"),
            "/?c=unknown": app.test_client().get("/?c=" + "0" * 32)}


def test_every_html_page_has_a_strict_csp_and_no_inline_code(make_app):
    for path, response in html_pages(make_app()).items():
        assert response.status_code == 200 and response.mimetype == "text/html", path
        csp = dict(part.strip().split(" ", 1) for part in response.headers["Content-Security-Policy"].split(";"))
        assert csp["script-src"] == "'self'" and csp["style-src"] == "'self'", (path, csp)
        assert csp["default-src"] == "'self'" and csp["object-src"] == "'none'" and csp["base-uri"] == "'none'"
        assert csp["frame-ancestors"] == "'none'", path
        assert "unsafe" not in response.headers["Content-Security-Policy"], path
        assert inline_code(response.text) == [], path


def test_every_response_has_the_protective_headers(make_app):
    app = make_app()
    responses = [*html_pages(app).values(), app.test_client().get("/healthz"),
                 app.test_client().get("/static/chat.js"), app.test_client().post("/v1/chat/completions", data="x"),
                 app.test_client().get("/dashboard/data")]
    for response in responses:
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Referrer-Policy"] == "same-origin"
        assert "Strict-Transport-Security" not in response.headers, "no HSTS over plain HTTP"


def test_https_requests_get_hsts(make_app):
    response = make_app().test_client().get("/", base_url="https://shop.example")
    assert response.headers["Strict-Transport-Security"].startswith("max-age=31536000")


def test_behind_a_trusted_proxy_the_forwarded_scheme_counts(make_app):
    headers = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    proxied = make_app(TRUSTED_PROXY_HOPS=1).test_client().get("/", headers=headers)
    assert proxied.headers["Strict-Transport-Security"]
    direct = make_app().test_client().get("/", headers=headers)
    assert "Strict-Transport-Security" not in direct.headers, "forwarded headers are ignored unless trusted"


def test_the_chat_page_is_not_cached(make_app):
    response = make_app().test_client().get("/")
    assert "no-store" in response.headers["Cache-Control"]


def session_cookie(response) -> str:
    cookies = [c for c in response.headers.getlist("Set-Cookie") if c.startswith("session=")]
    assert len(cookies) == 1, response.headers
    return cookies[0]


SETTINGS = ("SECRET_KEY", "OPERATOR_PASSWORD", "OPERATOR_PASSWORD_HASH", "METRICS_TOKEN", "SESSION_COOKIE_SECURE",
            "FLASK_DEBUG", "SUPPORTBOT_ENV", "RATE_LIMIT_PER_IP", "RATE_LIMIT_PER_SESSION", "LOGIN_RATE_LIMIT")


@pytest.fixture()
def env(monkeypatch, tmp_path, redis_url, database_url):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "INSTANCE_DIR", tmp_path / "instance")
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", database_url)
    return monkeypatch


def production(env, **extra: str) -> None:
    env.setenv("SUPPORTBOT_ENV", "production")
    env.setenv("SECRET_KEY", "7" * 64)
    env.setenv("OPERATOR_PASSWORD", PASSWORD)
    for name, value in extra.items():
        env.setenv(name, value)


def test_development_cookies_are_httponly_and_samesite(env):
    cookie = session_cookie(create_app().test_client().get("/"))
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie


def test_production_cookies_are_secure(env):
    production(env)
    app = create_app()
    cookie = session_cookie(app.test_client().get("/", base_url="https://shop.example"))
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" in cookie
    assert app.debug is False


def test_production_over_plain_http_may_opt_out_of_secure_cookies(env):
    production(env, SESSION_COOKIE_SECURE="0")
    cookie = session_cookie(create_app().test_client().get("/"))
    assert "HttpOnly" in cookie and "Secure" not in cookie


def test_production_refuses_debug_mode(env):
    production(env, FLASK_DEBUG="1")
    with pytest.raises(ConfigError, match="FLASK_DEBUG"):
        create_app()


@pytest.mark.parametrize("name, value", [("RATE_LIMIT_PER_IP", "lots"), ("RATE_LIMIT_PER_SESSION", "10 per minute"),
                                         ("LOGIN_RATE_LIMIT", "0/minute"), ("RATE_LIMIT_PER_IP", "5/0 seconds")])
def test_a_limit_that_does_not_parse_stops_the_app_naming_it(env, name, value):
    env.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        create_app()


@pytest.mark.parametrize("text, rule", [
    ("10/minute", limits.Rule(10, 60)), ("5 / 10 seconds", limits.Rule(5, 10)), ("100/hours", limits.Rule(100, 3600)),
    ("2/day", limits.Rule(2, 86400)), ("off", None), ("0", None), ("", None),
])
def test_limit_rules_parse(text, rule):
    assert limits.parse_rule(text, "X") == rule


def test_a_sliding_window_refuses_the_extra_event_and_says_when_to_retry(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    rule = limits.Rule(3, 60)
    outcomes = [limits.hit(r, [("k", rule)]) for _ in range(3)]
    assert [o.wait for o in outcomes] == [0, 0, 0] and [o.remaining for o in outcomes] == [2, 1, 0]
    assert all(o.limit == 3 and 0 < o.reset_s <= 60 for o in outcomes)
    refused = limits.hit(r, [("k", rule)])
    assert 0 < refused.wait <= 60 and refused.remaining == 0 and refused.reset_s == refused.wait
    # A refused event is not recorded, and a check against several keys records in none when one is full.
    assert limits.hit(r, [("other", rule), ("k", rule)]).wait > 0
    assert r.zcard(limits.PREFIX + "other") == 0 and r.zcard(limits.PREFIX + "k") == 3


def test_connections_of_a_dead_process_stop_counting(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    counter = limits.ConnectionCounter(r, limit=2)
    assert counter.acquire("198.51.100.1", "a") and counter.acquire("198.51.100.1", "b")
    assert not counter.acquire("198.51.100.1", "c")
    counter.release("a")
    assert counter.acquire("198.51.100.1", "c")
    # Entries that a crashed process can no longer refresh: older than the TTL, so they are not counted.
    stale = time.time() - limits.CONNECTION_TTL_S - 1
    r.zadd(limits.ConnectionCounter.key("198.51.100.2"), {"ghost-1": stale, "ghost-2": stale})
    assert counter.acquire("198.51.100.2", "d")
    assert r.ttl(limits.ConnectionCounter.key("198.51.100.2")) > 0, "the count expires by itself"


def test_login_attempts_are_throttled_per_address_and_per_username(make_app):
    app = make_app(LOGIN_RATE_LIMIT="3/minute")
    here, there, elsewhere = ({"REMOTE_ADDR": ip} for ip in ("198.51.100.10", "198.51.100.11", "198.51.100.12"))
    client = app.test_client()
    for _ in range(3):
        assert login(client, password="guess", **here).status_code == 401
    refused = login(client, **here)   # even the right password: the limit comes first
    assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 60
    assert "Too many login attempts" in refused.text and "try again" in refused.text
    # Guessing one name from many addresses is no way around it.
    assert login(app.test_client(), **there).status_code == 429
    # Another name from another address still gets its answer, and customers are served meanwhile.
    assert login(app.test_client(), username="someone", password="guess", **elsewhere).status_code == 401
    assert app.test_client().get("/").status_code == 200
    # The address that guessed is refused whatever name it tries next.
    assert login(app.test_client(), username="someone", **here).status_code == 429


def test_successful_logins_do_not_use_up_the_limit(make_app):
    app = make_app(LOGIN_RATE_LIMIT="2/minute")
    for _ in range(4):
        assert login(app.test_client()).status_code == 302


def test_the_audit_fails_on_a_vulnerability_and_only_warns_when_nothing_could_be_checked(tmp_path, monkeypatch, capsys):
    found = {"dependencies": [{"name": "flask", "version": "3.1.3", "vulns": []},
                              {"name": "werkzeug", "version": "0.1", "vulns": [
                                  {"id": "GHSA-test-0000-0000", "fix_versions": ["3.0.6"]}]}]}
    assert audit.verdict(found, 2) == 1
    assert "werkzeug 0.1: GHSA-test-0000-0000 (fixed in: 3.0.6)" in capsys.readouterr().err
    unknown = {"dependencies": [{"name": "flask", "skip_reason": "Dependency not found on PyPI"}]}
    assert audit.verdict(unknown, 1) == 0
    assert "could not be audited" in capsys.readouterr().err
    # No report at all: the service could not be reached.
    monkeypatch.setattr(audit.subprocess, "run", lambda *a, **k: subprocess_result("ConnectionError: no route"))
    assert audit.audit({"flask": "3.1.3"}, tmp_path / "pip-audit.json", []) == 0
    assert "could not reach its vulnerability service (ConnectionError: no route)" in capsys.readouterr().err


def subprocess_result(stderr: str):
    return type("Completed", (), {"returncode": 1, "stderr": stderr, "stdout": ""})()


def test_the_audit_covers_what_the_runtime_requirements_pull_in():
    pins = audit.runtime_closure(audit.ROOT / "requirements.txt")
    assert {"flask", "werkzeug", "jinja2", "python-engineio", "kombu", "sqlalchemy"} <= set(pins)
    assert "pytest" not in pins and "playwright" not in pins, "test tools are not runtime dependencies"


# ---- the running stack -------------------------------------------------------------------------


def events_until(client: ChatClient, request_id: str, last: tuple[str, ...] = ("done", "error")) -> list:
    events = []
    while not events or not (events[-1][0] in last and events[-1][1].get("request_id") == request_id):
        events.append(client.next(60))
    return events


def test_a_conversation_stays_with_its_session(stack, db):
    web = stack.web_urls[0]
    alice, mallory = ChatClient(web), ChatClient(stack.web_urls[1])
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    try:
        first = alice.ask(INJECTION)["done"]
        conv = first["conversation_id"]
        with db() as s:
            stored = [m.content for m in s.query(Message).filter_by(conversation_id=conv)]

        # Pages and JSON: Alice sees her conversation (as text, not markup); Mallory sees nothing of it.
        own = alice.http.get(f"{web}/?c={conv}")
        assert f'data-conversation-id="{conv}"' in own.text and INJECTION not in own.text
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in own.text
        theirs = mallory.http.get(f"{web}/?c={conv}")
        assert theirs.status_code == 200 and conv not in theirs.text and "__pwned" not in theirs.text
        assert mallory.http.get(f"{web}/conversations/{conv}").status_code == 404
        assert alice.http.get(f"{web}/conversations/{conv}").json()["messages"][0]["content"] == INJECTION

        # Events: joining, writing into, or stopping Alice's answers is refused.
        mallory.sio.emit("join", {"conversation_id": conv})
        assert mallory.next(10)[1]["code"] == "unknown_conversation"
        mallory.sio.emit("chat_message", {"text": "Refund everything", "conversation_id": conv})
        assert mallory.next(10)[1]["code"] == "unknown_conversation"
        alice.sio.emit("chat_message", {"text": "And the delivery time?", "conversation_id": conv})
        name, accepted = alice.next(10)
        assert name == "accepted"
        mallory.sio.emit("cancel", {"request_id": accepted["request_id"]})
        assert mallory.next(10)[1]["code"] == "unknown_request"
        assert r.get(cancelled_key(accepted["request_id"])) is None, "the refused cancel must not reach the worker"
        done = events_until(alice, accepted["request_id"])[-1]
        assert done[0] == "done" and done[1]["finish_reason"] != "cancelled", done

        # Mallory's own answer arrives after everything Alice's room got: none of it reached Mallory.
        mine = mallory.ask("Hello?")["accepted"]["request_id"]
        while not mallory.events.empty():
            _, data = mallory.events.get_nowait()
            assert data.get("request_id") in (None, mine), data
        with db() as s:
            contents = [m.content for m in s.query(Message).filter_by(conversation_id=conv).order_by(Message.id)]
            assert contents[:len(stored)] == stored and "Refund everything" not in contents
            assert s.get(RequestRecord, accepted["request_id"]).finish_reason != "cancelled"
    finally:
        alice.close()
        mallory.close()


def test_socketio_refuses_other_origins(stack):
    client = socketio.Client(reconnection=False)
    with pytest.raises(socketio.exceptions.ConnectionError):
        client.connect(stack.web_urls[0], transports=["websocket"], headers={"Origin": "http://evil.example"},
                       wait_timeout=10)


class Customer(ChatClient):
    """A chat client that arrives from a given address, as a trusted proxy reports it."""

    def __init__(self, url: str, address: str) -> None:
        self.http = requests.Session()
        self.http.headers["X-Forwarded-For"] = address
        self.http.get(url + "/").raise_for_status()
        self.events = queue.Queue()
        self.sio = InOrderClient(http_session=self.http, reconnection=False)
        for name in ("accepted", "token", "done", "error"):
            self.sio.on(name, lambda data, name=name: self.events.put((name, data)))
        self.sio.connect(url, transports=["websocket"], headers={"X-Forwarded-For": address}, wait_timeout=10)


LIMITED = {"RATE_LIMIT_PER_SESSION": "3/minute", "RATE_LIMIT_PER_IP": "6/minute", "MAX_CONNECTIONS_PER_IP": "3",
           "TRUSTED_PROXY_HOPS": "1"}


@pytest.fixture(scope="module")
def limited(stack):
    """A web process with low limits, behind a (pretend) proxy so each test can use its own addresses."""
    return stack.web_with(**LIMITED)


def send(client: ChatClient, text: str = "Where is my order?") -> tuple[str, dict]:
    client.sio.emit("chat_message", {"text": text, "max_new_tokens": 2})
    name, data = client.next(30)
    if name == "accepted":
        events_until(client, data["request_id"])
    return name, data


def assert_limited(name: str, data: dict) -> None:
    assert name == "error" and data["code"] == "rate_limited" and data["retryable"] is True, data
    assert isinstance(data["retry_after"], int) and 1 <= data["retry_after"] <= 60, data
    assert f"wait {data['retry_after']} second" in data["message"]


def test_socketio_messages_are_limited_per_session_while_others_are_served(limited):
    a, b = Customer(limited, "203.0.113.1"), Customer(limited, "203.0.113.1")
    try:
        assert [send(a)[0] for _ in range(3)] == ["accepted"] * 3
        assert_limited(*send(a))
        assert_limited(*send(a))
        assert a.sio.connected
        assert send(b)[0] == "accepted", "another session from the same address is still served"
    finally:
        a.close()
        b.close()


def test_socketio_messages_are_limited_per_address(limited):
    sessions = [Customer(limited, "203.0.113.2") for _ in range(3)]
    other = Customer(limited, "203.0.113.3")
    try:
        for c in sessions:
            assert [send(c)[0] for _ in range(2)] == ["accepted"] * 2
        assert_limited(*send(sessions[0]))
        assert send(other)[0] == "accepted", "another address is still served"
    finally:
        for c in (*sessions, other):
            c.close()


def post(url: str, address: str, key: str | None = None) -> requests.Response:
    headers = {"X-Forwarded-For": address} | ({"Authorization": f"Bearer {key}"} if key else {})
    return requests.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                         json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def assert_http_limited(response: requests.Response) -> None:
    assert response.status_code == 429, response.text
    seconds = int(response.headers["Retry-After"])
    assert 1 <= seconds <= 60
    error = response.json()["error"]
    assert error["code"] == "rate_limited" and error["type"] == "rate_limit_error"
    assert f"wait {seconds}" in error["message"]


def test_the_api_is_limited_per_key_and_address_while_others_are_served(limited):
    assert [post(limited, "203.0.113.4", "key-1").status_code for _ in range(3)] == [200] * 3
    assert_http_limited(post(limited, "203.0.113.4", "key-1"))
    assert post(limited, "203.0.113.4", "key-2").status_code == 200, "another key is another session"
    assert post(limited, "203.0.113.44", "key-1").status_code == 200, "so is the same key elsewhere"


def test_the_address_limit_counts_socketio_and_http_together(limited):
    assert [post(limited, "203.0.113.5", f"key-{i}").status_code for i in range(6)] == [200] * 6
    assert_http_limited(post(limited, "203.0.113.5", "key-new"))
    c = Customer(limited, "203.0.113.5")
    try:
        assert_limited(*send(c))
    finally:
        c.close()


def test_open_connections_are_limited_per_address(limited):
    open_ = [Customer(limited, "203.0.113.6") for _ in range(3)]
    try:
        with pytest.raises(socketio.exceptions.ConnectionError):
            Customer(limited, "203.0.113.6")
        elsewhere = Customer(limited, "203.0.113.7")
        assert send(elsewhere)[0] == "accepted"
        elsewhere.close()
        open_.pop().close()

        def reconnects() -> bool:
            open_.append(Customer(limited, "203.0.113.6"))
            return True

        wait_for(reconnects, 30, "a connection after one closed")
    finally:
        for c in open_:
            c.close()


def test_a_refused_connection_says_why(limited):
    holders = [Customer(limited, "203.0.113.8") for _ in range(3)]
    try:
        client = socketio.Client(reconnection=False)
        reasons = []
        client.on("connect_error", reasons.append)
        with pytest.raises(socketio.exceptions.ConnectionError):
            client.connect(limited, transports=["websocket"], headers={"X-Forwarded-For": "203.0.113.8"},
                           wait_timeout=10)
        assert reasons, "the client is told the reason"
        reason = reasons[0]
        assert "Too many open chat connections" in reason["message"]
        assert reason["data"]["code"] == "too_many_connections" and reason["data"]["retryable"] is True
    finally:
        for c in holders:
            c.close()
