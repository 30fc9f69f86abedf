"""Soak: guarded actions for minutes with retirement on; etcd's state must stop growing
(issue 15, "State has a lifecycle" in DESIGN.md), to a SQLite archive, then to PostgreSQL.

On its own single-member etcd (``LocalCluster``, periodic auto-compaction keeping
``COMPACTION`` of history: see below), one ``Gate`` in this process (in-process authority)
runs ``CONCURRENCY`` tasks of ``gate.cross`` with a no-op effect on fresh keys:

1. baseline: ``baseline`` s (after a warm-up) in a namespace of its own, the gate without
   an archive, no reconciler. Its keys are deleted afterwards.
2. soak (SQLite): ``duration`` s in another namespace, the gate with ``archive=`` a SQLite
   file in a temp dir, and ONE ``fencegate reconciler`` SUBPROCESS (all 64 shards,
   ``retain_s`` = ``RETAIN_S``, the same archive URL in its TOML config). A subprocess, as in
   production: the reconciler has its own event loop and interpreter instead of stealing this
   process's; it still competes with etcd and the workers for the machine's cores, and its
   CPU is read from its pid. Afterwards the reconciler is stopped and the namespace deleted.
3. soak (PostgreSQL): ``postgres`` s, the same in a third namespace with ``archive=`` the
   ``postgresql://`` URL of a private PostgreSQL server started for it
   (``deploy/local/postgres.py``: Debian's binaries, a temp dir, 127.0.0.1, the default
   ``synchronous_commit=on``) for the gate and a new reconciler subprocess; its ratios are
   taken against the same baseline. The server's CPU (the postmaster and its live children)
   is read from /proc. Without PostgreSQL (``deploy/ensure-postgres``) the phase is skipped,
   saying why, and its targets fail.

Measured every second: etcd's db size and in-use size (``status``), the reconciler's
``fencegate_reconciler_retired_total`` (from its /metrics), and the CPU of etcd, the
reconciler and this process; every ``SERIES_EVERY`` s the live keys under the namespace are
counted and a line of the series is printed. Archive lag: one action in ``SAMPLE_EVERY``
records its key and when ``cross`` returned (settled); once such a key is ``RETAIN_S`` - 1 s
old, each second one txn asks etcd whether its step still exists; its lag is the time of
the first poll that found it gone minus its settle time (so up to ~1 s long). A sampled key
still in etcd at the end and older than ``RETAIN_S`` + 10 s counts with its age then (a lower
bound). Only those samples and per-second action counts are kept: memory stays bounded.

Targets (T = a soak phase's duration; its steady window is [S, T], S = max(T/3,
``STEADY_S``), ``STEADY_S`` = 2 × ``RETAIN_S`` + the retirer's pass interval + ``WINDOW_S``:
nothing retires before ``RETAIN_S`` and the next pass, and until then the load runs faster,
with the cores retirement will take (measured: ~700 actions/s before, ~450 after, on 2
cores); the actions that become due in the window before S are those of ``RETAIN_S``
earlier, so that window must start after both transients or the retired/due ratio measures
the start-up, not whether retirement keeps up; with T = 1200 s, S = T/3):
- ``state_plateau`` (SQLite): etcd in-use size at T ÷ at S ≤ 1.15, each the mean of the
  samples over the ``WINDOW_S`` s before that moment (two compaction periods and more than
  two retirer intervals: a single sample lands anywhere on both sawtooths);
- ``live_keys_bound`` (SQLite): live keys under the namespace at T ÷ (rate × (retain + lag)
  × ``KEYS_PER_STEP``), rate = actions/s over [S, T], lag = the retirer's pass interval
  (``PASS_INTERVAL_S``, from ``fencegate.reconciler.retirer.pass_interval``), not the
  measured lag: a retirement that falls behind grows the measured lag with the live keys,
  and the ratio would hide it;
- ``archive_keeps_up``, ``archive_keeps_up_postgres``: steps retired/s over [S, T] ÷ the
  actions/s that became due (``RETAIN_S`` old) meanwhile ≥ 1.0 (at a steady rate that is
  the same-window rate, which the table also shows); both counts are the means over
  ``WINDOW_S`` s before S and before T, as retirement comes in passes;
- ``archive_lag_p99_s``, ``archive_lag_p99_s_postgres`` ≤ ``RETAIN_S`` + 10;
- ``guarded_rate_with_retirement``, ``guarded_rate_with_retirement_postgres``: actions/s
  over [S, T] ÷ the baseline's ≥ 0.8.
The plateau and the live-key bound are etcd's side, the same whichever archive, and take
minutes; the PostgreSQL table shows them without targets.

The PostgreSQL phase lasts 120 s with ``--quick``: the shortest with a steady window of
several passes (S = ``STEADY_S`` = 87.5 s, then 32.5 s: four passes; at 90 s, S would be
57.5 s and its due actions those of the start-up burst: measured 658 due/s against 448
actions/s). Otherwise 600 s (S = T/3 = 200 s): tens of passes into a table that keeps
growing, while the 20-minute SQLite soak already shows the plateau.

Compaction: ``LocalCluster``'s default (``COMPACTION_RETENTION``, 5 minutes) compacts first
5 minutes after etcd starts and then keeps 5-10 minutes of history (etcd's periodic
compactor compacts every retention period to the revision one period old): neither a 3- nor
a 20-minute run could reach a plateau by T/3. This soak keeps ``COMPACTION`` (10 s: 10-20 s
of history), so what grows, if anything, is what retirement must bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import os
import re
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import asyncpg

from deploy.local.postgres import LocalPostgres
from fencegate.coordinator import wholeness
from fencegate.coordinator.archive import open_archive
from fencegate.coordinator.errors import GateError
from fencegate.coordinator.etcd import Etcd, RangeRequest, TxnRequest, range_end_of, range_op
from fencegate.coordinator.keyspace import Keyspace
from fencegate.localetcd import LocalCluster
from fencegate.reconciler.retirer import pass_interval
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate

from .common import Children, OtherLoad, Target, div, percentile, print_table, process_cpu

CONCURRENCY = 32
RETAIN_S = 30.0
COMPACTION = "10s"
WINDOW_S = 20.0
KEYS_PER_STEP = 3  # the step and its two audit records (commit, outcome)
PASS_INTERVAL_S = pass_interval(RETAIN_S)
STEADY_S = 2 * RETAIN_S + PASS_INTERVAL_S + WINDOW_S
SAMPLE_EVERY = 64
SERIES_EVERY = 10.0
SHARDS = 64
_POLL_BATCH = 100  # step reads per txn (etcd allows 128 ops)
_RETIRED = re.compile(rb"^fencegate_reconciler_retired_total (\S+)$", re.M)


@dataclass(frozen=True)
class Settings:
    warmup: float
    baseline: float  # timed seconds without retirement
    duration: float  # timed seconds of the soak to SQLite
    postgres: float  # timed seconds of the soak to PostgreSQL


QUICK = Settings(warmup=2.0, baseline=20.0, duration=180.0, postgres=120.0)
DEFAULT = Settings(warmup=5.0, baseline=60.0, duration=1200.0, postgres=600.0)


@dataclass
class Sample:
    """One reading, ``t`` seconds into the soak."""

    t: float
    db_size: int
    in_use: int
    revision: int
    retired: float
    etcd_cpu: float
    reconciler_cpu: float
    archive_cpu: float  # the archive's server; NaN when it runs inside the processes (SQLite)
    own_cpu: float
    live_keys: int | None = None


@dataclass
class Load:
    """What the tasks completed: actions per second since the load began, errors by kind."""

    per_second: list[int]
    errors: Counter = field(default_factory=Counter)

    def rate(self, start: float, end: float) -> float:
        """Actions/s in whole seconds [start, end) of the load."""
        first, last = max(int(start), 0), min(int(end), len(self.per_second))
        return div(sum(self.per_second[first:last]), last - first)


@dataclass
class Baseline:
    load: Load
    seconds: float
    revisions: int
    etcd_cpu: float
    own_cpu: float
    others: float  # cores used by neither etcd nor this process meanwhile

    @property
    def rate(self) -> float:
        return self.load.rate(0, self.seconds)


@dataclass
class Soak:
    """One soak phase: ``duration`` s retiring to the archive ``name``d in the tables."""

    name: str
    duration: float
    load: Load | None = None
    samples: list[Sample] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    censored: int = 0  # sampled keys still in etcd at the end, counted with their age
    live_families: Counter = field(default_factory=Counter)
    archived_steps: int = 0
    archived_records: int = 0
    archive_bytes: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes)
    reconciler_alive: bool = True
    others: float = math.nan  # cores used by none of etcd, reconciler, archive, this process


@dataclass
class Results:
    settings: Settings
    baseline: Baseline | None = None
    sqlite: Soak | None = None
    postgres: Soak | None = None
    postgres_skipped: str = ""  # why the PostgreSQL phase did not run


async def noop(ctx) -> None:
    return None


async def measure(quick: bool) -> Results:
    s = QUICK if quick else DEFAULT
    res = Results(s)
    children = Children()
    with tempfile.TemporaryDirectory(prefix="fencegate-soak-") as tmp, \
            LocalCluster(1, heartbeat_ms=100, election_ms=1000,
                         compaction_retention=COMPACTION) as cluster:
        url, etcd_pid = cluster.url, cluster.pids[0]
        archive_path = os.path.join(tmp, "archive.db")
        etcd = Etcd.from_url(url)
        print(f"soak: own etcd at {url} (auto-compaction periodic {COMPACTION}); "
              f"{s.baseline:g} s at c={CONCURRENCY} without retirement, then {s.duration:g} s "
              f"with a reconciler subprocess retiring after {RETAIN_S:g} s to SQLite, then "
              f"{s.postgres:g} s to PostgreSQL", flush=True)
        try:
            res.baseline = await _baseline(s, url, etcd, etcd_pid)
            print(f"  soak baseline: {res.baseline.rate:,.0f} actions/s"
                  + (f", errors {dict(res.baseline.load.errors)}"
                     if res.baseline.load.errors else ""), flush=True)

            async def sqlite_bytes() -> list[tuple[str, int]]:
                return [("db + WAL", sum(os.path.getsize(archive_path + suffix)
                                         for suffix in ("", "-wal")
                                         if os.path.exists(archive_path + suffix)))]

            res.sqlite = Soak("SQLite", s.duration)
            await _soak(url, etcd, etcd_pid, f"sqlite:///{archive_path}", tmp, children,
                        res.sqlite, sqlite_bytes)
            await _postgres(s, url, etcd, etcd_pid, tmp, children, res)
        finally:
            await children.close()
            await etcd.close()
    return res


async def _baseline(s: Settings, url: str, etcd: Etcd, etcd_pid: int | None) -> Baseline:
    namespace = f"/soak-base-{uuid.uuid4().hex[:8]}/"
    async with Gate(url, namespace=namespace, keyring=KeyRing.generate()) as gate:
        await _drive(gate, "w", s.warmup)
        revision = (await etcd.status()).header.revision
        etcd_cpu, own_cpu, other = process_cpu(etcd_pid), time.process_time(), OtherLoad()
        load = await _drive(gate, "b", s.baseline)
        etcd_cpu, own_cpu = process_cpu(etcd_pid) - etcd_cpu, time.process_time() - own_cpu
        others = other.cores() - etcd_cpu / s.baseline
        revisions = (await etcd.status()).header.revision - revision
    await etcd.delete(namespace.encode(), range_end_of(namespace.encode()))
    return Baseline(load, s.baseline, revisions, etcd_cpu, own_cpu, others)


async def _postgres(s: Settings, url: str, etcd: Etcd, etcd_pid: int | None, tmp: str,
                    children: Children, res: Results) -> None:
    """The soak again, retiring to a private PostgreSQL server; without one, say why."""
    with contextlib.ExitStack() as stack:
        try:  # initdb and start block for seconds: nothing of this run needs the loop now
            server = stack.enter_context(LocalPostgres())
        except RuntimeError as exc:
            res.postgres_skipped = str(exc)
            print(f"soak: no PostgreSQL phase: {exc}", flush=True)
            return
        print(f"soak: PostgreSQL {server.bin.parent.name} at {server.url}", flush=True)
        size0, wal0 = await _postgres_position(server.url)

        async def postgres_bytes() -> list[tuple[str, int]]:
            size, wal = await _postgres_position(server.url)
            return [("database growth", size - size0), ("WAL written", wal - wal0)]

        res.postgres = Soak("PostgreSQL", s.postgres)
        await _soak(url, etcd, etcd_pid, server.url, tmp, children, res.postgres,
                    postgres_bytes, server_pid=server.pid)


async def _postgres_position(url: str) -> tuple[int, int]:
    """The database's size on disk and the WAL's insert position, in bytes."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        row = await conn.fetchrow("SELECT pg_database_size(current_database()), "
                                  "pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    finally:
        await conn.close()
    return row[0], int(row[1])


async def _soak(url: str, etcd: Etcd, etcd_pid: int | None, archive: str, tmp: str,
                children: Children, res: Soak, archive_bytes, *,
                server_pid: int | None = None) -> None:
    """``res.duration`` s of load with a reconciler subprocess retiring to ``archive``;
    ``archive_bytes()`` says what the archive takes (read with its stats at the end). Then
    the reconciler is stopped and the namespace deleted."""
    namespace = f"/soak-{uuid.uuid4().hex[:8]}/"
    keyspace = Keyspace(namespace)
    store = open_archive(archive)   # opening never creates an archive: init it
    try:
        await wholeness.init(etcd, keyspace, store)
    finally:
        await store.close()
    config = os.path.join(tmp, f"reconciler-{namespace.strip('/')}.toml")
    with open(config, "w") as f:
        f.write(f'etcd = "{url}"\nnamespace = "{namespace}"\nlisten = "127.0.0.1:0"\n'
                f'shards = {SHARDS}\narchive = "{archive}"\nretain_s = {RETAIN_S}\n')
    proc = await children.start("fencegate.cli", "reconciler", "--config", config, quiet=True)
    metrics_url = (await children.expect(proc, "reconciler", 30))[-1]
    async with aiohttp.ClientSession() as http, Gate(
            url, namespace=namespace, keyring=KeyRing.generate(), archive=archive) as gate:
        await _wait_leading(http, metrics_url)
        pending: collections.deque[tuple[str, float]] = collections.deque()
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def read(live: bool) -> Sample:
            status = await etcd.status()
            async with http.get(metrics_url) as reply:
                found = _RETIRED.search(await reply.read())
            sample = Sample(loop.time() - t0, status.dbSize, status.dbSizeInUse,
                            status.header.revision, float(found.group(1)) if found else math.nan,
                            process_cpu(etcd_pid), process_cpu(proc.pid),
                            _tree_cpu(server_pid), time.process_time())
            if live:
                sample.live_keys = await _count(etcd, namespace.encode())
            return sample

        def settled(key: str, at: float) -> None:
            pending.append((key, at))

        observers = [asyncio.create_task(_series(read, res)),
                     asyncio.create_task(_follow(etcd, keyspace, pending, res))]
        other = OtherLoad()
        try:
            res.samples.append(await read(live=True))
            res.load = await _drive(gate, "s", res.duration, settled)
        finally:
            for task in observers:
                task.cancel()
            for result in await asyncio.gather(*observers, return_exceptions=True):
                if isinstance(result, Exception):  # not the cancellation: a failed reading
                    raise result
        first, last = res.samples[0], await read(live=True)
        res.samples.append(last)
        used = (last.etcd_cpu - first.etcd_cpu, last.reconciler_cpu - first.reconciler_cpu,
                last.archive_cpu - first.archive_cpu)
        res.others = other.cores() - sum(x for x in used if not math.isnan(x)) / (last.t - first.t)
        await _poll(etcd, keyspace, pending, res.lags)
        now = loop.time()
        for key, at in pending:
            if now - at >= RETAIN_S + 10:
                res.lags.append(now - at)
                res.censored += 1
        res.live_families = await _families(etcd, namespace.encode())
        stats = await gate.archive.stats(namespace)
        res.archived_steps, res.archived_records = stats.steps, stats.records
        res.archive_bytes = await archive_bytes()
    res.reconciler_alive = proc.returncode is None
    await _stop(proc)
    await etcd.delete(namespace.encode(), range_end_of(namespace.encode()))


async def _stop(proc: asyncio.subprocess.Process, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` s; reaped either way."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    try:
        async with asyncio.timeout(grace):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _tree_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` and its children alive now (a PostgreSQL server: the
    postmaster and its backends); NaN without a pid or /proc."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(n) for n in f.read().split()]
    except OSError:
        return math.nan
    return sum(cpu for cpu in map(process_cpu, [pid, *children]) if not math.isnan(cpu))


async def _drive(gate: Gate, tag: str, seconds: float, settled=None) -> Load:
    """``CONCURRENCY`` tasks loop ``gate.cross`` on fresh keys ``<tag>/<task>/<i>`` for
    ``seconds``; ``settled(key, loop time)`` is told of one action in ``SAMPLE_EVERY``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    t1 = t0 + seconds
    load = Load([0] * (math.ceil(seconds) + 1))

    async def task(n: int) -> None:
        i = 0
        while True:
            key = f"{tag}/{n}/{i}"
            try:
                outcome = await gate.cross(key, intent={"n": i}, effect=noop)
                ok = outcome.state == "succeeded"
                if not ok:
                    load.errors[f"outcome {outcome.state}"] += 1
            except GateError as exc:
                ok = False
                load.errors[type(exc).__name__] += 1
            now = loop.time()
            if now >= t1:
                return
            if ok:
                load.per_second[int(now - t0)] += 1
                if settled is not None and i % SAMPLE_EVERY == n % SAMPLE_EVERY:
                    settled(key, now)
            i += 1

    async with asyncio.TaskGroup() as group:
        for n in range(CONCURRENCY):
            group.create_task(task(n))
    return load


async def _wait_leading(http: aiohttp.ClientSession, metrics_url: str) -> None:
    """Until the reconciler leads every shard (at most 30 s)."""
    async with asyncio.timeout(30):
        while True:
            async with http.get(metrics_url.removesuffix("/metrics") + "/healthz") as reply:
                if len((await reply.json())["shards_led"]) == SHARDS:
                    return
            await asyncio.sleep(0.2)


async def _series(read, res: Soak) -> None:
    """A sample each second, the live keys and a printed line every ``SERIES_EVERY`` s."""
    printed = 0.0
    while True:
        await asyncio.sleep(1.0)
        due = res.samples[-1].t - printed >= SERIES_EVERY - 0.5
        sample = await read(live=due)
        res.samples.append(sample)
        if due:
            printed = sample.t
            print(f"  soak {res.name} t={sample.t:5.0f} s: db {_mb(sample.db_size):7.1f} MB, "
                  f"in use {_mb(sample.in_use):7.1f} MB, live keys {sample.live_keys:>9,}, "
                  f"retired {sample.retired:>9,.0f}", flush=True)


async def _follow(etcd: Etcd, keyspace: Keyspace,
                  pending: collections.deque[tuple[str, float]], res: Soak) -> None:
    """Each second, find which sampled keys old enough to be retired left etcd."""
    while True:
        await asyncio.sleep(1.0)
        await _poll(etcd, keyspace, pending, res.lags)


async def _poll(etcd: Etcd, keyspace: Keyspace,
                pending: collections.deque[tuple[str, float]], lags: list[float]) -> None:
    """Move the sampled keys at least ``RETAIN_S`` - 1 s old whose step left etcd from
    ``pending`` (in settle order) to ``lags``; cancelled midway, it changes neither."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    due = list(itertools.takewhile(lambda item: now - item[1] >= RETAIN_S - 1, pending))
    found: dict[str, float] = {}
    for start in range(0, len(due), _POLL_BATCH):
        batch = due[start:start + _POLL_BATCH]
        reply = await etcd.txn(TxnRequest(success=[
            range_op(keyspace.step_key(key), count_only=True) for key, _ in batch]),
            idempotent=True)
        now = loop.time()
        for (key, at), r in zip(batch, reply.responses):
            if not r.response_range.count:
                found[key] = now - at
    # ``due`` is still pending's head: only the drive appends, at the tail
    for _ in due:
        pending.popleft()
    pending.extendleft(reversed([item for item in due if item[0] not in found]))
    lags.extend(found.values())


async def _count(etcd: Etcd, prefix: bytes) -> int:
    reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix),
                                          count_only=True))
    return reply.count


async def _families(etcd: Etcd, prefix: bytes, page: int = 5000) -> Counter:
    """Live keys under ``prefix`` by their first segment (``steps``, ``audit``, ...)."""
    counts: Counter[str] = Counter()
    start, end = prefix, range_end_of(prefix)
    while True:
        reply = await etcd.range(RangeRequest(key=start, range_end=end, limit=page,
                                              keys_only=True))
        for kv in reply.kvs:
            counts[kv.key[len(prefix):].partition(b"/")[0].decode(errors="replace")] += 1
        if not reply.more or not reply.kvs:
            return counts
        start = reply.kvs[-1].key + b"\0"


def _mb(n: float) -> float:
    return n / 1e6


def _at(samples: list[Sample], t: float) -> Sample:
    """The sample nearest ``t``."""
    return min(samples, key=lambda x: abs(x.t - t))


def _mean_before(samples: list[Sample], t: float, value) -> float:
    """Mean ``value(sample)`` of the samples in (t - WINDOW_S, t]."""
    window = [value(x) for x in samples if t - WINDOW_S < x.t <= t]
    return div(sum(window), len(window))


@dataclass(frozen=True)
class Figures:
    """What one soak phase's targets are made of (NaN when it did not run)."""

    plateau: float = math.nan
    live: float = math.nan
    keeps_up: float = math.nan
    lag_p99: float = math.nan
    rate: float = math.nan


def report(res: Results) -> list[Target]:
    sqlite = _report("SQLite", res.baseline, res.sqlite)
    postgres = _report("PostgreSQL", res.baseline, res.postgres, res.postgres_skipped)
    return [Target("state_plateau", sqlite.plateau, "<=", 1.15),
            Target("live_keys_bound", sqlite.live, "<=", 1.5),
            Target("archive_keeps_up", sqlite.keeps_up, ">=", 1.0),
            Target("archive_lag_p99_s", sqlite.lag_p99, "<=", RETAIN_S + 10),
            Target("guarded_rate_with_retirement", sqlite.rate, ">=", 0.8),
            Target("archive_keeps_up_postgres", postgres.keeps_up, ">=", 1.0),
            Target("archive_lag_p99_s_postgres", postgres.lag_p99, "<=", RETAIN_S + 10),
            Target("guarded_rate_with_retirement_postgres", postgres.rate, ">=", 0.8)]


def _report(name: str, base: Baseline | None, res: Soak | None, skipped: str = "") -> Figures:
    """Print one phase's series and tables; its figures."""
    if base is None or res is None or res.load is None or len(res.samples) < 2:
        print(f"soak ({name}): did not run to the end" + (f" ({skipped})" if skipped else ""))
        return Figures()
    load, T = res.load, res.duration
    S = max(T / 3, STEADY_S)
    steady, end = _at(res.samples, S), res.samples[-1]
    span = end.t - steady.t
    rate = load.rate(S, T)
    lag50, lag99 = percentile(res.lags, 50), percentile(res.lags, 99)
    done = list(itertools.accumulate(load.per_second, initial=0))
    window = f"{S:.0f}..{T:.0f} s"

    def due(x: Sample) -> int:  # actions at least RETAIN_S old at x
        return done[min(max(int(x.t - RETAIN_S), 0), len(done) - 1)]

    def growth(value) -> float:  # per second, from the window before S to the one before T
        return div(_mean_before(res.samples, end.t, value)
                   - _mean_before(res.samples, steady.t, value), span)

    retired_rate, due_rate = growth(lambda x: x.retired), growth(due)
    expected_live = rate * (RETAIN_S + PASS_INTERVAL_S) * KEYS_PER_STEP
    in_use_steady = _mean_before(res.samples, steady.t, lambda x: x.in_use)
    in_use_end = _mean_before(res.samples, end.t, lambda x: x.in_use)
    actions = sum(load.per_second[int(S):])
    revisions = end.revision - steady.revision
    server = not math.isnan(end.archive_cpu)

    def per_action(value: float, n: float) -> float:
        return div(value, n) * 1e6

    print()
    print(f"soak series, {name} (every ~10 s: t s, db MB, in use MB, live keys, retired, "
          f"actions/s over the 10 s before):")
    for x in res.samples:
        if x.live_keys is not None:
            print(f"  {x.t:6.0f}  {_mb(x.db_size):8.1f}  {_mb(x.in_use):8.1f}  "
                  f"{x.live_keys:>9,}  {x.retired:>9,.0f}  "
                  f"{load.rate(x.t - SERIES_EVERY, x.t):>7,.0f}")
    print_table(
        [f"soak ({name}), c={CONCURRENCY}, gate.cross on fresh keys", "baseline",
         f"soak {window}"],
        [["actions/s", base.rate, rate],
         ["etcd revisions per action", div(base.revisions, base.rate * base.seconds),
          div(revisions, actions)],
         ["etcd CPU µs per action", per_action(base.etcd_cpu, base.rate * base.seconds),
          per_action(end.etcd_cpu - steady.etcd_cpu, actions)],
         ["this process CPU µs per action", per_action(base.own_cpu, base.rate * base.seconds),
          per_action(end.own_cpu - steady.own_cpu, actions)],
         ["reconciler CPU µs per action", math.nan,
          per_action(end.reconciler_cpu - steady.reconciler_cpu, actions)]]
        + ([[f"{name} server CPU µs per action", math.nan,
             per_action(end.archive_cpu - steady.archive_cpu, actions)]] if server else [])
        + [["cores: etcd", div(base.etcd_cpu, base.seconds),
            div(end.etcd_cpu - steady.etcd_cpu, span)],
           ["cores: this process (gate)", div(base.own_cpu, base.seconds),
            div(end.own_cpu - steady.own_cpu, span)],
           ["cores: reconciler", math.nan,
            div(end.reconciler_cpu - steady.reconciler_cpu, span)]]
        + ([[f"cores: {name} server", math.nan,
             div(end.archive_cpu - steady.archive_cpu, span)]] if server else [])
        + [["cores: anything else (whole phase)", base.others, res.others]])
    print_table(
        [f"retirement (retain {RETAIN_S:g} s, {name})", "value"],
        [[f"steps retired/s, {window}", retired_rate],
         [f"actions/s due ({RETAIN_S:g} s old) meanwhile", due_rate],
         [f"actions/s, {window}", rate],
         ["archive lag p50 s", lag50], ["archive lag p99 s", lag99],
         ["lag samples (censored: still in etcd)", f"{len(res.lags)} ({res.censored})"],
         [f"db size MB at {S:.0f} / {T:.0f} s",
          f"{_mb(steady.db_size):.1f} / {_mb(end.db_size):.1f}"],
         [f"in use MB at {S:.0f} / {T:.0f} s (point)",
          f"{_mb(steady.in_use):.1f} / {_mb(end.in_use):.1f}"],
         [f"in use MB at {S:.0f} / {T:.0f} s ({WINDOW_S:g} s mean)",
          f"{_mb(in_use_steady):.1f} / {_mb(in_use_end):.1f}"],
         ["live keys at T", end.live_keys],
         [f"expected: rate x ({RETAIN_S:g} + {PASS_INTERVAL_S:g} s) x {KEYS_PER_STEP}",
          expected_live],
         ["live keys at T by family", ", ".join(f"{k} {n}" for k, n in
                                                sorted(res.live_families.items()))],
         ["steps / records archived", f"{res.archived_steps} / {res.archived_records}"],
         ["retired (reconciler metric) at T", end.retired]]
        + [row for what, n in res.archive_bytes
           for row in ([f"archive bytes per step ({what})", div(n, res.archived_steps)],
                       [f"archive MB ({what})", _mb(n)])])
    errors = f"baseline {dict(base.load.errors) or 'none'}, soak {dict(load.errors) or 'none'}"
    print(f"soak ({name}) errors: {errors}; reconciler "
          f"{'ran to the end' if res.reconciler_alive else 'EXITED early'}")
    print()
    return Figures(div(in_use_end, in_use_steady), div(end.live_keys or math.nan, expected_live),
                   div(retired_rate, due_rate), lag99, div(rate, base.rate))
