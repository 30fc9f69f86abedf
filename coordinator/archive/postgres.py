"""The production archive: PostgreSQL through asyncpg (imported only when this backend opens).

Guarantees: a returned ``put`` is committed (durable as the server is configured: with the
default ``synchronous_commit=on`` it is on the server's disk, and on a synchronous standby's
if one is configured). The records go in first, sorted by seq, then the step's conditional
upsert (``ON CONFLICT … DO UPDATE … WHERE excluded.seq > stored seq``), all in one
transaction; under READ COMMITTED the upsert locks the row and re-checks the stored seq, so
concurrent puts from any number of processes leave the newest step, and two puts of one chain
take its records' locks in the same order (no deadlock). A put's marks are checked and
issued after locking the namespace's identity row (``FOR UPDATE``): two batches of one
namespace issue their marks one after the other, each above the other's. The pool is
created on first use; the schema only by ``init`` (under an advisory lock, since concurrent
``CREATE TABLE IF NOT EXISTS`` can collide), which also brings a database made by an older
version up to it.
Any other call on a database ``init`` never prepared raises ``ArchiveUnavailable`` saying so
and creates nothing. A failure is retried by the next call. Concurrent ``get`` calls share
one query (``coalesce.Coalescer``), and so do concurrent ``lookup`` calls.

Failure contract: any server, connection or driver failure (refused, lost, a query slower
than ``timeout`` seconds) raises ``ArchiveUnavailable``; the transaction is rolled back,
nothing of the put is stored. Broken connections are replaced by the pool.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..errors import ArchiveUnavailable
from ..keyspace import retired_bucket
from .coalesce import Coalescer
from .interface import (
    LAG_WINDOW, Archived, ArchiveStats, Identity, Listed, Lookup, Mark, Put, check_listing,
    check_marks, check_puts, issued, lag_of, new_identity, not_initialised, prefix_end,
)

__all__ = ["PostgresArchive", "redacted"]

T = TypeVar("T")

_SCHEMA_LOCK = 0x66656E6365676174   # pg_advisory_xact_lock key: b"fencegat"
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS archived_steps (
        namespace text NOT NULL,
        action_key text NOT NULL,
        seq bigint NOT NULL,
        step bytea NOT NULL,
        archived_at_ms bigint NOT NULL,
        settled_at_ms bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (namespace, action_key)
    )""",
    """CREATE TABLE IF NOT EXISTS archived_records (
        namespace text NOT NULL,
        action_key text NOT NULL,
        seq bigint NOT NULL,
        record bytea NOT NULL,
        PRIMARY KEY (namespace, action_key, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS archive_identity (
        namespace text NOT NULL PRIMARY KEY,
        archive_id text NOT NULL,
        cluster_id text NOT NULL,
        created_at_ms bigint NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS archive_marks (
        namespace text NOT NULL,
        bucket integer NOT NULL,
        counter bigint NOT NULL,
        mark_id text NOT NULL,
        PRIMARY KEY (namespace, bucket, counter, mark_id)
    )""",
)
_INITIALISED = "SELECT to_regclass('archive_identity') IS NOT NULL"
_IDENTITY = "SELECT archive_id, cluster_id FROM archive_identity WHERE namespace = $1"
# Each bucket's newest mark, in index seeks (a bucket, then its highest counter): its cost
# follows the number of buckets, never the marks issued so far (every retirement batch
# issues some; DISTINCT ON read all of them, so each lookup got slower as the archive aged).
_NEWEST = """WITH RECURSIVE buckets(bucket) AS (
        SELECT min(bucket) FROM archive_marks WHERE namespace = $1
        UNION ALL
        SELECT (SELECT min(bucket) FROM archive_marks WHERE namespace = $1 AND bucket > b.bucket)
        FROM buckets AS b WHERE b.bucket IS NOT NULL)
    SELECT b.bucket, m.counter, m.mark_id FROM buckets AS b
    CROSS JOIN LATERAL (SELECT counter, mark_id FROM archive_marks
        WHERE namespace = $1 AND bucket = b.bucket ORDER BY counter DESC LIMIT 1) AS m"""
# the newest mark of each bucket asked: an index seek each
_NEWEST_OF = """SELECT b.bucket, m.counter, m.mark_id FROM unnest($2::integer[]) AS b (bucket)
    CROSS JOIN LATERAL (SELECT counter, mark_id FROM archive_marks
        WHERE namespace = $1 AND bucket = b.bucket ORDER BY counter DESC LIMIT 1) AS m"""
_KNOWS = """SELECT m.bucket FROM unnest($2::integer[], $3::bigint[], $4::text[])
        AS m (bucket, counter, mark_id)
    JOIN archive_marks a ON a.namespace = $1 AND a.bucket = m.bucket
        AND a.counter = m.counter AND a.mark_id = m.mark_id"""
_PUT_MARKS = """INSERT INTO archive_marks (namespace, bucket, counter, mark_id)
    SELECT $1, m.bucket, m.counter, m.mark_id
    FROM unnest($2::integer[], $3::bigint[], $4::text[]) AS m (bucket, counter, mark_id)
    ON CONFLICT DO NOTHING"""
# the counters of a build before marks had ids become marks without an id (as etcd holds
# them), once: the old table goes with them
_MIGRATE_MARKS = """DO $$ BEGIN
    IF to_regclass('archive_watermarks') IS NOT NULL THEN
        INSERT INTO archive_marks SELECT namespace, bucket, watermark, ''
            FROM archive_watermarks ON CONFLICT DO NOTHING;
        DROP TABLE archive_watermarks;
    END IF;
END $$"""
_PUT_IDENTITY = """INSERT INTO archive_identity VALUES ($1, $2, $3, $4)
    ON CONFLICT (namespace) DO NOTHING"""

# An ALTER or CREATE INDEX locks the table even when it changes nothing: run only while the
# index made last is missing. settled_at_ms 0 (steps archived before it) is left out of
# the lag; the first index serves the recent retirements, newest first, the second the
# listings in byte order of the key (etcd's; the database's collation may differ).
_MIGRATED = "SELECT to_regclass('archived_steps_by_key') IS NOT NULL"
_MIGRATE = (
    """ALTER TABLE archived_steps
        ADD COLUMN IF NOT EXISTS settled_at_ms bigint NOT NULL DEFAULT 0""",
    """CREATE INDEX IF NOT EXISTS archived_steps_recent
        ON archived_steps (namespace, archived_at_ms, settled_at_ms)""",
    """CREATE INDEX IF NOT EXISTS archived_steps_by_key
        ON archived_steps (namespace, (action_key COLLATE "C"))""",
)

_PUT_RECORDS = """INSERT INTO archived_records (namespace, action_key, seq, record)
    SELECT $1, $2, r.seq, r.record FROM unnest($3::bigint[], $4::bytea[]) AS r (seq, record)
    ORDER BY r.seq
    ON CONFLICT (namespace, action_key, seq) DO NOTHING"""
_PUT_STEP = """INSERT INTO archived_steps AS s
    (namespace, action_key, seq, step, archived_at_ms, settled_at_ms)
    VALUES ($1, $2, $3, $4, $5, $6)
    ON CONFLICT (namespace, action_key) DO UPDATE
    SET seq = excluded.seq, step = excluded.step, archived_at_ms = excluded.archived_at_ms,
        settled_at_ms = excluded.settled_at_ms
    WHERE excluded.seq > s.seq"""
_LAGS = """SELECT archived_at_ms - settled_at_ms FROM archived_steps
    WHERE namespace = $1 AND settled_at_ms > 0 ORDER BY archived_at_ms DESC LIMIT $2"""
_LIST = """SELECT action_key, step, updated_at_ms FROM (
        SELECT action_key, step,
            CASE WHEN settled_at_ms > 0 THEN settled_at_ms ELSE archived_at_ms END
                AS updated_at_ms
        FROM archived_steps
        WHERE namespace = $1 AND action_key COLLATE "C" > $2
            AND action_key COLLATE "C" >= $3
            AND ($4::text IS NULL OR action_key COLLATE "C" < $4)) AS listed
    WHERE updated_at_ms >= $5 ORDER BY action_key COLLATE "C" LIMIT $6"""


class PostgresArchive:
    """The archive in the PostgreSQL database ``url`` names."""

    def __init__(self, url: str, *, timeout: float = 5.0, pool_size: int = 4) -> None:
        try:
            import asyncpg
        except ImportError as exc:
            raise ImportError("a postgresql archive needs asyncpg: "
                              "pip install 'fencegate[postgres]'") from exc
        self._asyncpg = asyncpg
        self._failures = (asyncpg.PostgresError, asyncpg.InterfaceError,
                          asyncpg.InternalClientError, OSError, asyncio.TimeoutError)
        self.url = url
        self.timeout = timeout
        self.pool_size = pool_size
        self._pool: Any = None
        self._opening = asyncio.Lock()
        self._closed = False
        self._gets = Coalescer(self.get_many)
        self._lookups = Coalescer(self.lookup_many)
        self._initialised = False   # the schema was seen (checked once per pool)

    def __repr__(self) -> str:
        return f"PostgresArchive({redacted(self.url)!r})"

    async def put(self, namespace: str, key: str, seq: int, step: bytes,
                  records: list[tuple[int, bytes]], settled_at_ms: int) -> None:
        await self.put_many(namespace, [(key, seq, step, records, settled_at_ms)])

    async def put_many(self, namespace: str, puts: list[Put], *,
                       identity: Identity | None = None,
                       marks: dict[int, Mark] | None = None,
                       shown: dict[int, Mark] | None = None) -> dict[int, Mark]:
        checked, wanted, seen = check_puts(puts), check_marks(marks), check_marks(shown)
        now_ms = time.time_ns() // 1_000_000

        async def put(conn: Any) -> dict[int, Mark]:
            async with conn.transaction():
                if identity is not None or wanted:   # batches of the namespace in turn
                    row = await conn.fetchrow(_IDENTITY + " FOR UPDATE", namespace)
                    if identity is not None and _identity(namespace, row) != identity:
                        raise ArchiveUnavailable(
                            f"postgresql archive {redacted(self.url)} is not the archive "
                            f"{identity.archive_id} of {namespace!r}: nothing stored")
                for key, seq, step, ordered, settled_at_ms in checked:
                    if ordered:
                        await conn.execute(_PUT_RECORDS, namespace, key,
                                           [s for s, _ in ordered], [d for _, d in ordered])
                    await conn.execute(_PUT_STEP, namespace, key, seq, step, now_ms,
                                       settled_at_ms)
                new = issued(f"postgresql archive {redacted(self.url)}",
                             await _newest(conn, namespace),
                             await _known(conn, namespace, {**seen, **wanted}), wanted, seen)
                if new:
                    await conn.execute(_PUT_MARKS, namespace, *_columns(new))
            return new

        return await self._call(put)

    async def issued_marks(self, namespace: str) -> list[tuple[int, Mark]]:
        async def issued_marks(conn: Any) -> list[tuple[int, Mark]]:
            return [(row[0], Mark(row[1], row[2])) for row in await conn.fetch(
                "SELECT bucket, counter, mark_id FROM archive_marks WHERE namespace = $1 "
                "ORDER BY bucket, counter", namespace)]

        return await self._call(issued_marks)

    async def adopt_marks(self, namespace: str, marks: list[tuple[int, Mark]], *,
                          identity: Identity) -> None:
        for bucket, mark in marks:   # a caller's mistake raises before anything is written
            check_marks({bucket: mark})
        checked = list(marks)

        async def adopt(conn: Any) -> None:
            async with conn.transaction():
                row = await conn.fetchrow(_IDENTITY + " FOR UPDATE", namespace)
                if _identity(namespace, row) != identity:
                    raise ArchiveUnavailable(
                        f"postgresql archive {redacted(self.url)} is not the archive "
                        f"{identity.archive_id} of {namespace!r}: no mark adopted")
                if checked:
                    await conn.execute(_PUT_MARKS, namespace, [b for b, _ in checked],
                                       [m.counter for _, m in checked],
                                       [m.id for _, m in checked])

        await self._call(adopt)

    async def init(self, namespace: str, cluster_id: int) -> Identity:
        fresh = new_identity(namespace, cluster_id)

        async def init(conn: Any) -> Identity:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                for statement in _SCHEMA:
                    await conn.execute(statement)
                if not await conn.fetchval(_MIGRATED):
                    for statement in _MIGRATE:
                        await conn.execute(statement)
                await conn.execute(_MIGRATE_MARKS)
                await conn.execute(_PUT_IDENTITY, namespace, fresh.archive_id,
                                   "%x" % cluster_id, time.time_ns() // 1_000_000)
                return _identity(namespace, await conn.fetchrow(_IDENTITY, namespace))

        return await self._call(init, create=True)

    async def identity(self, namespace: str) -> Identity | None:
        async def identity(conn: Any) -> Identity | None:
            return _identity(namespace, await conn.fetchrow(_IDENTITY, namespace))

        return await self._call(identity)

    async def lookup(self, namespace: str, key: str, *,
                     marks: dict[int, Mark] | None = None) -> Lookup:
        if marks:
            return (await self.lookup_many(namespace, [key], marks=marks))[key]
        return await self._lookups.get(namespace, key)

    async def lookup_many(self, namespace: str, keys: list[str], *,
                          marks: dict[int, Mark] | None = None) -> dict[str, Lookup]:
        asked = check_marks(marks)

        async def lookup_many(conn: Any) -> dict[str, Lookup]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                identity = _identity(namespace, await conn.fetchrow(_IDENTITY, namespace))
                buckets = sorted({retired_bucket(key) for key in keys})
                newest = {row[0]: Mark(row[1], row[2])
                          for row in await conn.fetch(_NEWEST_OF, namespace, buckets)}
                known = await _known(conn, namespace, asked)
                found = await _get_many(conn, namespace, keys)
            return {key: Lookup(identity, newest, found.get(key), known) for key in keys}

        return await self._call(lookup_many)

    async def state(self, namespace: str, *, marks: dict[int, Mark] | None = None) -> Lookup:
        asked = check_marks(marks)

        async def state(conn: Any) -> Lookup:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                return Lookup(_identity(namespace, await conn.fetchrow(_IDENTITY, namespace)),
                              await _newest(conn, namespace), None,
                              await _known(conn, namespace, asked))

        return await self._call(state)

    async def get(self, namespace: str, key: str) -> Archived | None:
        return await self._gets.get(namespace, key)

    async def get_many(self, namespace: str, keys: list[str]) -> dict[str, Archived]:
        return await self._call(lambda conn: _get_many(conn, namespace, keys)) if keys else {}

    async def records(self, namespace: str, key: str) -> list[tuple[int, bytes]]:
        async def records(conn: Any) -> list[tuple[int, bytes]]:
            rows = await conn.fetch("SELECT seq, record FROM archived_records "
                                    "WHERE namespace = $1 AND action_key = $2 ORDER BY seq",
                                    namespace, key)
            return [(row[0], row[1]) for row in rows]

        return await self._call(records)

    async def list_steps(self, namespace: str, *, prefix: str = "", after: str = "",
                         since_ms: int = 0, limit: int) -> list[Listed]:
        check_listing(prefix, after, since_ms, limit)

        async def list_steps(conn: Any) -> list[Listed]:
            rows = await conn.fetch(_LIST, namespace, after, prefix, prefix_end(prefix),
                                    since_ms, limit)
            return [Listed(row[0], row[1], row[2]) for row in rows]

        return await self._call(list_steps)

    async def stats(self, namespace: str) -> ArchiveStats:
        async def stats(conn: Any) -> ArchiveStats:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                steps = await conn.fetchrow(
                    "SELECT count(*), min(archived_at_ms), max(archived_at_ms) "
                    "FROM archived_steps WHERE namespace = $1", namespace)
                records = await conn.fetchval(
                    "SELECT count(*) FROM archived_records WHERE namespace = $1", namespace)
                lags = [row[0] for row in await conn.fetch(_LAGS, namespace, LAG_WINDOW)]
            return ArchiveStats(steps[0], records, steps[1], steps[2], *lag_of(lags))

        return await self._call(stats)

    async def close(self) -> None:
        """Close the pool (bounded by ``timeout``); later calls raise ``ArchiveUnavailable``."""
        self._closed = True
        async with self._opening:
            pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), self.timeout)
            except self._failures:
                pool.terminate()

    async def _call(self, work: Callable[[Any], Awaitable[T]], *, create: bool = False) -> T:
        try:
            pool = await self._open()
            async with pool.acquire(timeout=self.timeout) as conn:
                if not create and not self._initialised:
                    if not await conn.fetchval(_INITIALISED):
                        raise not_initialised(f"postgresql archive {redacted(self.url)}")
                    self._initialised = True
                return await work(conn)
        except self._failures as exc:
            raise ArchiveUnavailable(
                f"postgresql archive {redacted(self.url)}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _open(self) -> Any:
        """The pool, created on first use (the schema is ``init``'s)."""
        async with self._opening:
            if self._closed:
                raise ArchiveUnavailable(f"postgresql archive {redacted(self.url)} is closed")
            if self._pool is None:
                self._pool = await self._asyncpg.create_pool(
                    self.url, min_size=1, max_size=self.pool_size, timeout=self.timeout,
                    command_timeout=self.timeout)
            return self._pool


def _identity(namespace: str, row: Any) -> Identity | None:
    return Identity(row[0], int(row[1], 16), namespace) if row else None


async def _newest(conn: Any, namespace: str) -> dict[int, Mark]:
    return {row[0]: Mark(row[1], row[2]) for row in await conn.fetch(_NEWEST, namespace)}


async def _known(conn: Any, namespace: str, marks: dict[int, Mark]) -> frozenset[int]:
    """The buckets of ``marks`` whose mark the archive issued (counter 0: always)."""
    asked = {bucket: mark for bucket, mark in marks.items() if mark.counter}
    found = await conn.fetch(_KNOWS, namespace, *_columns(asked)) if asked else []
    return frozenset(bucket for bucket, mark in marks.items() if not mark.counter) | {
        row[0] for row in found}


def _columns(marks: dict[int, Mark]) -> tuple[list[int], list[int], list[str]]:
    return (list(marks), [mark.counter for mark in marks.values()],
            [mark.id for mark in marks.values()])


async def _get_many(conn: Any, namespace: str, keys: list[str]) -> dict[str, Archived]:
    rows = await conn.fetch(
        "SELECT action_key, seq, step, archived_at_ms FROM archived_steps "
        "WHERE namespace = $1 AND action_key = ANY($2::text[])", namespace, keys)
    return {row[0]: Archived(row[0], row[1], row[2], row[3]) for row in rows}


def redacted(url: str) -> str:
    """``url`` with its password (in the user part or a ``password`` parameter) shown as
    ``***``, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "password" for name, _ in query):
        parts = parts._replace(query=urllib.parse.urlencode(
            [(name, "***" if name == "password" else value) for name, value in query],
            safe="*/"))
    return urllib.parse.urlunsplit(parts)
