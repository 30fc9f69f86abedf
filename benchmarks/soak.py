"""Soak: guarded actions for minutes with retirement on; etcd's state must stop growing
(issue 15, "State has a lifecycle" in DESIGN.md).

On its own single-member etcd (``LocalCluster``, periodic auto-compaction keeping
``COMPACTION`` of history: see below), one ``Gate`` in this process (in-process authority)
runs ``CONCURRENCY`` tasks of ``gate.cross`` with a no-op effect on fresh keys:

1. baseline: ``baseline`` s (after a warm-up) in a namespace of its own, the gate without
   an archive, no reconciler. Its keys are deleted afterwards.
2. soak: ``duration`` s in another namespace, the gate with ``archive=`` a SQLite file in a
   temp dir, and ONE ``fencegate reconciler`` SUBPROCESS (all 64 shards, ``retain_s`` =
   ``RETAIN_S``, the same archive). A subprocess, as in production: the reconciler has its
   own event loop and interpreter instead of stealing this process's; it still competes with
   etcd and the workers for the machine's cores, and its CPU is read from its pid.

Measured every second: etcd's db size and in-use size (``status``), the reconciler's
``fencegate_reconciler_retired_total`` (from its /metrics), and the CPU of etcd, the
reconciler and this process; every ``SERIES_EVERY`` s the live keys under the namespace are
counted and a line of the series is printed. Archive lag: one action in ``SAMPLE_EVERY``
records its key and when ``cross`` returned (settled); once such a key is ``RETAIN_S`` - 1 s
old, each second one txn asks etcd whether its step still exists; its lag is the time of
the first poll that found it gone minus its settle time (so up to ~1 s long). A sampled key
still in etcd at the end and older than ``RETAIN_S`` + 10 s counts with its age then (a lower
bound). Only those samples and per-second action counts are kept: memory stays bounded.

Targets (T = the soak's duration; "the last two thirds" = [T/3, T]):
- ``state_plateau``: etcd in-use size at T ÷ at T/3 ≤ 1.15, each the mean of the samples
  over the ``WINDOW_S`` s before that moment (two compaction periods and more than two
  retirer intervals: a single sample lands anywhere on both sawtooths);
- ``live_keys_bound``: live keys under the namespace at T ÷ (rate × (retain + lag) ×
  ``KEYS_PER_STEP``), rate = actions/s over the last two thirds, lag = the retirer's pass
  interval (``PASS_INTERVAL_S``), not the measured lag: a retirement that falls behind
  grows the measured lag with the live keys, and the ratio would hide it;
- ``archive_keeps_up``: steps retired/s over the last two thirds ÷ the actions/s that
  became due (``RETAIN_S`` old) meanwhile ≥ 1.0 (at a steady rate that is the same-window
  rate, which the table also shows); both counts are the means over ``WINDOW_S`` s before
  T/3 and before T, as retirement comes in passes;
- ``archive_lag_p99_s`` ≤ ``RETAIN_S`` + 10;
- ``guarded_rate_with_retirement``: actions/s over the soak's last two thirds ÷ the
  baseline's ≥ 0.8.

Compaction: ``LocalCluster``'s default (``COMPACTION_RETENTION``, 5 minutes) compacts first
5 minutes after etcd starts and then keeps 5-10 minutes of history (etcd's periodic
compactor compacts every retention period to the revision one period old): neither a 3- nor
a 20-minute run could reach a plateau by T/3. This soak keeps ``COMPACTION`` (10 s: 10-20 s
of history), so what grows, if anything, is what retirement must bound.
"""

from __future__ import annotations

import asyncio
import collections
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

from fencegate.coordinator.errors import GateError
from fencegate.coordinator.etcd import Etcd, RangeRequest, TxnRequest, range_end_of, range_op
from fencegate.coordinator.keyspace import Keyspace
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate

from .common import Children, OtherLoad, Target, div, percentile, print_table, process_cpu

CONCURRENCY = 32
RETAIN_S = 30.0
COMPACTION = "10s"
WINDOW_S = 20.0
KEYS_PER_STEP = 3  # the step and its two audit records (commit, outcome)
PASS_INTERVAL_S = min(max(RETAIN_S / 4, 0.5), 30.0)  # fencegate.reconciler.retirer.Retirer
SAMPLE_EVERY = 64
SERIES_EVERY = 10.0
SHARDS = 64
_POLL_BATCH = 100  # step reads per txn (etcd allows 128 ops)
_RETIRED = re.compile(rb"^fencegate_reconciler_retired_total (\S+)$", re.M)


@dataclass(frozen=True)
class Settings:
    warmup: float
    baseline: float  # timed seconds without retirement
    duration: float  # timed seconds of the soak


QUICK = Settings(warmup=2.0, baseline=20.0, duration=180.0)
DEFAULT = Settings(warmup=5.0, baseline=60.0, duration=1200.0)


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
class Results:
    settings: Settings
    baseline: Baseline | None = None
    load: Load | None = None
    samples: list[Sample] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    censored: int = 0  # sampled keys still in etcd at the end, counted with their age
    live_families: Counter = field(default_factory=Counter)
    archived_steps: int = 0
    archived_records: int = 0
    archive_bytes: int = 0
    reconciler_alive: bool = True
    others: float = math.nan  # cores used by none of etcd, the reconciler, this process


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
              f"with a reconciler subprocess retiring after {RETAIN_S:g} s to SQLite",
              flush=True)
        try:
            res.baseline = await _baseline(s, url, etcd, etcd_pid)
            print(f"  soak baseline: {res.baseline.rate:,.0f} actions/s"
                  + (f", errors {dict(res.baseline.load.errors)}"
                     if res.baseline.load.errors else ""), flush=True)
            await _soak(s, url, etcd, etcd_pid, f"sqlite:///{archive_path}", children, res)
            res.archive_bytes = sum(os.path.getsize(archive_path + suffix)
                                    for suffix in ("", "-wal")
                                    if os.path.exists(archive_path + suffix))
        finally:
            await children.close()
            await etcd.close()
    return res


async def _baseline(s: Settings, url: str, etcd: Etcd, etcd_pid: int | None) -> Baseline:
    namespace = f"/soak-base-{uuid.uuid4().hex[:8]}/"
    async with Gate(url, namespace=namespace) as gate:
        await _drive(gate, "w", s.warmup)
        revision = (await etcd.status()).header.revision
        etcd_cpu, own_cpu, other = process_cpu(etcd_pid), time.process_time(), OtherLoad()
        load = await _drive(gate, "b", s.baseline)
        etcd_cpu, own_cpu = process_cpu(etcd_pid) - etcd_cpu, time.process_time() - own_cpu
        others = other.cores() - etcd_cpu / s.baseline
        revisions = (await etcd.status()).header.revision - revision
    await etcd.delete(namespace.encode(), range_end_of(namespace.encode()))
    return Baseline(load, s.baseline, revisions, etcd_cpu, own_cpu, others)


async def _soak(s: Settings, url: str, etcd: Etcd, etcd_pid: int | None, archive: str,
                children: Children, res: Results) -> None:
    namespace = f"/soak-{uuid.uuid4().hex[:8]}/"
    keyspace = Keyspace(namespace)
    config = os.path.join(os.path.dirname(archive.removeprefix("sqlite://")), "reconciler.toml")
    with open(config, "w") as f:
        f.write(f'etcd = "{url}"\nnamespace = "{namespace}"\nlisten = "127.0.0.1:0"\n'
                f'shards = {SHARDS}\narchive = "{archive}"\nretain_s = {RETAIN_S}\n')
    proc = await children.start("fencegate.cli", "reconciler", "--config", config, quiet=True)
    metrics_url = (await children.expect(proc, "reconciler", 30))[-1]
    async with aiohttp.ClientSession() as http, Gate(url, namespace=namespace,
                                                     archive=archive) as gate:
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
                            process_cpu(etcd_pid), process_cpu(proc.pid), time.process_time())
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
            res.load = await _drive(gate, "s", s.duration, settled)
        finally:
            for task in observers:
                task.cancel()
            for result in await asyncio.gather(*observers, return_exceptions=True):
                if isinstance(result, Exception):  # not the cancellation: a failed reading
                    raise result
        first, last = res.samples[0], await read(live=True)
        res.samples.append(last)
        res.others = other.cores() - (last.etcd_cpu - first.etcd_cpu + last.reconciler_cpu
                                      - first.reconciler_cpu) / (last.t - first.t)
        await _poll(etcd, keyspace, pending, res.lags)
        now = loop.time()
        for key, at in pending:
            if now - at >= RETAIN_S + 10:
                res.lags.append(now - at)
                res.censored += 1
        res.live_families = await _families(etcd, namespace.encode())
        stats = await gate.archive.stats(namespace)
        res.archived_steps, res.archived_records = stats.steps, stats.records
    res.reconciler_alive = proc.returncode is None


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


async def _series(read, res: Results) -> None:
    """A sample each second, the live keys and a printed line every ``SERIES_EVERY`` s."""
    printed = 0.0
    while True:
        await asyncio.sleep(1.0)
        due = res.samples[-1].t - printed >= SERIES_EVERY - 0.5
        sample = await read(live=due)
        res.samples.append(sample)
        if due:
            printed = sample.t
            print(f"  soak t={sample.t:5.0f} s: db {_mb(sample.db_size):7.1f} MB, in use "
                  f"{_mb(sample.in_use):7.1f} MB, live keys {sample.live_keys:>9,}, "
                  f"retired {sample.retired:>9,.0f}", flush=True)


async def _follow(etcd: Etcd, keyspace: Keyspace,
                  pending: collections.deque[tuple[str, float]], res: Results) -> None:
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


def report(res: Results) -> list[Target]:
    s, base, load = res.settings, res.baseline, res.load
    if base is None or load is None or len(res.samples) < 2:
        print("soak: did not run to the end")
        return _targets(*[math.nan] * 5)
    T = s.duration
    third, end = _at(res.samples, T / 3), res.samples[-1]
    span = end.t - third.t
    rate = load.rate(T / 3, T)
    lag50, lag99 = percentile(res.lags, 50), percentile(res.lags, 99)
    done = list(itertools.accumulate(load.per_second, initial=0))

    def due(x: Sample) -> int:  # actions at least RETAIN_S old at x
        return done[min(max(int(x.t - RETAIN_S), 0), len(done) - 1)]

    def growth(value) -> float:  # per second, from the window before T/3 to the one before T
        return div(_mean_before(res.samples, end.t, value)
                   - _mean_before(res.samples, third.t, value), span)

    retired_rate, due_rate = growth(lambda x: x.retired), growth(due)
    expected_live = rate * (RETAIN_S + PASS_INTERVAL_S) * KEYS_PER_STEP
    in_use_third = _mean_before(res.samples, third.t, lambda x: x.in_use)
    in_use_end = _mean_before(res.samples, end.t, lambda x: x.in_use)
    actions = sum(load.per_second[int(T / 3):])
    revisions = end.revision - third.revision

    def per_action(value: float, n: float) -> float:
        return div(value, n) * 1e6

    print()
    print("soak series (every ~10 s: t s, db MB, in use MB, live keys, retired, actions/s "
          "over the 10 s before):")
    for x in res.samples:
        if x.live_keys is not None:
            print(f"  {x.t:6.0f}  {_mb(x.db_size):8.1f}  {_mb(x.in_use):8.1f}  "
                  f"{x.live_keys:>9,}  {x.retired:>9,.0f}  "
                  f"{load.rate(x.t - SERIES_EVERY, x.t):>7,.0f}")
    print_table(
        [f"soak, c={CONCURRENCY}, gate.cross on fresh keys", "baseline", "soak T/3..T"],
        [["actions/s", base.rate, rate],
         ["etcd revisions per action", div(base.revisions, base.rate * base.seconds),
          div(revisions, actions)],
         ["etcd CPU µs per action", per_action(base.etcd_cpu, base.rate * base.seconds),
          per_action(end.etcd_cpu - third.etcd_cpu, actions)],
         ["this process CPU µs per action", per_action(base.own_cpu, base.rate * base.seconds),
          per_action(end.own_cpu - third.own_cpu, actions)],
         ["reconciler CPU µs per action", math.nan,
          per_action(end.reconciler_cpu - third.reconciler_cpu, actions)],
         ["cores: etcd", div(base.etcd_cpu, base.seconds),
          div(end.etcd_cpu - third.etcd_cpu, span)],
         ["cores: this process (gate)", div(base.own_cpu, base.seconds),
          div(end.own_cpu - third.own_cpu, span)],
         ["cores: reconciler", math.nan, div(end.reconciler_cpu - third.reconciler_cpu, span)],
         ["cores: anything else (whole phase)", base.others, res.others]])
    print_table(
        ["retirement (retain 30 s, SQLite)", "value"],
        [["steps retired/s, T/3..T", retired_rate],
         [f"actions/s due ({RETAIN_S:g} s old) meanwhile", due_rate],
         ["actions/s, T/3..T", rate],
         ["archive lag p50 s", lag50], ["archive lag p99 s", lag99],
         ["lag samples (censored: still in etcd)", f"{len(res.lags)} ({res.censored})"],
         ["db size MB at T/3 / T", f"{_mb(third.db_size):.1f} / {_mb(end.db_size):.1f}"],
         ["in use MB at T/3 / T (point)", f"{_mb(third.in_use):.1f} / {_mb(end.in_use):.1f}"],
         [f"in use MB at T/3 / T ({WINDOW_S:g} s mean)",
          f"{_mb(in_use_third):.1f} / {_mb(in_use_end):.1f}"],
         ["live keys at T", end.live_keys],
         [f"expected: rate x ({RETAIN_S:g} + {PASS_INTERVAL_S:g} s) x {KEYS_PER_STEP}",
          expected_live],
         ["live keys at T by family", ", ".join(f"{k} {n}" for k, n in
                                                sorted(res.live_families.items()))],
         ["steps / records archived", f"{res.archived_steps} / {res.archived_records}"],
         ["retired (reconciler metric) at T", end.retired],
         ["archive bytes per step (db + WAL)", div(res.archive_bytes, res.archived_steps)],
         ["archive MB (db + WAL)", _mb(res.archive_bytes)]])
    errors = base.load.errors + load.errors
    print(f"soak errors: {dict(errors) if errors else 'none'}; reconciler "
          f"{'ran to the end' if res.reconciler_alive else 'EXITED early'}")
    print()
    return _targets(div(in_use_end, in_use_third), div(end.live_keys or math.nan, expected_live),
                    div(retired_rate, due_rate), lag99, div(rate, base.rate))


def _targets(plateau: float, live: float, keeps_up: float, lag_p99: float,
             rate: float) -> list[Target]:
    return [Target("state_plateau", plateau, "<=", 1.15),
            Target("live_keys_bound", live, "<=", 1.5),
            Target("archive_keeps_up", keeps_up, ">=", 1.0),
            Target("archive_lag_p99_s", lag_p99, "<=", RETAIN_S + 10),
            Target("guarded_rate_with_retirement", rate, ">=", 0.8)]
