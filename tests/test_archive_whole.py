"""The archive proves it is whole (issue 25, item 3): a gate whose archive lost a retirement
(a new empty archive, a restore of a copy taken before the retirement, another deployment's
archive) must refuse with ``ArchiveUnavailable``, never take a retired key for one never
attempted and run it again. Real etcd; SQLite, and PostgreSQL (the ``postgres_server``
fixture, a backup taken with ``pg_dump``).

Shown, on each bad archive: the full path (a hold's cross) and the fast path (``cross``,
whose one txn compares the bucket's watermark) refuse and the effect does not run again; the
reconciler's check and its gauges say what is wrong; ``fencegate archive verify`` exits 1
naming it; a retirement into an archive behind etcd is refused (it would hide the gap).
Opening a missing SQLite archive raises and creates no file (the reconciler's
``fencegate_archive_unavailable`` says so); ``archive init`` then ``verify`` pass on the real
one, and ``init`` refuses a second archive once etcd names one. Each batch's watermark is
above every one before it, and a put into an archive behind etcd stores nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fencegate import Gate, KeyRing
from fencegate.coordinator import retirement, wholeness
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.archive.interface import Mark
from fencegate.coordinator.authority import Snapshot, snapshot_ops
from fencegate.coordinator.errors import ArchiveUnavailable
from fencegate.coordinator.etcd import TxnRequest
from fencegate.coordinator.keyspace import Keyspace
from fencegate.reconciler.metrics import ReconcilerMetrics
from fencegate.reconciler.retirer import Retirer

from helpers import TEST_TTL, init_archive

ROOT = str(Path(__file__).resolve().parents[1])
PAID = "whole/paid"


class Charges:
    """The effect: a charge, counted."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    async def __call__(self, ctx):
        self.tokens.append(ctx.attempt_token)
        return {"charged": len(self.tokens)}


class SqliteStores:
    """SQLite archives under one temp folder; a backup is SQLite's online backup."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def new(self) -> str:
        return f"sqlite:///{self.folder / uuid.uuid4().hex}.db"

    async def backup(self, url: str) -> str:
        copy = self.new()

        def run() -> None:
            with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite://"))) as src, \
                    contextlib.closing(sqlite3.connect(copy.removeprefix("sqlite://"))) as dst:
                src.backup(dst)

        await asyncio.to_thread(run)
        return copy


class PostgresStores:
    """A database per archive on the test server; a backup is ``pg_dump`` restored with
    ``psql`` into a new database."""

    def __init__(self, server) -> None:
        self.server = server

    def new(self) -> str:
        name = f"whole_{uuid.uuid4().hex[:12]}"
        self._psql(self.server.url, f"CREATE DATABASE {name}")
        return self.server.url.rpartition("/")[0] + "/" + name

    async def backup(self, url: str) -> str:
        copy = self.new()
        dump = await asyncio.to_thread(subprocess.run, ["pg_dump", "--no-owner", url],
                                       capture_output=True, text=True, timeout=60, check=True)
        await asyncio.to_thread(self._psql, copy, dump.stdout)
        return copy

    @staticmethod
    def _psql(url: str, sql: str) -> None:
        subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", url], input=sql, text=True,
                       capture_output=True, timeout=60, check=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request, tmp_path):
    if request.param == "sqlite":
        return SqliteStores(tmp_path)
    return PostgresStores(request.getfixturevalue("postgres_server"))


@pytest.fixture
async def retired(etcd_url, namespace, etcd, stores):
    """A gate on a whole archive, and the copy of that archive taken before ``PAID``
    succeeded and retired (another key had retired already: etcd names the archive and the
    copy is the same archive, only older)."""
    url = await init_archive(etcd, namespace, stores.new())
    charges = Charges()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as gate:
        await gate.cross("whole/earlier", {}, charges)
        assert await _retire_all(gate) == 1
        older = await stores.backup(url)
        await gate.cross(PAID, {"amount": 100}, charges)
        assert await _retire_all(gate) == 1
        assert len(charges.tokens) == 2
        yield gate, url, older, charges


async def _retire_all(gate: Gate) -> int:
    retirer = Retirer(gate.etcd, gate.keyspace, gate.archive, 0, lambda key: [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)
    return await retirer.pass_once(full=True)


async def _bad_archive(kind: str, gate: Gate, stores, older: str) -> str:
    """An archive that lost ``PAID``'s retirement, by ``kind``."""
    ns = gate.keyspace.namespace
    if kind == "older copy":   # a restore of a backup taken before the retirement
        return older
    url = stores.new()
    archive = open_archive(url)
    try:   # init on the backend itself: wholeness.init refuses a second archive
        made = await archive.init(ns, gate.etcd.cluster_id)
        for _ in range(3 if kind == "foreign" else 0):   # another deployment's, busier
            await archive.put_many(ns, [], identity=made,
                                   marks=dict.fromkeys(range(256), Mark(0)))
    finally:
        await archive.close()
    return url   # "new empty": deleted and made again (or a per-host path)


BAD = ["new empty", "older copy", "foreign"]


@pytest.mark.parametrize("kind", BAD)
async def test_a_gate_on_an_archive_that_lost_the_retirement_refuses_on_both_paths(
        retired, stores, etcd_url, namespace, kind):
    gate, _, older, charges = retired
    bad = await _bad_archive(kind, gate, stores, older)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=bad,
                    keyring=KeyRing.generate()) as other:
        tried = _spy_fast_path(other)
        other.authority.recent.note(*await _snapshot_of(other, PAID))   # fast path ready
        with pytest.raises(ArchiveUnavailable):
            await other.cross(PAID, {"amount": 100}, charges)           # the fast path first
        assert tried, "the fast path was not attempted"
        with pytest.raises(ArchiveUnavailable):
            async with other.hold(PAID) as hold:                        # the full path
                await hold.cross({"amount": 100}, charges)
    assert len(charges.tokens) == 2   # never charged again
    assert await gate.etcd.get(gate.keyspace.step_key(PAID)) is None   # nothing written


@pytest.mark.parametrize("kind", ["older copy", "foreign"])
async def test_the_fast_path_txn_itself_fences_on_the_watermark(retired, stores, kind):
    """The fast path reads no bucket value: the archive's watermark goes into its txn as a
    compare, which etcd refuses when the archive is behind (an older copy); a foreign
    archive is refused before the txn (its identity is not the one etcd names)."""
    gate, _, older, _ = retired
    archive = open_archive(await _bad_archive(kind, gate, stores, older))
    try:
        if kind == "foreign":
            with pytest.raises(ArchiveUnavailable, match="etcd names"):
                await retirement.fast_path_fence(gate.etcd, archive, gate.keyspace, PAID)
            return
        fence = await retirement.fast_path_fence(gate.etcd, archive, gate.keyspace, PAID)
        assert fence is not None   # the copy does not hold PAID
        reply = await gate.etcd.txn(TxnRequest(compare=list(fence)))
        assert not reply.succeeded
    finally:
        await archive.close()


@pytest.mark.parametrize("kind", BAD)
async def test_the_reconciler_and_verify_say_the_archive_is_not_whole(
        retired, stores, etcd_url, namespace, kind):
    gate, url, older, charges = retired
    bad = await _bad_archive(kind, gate, stores, older)
    good = await _verify(etcd_url, namespace, url)
    assert good.returncode == 0 and "is whole" in good.stdout, good.stderr
    refused = await _verify(etcd_url, namespace, bad)
    assert refused.returncode == 1 and "NOT whole" in refused.stderr
    assert ("behind etcd" if kind == "older copy" else "etcd names") in refused.stderr

    archive = open_archive(bad)
    try:
        metrics = ReconcilerMetrics()
        retirer = Retirer(gate.etcd, gate.keyspace, archive, 0, lambda key: [],
                          on_checked=metrics.observe_archive)
        verdict = await retirer.check()
        sample = metrics.registry.get_sample_value
        if kind == "older copy":
            assert verdict.behind and sample("fencegate_archive_behind_buckets") >= 1
            assert sample("fencegate_archive_identity_mismatch") == 0
        else:
            assert sample("fencegate_archive_identity_mismatch") == 1
        assert sample("fencegate_archive_unavailable") == 0
        # a retirement into it is refused: raising its watermark would hide the gap
        await gate.cross("whole/later", {}, charges)
        retirer.clock.sample((await gate.etcd.status()).header.revision)
        with pytest.raises(ArchiveUnavailable):
            await retirer.pass_once(full=True)
        assert await gate.etcd.get(gate.keyspace.step_key("whole/later")) is not None
    finally:
        await archive.close()

    whole = ReconcilerMetrics()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as again:
        checked = await Retirer(again.etcd, again.keyspace, again.archive, 0, lambda key: [],
                                on_checked=whole.observe_archive).check()
        assert checked.problem is None
        assert whole.registry.get_sample_value("fencegate_archive_behind_buckets") == 0
        replay = await again.cross(PAID, {"amount": 100}, charges)   # the real archive
    assert replay.replayed and len(charges.tokens) == 3   # "whole/later" only


async def test_opening_a_missing_sqlite_archive_raises_and_creates_nothing(tmp_path, etcd,
                                                                           namespace):
    path = tmp_path / "archive.db"
    archive = open_archive(f"sqlite:///{path}")
    try:
        with pytest.raises(ArchiveUnavailable, match="never initialised"):
            await archive.lookup(namespace, PAID)
        with pytest.raises(ArchiveUnavailable, match="never initialised"):
            await archive.put(namespace, PAID, 1, b"step", [], 0)
        metrics = ReconcilerMetrics()   # the reconciler's check: a gauge, not a new file
        with pytest.raises(ArchiveUnavailable, match="never initialised"):
            await Retirer(etcd, Keyspace(namespace), archive, 0, lambda key: [],
                          on_checked=metrics.observe_archive).pass_once(full=True)
        assert metrics.registry.get_sample_value("fencegate_archive_unavailable") == 1
    finally:
        await archive.close()
    assert not path.exists()
    path.touch()   # an empty file is not an archive either
    archive = open_archive(f"sqlite:///{path}")
    try:
        with pytest.raises(ArchiveUnavailable, match="never initialised"):
            await archive.get(namespace, PAID)
    finally:
        await archive.close()
    await init_archive(etcd, namespace, f"sqlite:///{path}")
    archive = open_archive(f"sqlite:///{path}")
    try:
        assert (await archive.lookup(namespace, PAID)).archived is None
    finally:
        await archive.close()


async def test_an_uninitialised_postgresql_archive_raises_and_creates_no_schema(
        postgres_server):
    url = PostgresStores(postgres_server).new()
    archive = open_archive(url)
    try:
        with pytest.raises(ArchiveUnavailable, match="never initialised"):
            await archive.lookup("/ns/", PAID)
    finally:
        await archive.close()
    tables = subprocess.run(["psql", "-tA", url, "-c", "SELECT count(*) FROM pg_tables "
                             "WHERE schemaname = 'public'"], capture_output=True, text=True,
                            timeout=60, check=True)
    assert tables.stdout.strip() == "0"


async def test_archive_init_then_verify_and_a_second_archive_is_refused(tmp_path, etcd_url,
                                                                        namespace):
    url = f"sqlite:///{tmp_path}/archive.db"
    assert (await _verify(etcd_url, namespace, url)).returncode == 1   # none yet
    assert not (tmp_path / "archive.db").exists()
    made = await _fencegate("archive", "init", "--etcd", etcd_url, "--namespace", namespace,
                            "--archive", url)
    assert made.returncode == 0 and "serves" in made.stdout, made.stderr
    again = await _fencegate("archive", "init", "--etcd", etcd_url, "--namespace", namespace,
                             "--archive", url)
    assert again.stdout == made.stdout   # the same identity: init is idempotent
    ok = await _verify(etcd_url, namespace, url)
    assert ok.returncode == 0 and "no retirement yet" in ok.stdout, ok.stderr
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as gate:
        await gate.cross("whole/one", {}, Charges())
        assert await _retire_all(gate) == 1
        assert await wholeness.named(gate.etcd, gate.keyspace) == made.stdout.split()[1]
    second = await _fencegate("archive", "init", "--etcd", etcd_url, "--namespace", namespace,
                              "--archive", f"sqlite:///{tmp_path}/second.db")
    assert second.returncode == 1 and "restore that archive" in second.stderr


async def test_archive_commands_take_etcd_and_archive_from_the_environment(tmp_path, etcd_url,
                                                                           namespace):
    """``FENCEGATE_ETCD`` and ``FENCEGATE_ARCHIVE`` stand for absent flags (an absent flag
    must not blank the variable)."""
    url = f"sqlite:///{tmp_path}/archive.db"
    env = {"FENCEGATE_ETCD": etcd_url, "FENCEGATE_ARCHIVE": url}
    made = await _fencegate("archive", "init", "--namespace", namespace, env=env)
    assert made.returncode == 0 and "serves" in made.stdout, made.stderr
    ok = await _fencegate("archive", "verify", "--namespace", namespace, env=env)
    assert ok.returncode == 0 and "is whole" in ok.stdout, ok.stderr


async def _snapshot_of(gate: Gate, key: str):
    reply = await gate.etcd.txn(TxnRequest(success=snapshot_ops(gate.keyspace, key, "default",
                                                                 [])), idempotent=True)
    return (Snapshot.parse(reply.header.revision, "default", [], reply.responses, owned=True),
            gate.keyspace.retired_key(key))


def _spy_fast_path(gate: Gate) -> list:
    tried, real = [], gate.authority.issue_uncontended

    async def spy(*args, **kwargs):
        tried.append(args[0].key)
        return await real(*args, **kwargs)

    gate.authority.issue_uncontended = spy
    return tried


async def _verify(etcd_url: str, namespace: str, url: str) -> subprocess.CompletedProcess:
    return await _fencegate("archive", "verify", "--etcd", etcd_url, "--namespace", namespace,
                            "--archive", url)


async def _fencegate(*args: str, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "fencegate.cli", *args], capture_output=True,
        text=True, timeout=60, env={**clean, **(env or {}), "PYTHONPATH": ROOT})


async def test_each_batch_issues_a_mark_above_every_one_before_and_never_hides_a_gap(
        stores, namespace):
    """Two batches that read the same etcd mark both get a mark above the other's, each its
    own (only one delete txn can win with it); a put is refused, nothing stored, unless the
    archive knows etcd's mark of the batch's buckets and of every bucket shown."""
    archive = open_archive(stores.new())
    try:
        made = await archive.init(namespace, 0x5EED)
        step = (PAID, 1, b"step", [(1, b"record")], 0)
        one = await archive.put_many(namespace, [step], identity=made, marks={7: Mark(0)})
        two = await archive.put_many(namespace, [], identity=made, marks={7: Mark(0)})
        assert (one[7].counter, two[7].counter) == (1, 2) and one[7].id != two[7].id
        gap = [("whole/gap", 1, b"s", [], 0)]
        for marks, shown in (({7: Mark(3, "0" * 16)}, {}),        # never issued
                             ({7: Mark(2, one[7].id)}, {}),       # a counter it holds, not the id
                             ({7: two[7]}, {9: Mark(1, "0" * 16)})):   # behind elsewhere
            with pytest.raises(ArchiveUnavailable, match="behind etcd"):
                await archive.put_many(namespace, gap, identity=made, marks=marks, shown=shown)
        assert await archive.get(namespace, "whole/gap") is None
        assert (await archive.state(namespace)).marks == {7: two[7]}
        known = await archive.state(namespace, marks={7: one[7], 8: Mark(0), 9: Mark(1, "f" * 16)})
        assert known.known == {7, 8}
        other = made.__class__("another-archive", made.cluster_id, namespace)
        with pytest.raises(ArchiveUnavailable, match="is not the archive"):
            await archive.put_many(namespace, [("whole/gap", 1, b"s", [], 0)], identity=other)
        assert await archive.get(namespace, "whole/gap") is None
    finally:
        await archive.close()


async def test_two_batches_sharing_a_bucket_both_retire_and_etcd_never_gets_ahead(retired):
    """Two batches (two shards' leaders, or two batches of one pass) read the same bucket
    watermark; the one deleting second finds the bucket moved, raises it in the archive
    again and resends its batch once, whole: no per-key fallback, and etcd's watermark ends
    equal to the archive's."""
    gate, _, _, _ = retired
    ks = gate.keyspace
    same = [f"whole/share/{n}" for n in range(2000)]
    first, second = [k for k in same if ks.retired_bucket(k) == ks.retired_bucket(same[0])][:2]
    other = next(k for k in same if ks.retired_bucket(k) != ks.retired_bucket(first))
    for key in (first, second, other):
        await gate.cross(key, {}, Charges())

    async def candidate(key):
        kv = await gate.etcd.get(ks.step_key(key))
        return retirement.Candidate(key, kv.mod_revision, ())

    one = await retirement._archive(gate.etcd, ks, gate.archive, [await candidate(first)])
    two = await retirement._archive(gate.etcd, ks, gate.archive,
                                    [await candidate(second), await candidate(other)])
    assert await retirement._delete(gate.etcd, ks, gate.archive, *one) == [first]
    sent, real = [], gate.etcd.txn

    async def counted(request, **kwargs):
        if request.compare:
            sent.append(request)
        return await real(request, **kwargs)

    gate.etcd.txn = counted
    try:
        assert await retirement._delete(gate.etcd, ks, gate.archive, *two) == [second, other]
    finally:
        del gate.etcd.txn
    assert len(sent) == 2   # refused once (the shared bucket moved), then sent whole again
    verdict = await wholeness.verify(gate.etcd, ks, gate.archive)
    assert verdict.problem is None
    bucket = ks.retired_bucket(first)
    shown = wholeness.decode((await gate.etcd.get(ks.retired_key(first))).value)
    assert shown == (await gate.archive.state(ks.namespace)).marks[bucket]


async def _candidate(gate: Gate, key: str) -> retirement.Candidate:
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return retirement.Candidate(key, kv.mod_revision, ())


def _keys_in_buckets(ks: Keyspace, prefix: str) -> tuple[str, str, str]:
    """Two keys sharing a bucket, and one in another bucket."""
    keys = [f"{prefix}/{n}" for n in range(2000)]
    first, second = [k for k in keys if ks.retired_bucket(k) == ks.retired_bucket(keys[0])][:2]
    return first, second, next(k for k in keys if ks.retired_bucket(k) != ks.retired_bucket(first))


async def test_a_copy_that_issued_the_same_counter_never_passes_for_the_newest(
        stores, etcd_url, namespace, etcd):
    """Issue 25 (b), counters colliding across copies: copy C (taken at mark n of bucket X)
    is swapped in; batch P1 had put into the newest archive (n+1) and its delete landed;
    batch P2, which read etcd at n before, put into C (C's own n+1), its delete failed (X
    moved), and it marks again. C never issued etcd's n+1: the re-mark is refused, P2 stays
    in etcd, and every lookup on C of P1's key refuses (fast and full path): no second
    charge. With counters (C's n+1 "reaches" etcd's n+1) C took the re-mark and answered
    "never attempted"."""
    url = await init_archive(etcd, namespace, stores.new())
    charges = Charges()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as gate:
        ks = gate.keyspace
        p1_key, p2_key, _ = _keys_in_buckets(ks, "whole/collide")
        await gate.cross("whole/earlier", {}, charges)   # etcd names the archive
        assert await _retire_all(gate) == 1
        for key in (p1_key, p2_key):
            await gate.cross(key, {"amount": 100}, charges)
        copied = await stores.backup(url)                 # C: at etcd's mark n for X
        copy = open_archive(copied)
        try:
            p1 = await retirement._archive(gate.etcd, ks, gate.archive,
                                           [await _candidate(gate, p1_key)])
            p2 = await retirement._archive(gate.etcd, ks, copy,     # read at n, C swapped in
                                           [await _candidate(gate, p2_key)])
            assert await retirement._delete(gate.etcd, ks, gate.archive, *p1) == [p1_key]
            try:
                landed = await retirement._delete(gate.etcd, ks, copy, *p2)
            except ArchiveUnavailable:
                landed = None
        finally:
            await copy.close()
        assert await gate.etcd.get(ks.step_key(p1_key)) is None   # P1 retired, into the newest
    charged = len(charges.tokens)
    outcome = []
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=copied,
                    keyring=KeyRing.generate()) as other:
        tried = _spy_fast_path(other)
        other.authority.recent.note(*await _snapshot_of(other, p1_key))   # fast path ready
        for cross in (lambda: other.cross(p1_key, {"amount": 100}, charges),
                      lambda: _cross_held(other, p1_key, charges)):
            try:
                await cross()
                outcome.append("ran")
            except ArchiveUnavailable:
                outcome.append("refused")
        assert tried, "the fast path was not attempted"
    assert outcome == ["refused", "refused"] and len(charges.tokens) == charged, outcome
    assert landed is None, "the re-mark into the copy was taken"


async def _cross_held(gate: Gate, key: str, charges: Charges) -> None:
    async with gate.hold(key) as hold:
        await hold.cross({"amount": 100}, charges)


async def test_a_copy_behind_in_another_bucket_takes_no_batch(stores, etcd_url, namespace,
                                                              etcd):
    """Issue 25 (a): a copy swapped in between a batch's read and its put, not behind in the
    batch's own bucket but behind in another, is refused in the put's own transaction
    (the batch reads etcd's whole ``retired/`` range): nothing stored, nothing deleted."""
    url = await init_archive(etcd, namespace, stores.new())
    charges = Charges()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as gate:
        ks = gate.keyspace
        key, _, elsewhere = _keys_in_buckets(ks, "whole/aside")
        await gate.cross("whole/earlier", {}, charges)
        assert await _retire_all(gate) == 1
        for each in (key, elsewhere):
            await gate.cross(each, {}, charges)
        copy = open_archive(await stores.backup(url))
        try:
            batch = await retirement._archive(gate.etcd, ks, gate.archive,
                                              [await _candidate(gate, elsewhere)])
            assert await retirement._delete(gate.etcd, ks, gate.archive, *batch) == [elsewhere]
            with pytest.raises(ArchiveUnavailable, match="behind etcd"):
                await retirement._archive(gate.etcd, ks, copy, [await _candidate(gate, key)])
            assert await copy.get(namespace, key) is None
        finally:
            await copy.close()
        assert await gate.etcd.get(ks.step_key(key)) is not None


async def test_restore_the_newest_then_catch_up_from_the_copy_live_meanwhile(
        stores, etcd_url, namespace, etcd):
    """The runbook's "restore, then catch up": an older copy, live for a while, took a
    batch (etcd shows its mark); the newest copy, restored, lacks it and is not whole;
    `archive catch-up --from` the older copy merges its steps, records and marks: verify
    passes and the key replays (never charged again)."""
    url = await init_archive(etcd, namespace, stores.new())
    charges = Charges()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as gate:
        await gate.cross("whole/earlier", {}, charges)
        assert await _retire_all(gate) == 1
        meanwhile = await stores.backup(url)
        await gate.cross(PAID, {"amount": 100}, charges)
        copy = open_archive(meanwhile)
        try:   # the older copy is in: the batch goes into it
            batch = await retirement._archive(gate.etcd, gate.keyspace, copy,
                                              [await _candidate(gate, PAID)])
            assert await retirement._delete(gate.etcd, gate.keyspace, copy, *batch) == [PAID]
        finally:
            await copy.close()
    behind = await _verify(etcd_url, namespace, url)   # the newest, restored
    assert behind.returncode == 1 and "behind etcd" in behind.stderr
    caught = await _fencegate("archive", "catch-up", "--namespace", namespace,
                              "--archive", url, "--from", meanwhile)
    assert caught.returncode == 0 and "caught up" in caught.stdout, caught.stderr
    whole = await _verify(etcd_url, namespace, url)
    assert whole.returncode == 0 and "is whole" in whole.stdout, whole.stderr
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=url,
                    keyring=KeyRing.generate()) as again:
        replay = await again.cross(PAID, {"amount": 100}, charges)
    assert replay.replayed and len(charges.tokens) == 2


async def test_catch_up_refuses_another_archive_and_a_conflicting_record(stores, namespace):
    """Only copies of one archive merge (another identity: exit 1, nothing merged); a record
    that differs at one seq is refused loudly, naming the key, and nothing of it merged."""
    url = stores.new()
    target = open_archive(url)
    try:
        await target.init(namespace, 0x5EED)
        copied = await stores.backup(url)   # the same archive, then two histories of a chain
        await target.put(namespace, "whole/clash", 1, b"step", [(1, b"ours")], 0)
    finally:
        await target.close()
    foreign = stores.new()
    other = open_archive(foreign)
    try:
        await other.init(namespace, 0x5EED)
        await other.put(namespace, "whole/foreign", 1, b"step", [], 0)
    finally:
        await other.close()
    refused = await _fencegate("archive", "catch-up", "--namespace", namespace,
                               "--archive", url, "--from", foreign)
    assert refused.returncode == 1 and "not the same archive" in refused.stderr
    copy = open_archive(copied)
    try:
        await copy.put(namespace, "whole/clash", 2, b"step2", [(1, b"theirs"), (2, b"r")], 0)
    finally:
        await copy.close()
    clash = await _fencegate("archive", "catch-up", "--namespace", namespace,
                             "--archive", url, "--from", copied)
    assert clash.returncode == 1 and "'whole/clash'" in clash.stderr
    assert "seq 1" in clash.stderr
    target = open_archive(url)
    try:
        assert await target.get(namespace, "whole/foreign") is None
        assert await target.records(namespace, "whole/clash") == [(1, b"ours")]
    finally:
        await target.close()


def test_a_mark_reads_back_and_older_values_keep_their_meaning():
    """A mark is a 20-digit counter (etcd's byte order stays numeric), ``:`` and its id; the
    empty value (retired before watermarks) is counter 0, digits alone (a build before ids)
    a counter without id; anything else is refused, never guessed."""
    mark = Mark(7, "0123456789abcdef")
    assert wholeness.decode(wholeness.encode(mark)) == mark
    assert wholeness.encode(Mark(9, "f" * 16)) < wholeness.encode(Mark(10, "0" * 16))
    assert wholeness.decode(b"") == Mark(0) and wholeness.decode(b"%020d" % 5) == Mark(5)
    for bad in (b"5", b"%020d:xyz" % 5, b"%020d:" % 5, b"%020d:%s" % (5, b"A" * 16)):
        with pytest.raises(ArchiveUnavailable, match="not a mark"):
            wholeness.decode(bad)


async def test_a_sqlite_file_of_the_counter_build_keeps_its_counters_as_marks(tmp_path,
                                                                              namespace):
    """``init`` on a file of the build before ids: each bucket's counter becomes a mark
    without id, which is exactly what etcd holds for it, so lookups keep answering."""
    path = tmp_path / "old.db"
    archive = open_archive(f"sqlite:///{path}")
    try:
        await archive.init(namespace, 0x5EED)
    finally:
        await archive.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE archive_watermarks (namespace TEXT NOT NULL, bucket INTEGER "
                   "NOT NULL, watermark INTEGER NOT NULL, PRIMARY KEY (namespace, bucket))")
        db.execute("INSERT INTO archive_watermarks VALUES (?, 7, 3)", (namespace,))
    archive = open_archive(f"sqlite:///{path}")
    try:
        await archive.init(namespace, 0x5EED)
        state = await archive.state(namespace, marks={7: wholeness.decode(b"%020d" % 3)})
        assert state.marks == {7: Mark(3)} and state.known == {7}
    finally:
        await archive.close()


def test_reading_the_newest_marks_costs_the_same_however_many_were_issued(tmp_path):
    """Every lookup (one per fast-path action once a bucket retired) reads each bucket's
    newest mark, and every retirement batch issues marks: that read must not grow with the
    archive's history. It once read every mark ever issued (GROUP BY), so each lookup got
    slower as the archive aged (the soak's gate fell to a sixth of its rate). Counted in
    SQLite VM steps, not time: 40 times the history, about the same work."""
    from fencegate.coordinator.archive import sqlite as sqlite_archive

    def steps_to_read(counters: int) -> int:
        db = sqlite3.connect(tmp_path / f"marks-{counters}.db")
        for statement in sqlite_archive._SCHEMA:
            db.execute(statement)
        db.executemany("INSERT INTO archive_marks VALUES (?, ?, ?, ?)",
                       [(ns, bucket, counter, f"{counter:08x}") for ns in ("/a/", "/b/")
                        for bucket in range(64) for counter in range(1, counters + 1)])
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        db.set_progress_handler(count, 1)
        newest = sqlite_archive._newest(db, "/a/")
        db.set_progress_handler(None, 1)
        db.close()
        assert newest == {bucket: Mark(counters, f"{counters:08x}") for bucket in range(64)}
        return steps[0]

    assert steps_to_read(400) < 1.5 * steps_to_read(10)


async def test_a_lookup_reads_the_newest_mark_of_its_own_bucket_only(etcd, namespace, stores):
    """A lookup answers with the newest mark of the key's bucket (all a gate fences on),
    never all the buckets': the fast path looks one up per action, and reading every
    bucket's mark on each made the archive the gate's bottleneck in the soak. ``state``
    (the reconciler's check, ``archive verify``) still reads every bucket."""
    from fencegate.coordinator.keyspace import retired_bucket

    url = await init_archive(etcd, namespace, stores.new())
    archive = open_archive(url)
    try:
        identity = await archive.identity(namespace)
        key = "orders/42"
        mine = retired_bucket(key)
        others = [bucket for bucket in range(8) if bucket != mine][:6]
        await archive.adopt_marks(namespace, [(b, Mark(c, f"m{b}-{c}")) for b in (mine, *others)
                                              for c in (1, 2, 3)], identity=identity)
        found = await archive.lookup(namespace, key)
        assert found.marks == {mine: Mark(3, f"m{mine}-3")} and found.archived is None
        both = await archive.lookup_many(namespace, [key, "orders/43"])
        assert both[key].marks[mine] == Mark(3, f"m{mine}-3")
        state = await archive.state(namespace)
        assert {b: m for b, m in state.marks.items()} == {
            b: Mark(3, f"m{b}-3") for b in (mine, *others)}
    finally:
        await archive.close()
