"""Service classes of API requests: a key's default class and its right to ask for priority (command line and
dashboard), service_tier mapped to a class and a queue, bad tiers refused, and admission that refuses bulk first."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from sqlalchemy import select

from messaging.contract import CLASS_QUEUES
from models import ApiKey, RequestRecord
from tests.test_api_keys import (bearer, cli, csrf_from, database_url, make_app, operator,  # noqa: F401
                                 redis_url, sessions)
from webapp import keys

MESSAGES = [{"role": "user", "content": "Summarise ticket 1234."}]


def test_a_keys_class_and_priority_right_are_set_from_the_command_line(database_url, capsys):  # noqa: F811
    code, out, _ = cli(capsys, "create", "evals", "--class", "bulk")
    assert code == 0 and "class bulk, may not ask for priority" in out
    code, out, _ = cli(capsys, "create", "support-desk", "--priority")
    assert code == 0 and "class standard, may ask for priority" in out
    code, out, _ = cli(capsys, "list")
    rows = {line.split()[0]: line.split()[-2:] for line in out.splitlines()[1:]}
    assert rows == {"evals": ["bulk", "-"], "support-desk": ["standard", "allowed"]}
    code, out, _ = cli(capsys, "set", "evals", "--class", "standard", "--priority")
    assert code == 0 and "'evals' is now class standard, may ask for priority" in out
    code, out, _ = cli(capsys, "set", "support-desk", "--no-priority")
    assert code == 0 and "class standard, may not ask for priority" in out
    code, _, err = cli(capsys, "set", "evals")
    assert code == 1 and "--class interactive|standard|bulk, --priority or --no-priority" in err
    code, _, err = cli(capsys, "set", "nobody", "--priority")
    assert code == 1 and "No API key is named 'nobody'" in err
    with pytest.raises(SystemExit):   # argparse names the choices
        keys.main(["create", "x", "--class", "urgent"])
    assert "choose from interactive, standard, bulk" in capsys.readouterr().err.replace("'", "")


def queued(r: redis.Redis) -> dict[str, list[dict]]:
    """The jobs waiting in each class's queue (no worker runs in these tests)."""
    def job(raw: bytes) -> dict:
        return json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
    return {cls: [job(raw) for raw in r.lrange(name, 0, -1)] for cls, name in CLASS_QUEUES.items()}


def send(client, key: str | None, tier: object = None):
    """A streamed request: queued before the answer starts, which this test does not wait for."""
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, **({"service_tier": tier} if tier else {})}
    response = client.post("/v1/chat/completions", json=body, headers=bearer(key) if key else {}, buffered=False)
    response.close()
    return response


def test_service_tier_and_the_key_pick_the_class_and_its_queue(make_app, sessions, redis_url):  # noqa: F811
    client = make_app().test_client()
    r = redis.Redis.from_url(redis_url)
    assert send(client, None, "priority").status_code == 200, "without keys (development) every tier is open"
    assert [j["params"]["service_class"] for j in queued(r)["interactive"]] == ["interactive"]
    with sessions() as db:
        _, plain = keys.create(db, "plain")
        _, evals = keys.create(db, "evals", service_class="bulk")
        _, desk = keys.create(db, "desk", priority=True)
    r.flushdb()
    asked = {"standard": [(plain, None), (plain, "auto"), (plain, "default")],
             "bulk": [(plain, "flex"), (evals, None), (evals, "default"), (evals, "flex")],
             "interactive": [(desk, "priority")]}
    for cls, requests in asked.items():
        for key, tier in requests:
            assert send(client, key, tier).status_code == 200, (cls, tier)
    jobs = queued(r)
    for cls, requests in asked.items():
        assert [j["params"]["service_class"] for j in jobs[cls]] == [cls] * len(requests)
    with sessions() as db:
        recorded = {rec.request_id: rec.service_class for rec in db.scalars(select(RequestRecord))}
    for cls, in_queue in jobs.items():
        assert all(recorded[j["request_id"]] == cls for j in in_queue), "the record carries the class"


@pytest.mark.parametrize("tier", ["urgent", "PRIORITY", 3, ["flex"]])
def test_an_unknown_service_tier_is_a_400_naming_the_allowed_values(make_app, redis_url, tier):  # noqa: F811
    client = make_app().test_client()
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "service_tier": tier})
    assert response.status_code == 400, response.text
    error = response.json["error"]
    assert error["param"] == "service_tier" and error["code"] == "invalid_value"
    assert "'auto', 'default', 'flex', 'priority'" in error["message"]
    assert sum(r for r in map(redis.Redis.from_url(redis_url).llen, CLASS_QUEUES.values())) == 0


def test_priority_from_a_key_without_the_right_is_a_400_until_it_is_allowed(make_app, sessions, redis_url):  # noqa: F811
    client = make_app().test_client()
    with sessions() as db:
        _, key = keys.create(db, "app")
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "service_tier": "priority"},
                           headers=bearer(key))
    assert response.status_code == 400 and response.json["error"]["param"] == "service_tier"
    message = response.json["error"]["message"]
    assert "may not ask for service_tier 'priority'" in message and "'auto', 'default' or 'flex'" in message
    assert "python -m webapp.keys set NAME --priority" in message and key not in message
    with sessions() as db:
        keys.set_class(db, "app", priority=True)
    assert send(client, key, "priority").status_code == 200


def test_a_full_queue_refuses_bulk_first_and_keeps_room_for_interactive(make_app, redis_url):  # noqa: F811
    client = make_app(QUEUE_LIMIT=10).test_client()
    r = redis.Redis.from_url(redis_url)
    r.rpush(CLASS_QUEUES["bulk"], *[b"waiting"] * 8)   # 8 of 10: past bulk's share (0.75)

    refused = send(client, None, "flex")
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "10"
    body = json.loads(refused.get_data())
    assert body["error"]["code"] == "queue_full" and "full for bulk requests (8 waiting)" in body["error"]["message"]
    assert send(client, None).status_code == 200            # standard: 8 < 9
    assert send(client, None).status_code == 429            # 9 of 10: standard's share (0.9) is taken
    assert send(client, None, "priority").status_code == 200   # interactive: the last place
    last = send(client, None, "priority")
    assert last.status_code == 429 and last.headers["Retry-After"] == "2"
    assert r.llen(CLASS_QUEUES["bulk"]) == 8 and r.llen(CLASS_QUEUES["standard"]) == 1
    assert r.llen(CLASS_QUEUES["interactive"]) == 1


def test_the_queue_shares_are_configurable_and_checked(make_app, monkeypatch):  # noqa: F811
    from webapp.config import ConfigError
    monkeypatch.setenv("QUEUE_SHARE_BULK", "0.5")
    monkeypatch.setenv("TTFT_OBJECTIVE_INTERACTIVE_S", "0.5")
    app = make_app()
    assert app.config["QUEUE_SHARES"]["bulk"] == 0.5 and app.config["TTFT_OBJECTIVES"]["interactive"] == 0.5
    monkeypatch.setenv("QUEUE_SHARE_BULK", "lots")
    with pytest.raises(ConfigError, match="QUEUE_SHARE_BULK must be a number"):
        make_app()


def test_the_keys_page_sets_a_keys_class_and_priority_right(operator, sessions):  # noqa: F811
    page = operator.get("/dashboard/keys")
    created = operator.post("/dashboard/keys", data={"name": "nightly-evals", "rate_limit": "",
                                                     "service_class": "bulk", "csrf_token": csrf_from(page.text)})
    assert created.status_code == 201
    assert 'action="/dashboard/keys/nightly-evals/class"' in created.text
    with sessions() as db:
        row = db.scalar(select(ApiKey).where(ApiKey.name == "nightly-evals"))
        assert (row.service_class, row.priority_allowed) == ("bulk", False)
    saved = operator.post("/dashboard/keys/nightly-evals/class", follow_redirects=True, data={
        "service_class": "interactive", "priority": "on", "csrf_token": csrf_from(page.text)})
    assert saved.status_code == 200 and "is now class interactive, may ask for priority" in saved.text
    with sessions() as db:
        row = db.scalar(select(ApiKey).where(ApiKey.name == "nightly-evals"))
        assert (row.service_class, row.priority_allowed) == ("interactive", True)
    bad = operator.post("/dashboard/keys/nightly-evals/class", data={"service_class": "urgent",
                                                                     "csrf_token": csrf_from(page.text)})
    assert bad.status_code == 400 and "choose one of interactive, standard, bulk" in bad.text
    assert operator.post("/dashboard/keys/nightly-evals/class", data={"service_class": "bulk"}).status_code == 400
