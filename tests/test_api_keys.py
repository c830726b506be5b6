"""API keys for /v1: the operators' command line and page, the refusals, and the whole stack with keys.

The stack tests share the session's stack with every other API test, which send no key: the `keyed` fixture
creates this module's keys, and at teardown deletes their rows (revoking would keep /v1 closed) and waits until
every web process serves keyless requests again (webapp/keyring.py re-reads the keys every 2 s). A stack of their
own would need its own worker too (records go to the worker's database): far slower on two cores.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import openai
import pytest
import redis
import requests
from sqlalchemy import func, select

from messaging.contract import QUEUE
from models import ApiKey, RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from tests.stack import wait_for
from tests.test_security import inline_code
from webapp import create_app, keys
from worker.local_redis import start_redis

PASSWORD = "api-keys-operator-password"
PRODUCTION = {"SUPPORTBOT_ENV": "production", "SECRET_KEY": "a-long-production-secret-key-0123456789",
              "SESSION_COOKIE_SECURE": False}
MESSAGES = [{"role": "user", "content": "Where is my parcel?"}]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ---- the command line ------------------------------------------------------------------------


@pytest.fixture()
def database_url(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    upgrade(url)
    monkeypatch.setenv("DATABASE_URL", url)
    return url


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = keys.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_create_prints_the_key_once_and_stores_only_its_digest(database_url, capsys):
    code, out, err = cli(capsys, "create", "mobile-app", "--rate-limit", "60/minute")
    assert code == 0 and err == ""
    key = re.search(r"^    (sb-\S{43})$", out, re.M).group(1)
    assert f'OpenAI(base_url="http://127.0.0.1:5000/v1", api_key="{key}")' in out
    assert "python -m webapp.keys revoke mobile-app" in out
    with make_session_factory(make_engine(database_url))() as db:
        row = db.scalar(select(ApiKey))
    assert (row.name, row.key_hash, row.prefix, row.rate_limit) == ("mobile-app", digest(key), key[:7] + "…",
                                                                    "60/minute")
    assert row.last_used_at is None and row.revoked_at is None

    code, out, _ = cli(capsys, "list")
    assert code == 0 and key not in out and key[:7] + "…" in out
    assert re.search(r"^mobile-app\s+sb-\S{4}…\s+\d{4}-\d\d-\d\d \d\d:\d\d UTC\s+never\s+-\s+60/minute"
                     r"\s+standard\s+-$", out, re.M)


def test_revoke_and_delete(database_url, capsys):
    cli(capsys, "create", "a")
    cli(capsys, "create", "b")
    code, out, _ = cli(capsys, "revoke", "a")
    assert code == 0 and "Revoked the API key 'a'" in out and "within a few seconds" in out
    code, out, _ = cli(capsys, "revoke", "a")
    assert code == 0 and "revoked already" in out
    code, out, _ = cli(capsys, "list")
    live, revoked = out.splitlines()[1:]
    assert live.startswith("b ") and revoked.startswith("a ") and "UTC" in revoked.split("never")[1]
    assert cli(capsys, "delete", "a")[0] == 0
    assert cli(capsys, "create", "a")[0] == 0, "a deleted key's name may be given again"


@pytest.mark.parametrize("argv, message", [
    (["create", "taken"], "An API key named 'taken' exists already"),
    (["create", "x", "--rate-limit", "lots"], "--rate-limit='lots': write it like '10/minute'"),
    (["create", "no spaces"], "is not a usable key name"),
    (["revoke", "nobody"], "No API key is named 'nobody'; `python -m webapp.keys list`"),
    (["delete", "nobody"], "No API key is named 'nobody'"),
])
def test_mistakes_are_refused_saying_what_to_do(database_url, capsys, argv, message):
    cli(capsys, "create", "taken")
    code, out, err = cli(capsys, *argv)
    assert code == 1 and out == "" and err.startswith("error: ") and message in err


def test_ensure_creates_the_key_from_a_variable_once(database_url, capsys, monkeypatch):
    code, _, err = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 1 and "API_KEY is not set" in err and "secrets.token_urlsafe" in err
    monkeypatch.setenv("API_KEY", "change-me")
    code, _, err = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 1 and "at least 32" in err
    key = "sb-" + "k" * 40
    monkeypatch.setenv("API_KEY", key)
    code, out, _ = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 0 and "Created the API key 'default'" in out and key not in out
    code, out, _ = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 0 and "in place already; nothing changed" in out
    monkeypatch.setenv("API_KEY", "sb-" + "j" * 40)
    code, _, err = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 1 and "holds another value" in err and "delete default" in err
    monkeypatch.setenv("API_KEY", key)
    cli(capsys, "revoke", "default")
    code, _, err = cli(capsys, "ensure", "default", "--from-env", "API_KEY")
    assert code == 1 and "was revoked" in err
    with make_session_factory(make_engine(database_url))() as db:
        assert db.scalar(select(func.count()).select_from(ApiKey)) == 1


def test_a_database_without_the_schema_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    code, _, err = cli(capsys, "list")
    assert code == 1 and "alembic upgrade head" in err


def test_the_start_line_says_whether_the_api_is_open(database_url):
    sessions = make_session_factory(make_engine(database_url))
    base = "http://127.0.0.1:5000/v1"
    with sessions() as db:
        assert keys.api_status(db, base, False, ".venv/bin/python") == (
            f"the OpenAI-compatible API at {base} is open to anyone who can reach it; create a key with: "
            ".venv/bin/python -m webapp.keys create NAME")
        assert "refuses every request: no API key is configured" in keys.api_status(db, base, True)
        keys.create(db, "k")
        assert keys.api_status(db, base, False).startswith(f"the OpenAI-compatible API at {base} requires an API key")


# ---- the check before every /v1 request, in process ------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("keys-redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def make_app(database_url, redis_url):
    def make(**overrides):
        redis.Redis.from_url(redis_url).flushdb()
        app = create_app({"DATABASE_URL": database_url, "REDIS_URL": redis_url, "OPERATOR_PASSWORD": PASSWORD,
                          **overrides})
        app.extensions["keyring"].refresh_s = 0   # every request reads the keys: no waiting in these tests
        return app
    return make


@pytest.fixture()
def sessions(database_url):
    return make_session_factory(make_engine(database_url))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_refused(response, *phrases: str) -> str:
    assert response.status_code == 401, response.text
    assert response.json["error"]["code"] == "invalid_api_key"
    assert response.json["error"]["type"] == "invalid_request_error" and response.json["error"]["param"] is None
    for phrase in phrases:
        assert phrase in response.json["error"]["message"]
    return response.json["error"]["message"]


def test_without_any_key_the_api_is_open_in_development_and_closed_in_production(make_app, sessions):
    assert make_app().test_client().get("/v1/models").status_code == 200
    client = make_app(**PRODUCTION).test_client()
    assert_refused(client.get("/v1/models"), "No API key is configured", "python -m webapp.keys create NAME")
    assert_refused(client.get("/v1/nowhere"), "No API key is configured")
    with sessions() as db:
        _, key = keys.create(db, "prod")
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200


def test_once_a_key_exists_every_v1_request_needs_it(make_app, sessions):
    client = make_app().test_client()
    with sessions() as db:
        _, key = keys.create(db, "one")
        _, other = keys.create(db, "two")
    assert_refused(client.get("/v1/models"), "You didn't provide an API key", "Authorization: Bearer")
    assert_refused(client.get("/v1/models", headers={"Authorization": key}), "You didn't provide an API key")
    wrong = "sb-" + "x" * 40
    message = assert_refused(client.get("/v1/models", headers=bearer(wrong)), "Incorrect API key provided: sb-…xxxx")
    assert wrong not in message
    # Unknown routes and bodies are refused before they are read: nothing about the API is told.
    assert_refused(client.post("/v1/chat/completions", data="not json"))
    assert_refused(client.get("/v1/nowhere"))
    assert_refused(client.post("/tokenize", json={"prompt": "hi"}), "You didn't provide")   # vLLM's, keyed too
    assert_refused(client.post("/detokenize", json={"tokens": [1]}), "You didn't provide")
    for k in (key, other):
        assert client.get("/v1/models", headers=bearer(k)).status_code == 200
    assert client.get("/v1/models", headers={"X-Api-Key": key}).status_code == 200, "as Anthropic's clients send it"
    refused = client.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401 and refused.json["type"] == "error", "in the Messages API's shape there"
    assert refused.json["error"]["type"] == "authentication_error"
    assert client.get("/healthz").status_code == 200, "only /v1 needs a key"

    with sessions() as db:
        keys.revoke(db, "one")
    message = assert_refused(client.get("/v1/models", headers=bearer(key)), f"The API key {key[:7]}… has been revoked",
                             "ask an operator")
    assert key not in message
    with sessions() as db:
        keys.revoke(db, "two")
    assert_refused(client.get("/v1/models"), "You didn't provide"), "revoking every key does not reopen the API"
    with sessions() as db:
        keys.delete(db, "one")
        keys.delete(db, "two")
    assert client.get("/v1/models").status_code == 200, "deleting them all does"


def test_last_used_is_written_at_most_once_a_minute(make_app, sessions):
    client = make_app().test_client()
    with sessions() as db:
        _, key = keys.create(db, "busy")
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    with sessions() as db:
        first = db.scalar(select(ApiKey.last_used_at))
    assert first is not None
    for _ in range(3):
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    with sessions() as db:
        assert db.scalar(select(ApiKey.last_used_at)) == first, "not written again within the minute"


def test_a_revocation_reaches_a_process_within_its_refresh(make_app, sessions):
    app = make_app()
    ring = app.extensions["keyring"]
    ring.refresh_s = 3600   # a copy that stays until refreshed, to see the bound at work
    client = app.test_client()
    with sessions() as db:
        _, key = keys.create(db, "cached")
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    with sessions() as db:
        keys.revoke(db, "cached")
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200, "the copy holds until refreshed"
    ring.refresh_s = 0
    assert client.get("/v1/models", headers=bearer(key)).status_code == 401


def test_a_new_key_works_at_once_without_waiting_for_the_refresh(make_app, sessions):
    app = make_app()
    ring = app.extensions["keyring"]
    client = app.test_client()
    with sessions() as db:
        _, first = keys.create(db, "first")
    assert client.get("/v1/models", headers=bearer(first)).status_code == 200
    ring.refresh_s = 3600   # the copy now holds until refreshed
    with sessions() as db:
        _, second = keys.create(db, "second", rate_limit="5/minute")
    assert client.get("/v1/models", headers=bearer(second)).status_code == 200, "looked up, not refused"
    assert ring.snapshot().by_hash[digest(second)].rule is not None, "the copy was re-read with the key's settings"
    assert_refused(client.get("/v1/models", headers=bearer("sb-" + "y" * 40)), "Incorrect API key")


# ---- the operators' page ---------------------------------------------------------------------


def csrf_from(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


@pytest.fixture()
def operator(make_app):
    client = make_app().test_client()
    token = csrf_from(client.get("/login").text)
    assert client.post("/login", data={"username": "operator", "password": PASSWORD, "csrf_token": token}
                       ).status_code == 302
    return client


def test_the_keys_page_needs_a_login_and_a_csrf_token(make_app, operator, sessions):
    client = make_app().test_client()
    assert client.get("/dashboard/keys").headers["Location"].startswith("/login?next=/dashboard/keys")
    assert client.post("/dashboard/keys", data={"name": "x"}).status_code == 302
    assert operator.post("/dashboard/keys", data={"name": "x"}).status_code == 400
    with sessions() as db:
        keys.create(db, "y")
    assert operator.post("/dashboard/keys/y/revoke", data={"csrf_token": "forged"}).status_code == 400
    with sessions() as db:
        assert [(k.name, k.revoked) for k in keys.all_keys(db)] == [("y", False)]


def test_the_keys_page_creates_a_key_shown_once_and_revokes_it(operator, sessions):
    page = operator.get("/dashboard/keys")
    assert page.status_code == 200 and "is open to anyone who can reach it" in page.text
    assert 'id="no-keys"' in page.text and "API keys" in operator.get("/dashboard").text
    created = operator.post("/dashboard/keys", data={"name": "web-shop", "rate_limit": "100/hour",
                                                     "csrf_token": csrf_from(page.text)})
    assert created.status_code == 201 and created.headers["Cache-Control"] == "no-store"
    key = re.search(r'id="new-key-value">(sb-[^<]+)</code>', created.text).group(1)
    assert f'api_key="{key}"' in created.text and "requires an API key" in created.text
    with sessions() as db:
        assert db.scalar(select(ApiKey.key_hash).where(ApiKey.name == "web-shop")) == digest(key)
    page = operator.get("/dashboard/keys")
    assert key not in page.text and key[:7] + "…" in page.text and "100/hour" in page.text, "shown once only"
    assert inline_code(created.text) == inline_code(page.text) == [], "nothing a strict CSP would block"
    assert operator.get("/v1/models", headers=bearer(key)).status_code == 200

    again = operator.post("/dashboard/keys", data={"name": "web-shop", "rate_limit": "",
                                                   "csrf_token": csrf_from(page.text)})
    assert again.status_code == 400 and "exists already" in again.text and 'id="new-key"' not in again.text
    bad = operator.post("/dashboard/keys", data={"name": "other", "rate_limit": "often",
                                                 "csrf_token": csrf_from(page.text)})
    assert bad.status_code == 400 and "write it like" in bad.text

    revoked = operator.post("/dashboard/keys/web-shop/revoke", data={"csrf_token": csrf_from(page.text)},
                            follow_redirects=True)
    assert revoked.status_code == 200 and "Revoked the key" in revoked.text
    assert re.search(r'data-key="web-shop" data-revoked="true"', revoked.text)
    assert 'action="/dashboard/keys/web-shop/revoke"' not in revoked.text
    assert_refused(operator.get("/v1/models", headers=bearer(key)), "has been revoked")


# ---- through the stack -----------------------------------------------------------------------


@dataclass
class Keys:
    alpha: str
    limited: str
    revoked: str
    usage: str


def keyless(url: str) -> int:
    return requests.get(url + "/v1/models", timeout=5).status_code


@pytest.fixture(scope="module")
def keyed(stack):
    sessions = make_session_factory(make_engine(stack.env["DATABASE_URL"]))
    names = ("test-alpha", "test-limited", "test-revoked", "test-usage")
    with sessions() as db:
        made = Keys(keys.create(db, names[0])[1], keys.create(db, names[1], "2/minute")[1],
                    keys.create(db, names[2])[1], keys.create(db, names[3])[1])
        keys.revoke(db, names[2])
    try:
        for url in stack.web_urls:
            wait_for(lambda: keyless(url) == 401, 30, f"{url} asking for keys")
        yield made
    finally:
        with sessions() as db:
            for name in names:
                keys.delete(db, name)
        for url in stack.web_urls:
            wait_for(lambda: keyless(url) == 200, 30, f"{url} open again")


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_valid_key_gets_an_answer_and_its_record_carries_the_key_name(stack, keyed, db):
    reply = client(stack.web_urls[0], keyed.alpha).chat.completions.create(model="any", messages=MESSAGES,
                                                                           max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    chunks = list(client(stack.web_urls[1], keyed.alpha).chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=8, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with db() as s:
        for request_id in (reply.id, chunks[0].id):
            record = s.get(RequestRecord, request_id.removeprefix("chatcmpl-"))
            assert record.api_key == "test-alpha" and record.source == "api"
        wait_for(lambda: s.scalar(select(ApiKey.last_used_at).where(ApiKey.name == "test-alpha")) is not None, 10,
                 "last used")


def test_no_key_a_wrong_key_and_a_revoked_key_are_refused_before_anything_is_queued(stack, keyed, db):
    r = redis.Redis.from_url(stack.env["REDIS_URL"])

    def state() -> tuple:
        with db() as s:
            records = s.scalar(select(func.count()).select_from(RequestRecord))
        return records, sum(1 for _ in r.scan_iter("supportbot:job:*")), r.llen(QUEUE)

    before = state()
    wrong = "sb-" + "w" * 43
    for key, phrase in ((None, "You didn't provide an API key"), (wrong, "Incorrect API key provided: sb-…wwww"),
                        (keyed.revoked, f"The API key {keyed.revoked[:7]}… has been revoked")):
        # The client insists on a key of its own: "no key" is one it is told not to send.
        headers = {"Authorization": openai.omit} if key is None else None
        with pytest.raises(openai.AuthenticationError) as caught:
            client(stack.web_urls[0], key or "unsent").chat.completions.create(
                model="any", messages=MESSAGES, max_tokens=4, extra_headers=headers)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        assert phrase in caught.value.message and (not key or key not in caught.value.message)
    assert state() == before, "nothing queued and no record stored for a refused request"


def test_a_keys_own_rate_limit_gives_429_with_retry_after(stack, keyed):
    url = stack.web_urls[1]

    def post(key: str) -> requests.Response:
        return requests.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                             json={"messages": MESSAGES, "max_tokens": 2})

    assert [post(keyed.limited).status_code for _ in range(2)] == [200, 200]
    refused = post(keyed.limited)
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limited" and refused.json()["error"]["type"] == "rate_limit_error"
    assert post(keyed.alpha).status_code == 200, "another key from the same address is served"
    with pytest.raises(openai.RateLimitError):
        client(url, keyed.limited).chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)


def test_the_dashboard_shows_requests_and_tokens_per_key(stack, keyed):
    replies = [client(stack.web_urls[i % 2], keyed.usage).chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=6) for i in range(3)]
    want = {"requests": 3, "prompt_tokens": sum(r.usage.prompt_tokens for r in replies),
            "completion_tokens": sum(r.usage.completion_tokens for r in replies)}
    operator = requests.Session()
    page = operator.get(stack.web_urls[0] + "/login", timeout=10)
    operator.post(stack.web_urls[0] + "/login", timeout=10, data={
        "username": "operator", "password": stack.env["OPERATOR_PASSWORD"], "csrf_token": csrf_from(page.text)})

    def usage() -> dict | None:
        body = operator.get(stack.web_urls[0] + "/dashboard/data?window=5m", timeout=10).json()
        return next((k for k in body["api_keys"] or [] if k["name"] == "test-usage"), None)

    wait_for(lambda: usage()["requests"] == 3, 30, "the summaries of the key's requests")
    got = usage()
    assert {name: got[name] for name in want} == want
    assert got["prefix"] == keyed.usage[:7] + "…" and got["revoked"] is False and got["deleted"] is False


def test_the_raw_keys_reach_no_log_redis_key_or_database_file(stack, keyed):
    logged = stack.web_with(WEB_ACCESS_LOG="-")   # gunicorn's access log on: a line per request
    wait_for(lambda: keyless(logged) == 401, 30, "the new web process asking for keys")
    wrong = "sb-" + "v" * 43
    for key in (keyed.alpha, keyed.limited, keyed.revoked, wrong):
        requests.post(logged + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 2})
    secrets = [keyed.alpha, keyed.limited, keyed.revoked, keyed.usage, wrong]

    logs = {path.name: path.read_text(errors="replace") for path in stack.workdir.glob("*.log")}
    port = logged.rsplit(":", 1)[1]
    assert "POST /v1/chat/completions" in logs[f"web{port}.log"], "the access log is on and written"
    assert "worker.log" in logs
    for name, text in logs.items():
        for key in secrets:
            assert key not in text and key[3:] not in text, name

    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    names = [k.decode() for k in r.scan_iter("*")]
    assert any(n.startswith("supportbot:limits:messages:key:") for n in names), "the per-key limit is in Redis"
    for name in names:
        kind = r.type(name).decode()
        values = [r.get(name)] if kind == "string" else r.lrange(name, 0, -1) if kind == "list" else \
            list(r.hgetall(name).values()) if kind == "hash" else []
        for key in secrets:
            assert key not in name and not any(key.encode() in (v or b"") for v in values), name

    database = stack.env["DATABASE_URL"].removeprefix("sqlite:///")
    stored = b"".join(open(path, "rb").read() for path in (database, database + "-wal") if os.path.exists(path))
    assert digest(keyed.alpha).encode() in stored, "the database file holds the digest"
    for key in secrets:
        assert key.encode() not in stored


def test_the_keys_page_in_a_browser(browser, stack, keyed):
    url = stack.web_urls[0]
    page = browser.new_page()
    try:
        script_errors = []
        page.on("pageerror", lambda exc: script_errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())   # "Revoke the key ...?"
        page.goto(url + "/dashboard/keys")
        page.fill("#username", "operator")
        page.fill("#password", stack.env["OPERATOR_PASSWORD"])
        page.click("button[type=submit]")
        page.wait_for_url("**/dashboard/keys")
        assert "requires an API key" in page.text_content("#api-status")
        page.fill("#key-name", "test-browser")
        page.fill("#key-rate-limit", "30/minute")
        page.click("#create-key button[type=submit]")
        key = page.text_content("#new-key-value")
        assert key.startswith("sb-"), "shown once"
        # keys.js (deferred) shows the copy button; the new page's text is there before it runs.
        page.wait_for_selector("#copy-key", state="visible", timeout=10_000)
        models = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert models.ok, "a key works as soon as it is shown: " + models.text
        page.goto(url + "/dashboard/keys")
        assert key not in page.content()
        page.click('tr[data-key="test-browser"] .revoke button')
        page.wait_for_selector('tr[data-key="test-browser"][data-revoked="true"]')
        assert "Revoked the key" in page.text_content(".notice")
        page.goto(url + "/dashboard")
        page.wait_for_selector('#api-keys tr[data-key="test-usage"]')
        assert not script_errors, script_errors
    finally:
        page.close()
        with make_session_factory(make_engine(stack.env["DATABASE_URL"]))() as db:
            if db.scalar(select(ApiKey).where(ApiKey.name == "test-browser")) is not None:
                keys.delete(db, "test-browser")
