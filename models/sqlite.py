"""SQLite connections whose writers in one process take turns on a lock, not on SQLite's busy handler.

SQLite lets one transaction write at a time. A writer that finds the file locked sleeps and retries
(1, 2, 5, 10 ... 100 ms), so a burst of messages, each written by its own request thread, spread over
hundreds of milliseconds and in no fair order. Here a thread about to write first waits on a lock
shared by every connection of the process to that file, and the next writer starts as soon as the
previous one commits. Other processes (a second web app, the worker) still meet at SQLite's lock.

Under gevent (the web server) SQLite's busy handler would sleep in C and stall every connection the
process serves; there a connection waits for another process's lock itself, in cooperative sleeps
(`cooperative=True`, with SQLite's own busy timeout set to 0).
"""

from __future__ import annotations

import sqlite3
import threading
import time

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")   # the statements sqlite3 opens a transaction for
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def writer_lock(database: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(database, threading.Lock())


class QueuedWritesConnection(sqlite3.Connection):
    """Holds the file's writer lock from its first write statement until commit, rollback or close."""

    cooperative = False   # set on a subclass for processes whose threads are greenlets (see cooperative())

    def __init__(self, database: str, *args, **kwargs) -> None:
        self._lock_timeout_s = kwargs.get("timeout", 5.0)   # as long as SQLite's busy handler would wait
        if self.cooperative:
            kwargs["timeout"] = 0   # never sleep inside SQLite: run() waits instead
        super().__init__(database, *args, **kwargs)
        self._writer_lock = writer_lock(str(database))
        self._holds = False

    def run(self, call, sql: str):
        """`call()`, retried in short cooperative sleeps while another process holds the lock it needs.

        Only where a retry is safe: a statement outside a transaction, or the first write of one (its BEGIN
        is deferred, so it holds no lock yet); a later statement inside a transaction fails as it would.
        """
        if not self.cooperative:
            return call()
        safe, deadline, pause = not self.in_transaction, time.monotonic() + self._lock_timeout_s, 0.001
        while True:
            try:
                return call()
            except sqlite3.OperationalError as exc:
                if not (safe and "locked" in str(exc)) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)   # gevent's sleep: the process's other connections go on meanwhile
            pause = min(0.05, pause * 2)

    def cursor(self, factory=None):
        return super().cursor(factory or QueuedWritesCursor)

    def execute(self, sql, parameters=()):   # the shortcuts would bypass cursor()
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql, seq_of_parameters):
        return self.cursor().executemany(sql, seq_of_parameters)

    def before(self, sql: str) -> None:
        if not self._holds and not self.in_transaction and sql.lstrip()[:7].upper().startswith(_WRITES):
            # Past the timeout (a thread writing through two connections at once would wait on itself),
            # go on without the lock: SQLite's own busy handling then decides, as it would without this.
            self._holds = self._writer_lock.acquire(timeout=self._lock_timeout_s)

    def after(self) -> None:
        if self._holds and not self.in_transaction:   # a write outside a transaction is already committed
            self._release()

    def commit(self) -> None:
        self._end(lambda: self._commit())

    def _commit(self) -> None:
        if not self.cooperative:
            return super().commit()
        deadline, pause = time.monotonic() + self._lock_timeout_s, 0.001
        while True:   # a COMMIT that meets a lock may always be retried
            try:
                return super().commit()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(0.05, pause * 2)

    def rollback(self) -> None:
        self._end(super().rollback)

    def close(self) -> None:
        self._end(super().close)

    def _end(self, end) -> None:
        try:
            end()
        finally:
            self._release()

    def _release(self) -> None:
        if self._holds:
            self._holds = False
            self._writer_lock.release()


class QueuedWritesCursor(sqlite3.Cursor):
    def execute(self, sql, parameters=()):
        self.connection.before(sql)
        try:
            return self.connection.run(lambda: super(QueuedWritesCursor, self).execute(sql, parameters), sql)
        finally:
            self.connection.after()

    def executemany(self, sql, seq_of_parameters):
        self.connection.before(sql)
        try:
            return self.connection.run(lambda: super(QueuedWritesCursor, self).executemany(sql, seq_of_parameters),
                                       sql)
        finally:
            self.connection.after()


class CooperativeConnection(QueuedWritesConnection):
    cooperative = True


def connection_class() -> type[QueuedWritesConnection]:
    """Cooperative waits in a process that gevent has patched (the web server), SQLite's own elsewhere."""
    try:
        from gevent import monkey
    except ImportError:
        return QueuedWritesConnection
    return CooperativeConnection if monkey.is_module_patched("socket") else QueuedWritesConnection
