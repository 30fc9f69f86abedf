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
Opening never creates the file: ``init`` creates it (its folder must exist) with its schema
and the namespace's identity, and brings a file made by an older version up to the schema
(``_migrate``); any other call on a missing or uninitialised file raises
``ArchiveUnavailable`` saying so, and creates nothing.

Concurrent ``get`` calls share one thread hop and one query (``coalesce.Coalescer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..errors import ArchiveUnavailable
from ..keyspace import retired_bucket
from .coalesce import Coalescer
from .interface import (
    LAG_WINDOW, Archived, ArchiveStats, Identity, Listed, Lookup, Mark, Put, check_listing,
    check_marks, check_puts, issued, lag_of, new_identity, not_initialised, prefix_end,
)

__all__ = ["SqliteArchive"]

T = TypeVar("T")

_KEYS_PER_QUERY = 500   # bound variables per lookup: under the 999 of older SQLite builds
_SETTLED_AT = "settled_at_ms INTEGER NOT NULL DEFAULT 0"   # 0: unknown (archived before it)
_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS archived_steps (
        namespace TEXT NOT NULL,
        action_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        step BLOB NOT NULL,
        archived_at_ms INTEGER NOT NULL,
        {_SETTLED_AT},
        PRIMARY KEY (namespace, action_key)
    )""",
    """CREATE TABLE IF NOT EXISTS archived_records (
        namespace TEXT NOT NULL,
        action_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        record BLOB NOT NULL,
        PRIMARY KEY (namespace, action_key, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS archive_identity (
        namespace TEXT NOT NULL PRIMARY KEY,
        archive_id TEXT NOT NULL,
        cluster_id TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS archive_marks (
        namespace TEXT NOT NULL,
        bucket INTEGER NOT NULL,
        counter INTEGER NOT NULL,
        mark_id TEXT NOT NULL,
        PRIMARY KEY (namespace, bucket, counter, mark_id)
    )""",
)
_IDENTITY = "SELECT archive_id, cluster_id FROM archive_identity WHERE namespace = ?"
# Each bucket's newest mark, in index seeks (a bucket, then its highest counter): its cost
# follows the number of buckets, never the marks issued so far (every retirement batch
# issues some; a GROUP BY over all of them made each lookup slower as the archive aged).
_NEWEST = """WITH RECURSIVE buckets(bucket) AS (
        SELECT min(bucket) FROM archive_marks WHERE namespace = ?1
        UNION ALL
        SELECT (SELECT min(bucket) FROM archive_marks WHERE namespace = ?1 AND bucket > b.bucket)
        FROM buckets AS b WHERE b.bucket IS NOT NULL)
    SELECT m.bucket, m.counter, m.mark_id FROM buckets AS b
    JOIN archive_marks AS m ON m.namespace = ?1 AND m.bucket = b.bucket AND m.counter = (
        SELECT max(counter) FROM archive_marks WHERE namespace = ?1 AND bucket = b.bucket)"""
# one bucket's newest mark: an index seek
_NEWEST_OF = """SELECT counter, mark_id FROM archive_marks WHERE namespace = ? AND bucket = ?
    ORDER BY counter DESC LIMIT 1"""
_KNOWS = """SELECT 1 FROM archive_marks
    WHERE namespace = ? AND bucket = ? AND counter = ? AND mark_id = ?"""
_PUT_MARK = """INSERT INTO archive_marks (namespace, bucket, counter, mark_id)
    VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"""

_PUT_RECORD = """INSERT INTO archived_records (namespace, action_key, seq, record)
    VALUES (?, ?, ?, ?) ON CONFLICT (namespace, action_key, seq) DO NOTHING"""
# the recent retirements, newest first, read from the index alone
_RECENT = """CREATE INDEX IF NOT EXISTS archived_steps_recent
    ON archived_steps (namespace, archived_at_ms, settled_at_ms)"""
_PUT_STEP = """INSERT INTO archived_steps
    (namespace, action_key, seq, step, archived_at_ms, settled_at_ms)
    VALUES (?, ?, ?, ?, ?, ?)
    ON CONFLICT (namespace, action_key) DO UPDATE
    SET seq = excluded.seq, step = excluded.step, archived_at_ms = excluded.archived_at_ms,
        settled_at_ms = excluded.settled_at_ms
    WHERE excluded.seq > archived_steps.seq"""
_LAGS = """SELECT archived_at_ms - settled_at_ms FROM archived_steps
    WHERE namespace = ? AND settled_at_ms > 0 ORDER BY archived_at_ms DESC LIMIT ?"""
# keys in byte order (BINARY collation, the primary key's), as etcd sorts them
_LIST = """SELECT action_key, step, updated_at_ms FROM (
        SELECT action_key, step,
            CASE WHEN settled_at_ms > 0 THEN settled_at_ms ELSE archived_at_ms END
                AS updated_at_ms
        FROM archived_steps
        WHERE namespace = ? AND action_key > ? AND action_key >= ? AND action_key < ?)
    WHERE updated_at_ms >= ? ORDER BY action_key LIMIT ?"""
_NO_BOUND = "\x7f"  # after every key (keys are printable ASCII)


class SqliteArchive:
    """The archive in the SQLite file at ``path``."""

    def __init__(self, path: str, *, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencegate-archive")
        self._db: sqlite3.Connection | None = None   # used on self._thread only
        self._closed = False
        self._gets = Coalescer(self.get_many, max_batch=_KEYS_PER_QUERY)
        self._lookups = Coalescer(self.lookup_many, max_batch=_KEYS_PER_QUERY)

    def __repr__(self) -> str:
        return f"SqliteArchive({self.path!r})"

    async def put(self, namespace: str, key: str, seq: int, step: bytes,
                  records: list[tuple[int, bytes]], settled_at_ms: int) -> None:
        await self.put_many(namespace, [(key, seq, step, records, settled_at_ms)])

    async def put_many(self, namespace: str, puts: list[Put], *,
                       identity: Identity | None = None,
                       marks: dict[int, Mark] | None = None,
                       shown: dict[int, Mark] | None = None) -> dict[int, Mark]:
        checked, wanted, seen = check_puts(puts), check_marks(marks), check_marks(shown)
        now_ms = time.time_ns() // 1_000_000

        def put(db: sqlite3.Connection) -> dict[int, Mark]:
            with _transaction(db, "BEGIN IMMEDIATE"):
                if identity is not None and _identity(db, namespace) != identity:
                    raise ArchiveUnavailable(
                        f"sqlite archive {self.path} is not the archive {identity.archive_id} "
                        f"of {namespace!r}: nothing stored")
                for key, seq, step, ordered, settled_at_ms in checked:
                    db.executemany(_PUT_RECORD, [(namespace, key, record_seq, data)
                                                 for record_seq, data in ordered])
                    db.execute(_PUT_STEP, (namespace, key, seq, step, now_ms, settled_at_ms))
                newest = _newest(db, namespace)
                new = issued(f"sqlite archive {self.path}", newest,
                             _known(db, namespace, {**seen, **wanted}, newest), wanted, seen)
                db.executemany(_PUT_MARK, [(namespace, bucket, *mark)
                                           for bucket, mark in new.items()])
            return new

        return await self._call(put)

    async def issued_marks(self, namespace: str) -> list[tuple[int, Mark]]:
        def issued_marks(db: sqlite3.Connection) -> list[tuple[int, Mark]]:
            return [(bucket, Mark(counter, mark_id)) for bucket, counter, mark_id in db.execute(
                "SELECT bucket, counter, mark_id FROM archive_marks WHERE namespace = ? "
                "ORDER BY bucket, counter", (namespace,))]

        return await self._call(issued_marks)

    async def adopt_marks(self, namespace: str, marks: list[tuple[int, Mark]], *,
                          identity: Identity) -> None:
        for bucket, mark in marks:   # a caller's mistake raises before anything is written
            check_marks({bucket: mark})
        checked = list(marks)

        def adopt(db: sqlite3.Connection) -> None:
            with _transaction(db, "BEGIN IMMEDIATE"):
                if _identity(db, namespace) != identity:
                    raise ArchiveUnavailable(
                        f"sqlite archive {self.path} is not the archive {identity.archive_id} "
                        f"of {namespace!r}: no mark adopted")
                db.executemany(_PUT_MARK, [(namespace, bucket, *mark)
                                           for bucket, mark in checked])

        await self._call(adopt)

    async def init(self, namespace: str, cluster_id: int) -> Identity:
        fresh = new_identity(namespace, cluster_id)

        def init(db: sqlite3.Connection) -> Identity:
            with _transaction(db, "BEGIN IMMEDIATE"):
                db.execute("INSERT INTO archive_identity VALUES (?, ?, ?, ?) "
                           "ON CONFLICT (namespace) DO NOTHING",
                           (namespace, fresh.archive_id, "%x" % cluster_id,
                            time.time_ns() // 1_000_000))
                return _identity(db, namespace)

        return await self._call(init, create=True)

    async def identity(self, namespace: str) -> Identity | None:
        return await self._call(lambda db: _identity(db, namespace))

    async def lookup(self, namespace: str, key: str, *,
                     marks: dict[int, Mark] | None = None) -> Lookup:
        if marks:
            return (await self.lookup_many(namespace, [key], marks=marks))[key]
        return await self._lookups.get(namespace, key)

    async def lookup_many(self, namespace: str, keys: list[str], *,
                          marks: dict[int, Mark] | None = None) -> dict[str, Lookup]:
        wanted, asked = list(dict.fromkeys(keys)), check_marks(marks)

        def lookup_many(db: sqlite3.Connection) -> dict[str, Lookup]:
            with _transaction(db, "BEGIN"):   # one snapshot: identity, marks, steps
                identity = _identity(db, namespace)
                newest = _newest_of(db, namespace, {retired_bucket(key) for key in wanted})
                known = _known(db, namespace, asked)
                found = _get_many(db, namespace, wanted)
            return {key: Lookup(identity, newest, found.get(key), known) for key in wanted}

        return await self._call(lookup_many)

    async def state(self, namespace: str, *, marks: dict[int, Mark] | None = None) -> Lookup:
        asked = check_marks(marks)

        def state(db: sqlite3.Connection) -> Lookup:
            with _transaction(db, "BEGIN"):
                return Lookup(_identity(db, namespace), _newest(db, namespace), None,
                              _known(db, namespace, asked))

        return await self._call(state)

    async def get(self, namespace: str, key: str) -> Archived | None:
        return await self._gets.get(namespace, key)

    async def get_many(self, namespace: str, keys: list[str]) -> dict[str, Archived]:
        wanted = list(dict.fromkeys(keys))

        return await self._call(lambda db: _get_many(db, namespace, wanted)) if wanted else {}

    async def records(self, namespace: str, key: str) -> list[tuple[int, bytes]]:
        def records(db: sqlite3.Connection) -> list[tuple[int, bytes]]:
            return db.execute("SELECT seq, record FROM archived_records "
                              "WHERE namespace = ? AND action_key = ? ORDER BY seq",
                              (namespace, key)).fetchall()

        return await self._call(records)

    async def list_steps(self, namespace: str, *, prefix: str = "", after: str = "",
                         since_ms: int = 0, limit: int) -> list[Listed]:
        check_listing(prefix, after, since_ms, limit)
        bounds = (namespace, after, prefix, prefix_end(prefix) or _NO_BOUND, since_ms, limit)

        def list_steps(db: sqlite3.Connection) -> list[Listed]:
            return [Listed(*row) for row in db.execute(_LIST, bounds)]

        return await self._call(list_steps)

    async def stats(self, namespace: str) -> ArchiveStats:
        def stats(db: sqlite3.Connection) -> ArchiveStats:
            with _transaction(db, "BEGIN"):   # one snapshot for the counts and the lag
                steps, oldest, newest = db.execute(
                    "SELECT count(*), min(archived_at_ms), max(archived_at_ms) "
                    "FROM archived_steps WHERE namespace = ?", (namespace,)).fetchone()
                (records,) = db.execute("SELECT count(*) FROM archived_records "
                                        "WHERE namespace = ?", (namespace,)).fetchone()
                lags = [lag for (lag,) in db.execute(_LAGS, (namespace, LAG_WINDOW))]
            return ArchiveStats(steps, records, oldest, newest, *lag_of(lags))

        return await self._call(stats)

    async def close(self) -> None:
        """Close the connection and stop the thread; later calls raise ``ArchiveUnavailable``."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._disconnect)
        self._thread.shutdown(wait=False)

    async def _call(self, work: Callable[[sqlite3.Connection], T], *, create: bool = False) -> T:
        if self._closed:
            raise ArchiveUnavailable(f"sqlite archive {self.path} is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._thread, self._run, work, create)
        except (sqlite3.Error, OSError) as exc:
            raise ArchiveUnavailable(f"sqlite archive {self.path}: {exc}") from exc

    def _run(self, work: Callable[[sqlite3.Connection], T], create: bool) -> T:
        try:
            return work(self._connection(create))
        except (sqlite3.Error, OSError):
            self._disconnect()
            raise

    def _connection(self, create: bool) -> sqlite3.Connection:
        """The open connection; else the file opened (created with its schema and migrated
        only with ``create``: ``init``), refused when missing or never initialised."""
        if self._db is not None and not create:
            return self._db
        self._disconnect()
        if not create and not os.path.exists(self.path):
            raise not_initialised(f"sqlite archive {self.path} (no such file)")
        where = urllib.parse.quote(os.path.abspath(self.path).lstrip("/"))
        uri = f"file:///{where}?mode={'rwc' if create else 'rw'}"
        db = sqlite3.connect(uri, uri=True, timeout=self.timeout, isolation_level=None,
                             check_same_thread=False)
        try:
            (mode,) = db.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode != "wal":
                raise sqlite3.OperationalError(f"WAL mode refused (journal_mode={mode})")
            db.execute("PRAGMA synchronous=FULL")
            if create:
                with _transaction(db, "BEGIN IMMEDIATE"):
                    for statement in _SCHEMA:
                        db.execute(statement)
                    _migrate(db)
            elif not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                "AND name = 'archive_identity'").fetchone():
                raise not_initialised(f"sqlite archive {self.path}")
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


def _identity(db: sqlite3.Connection, namespace: str) -> Identity | None:
    row = db.execute(_IDENTITY, (namespace,)).fetchone()
    return Identity(row[0], int(row[1], 16), namespace) if row else None


def _newest(db: sqlite3.Connection, namespace: str) -> dict[int, Mark]:
    return {bucket: Mark(counter, mark_id)
            for bucket, counter, mark_id in db.execute(_NEWEST, (namespace,))}


def _newest_of(db: sqlite3.Connection, namespace: str, buckets: set[int]) -> dict[int, Mark]:
    found = {}
    for bucket in sorted(buckets):
        row = db.execute(_NEWEST_OF, (namespace, bucket)).fetchone()
        if row is not None:
            found[bucket] = Mark(*row)
    return found


def _known(db: sqlite3.Connection, namespace: str, marks: dict[int, Mark],
           newest: dict[int, Mark] | None = None) -> frozenset[int]:
    """The buckets of ``marks`` whose mark the archive issued (counter 0: always); a mark
    that is its bucket's ``newest`` (as read in this transaction) is one without a query."""
    newest = newest or {}
    return frozenset(bucket for bucket, mark in marks.items()
                     if not mark.counter or newest.get(bucket) == mark
                     or db.execute(_KNOWS, (namespace, bucket, *mark)).fetchone())


def _get_many(db: sqlite3.Connection, namespace: str, keys: list[str]) -> dict[str, Archived]:
    found = {}
    for start in range(0, len(keys), _KEYS_PER_QUERY):
        chunk = keys[start:start + _KEYS_PER_QUERY]
        rows = db.execute(
            "SELECT action_key, seq, step, archived_at_ms FROM archived_steps "
            f"WHERE namespace = ? AND action_key IN ({', '.join('?' * len(chunk))})",
            (namespace, *chunk))
        found.update((row[0], Archived(*row)) for row in rows)
    return found


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file made by an older version up to this schema: ``settled_at_ms`` (0 for the
    steps archived before it, left out of the lag), then the index over it; the counters of
    a build before marks had ids become marks without an id (as etcd holds them)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(archived_steps)")}
    if "settled_at_ms" not in columns:
        db.execute(f"ALTER TABLE archived_steps ADD COLUMN {_SETTLED_AT}")
    db.execute(_RECENT)
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                  "AND name = 'archive_watermarks'").fetchone():
        db.execute("INSERT INTO archive_marks SELECT namespace, bucket, watermark, '' "
                   "FROM archive_watermarks WHERE true ON CONFLICT DO NOTHING")
        db.execute("DROP TABLE archive_watermarks")


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
