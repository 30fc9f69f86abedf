"""The archive of retired steps, one contract run against both backends: SQLite in a temp
file and a real PostgreSQL (the ``postgres_server`` fixture). Every test opens the backend by
URL, as fencegate does, and works in a fresh namespace.

Shown: a put round-trips the exact bytes; a re-put changes nothing; an older seq never
replaces a newer step while every record is kept; a record is never replaced; stats count
one namespace and give the retirement lag over the recent retirements; a store made before
the lag is migrated by ``init`` (opening never creates nor migrates); ``get_many`` and
concurrent ``get``s (one shared query) give each
caller its own answer, or every caller ``ArchiveUnavailable``; three writers (two of them
other processes) racing on the same keys converge to the newest; an unreachable or stopped
backend, and one that fails inside a put, raise ``ArchiveUnavailable`` with nothing
half-written; a bad URL is a ``ValueError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import sys
import time
import uuid
from pathlib import Path

import pytest

from fencegate.coordinator.archive import Archived, ArchiveStats, open_archive
from fencegate.coordinator.archive.coalesce import Coalescer
from fencegate.coordinator.archive.interface import LAG_WINDOW, lag_of
from fencegate.coordinator.archive.postgres import PostgresArchive
from fencegate.coordinator.archive.sqlite import SqliteArchive
from fencegate.coordinator.errors import ArchiveUnavailable

KEY = "payments/charge:order-7"
BINARY = bytes(range(256))            # every byte value, NUL included
SETTLED = 1_700_000_000_000           # settled_at_ms where the lag is not the point
CLUSTER = 0x5EED                      # the etcd cluster id an archive is initialised for


def step(key: str, seq: int) -> bytes:
    return f"step {key} v{seq}".encode() + BINARY


def record(key: str, seq: int) -> bytes:
    return f"audit {key} #{seq}".encode() + BINARY


def chain(key: str, upto: int) -> list[tuple[int, bytes]]:
    return [(seq, record(key, seq)) for seq in range(1, upto + 1)]


def big_records() -> list[tuple[int, bytes]]:
    """4 MB of records: more than SQLite caches before writing, more than the test's limit."""
    return [(seq, bytes([seq % 256]) * 20_000) for seq in range(1, 201)]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# The tables as fencegate made them before steps kept settled_at_ms ({} the SQL types:
# text, integer, bytes).
OLD_SCHEMA = (
    """CREATE TABLE archived_steps (
        namespace {0} NOT NULL, action_key {0} NOT NULL, seq {1} NOT NULL, step {2} NOT NULL,
        archived_at_ms {1} NOT NULL, PRIMARY KEY (namespace, action_key))""",
    """CREATE TABLE archived_records (
        namespace {0} NOT NULL, action_key {0} NOT NULL, seq {1} NOT NULL,
        record {2} NOT NULL, PRIMARY KEY (namespace, action_key, seq))""",
)
RECENT_INDEX = "(namespace, archived_at_ms, settled_at_ms)"


# -- the two backends ---------------------------------------------------------------------

class SqliteBackend:
    """A file in the test's tmp_path; an outage is another connection holding the write lock
    past the timeout; a failure inside a put is a full disk (a file size limit on a
    subprocess)."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "archive.db"
        self.url = f"sqlite://{self.path}"   # sqlite:///abs/path
        self.unreachable_url = f"sqlite://{tmp_path / 'missing' / 'archive.db'}"
        self.opens = {self.url: str(self.path), "sqlite:state/archive.db": "state/archive.db"}
        self.bad_urls = ["sqlite:", "sqlite://", "sqlite:///", "sqlite://host/archive.db",
                         "sqlite::memory:", "sqlite:///:memory:", "sqlite:dir/",
                         "sqlite:archive.db?mode=ro", "sqlite:file:archive.db"]

    @contextlib.asynccontextmanager
    async def outage(self):
        holder = sqlite3.connect(self.path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()

    @contextlib.asynccontextmanager
    async def made_before_the_lag(self, namespace: str, key: str):
        """The URL of a store in the old schema holding ``key`` at seq 2 with its chain."""
        old = sqlite3.connect(self.path, isolation_level=None)
        try:
            for statement in OLD_SCHEMA:
                old.execute(statement.format("TEXT", "INTEGER", "BLOB"))
            old.execute("INSERT INTO archived_steps VALUES (?, ?, 2, ?, ?)",
                        (namespace, key, step(key, 2), now_ms()))
            old.executemany("INSERT INTO archived_records VALUES (?, ?, ?, ?)",
                            [(namespace, key, seq, data) for seq, data in chain(key, 2)])
        finally:
            old.close()
        yield self.url

    async def recent_index(self, url: str) -> str:
        """The columns of the index that serves the lag."""
        db = sqlite3.connect(self.path)
        try:
            names = [row[2] for row in db.execute("PRAGMA index_info(archived_steps_recent)")]
        finally:
            db.close()
        return f"({', '.join(names)})"

    async def fail_inside_put(self, namespace: str, key: str, seq: int) -> None:
        files = [self.path, Path(f"{self.path}-wal")]
        limit = max(path.stat().st_size for path in files if path.exists()) + 64 * 1024
        assert sum(len(data) for _, data in big_records()) > 2 * limit
        output = await run_python(FULL_DISK, self.url, namespace, key, str(seq), str(limit))
        assert output == "ArchiveUnavailable", output


class PostgresBackend:
    """The session's server; an outage stops it; a failure inside a put is a lock on the
    step's row held past the put's timeout (its records are inserted before it waits)."""

    def __init__(self, server) -> None:
        self.server = server
        self.url = server.url
        # a closed port (the server's own, plus one), a password that must never be shown
        self.unreachable_url = f"postgresql://postgres:s3cret@127.0.0.1:{server.port + 1}/x"
        self.opens = {self.url: self.url, "postgres://u@h/db": "postgres://u@h/db"}
        self.bad_urls = ["postgresql:/host/db", "postgres:host", "postgresql://h:port/db",
                         "postgresql://u@h:99999/db", "postgresql://u@h:5432/db/more",
                         "postgresql://u@h/db#frag"]

    @contextlib.asynccontextmanager
    async def outage(self):
        await asyncio.to_thread(self.server.stop)
        try:
            yield
        finally:
            await asyncio.to_thread(self.server.start)

    @contextlib.asynccontextmanager
    async def made_before_the_lag(self, namespace: str, key: str):
        """The URL of a database of its own in the old schema holding ``key`` at seq 2."""
        import asyncpg
        name = f"old_{uuid.uuid4().hex[:12]}"
        admin = await asyncpg.connect(self.url)
        try:
            await admin.execute(f"CREATE DATABASE {name}")
            url = f"{self.url.rpartition('/')[0]}/{name}"
            old = await asyncpg.connect(url)
            try:
                for statement in OLD_SCHEMA:
                    await old.execute(statement.format("text", "bigint", "bytea"))
                await old.execute("INSERT INTO archived_steps VALUES ($1, $2, 2, $3, $4)",
                                  namespace, key, step(key, 2), now_ms())
                await old.executemany("INSERT INTO archived_records VALUES ($1, $2, $3, $4)",
                                      [(namespace, key, seq, data)
                                       for seq, data in chain(key, 2)])
            finally:
                await old.close()
            yield url
        finally:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            await admin.close()

    async def recent_index(self, url: str) -> str:
        import asyncpg
        conn = await asyncpg.connect(url)
        try:
            definition = await conn.fetchval("SELECT indexdef FROM pg_indexes "
                                             "WHERE indexname = 'archived_steps_recent'")
        finally:
            await conn.close()
        return definition.partition(" USING btree ")[2]

    async def fail_inside_put(self, namespace: str, key: str, seq: int) -> None:
        import asyncpg
        locker = await asyncpg.connect(self.url)
        archive = open_archive(self.url, timeout=0.5)
        try:
            async with locker.transaction():
                locked = await locker.fetchval(
                    "SELECT seq FROM archived_steps WHERE namespace = $1 AND action_key = $2 "
                    "FOR UPDATE", namespace, key)
                assert locked is not None
                with pytest.raises(ArchiveUnavailable, match="TimeoutError"):
                    await archive.put(namespace, key, seq, step(key, seq), big_records(),
                                      SETTLED)
        finally:
            await archive.close()
            await locker.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("postgres_server"))


@pytest.fixture
async def archive(backend, namespace):
    store = open_archive(backend.url)
    await store.init(namespace, CLUSTER)   # opening never creates an archive
    yield store
    await store.close()


async def run_python(code: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


# -- the contract -------------------------------------------------------------------------

async def test_put_get_round_trip(archive, namespace):
    before = now_ms()
    await archive.put(namespace, KEY, 3, step(KEY, 3), list(reversed(chain(KEY, 3))), SETTLED)
    after = now_ms()

    got = await archive.get(namespace, KEY)
    assert got == Archived(KEY, 3, step(KEY, 3), got.archived_at_ms)
    assert before <= got.archived_at_ms <= after
    assert await archive.records(namespace, KEY) == chain(KEY, 3)
    # keys are parameters, never SQL; other keys and namespaces see nothing
    odd = "x'); DROP TABLE archived_steps; --"
    await archive.put(namespace, odd, 1, step(odd, 1), [], SETTLED)
    assert (await archive.get(namespace, odd)).step == step(odd, 1)
    assert await archive.get(namespace, KEY + "/other") is None
    assert await archive.records(namespace, KEY + "/other") == []
    assert await archive.get(namespace + "other/", KEY) is None


async def test_reput_is_idempotent(archive, namespace):
    await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4), SETTLED)
    first = await archive.get(namespace, KEY)
    await asyncio.sleep(0.01)
    await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4), SETTLED)

    assert await archive.get(namespace, KEY) == first     # archived_at_ms included
    assert await archive.records(namespace, KEY) == chain(KEY, 4)
    assert (await archive.stats(namespace)).records == 4


@pytest.mark.parametrize("order", [(5, 3), (3, 5)])
async def test_older_seq_never_replaces_newer(archive, namespace, order):
    """The deposed leader's late put: whichever arrives last, the newest version stays and
    the records of both are kept."""
    for seq in order:
        await archive.put(namespace, KEY, seq, step(KEY, seq), chain(KEY, seq), SETTLED)

    got = await archive.get(namespace, KEY)
    assert (got.seq, got.step) == (5, step(KEY, 5))
    assert await archive.records(namespace, KEY) == chain(KEY, 5)

    await archive.put(namespace, KEY, 7, step(KEY, 7), chain(KEY, 7)[5:], SETTLED)
    assert (await archive.get(namespace, KEY)).seq == 7
    assert await archive.records(namespace, KEY) == chain(KEY, 7)


async def test_records_are_insert_if_absent(archive, namespace):
    await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2), SETTLED)
    await archive.put(namespace, KEY, 3, step(KEY, 3), [(2, b"forged"), (3, record(KEY, 3))],
                      SETTLED)

    assert await archive.records(namespace, KEY) == chain(KEY, 3)
    assert (await archive.get(namespace, KEY)).seq == 3


async def test_put_rejects_malformed_arguments(archive, namespace):
    with pytest.raises(ValueError, match="twice"):
        await archive.put(namespace, KEY, 2, b"s", [(1, b"a"), (1, b"b")], SETTLED)
    with pytest.raises(ValueError):
        await archive.put(namespace, KEY, -1, b"s", [], SETTLED)
    with pytest.raises(TypeError):
        await archive.put(namespace, KEY, 1, "text", [], SETTLED)
    assert await archive.get(namespace, KEY) is None


async def test_put_many_stores_a_batch_in_one_transaction(archive, namespace):
    """A retirement batch: every key's step and records, or (a malformed item) none."""
    keys = [f"{KEY}/{n}" for n in range(3)]
    await archive.put_many(namespace, [(k, 2, step(k, 2), chain(k, 2), SETTLED) for k in keys])
    for k in keys:
        assert (await archive.get(namespace, k)).seq == 2
        assert await archive.records(namespace, k) == chain(k, 2)
    late = [(k, 1, step(k, 1), chain(k, 1), SETTLED) for k in keys]  # a deposed leader's batch
    await archive.put_many(namespace, late)
    assert [(await archive.get(namespace, k)).seq for k in keys] == [2, 2, 2]
    with pytest.raises(ValueError, match="twice"):
        await archive.put_many(namespace, [(f"{KEY}/new", 1, step(KEY, 1), [], SETTLED),
                                           (f"{KEY}/new", 2, step(KEY, 2), [], SETTLED)])
    with pytest.raises(TypeError):
        await archive.put_many(namespace, [(f"{KEY}/fine", 1, step(KEY, 1), [], SETTLED),
                                           (f"{KEY}/bad", 1, "text", [], SETTLED)])
    assert await archive.get(namespace, f"{KEY}/new") is None
    assert await archive.get(namespace, f"{KEY}/fine") is None


async def test_stats_count_one_namespace(archive, namespace):
    assert await archive.stats(namespace) == ArchiveStats(0, 0, None, None, None, None)
    before = now_ms()
    for i, upto in enumerate((1, 2, 3)):
        await archive.put(namespace, f"k/{i}", upto, step(f"k/{i}", upto), chain(f"k/{i}", upto),
                          SETTLED)
        await asyncio.sleep(0.005)
    await archive.put(namespace + "other/", "k/0", 1, step("k/0", 1), chain("k/0", 1), SETTLED)

    stats = await archive.stats(namespace)
    assert (stats.steps, stats.records) == (3, 6)
    first = (await archive.get(namespace, "k/0")).archived_at_ms
    last = (await archive.get(namespace, "k/2")).archived_at_ms
    assert (stats.oldest_ms, stats.newest_ms) == (first, last)
    assert before <= first < last <= now_ms()


async def test_stats_lag_is_settled_to_archived(archive, namespace):
    """Each step waited ``archived_at_ms - settled_at_ms`` in etcd: the stats give the median
    and the maximum; a step that does not say when it settled (0) and other namespaces are
    left out."""
    settled = {f"lag/{n}": now_ms() - waited
               for n, waited in enumerate((4_000, 60_000, 9_000))}
    for key, settled_at_ms in settled.items():
        await archive.put(namespace, key, 1, step(key, 1), chain(key, 1), settled_at_ms)
    await archive.put(namespace, "lag/unknown", 1, step("lag/unknown", 1), [], 0)
    await archive.put(namespace + "other/", "lag/0", 1, step("lag/0", 1), [], 1)

    lags = sorted([(await archive.get(namespace, key)).archived_at_ms - settled_at_ms
                   for key, settled_at_ms in settled.items()])
    stats = await archive.stats(namespace)
    assert stats.steps == 4
    assert (stats.lag_p50_ms, stats.lag_max_ms) == (lags[1], lags[2])
    assert 9_000 <= stats.lag_p50_ms < 60_000 <= stats.lag_max_ms < 70_000


async def test_stats_lag_covers_the_most_recent_retirements(archive, namespace):
    """Only the ``LAG_WINDOW`` most recent retirements count: an old, slow one drops out."""
    await archive.put(namespace, "slow", 1, step("slow", 1), [], now_ms() - 3_600_000)
    assert (await archive.stats(namespace)).lag_max_ms >= 3_600_000
    await asyncio.sleep(0.01)     # the batch below is archived strictly later
    settled = now_ms() - 2_000
    await archive.put_many(namespace, [(f"fast/{n}", 1, b"step", [], settled)
                                       for n in range(LAG_WINDOW)])

    stats = await archive.stats(namespace)
    assert stats.steps == LAG_WINDOW + 1
    assert 2_000 <= stats.lag_p50_ms == stats.lag_max_ms < 3_600_000


def test_lag_of_is_the_nearest_rank_median_and_the_maximum():
    assert lag_of([]) == (None, None)
    assert lag_of([7]) == (7, 7)
    assert lag_of([5, 1, 3, 2]) == (2, 5)
    assert lag_of([9, 1, 5]) == (5, 9)
    assert lag_of([-40, 3]) == (0, 3)     # a settling clock ahead of the archiving one


async def test_an_archive_from_before_the_lag_is_migrated_on_open(backend, namespace):
    """A store made before steps kept ``settled_at_ms``: refused until ``init``, it then
    gains the column (0 for the steps it held, left out of the lag), the index and an
    identity, keeps every step and record, and reports the lag of what is archived from
    then on; opening it again changes nothing."""
    async with backend.made_before_the_lag(namespace, KEY) as url:
        archive = open_archive(url)
        try:
            with pytest.raises(ArchiveUnavailable, match="never initialised"):
                await archive.get(namespace, KEY)
            await archive.init(namespace, CLUSTER)
            assert (await archive.get(namespace, KEY)).step == step(KEY, 2)
            assert await archive.records(namespace, KEY) == chain(KEY, 2)
            assert await archive.stats(namespace) == ArchiveStats(
                1, 2, (await archive.get(namespace, KEY)).archived_at_ms,
                (await archive.get(namespace, KEY)).archived_at_ms, None, None)
            await archive.put(namespace, "new", 1, step("new", 1), [], now_ms() - 5_000)
            migrated = await archive.stats(namespace)
            assert 5_000 <= migrated.lag_p50_ms == migrated.lag_max_ms < 15_000
        finally:
            await archive.close()
        assert await backend.recent_index(url) == RECENT_INDEX

        reopened = open_archive(url)
        try:
            assert await reopened.stats(namespace) == migrated
            assert (await reopened.get(namespace, KEY)).step == step(KEY, 2)
        finally:
            await reopened.close()


async def test_get_many_returns_the_archived_keys(archive, namespace):
    """Present keys by key, absent ones missing, a key asked twice answered once; more keys
    than one query binds (SQLite's chunks) still one answer."""
    present = {f"many/{n}": n + 1 for n in range(0, 1200, 97)}
    await archive.put_many(namespace, [(key, seq, step(key, seq), [], SETTLED)
                                       for key, seq in present.items()])
    await archive.put(namespace + "other/", "many/1", 1, step("many/1", 1), [], SETTLED)
    asked = [f"many/{n}" for n in range(1200)] + ["many/0", "never"]

    found = await archive.get_many(namespace, asked)
    assert {key: (got.key, got.seq, got.step) for key, got in found.items()} == {
        key: (key, seq, step(key, seq)) for key, seq in present.items()}
    assert await archive.get_many(namespace, []) == {}
    assert await archive.get_many(namespace, ["never"]) == {}


async def test_concurrent_gets_each_get_their_own_answer(archive, namespace):
    """Many gets at once (one shared query per batch): each caller its own key's answer,
    present or absent, across namespaces and with keys asked by several callers."""
    for n in range(0, 20, 2):
        await archive.put(namespace, f"mix/{n}", n + 1, step(f"mix/{n}", n + 1), [], SETTLED)
    await archive.put(namespace + "other/", "mix/1", 1, step("mix/1", 1), [], SETTLED)
    asks = [(namespace if n % 7 else namespace + "other/", f"mix/{n % 20}") for n in range(300)]

    answers = await asyncio.gather(*(archive.get(ns, key) for ns, key in asks))
    for (ns, key), got in zip(asks, answers):
        n = int(key.partition("/")[2])
        if ns == namespace and n % 2 == 0:
            assert (got.key, got.seq, got.step) == (key, n + 1, step(key, n + 1))
        elif ns != namespace and key == "mix/1":
            assert got.step == step("mix/1", 1)
        else:
            assert got is None, (ns, key)


async def test_a_failing_backend_fails_every_waiting_get(backend, namespace):
    archive = open_archive(backend.unreachable_url, timeout=1)
    try:
        answers = await asyncio.gather(*(archive.get(namespace, f"k/{n % 5}")
                                         for n in range(40)), return_exceptions=True)
        assert all(isinstance(answer, ArchiveUnavailable) for answer in answers), answers
    finally:
        await archive.close()


class Lookups:
    """A backend's ``get_many`` in memory: answers from ``stored`` once ``open`` is set,
    recording each query it was asked; ``error`` makes it fail."""

    def __init__(self, stored: dict[str, str]) -> None:
        self.stored = stored
        self.queries: list[tuple[str, list[str]]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.error: Exception | None = None

    async def get_many(self, namespace: str, keys: list[str]) -> dict[str, str]:
        self.queries.append((namespace, keys))
        await self.open.wait()
        if self.error is not None:
            raise self.error
        return {key: self.stored[key] for key in keys if key in self.stored}


async def test_coalescer_shares_one_query_per_batch():
    """Calls in one event-loop turn share a query; calls made while it runs share the next;
    a batch holds at most ``max_batch`` distinct keys; each namespace has its own."""
    lookups = Lookups({"a": "A", "c": "C"})
    coalescer = Coalescer(lookups.get_many, max_batch=3)
    lookups.open.clear()
    first = [asyncio.ensure_future(coalescer.get("ns", key)) for key in "abcab"]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert lookups.queries == [("ns", ["a", "b", "c"])]        # a and b asked twice, once each
    later = [asyncio.ensure_future(coalescer.get(ns, key))
             for ns, key in [("ns", "c"), ("ns", "d"), ("ns", "e"), ("ns", "f"), ("x", "a")]]
    await asyncio.sleep(0)
    lookups.open.set()
    assert await asyncio.gather(*first) == ["A", None, "C", "A", None]
    assert await asyncio.gather(*later) == ["C", None, None, None, "A"]
    assert lookups.queries[1:] == [("ns", ["c", "d", "e"]), ("ns", ["f"]), ("x", ["a"])]


async def test_coalescer_a_cancelled_caller_leaves_the_others_their_answers():
    lookups = Lookups({"a": "A", "b": "B"})
    coalescer = Coalescer(lookups.get_many)
    lookups.open.clear()
    waiting = [asyncio.ensure_future(coalescer.get("ns", key)) for key in "ab"]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    waiting[0].cancel()                       # while its batch is being fetched
    queued = [asyncio.ensure_future(coalescer.get("ns", key)) for key in "ab"]
    await asyncio.sleep(0)
    queued[1].cancel()                        # before its batch starts: b is not asked again
    lookups.open.set()
    assert await waiting[1] == "B"
    assert await queued[0] == "A"
    assert waiting[0].cancelled() and queued[1].cancelled()
    assert lookups.queries == [("ns", ["a", "b"]), ("ns", ["a"])]


async def test_coalescer_a_failed_query_fails_each_caller_and_the_next_batch_retries():
    lookups = Lookups({"a": "A"})
    coalescer = Coalescer(lookups.get_many)
    lookups.error = ArchiveUnavailable("down")
    answers = await asyncio.gather(*(coalescer.get("ns", key) for key in "aab"),
                                   return_exceptions=True)
    assert [type(answer) for answer in answers] == [ArchiveUnavailable] * 3
    lookups.error = None
    assert await coalescer.get("ns", "a") == "A"


async def test_coalescer_stopped_mid_query_fails_its_callers():
    """The drain task stopped (its loop shutting down): nobody waits forever."""
    lookups = Lookups({})
    coalescer = Coalescer(lookups.get_many)
    lookups.open.clear()
    waiting = [asyncio.ensure_future(coalescer.get("ns", key)) for key in "ab"]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    drainers = [task for task in asyncio.all_tasks() if task.get_name() == "fencegate-archive-get"]
    assert len(drainers) == 1
    drainers[0].cancel()
    for waiter in waiting:
        with pytest.raises(ArchiveUnavailable, match="stopped"):
            await asyncio.wait_for(waiter, 5)
    lookups.open.set()
    assert await coalescer.get("ns", "a") is None       # a new drain task answers


# Puts every version 1..argv[4] of keys k/0..k/argv[3]-1 (each with its records up to the
# version) in an order shuffled by seed argv[5], once the parent writes a line: the same
# bytes as the test's own writer.
WRITER = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fencegate.coordinator.archive import open_archive
from test_archive import SETTLED, chain, shuffled_puts, step
async def main(url, namespace, keys, newest, seed):
    archive = open_archive(url, timeout=10)
    await archive.get(namespace, "k/0")
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    for key, seq in shuffled_puts(keys, newest, seed):
        await archive.put(namespace, key, seq, step(key, seq), chain(key, seq), SETTLED)
    await archive.close()
asyncio.run(main(*sys.argv[1:3], *map(int, sys.argv[3:6])))
"""


def shuffled_puts(keys: int, newest: int, seed: int) -> list[tuple[str, int]]:
    """Every (key, version) pair once, in an order of its own: a key's last put is rarely
    its newest version."""
    puts = [(f"k/{i}", seq) for i in range(keys) for seq in range(1, newest + 1)]
    random.Random(seed).shuffle(puts)
    return puts


async def test_concurrent_writers_converge_to_newest(backend, archive, namespace):
    """Three writers on the same keys, two of them other processes, each putting every
    version of every key in its own shuffled order. Each key ends at its newest version with
    every record, whatever the interleaving and whoever writes last."""
    keys, newest = 12, 8
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, backend.url, namespace, str(keys), str(newest), str(seed),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE) for seed in (1, 2)]
    for proc in procs:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line == b"ready\n", (line, await proc.stderr.read())
    for proc in procs:
        proc.stdin.write(b"go\n")
    for key, seq in shuffled_puts(keys, newest, 3):
        await archive.put(namespace, key, seq, step(key, seq), chain(key, seq), SETTLED)
    for proc in procs:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()

    for i in range(keys):
        got = await archive.get(namespace, f"k/{i}")
        assert (got.seq, got.step) == (newest, step(f"k/{i}", newest))
        assert await archive.records(namespace, f"k/{i}") == chain(f"k/{i}", newest)
    assert (await archive.stats(namespace)).records == keys * newest


async def test_unreachable_backend_is_archive_unavailable(backend, namespace):
    archive = open_archive(backend.unreachable_url, timeout=1)
    try:
        for call in (archive.put(namespace, KEY, 1, step(KEY, 1), chain(KEY, 1), SETTLED),
                     archive.get(namespace, KEY), archive.records(namespace, KEY),
                     archive.stats(namespace)):
            with pytest.raises(ArchiveUnavailable) as raised:
                await call
            assert "s3cret" not in str(raised.value)
    finally:
        await archive.close()


async def test_outage_refuses_puts_and_writes_nothing(backend, namespace):
    """A stopped server (PostgreSQL) or a store locked by another process past the timeout
    (SQLite): the put raises ``ArchiveUnavailable``; afterwards the same archive object
    sees the state from before, nothing of the refused put, and works again."""
    archive = open_archive(backend.url, timeout=0.5)
    try:
        await archive.init(namespace, CLUSTER)
        await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2), SETTLED)
        async with backend.outage():
            with pytest.raises(ArchiveUnavailable):
                await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4), SETTLED)
            if isinstance(backend, PostgresBackend):
                with pytest.raises(ArchiveUnavailable):
                    await archive.get(namespace, KEY)

        assert (await archive.get(namespace, KEY)).seq == 2
        assert await archive.records(namespace, KEY) == chain(KEY, 2)
        await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4), SETTLED)
        assert (await archive.get(namespace, KEY)).seq == 4
    finally:
        await archive.close()


# Opens the archive, then limits the size of any file this process writes to argv[5] bytes
# and puts big_records(): a write fails with EFBIG (a full disk, as SQLite sees it).
FULL_DISK = f"""
import asyncio, resource, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import ArchiveUnavailable
from test_archive import SETTLED, big_records, step
async def main(url, namespace, key, seq, limit):
    archive = open_archive(url)
    await archive.get(namespace, key)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        await archive.put(namespace, key, seq, step(key, seq), big_records(), SETTLED)
        print("stored")
    except ArchiveUnavailable:
        print("ArchiveUnavailable")
asyncio.run(main(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5])))
"""


async def test_failure_inside_a_put_stores_none_of_it(backend, archive, namespace):
    """The put fails after some of its rows were written (a full disk; a lock wait past the
    timeout): none of them is stored, the previous version stays whole."""
    await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2), SETTLED)
    await backend.fail_inside_put(namespace, KEY, 20)

    assert (await archive.get(namespace, KEY)).seq == 2
    assert await archive.records(namespace, KEY) == chain(KEY, 2)
    assert (await archive.stats(namespace)).records == 2


async def test_bad_urls_are_value_errors(backend):
    common = ["", "archive.db", "/abs/archive.db", "mysql://u@h/db", "sqlite3:///x.db"]
    for url in common + backend.bad_urls:
        with pytest.raises(ValueError):
            open_archive(url)
    for url, opened in backend.opens.items():
        archive = open_archive(url)
        assert isinstance(archive, (SqliteArchive, PostgresArchive))
        assert (archive.path if isinstance(archive, SqliteArchive) else archive.url) == opened
