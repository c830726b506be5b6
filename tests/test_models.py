"""Models and migrations against real SQLite and PostgreSQL databases."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, func, inspect, select, text
from sqlalchemy.exc import IntegrityError, StatementError

from models import ORDER_STATUSES, ApiKey, Base, Conversation, Message, Order, RequestRecord, demo_orders, help_articles
from models.db import default_database_url, make_engine, make_session_factory, upgrade

EXPECTED_INDEXES = {
    "conversations": {"ix_conversations_owner": ["owner"]},
    "messages": {"ix_messages_conversation_id": ["conversation_id"]},
    "request_records": {
        "ix_request_records_enqueued_at": ["enqueued_at"],
        "ix_request_records_finished_at": ["finished_at"],
        "ix_request_records_finish_reason_finished_at": ["finish_reason", "finished_at"],
    },
}


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'supportbot.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture()
def engine(db_url: str) -> Iterator[Engine]:
    upgrade(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def test_upgrade_creates_schema_matching_models(db_url: str, tmp_path, monkeypatch) -> None:
    # upgrade() must find alembic.ini and the migrations from anywhere.
    monkeypatch.chdir(tmp_path)
    upgrade(db_url)
    upgrade(db_url)  # a second run at head is a no-op

    engine = make_engine(db_url)
    try:
        inspector = inspect(engine)
        assert set(EXPECTED_INDEXES) <= set(inspector.get_table_names())
        for table, expected in EXPECTED_INDEXES.items():
            # PostgreSQL also lists the index behind each unique constraint; those are checked below.
            indexes = {
                ix["name"]: ix["column_names"]
                for ix in inspector.get_indexes(table)
                if "duplicates_constraint" not in ix
            }
            assert indexes == expected, table
        unique = {tuple(uq["column_names"]) for uq in inspector.get_unique_constraints("messages")}
        assert ("request_id",) in unique
        unique = {tuple(uq["column_names"]) for uq in inspector.get_unique_constraints("api_keys")}
        assert {("name",), ("key_hash",)} <= unique

        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head_revision()
            context = MigrationContext.configure(conn, opts={"compare_type": True,
                                                             "include_object": help_articles.modelled})
            diff = compare_metadata(context, Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
    finally:
        engine.dispose()


def head_revision() -> str:
    """The one head of the migrations (a chain with two heads is refused)."""
    from alembic.script import ScriptDirectory

    from models.db import alembic_config
    heads = ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()
    assert len(heads) == 1, f"the migrations must form one chain; heads: {heads}"
    return heads[0]


def test_the_api_keys_revision_goes_down_and_up_again_keeping_records_and_triggers(db_url: str) -> None:
    from alembic import command

    from models.db import alembic_config

    upgrade(db_url)
    engine = make_engine(db_url)
    t0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    try:
        with make_session_factory(engine)() as session:
            session.add(ApiKey(name="k", key_hash="a" * 64, prefix="sb-aaaa…", rate_limit="5/minute"))
            session.add(RequestRecord(request_id="keyed", source="api", enqueued_at=t0, api_key="k"))
            session.commit()
        command.downgrade(alembic_config(db_url), "0002")
        inspector = inspect(engine)
        assert not {"api_keys", "key_usage"} & set(inspector.get_table_names())
        assert "api_key" not in {c["name"] for c in inspector.get_columns("request_records")}
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM request_records")).scalar_one() == 1
            # 0002's update trigger is whole again: a record that finishes marks its minute.
            conn.execute(text("UPDATE request_records SET finished_at = :t"), {"t": t0})
            assert conn.execute(text("SELECT minute FROM dirty_minutes")).scalars().all() == [int(t0.timestamp()) // 60]
            conn.execute(text("DELETE FROM dirty_minutes"))
        upgrade(db_url)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT api_key FROM request_records")).scalar_one() is None
            # ... and the new one watches the key's name too.
            conn.execute(text("UPDATE request_records SET api_key = 'other'"))
            assert conn.execute(text("SELECT count(*) FROM dirty_minutes")).scalar_one() == 1
            assert conn.execute(text("SELECT count(*) FROM api_keys")).scalar_one() == 0
    finally:
        engine.dispose()


def test_the_orders_revision_goes_down_and_up_again(db_url: str) -> None:
    from alembic import command

    from models.db import alembic_config

    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with make_session_factory(engine)() as session:
            assert demo_orders.seed(session) == len(demo_orders.DEMO_ORDERS)
            session.add(RequestRecord(request_id="kept", source="chat", enqueued_at=datetime.now(UTC)))
            session.commit()
        command.downgrade(alembic_config(db_url), "0003")
        assert "orders" not in inspect(engine).get_table_names()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0003"
            assert conn.execute(text("SELECT count(*) FROM request_records")).scalar_one() == 1
        upgrade(db_url)
        with make_session_factory(engine)() as session:
            assert session.scalar(select(func.count()).select_from(Order)) == 0
            assert demo_orders.seed(session) == len(demo_orders.DEMO_ORDERS)
    finally:
        engine.dispose()


def test_demo_orders_are_seeded_once_and_left_alone_after(engine: Engine) -> None:
    Session = make_session_factory(engine)
    with Session() as session:
        assert demo_orders.seed(session) == len(demo_orders.DEMO_ORDERS)
        statuses = session.scalars(select(Order.status)).all()
        assert len(set(statuses)) == len(statuses) and set(statuses) <= set(ORDER_STATUSES)
        shipped = session.scalars(select(Order).filter_by(order_number="NW-10042")).one()
        shipped.status = "delivered"   # the shop's own change survives a later seeding
        session.commit()
    with Session() as session:
        assert demo_orders.seed(session) == 0
        assert session.scalar(select(func.count()).select_from(Order)) == len(demo_orders.DEMO_ORDERS)
        assert session.scalars(select(Order.status).filter_by(order_number="NW-10042")).one() == "delivered"
        order = session.scalars(select(Order).filter_by(order_number="NW-10043")).one()
        assert order.placed_at <= order.updated_at <= datetime.now(UTC) and order.carrier == "UPS"


def test_demo_orders_go_only_to_the_embedded_database_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("DEMO_ORDERS", raising=False)
    assert demo_orders.wanted(database_url_given=False) and not demo_orders.wanted(database_url_given=True)
    monkeypatch.setenv("DEMO_ORDERS", "1")
    assert demo_orders.wanted(database_url_given=True)
    monkeypatch.setenv("DEMO_ORDERS", "0")
    assert not demo_orders.wanted(database_url_given=False)
    monkeypatch.setenv("DEMO_ORDERS", "maybe")
    with pytest.raises(ValueError, match="DEMO_ORDERS must be 1 or 0"):
        demo_orders.wanted(database_url_given=False)


def test_round_trip(engine: Engine) -> None:
    t0 = datetime(2026, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
    plus_two = timezone(timedelta(hours=2))
    Session = make_session_factory(engine)

    with Session() as session:
        conv = Conversation(owner="session-abc")
        conv.messages.append(Message(role="user", content="Where is my order?"))
        conv.messages.append(Message(role="assistant", content="It shipped.", request_id="req-1"))
        session.add(conv)
        session.flush()
        session.add(
            RequestRecord(
                request_id="req-1",
                conversation_id=conv.id,
                source="chat",
                model="SmolLM2-135M-Instruct",
                worker="worker@test",
                enqueued_at=t0,
                admitted_at=t0 + timedelta(microseconds=250_001),
                # Any zone goes in; UTC comes out.
                first_token_at=(t0 + timedelta(seconds=0.5, microseconds=7)).astimezone(plus_two),
                finished_at=t0 + timedelta(seconds=2.5, microseconds=7),
                prompt_tokens=42,
                completion_tokens=11,
                cached_tokens=16,
                finish_reason="stop",
                batch_size=3.5,
            )
        )
        session.commit()
        conv_id = conv.id

    assert len(conv_id) == 32 and int(conv_id, 16) >= 0

    with Session() as session:
        conv = session.get(Conversation, conv_id)
        assert conv is not None
        assert [(m.role, m.request_id) for m in conv.messages] == [("user", None), ("assistant", "req-1")]
        stamps = [conv.created_at] + [m.created_at for m in conv.messages]
        assert all(s.tzinfo is not None and s.utcoffset() == timedelta(0) for s in stamps)
        assert abs(datetime.now(UTC) - conv.created_at) < timedelta(minutes=1)

        rec = session.get(RequestRecord, "req-1")
        assert rec is not None
        assert rec.enqueued_at == t0 and rec.enqueued_at.microsecond == 123456
        assert rec.enqueued_at.tzinfo is not None and rec.enqueued_at.utcoffset() == timedelta(0)
        assert rec.first_token_at is not None and rec.first_token_at.utcoffset() == timedelta(0)
        assert rec.first_token_at.microsecond == 623463
        assert rec.queue_wait == pytest.approx(0.250001)
        assert rec.ttft == pytest.approx(0.500007)
        assert rec.e2e == pytest.approx(2.500007)
        assert rec.tpot == pytest.approx(2.0 / 10)
        assert rec.batch_size == pytest.approx(3.5)

        # The dashboard's time-window filter compares aware datetimes in SQL on both backends.
        window = select(RequestRecord.request_id).where(RequestRecord.finished_at >= t0 + timedelta(seconds=2.5))
        assert session.scalars(window).all() == ["req-1"]

    with Session() as session:
        # A redelivered request must not be able to store a second answer.
        session.add(Message(conversation_id=conv_id, role="assistant", content="Again.", request_id="req-1"))
        with pytest.raises(IntegrityError):
            session.commit()


def test_deleting_a_conversation_keeps_its_request_records(engine: Engine) -> None:
    Session = make_session_factory(engine)
    with Session() as session:
        conv = Conversation(owner="o")
        conv.messages.append(Message(role="assistant", content="hi", request_id="r"))
        session.add(conv)
        session.flush()
        session.add(RequestRecord(request_id="r", conversation_id=conv.id, source="api", enqueued_at=datetime.now(UTC)))
        session.commit()
        # Core DELETE: the database's ON DELETE rules must do the work, not the ORM cascade.
        session.execute(Conversation.__table__.delete())
        session.commit()
        assert session.scalars(select(Message)).all() == []
        session.expire_all()
        rec = session.get(RequestRecord, "r")
        assert rec is not None and rec.conversation_id is None


def test_metrics_none_until_timestamps_exist() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rec = RequestRecord(request_id="x", source="api", enqueued_at=t0)
    assert (rec.queue_wait, rec.ttft, rec.tpot, rec.e2e) == (None, None, None, None)
    rec.first_token_at, rec.finished_at, rec.completion_tokens = t0 + timedelta(seconds=1), t0 + timedelta(seconds=2), 1
    assert rec.ttft == 1.0 and rec.e2e == 2.0 and rec.tpot is None


def test_naive_datetime_is_rejected(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'naive.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            session.add(RequestRecord(request_id="n", source="api", enqueued_at=datetime(2026, 1, 1)))
            with pytest.raises(StatementError, match="naive datetime"):
                session.commit()
    finally:
        engine.dispose()


def test_sqlite_engine_lets_two_processes_write(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    upgrade(url)
    web, worker = make_engine(url), make_engine(url)
    try:
        with web.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar_one() >= 5000
            assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1

        errors: list[BaseException] = []

        def second_writer() -> None:
            try:
                with make_session_factory(worker)() as session:
                    session.add(Conversation(owner="worker"))
                    session.commit()
            except BaseException as exc:
                errors.append(exc)

        with make_session_factory(web)() as session:
            session.add(Conversation(owner="web"))
            session.flush()  # holds SQLite's write lock until commit
            thread = threading.Thread(target=second_writer)
            thread.start()
            time.sleep(0.3)
            session.commit()
        thread.join(timeout=10)
        assert not thread.is_alive() and errors == []
        with make_session_factory(web)() as session:
            assert sorted(session.scalars(select(Conversation.owner))) == ["web", "worker"]
    finally:
        web.dispose()
        worker.dispose()


def test_default_database_url(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("models.db.REPO_ROOT", tmp_path)
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p%40ss@db:5432/supportbot")
    assert default_database_url() == "postgresql+psycopg://u:p%40ss@db:5432/supportbot"
    monkeypatch.delenv("DATABASE_URL")
    assert default_database_url() == f"sqlite:///{tmp_path}/instance/supportbot.db"
    assert (tmp_path / "instance").is_dir()


def test_sqlite_writers_of_one_process_queue_on_a_lock_held_from_first_write_to_commit(tmp_path):
    from models.sqlite import writer_lock

    path = tmp_path / "queued.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    lock = writer_lock(str(path))

    with sessions() as s:
        s.execute(select(Conversation)).all()
        assert not lock.locked(), "reading takes no turn"
        s.add(Conversation(owner="a"))
        s.flush()
        assert lock.locked(), "the first write takes the turn"
        s.commit()
        assert not lock.locked(), "commit ends it"

    with sessions() as s:
        s.add(Conversation(owner="b"))
        s.flush()
        assert lock.locked()
        s.rollback()
        assert not lock.locked(), "so does rollback"

    # A second writer waits for the first to commit, then goes on.
    first = sessions()
    first.add(Conversation(owner="first"))
    first.flush()
    second_done = threading.Event()

    def second() -> None:
        with sessions() as s:
            s.add(Conversation(owner="second"))
            s.commit()
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_done.wait(0.3), "the second writer must wait while the first holds the turn"
    first.commit()
    first.close()
    assert second_done.wait(30)
    thread.join()
    with sessions() as s:
        assert {c.owner for c in s.scalars(select(Conversation))} == {"a", "first", "second"}


def test_one_thread_writing_through_two_sqlite_connections_falls_back_to_sqlites_own_lock(tmp_path, monkeypatch):
    # Waiting on itself would never end: past its timeout the second connection goes on without the turn,
    # and SQLite's busy timeout says the database is locked, as it would without the queue.
    from models import db as db_module

    path = tmp_path / "self.db"
    upgrade(f"sqlite:///{path}")
    monkeypatch.setattr(db_module, "SQLITE_BUSY_TIMEOUT_S", 1)
    engine = make_engine(f"sqlite:///{path}", connect_args={"timeout": 0.2})
    sessions = make_session_factory(engine)
    with sessions() as first, sessions() as second:
        first.add(Conversation(owner="first"))
        first.flush()
        second.add(Conversation(owner="second"))
        with pytest.raises(StatementError, match="database is locked"):
            second.flush()
