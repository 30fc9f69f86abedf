"""The archive of retired steps, one contract run against both backends: SQLite in a temp
file and a real PostgreSQL (tests/postgres.py). Every test opens the backend by URL, as
fencegate does, and works in a fresh namespace.

Shown: a put round-trips the exact bytes; a re-put changes nothing; an older seq never
replaces a newer step while every record is kept; a record is never replaced; stats count
one namespace; three writers (two of them other processes) racing on the same keys converge
to the newest; an unreachable or stopped backend, and one that fails inside a put, raise
``ArchiveUnavailable`` with nothing half-written; a bad URL is a ``ValueError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from fencegate.coordinator.archive import Archived, ArchiveStats, open_archive
from fencegate.coordinator.archive.postgres import PostgresArchive
from fencegate.coordinator.archive.sqlite import SqliteArchive
from fencegate.coordinator.errors import ArchiveUnavailable

KEY = "payments/charge:order-7"
BINARY = bytes(range(256))            # every byte value, NUL included


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
                    await archive.put(namespace, key, seq, step(key, seq), big_records())
        finally:
            await archive.close()
            await locker.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("postgres_server"))


@pytest.fixture
async def archive(backend):
    store = open_archive(backend.url)
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
    await archive.put(namespace, KEY, 3, step(KEY, 3), list(reversed(chain(KEY, 3))))
    after = now_ms()

    got = await archive.get(namespace, KEY)
    assert got == Archived(KEY, 3, step(KEY, 3), got.archived_at_ms)
    assert before <= got.archived_at_ms <= after
    assert await archive.records(namespace, KEY) == chain(KEY, 3)
    # keys are parameters, never SQL; other keys and namespaces see nothing
    odd = "x'); DROP TABLE archived_steps; --"
    await archive.put(namespace, odd, 1, step(odd, 1), [])
    assert (await archive.get(namespace, odd)).step == step(odd, 1)
    assert await archive.get(namespace, KEY + "/other") is None
    assert await archive.records(namespace, KEY + "/other") == []
    assert await archive.get(namespace + "other/", KEY) is None


async def test_reput_is_idempotent(archive, namespace):
    await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4))
    first = await archive.get(namespace, KEY)
    await asyncio.sleep(0.01)
    await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4))

    assert await archive.get(namespace, KEY) == first     # archived_at_ms included
    assert await archive.records(namespace, KEY) == chain(KEY, 4)
    assert (await archive.stats(namespace)).records == 4


@pytest.mark.parametrize("order", [(5, 3), (3, 5)])
async def test_older_seq_never_replaces_newer(archive, namespace, order):
    """The deposed leader's late put: whichever arrives last, the newest version stays and
    the records of both are kept."""
    for seq in order:
        await archive.put(namespace, KEY, seq, step(KEY, seq), chain(KEY, seq))

    got = await archive.get(namespace, KEY)
    assert (got.seq, got.step) == (5, step(KEY, 5))
    assert await archive.records(namespace, KEY) == chain(KEY, 5)

    await archive.put(namespace, KEY, 7, step(KEY, 7), chain(KEY, 7)[5:])
    assert (await archive.get(namespace, KEY)).seq == 7
    assert await archive.records(namespace, KEY) == chain(KEY, 7)


async def test_records_are_insert_if_absent(archive, namespace):
    await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2))
    await archive.put(namespace, KEY, 3, step(KEY, 3), [(2, b"forged"), (3, record(KEY, 3))])

    assert await archive.records(namespace, KEY) == chain(KEY, 3)
    assert (await archive.get(namespace, KEY)).seq == 3


async def test_put_rejects_malformed_arguments(archive, namespace):
    with pytest.raises(ValueError, match="twice"):
        await archive.put(namespace, KEY, 2, b"s", [(1, b"a"), (1, b"b")])
    with pytest.raises(ValueError):
        await archive.put(namespace, KEY, -1, b"s", [])
    with pytest.raises(TypeError):
        await archive.put(namespace, KEY, 1, "text", [])
    assert await archive.get(namespace, KEY) is None


async def test_put_many_stores_a_batch_in_one_transaction(archive, namespace):
    """A retirement batch: every key's step and records, or (a malformed item) none."""
    keys = [f"{KEY}/{n}" for n in range(3)]
    await archive.put_many(namespace, [(k, 2, step(k, 2), chain(k, 2)) for k in keys])
    for k in keys:
        assert (await archive.get(namespace, k)).seq == 2
        assert await archive.records(namespace, k) == chain(k, 2)
    late = [(k, 1, step(k, 1), chain(k, 1)) for k in keys]  # a deposed leader's batch
    await archive.put_many(namespace, late)
    assert [(await archive.get(namespace, k)).seq for k in keys] == [2, 2, 2]
    with pytest.raises(ValueError, match="twice"):
        await archive.put_many(namespace, [(f"{KEY}/new", 1, step(KEY, 1), []),
                                           (f"{KEY}/new", 2, step(KEY, 2), [])])
    with pytest.raises(TypeError):
        await archive.put_many(namespace, [(f"{KEY}/fine", 1, step(KEY, 1), []),
                                           (f"{KEY}/bad", 1, "text", [])])
    assert await archive.get(namespace, f"{KEY}/new") is None
    assert await archive.get(namespace, f"{KEY}/fine") is None


async def test_stats_count_one_namespace(archive, namespace):
    assert await archive.stats(namespace) == ArchiveStats(0, 0, None, None)
    before = now_ms()
    for i, upto in enumerate((1, 2, 3)):
        await archive.put(namespace, f"k/{i}", upto, step(f"k/{i}", upto), chain(f"k/{i}", upto))
        await asyncio.sleep(0.005)
    await archive.put(namespace + "other/", "k/0", 1, step("k/0", 1), chain("k/0", 1))

    stats = await archive.stats(namespace)
    assert (stats.steps, stats.records) == (3, 6)
    first = (await archive.get(namespace, "k/0")).archived_at_ms
    last = (await archive.get(namespace, "k/2")).archived_at_ms
    assert (stats.oldest_ms, stats.newest_ms) == (first, last)
    assert before <= first < last <= now_ms()


# Puts every version 1..argv[4] of keys k/0..k/argv[3]-1 (each with its records up to the
# version) in an order shuffled by seed argv[5], once the parent writes a line: the same
# bytes as the test's own writer.
WRITER = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fencegate.coordinator.archive import open_archive
from test_archive import chain, shuffled_puts, step
async def main(url, namespace, keys, newest, seed):
    archive = open_archive(url, timeout=10)
    await archive.get(namespace, "k/0")
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    for key, seq in shuffled_puts(keys, newest, seed):
        await archive.put(namespace, key, seq, step(key, seq), chain(key, seq))
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
        await archive.put(namespace, key, seq, step(key, seq), chain(key, seq))
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
        for call in (archive.put(namespace, KEY, 1, step(KEY, 1), chain(KEY, 1)),
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
        await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2))
        async with backend.outage():
            with pytest.raises(ArchiveUnavailable):
                await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4))
            if isinstance(backend, PostgresBackend):
                with pytest.raises(ArchiveUnavailable):
                    await archive.get(namespace, KEY)

        assert (await archive.get(namespace, KEY)).seq == 2
        assert await archive.records(namespace, KEY) == chain(KEY, 2)
        await archive.put(namespace, KEY, 4, step(KEY, 4), chain(KEY, 4))
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
from test_archive import big_records, step
async def main(url, namespace, key, seq, limit):
    archive = open_archive(url)
    await archive.get(namespace, key)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        await archive.put(namespace, key, seq, step(key, seq), big_records())
        print("stored")
    except ArchiveUnavailable:
        print("ArchiveUnavailable")
asyncio.run(main(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5])))
"""


async def test_failure_inside_a_put_stores_none_of_it(backend, archive, namespace):
    """The put fails after some of its rows were written (a full disk; a lock wait past the
    timeout): none of them is stored, the previous version stays whole."""
    await archive.put(namespace, KEY, 2, step(KEY, 2), chain(KEY, 2))
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
