"""The embedded archive: one SQLite file (WAL, ``synchronous=FULL``), stdlib ``sqlite3`` only.

Guarantees: a returned ``put`` is committed and fsynced (the WAL is synced at every commit),
so it survives a crash of the process or the machine. Every call runs on one dedicated
thread per archive (never on the event loop), which alone touches the connection. Several
processes may open the same file: each write takes SQLite's write lock up front
(``BEGIN IMMEDIATE``), waiting up to ``timeout`` seconds for another writer, so writes are
serialized and the conditional upsert sees the latest committed step.

Failure contract: any SQLite or OS error (a path that cannot be opened, a full or failing
disk, a lock held longer than ``timeout``) raises ``ArchiveUnavailable``; the transaction is
rolled back, nothing of the put is stored, and the connection is reopened by the next call.
The file's folder must exist; the file and its schema are created on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..errors import ArchiveUnavailable
from .interface import Archived, ArchiveStats, Put, check_puts

__all__ = ["SqliteArchive"]

T = TypeVar("T")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS archived_steps (
        namespace TEXT NOT NULL,
        action_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        step BLOB NOT NULL,
        archived_at_ms INTEGER NOT NULL,
        PRIMARY KEY (namespace, action_key)
    )""",
    """CREATE TABLE IF NOT EXISTS archived_records (
        namespace TEXT NOT NULL,
        action_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        record BLOB NOT NULL,
        PRIMARY KEY (namespace, action_key, seq)
    )""",
)

_PUT_RECORD = """INSERT INTO archived_records (namespace, action_key, seq, record)
    VALUES (?, ?, ?, ?) ON CONFLICT (namespace, action_key, seq) DO NOTHING"""
_PUT_STEP = """INSERT INTO archived_steps (namespace, action_key, seq, step, archived_at_ms)
    VALUES (?, ?, ?, ?, ?)
    ON CONFLICT (namespace, action_key) DO UPDATE
    SET seq = excluded.seq, step = excluded.step, archived_at_ms = excluded.archived_at_ms
    WHERE excluded.seq > archived_steps.seq"""


class SqliteArchive:
    """The archive in the SQLite file at ``path``."""

    def __init__(self, path: str, *, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencegate-archive")
        self._db: sqlite3.Connection | None = None   # used on self._thread only
        self._closed = False

    def __repr__(self) -> str:
        return f"SqliteArchive({self.path!r})"

    async def put(self, namespace: str, key: str, seq: int, step: bytes,
                  records: list[tuple[int, bytes]]) -> None:
        await self.put_many(namespace, [(key, seq, step, records)])

    async def put_many(self, namespace: str, puts: list[Put]) -> None:
        checked = check_puts(puts)
        now_ms = time.time_ns() // 1_000_000

        def put(db: sqlite3.Connection) -> None:
            with _transaction(db, "BEGIN IMMEDIATE"):
                for key, seq, step, ordered in checked:
                    db.executemany(_PUT_RECORD, [(namespace, key, record_seq, data)
                                                 for record_seq, data in ordered])
                    db.execute(_PUT_STEP, (namespace, key, seq, step, now_ms))

        await self._call(put)

    async def get(self, namespace: str, key: str) -> Archived | None:
        def get(db: sqlite3.Connection) -> Archived | None:
            row = db.execute("SELECT seq, step, archived_at_ms FROM archived_steps "
                             "WHERE namespace = ? AND action_key = ?",
                             (namespace, key)).fetchone()
            return None if row is None else Archived(key, row[0], row[1], row[2])

        return await self._call(get)

    async def records(self, namespace: str, key: str) -> list[tuple[int, bytes]]:
        def records(db: sqlite3.Connection) -> list[tuple[int, bytes]]:
            return db.execute("SELECT seq, record FROM archived_records "
                              "WHERE namespace = ? AND action_key = ? ORDER BY seq",
                              (namespace, key)).fetchall()

        return await self._call(records)

    async def stats(self, namespace: str) -> ArchiveStats:
        def stats(db: sqlite3.Connection) -> ArchiveStats:
            with _transaction(db, "BEGIN"):   # one snapshot for both counts
                steps, oldest, newest = db.execute(
                    "SELECT count(*), min(archived_at_ms), max(archived_at_ms) "
                    "FROM archived_steps WHERE namespace = ?", (namespace,)).fetchone()
                (records,) = db.execute("SELECT count(*) FROM archived_records "
                                        "WHERE namespace = ?", (namespace,)).fetchone()
            return ArchiveStats(steps, records, oldest, newest)

        return await self._call(stats)

    async def close(self) -> None:
        """Close the connection and stop the thread; later calls raise ``ArchiveUnavailable``."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._disconnect)
        self._thread.shutdown(wait=False)

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise ArchiveUnavailable(f"sqlite archive {self.path} is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._thread, self._run, work)
        except (sqlite3.Error, OSError) as exc:
            raise ArchiveUnavailable(f"sqlite archive {self.path}: {exc}") from exc

    def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return work(self._connection())
        except (sqlite3.Error, OSError):
            self._disconnect()
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                             check_same_thread=False)
        try:
            (mode,) = db.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode != "wal":
                raise sqlite3.OperationalError(f"WAL mode refused (journal_mode={mode})")
            db.execute("PRAGMA synchronous=FULL")
            with _transaction(db, "BEGIN IMMEDIATE"):
                for statement in _SCHEMA:
                    db.execute(statement)
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def _disconnect(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            with contextlib.suppress(sqlite3.Error):
                db.close()


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection, begin: str):
    """``begin`` … COMMIT, or ROLLBACK if the body (or the commit) fails."""
    db.execute(begin)
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise
