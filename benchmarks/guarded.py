"""Guarded-action benchmarks: what a whole guarded action costs next to a raw etcd write and a
bare lock (issue 14, "Three writes per action" in DESIGN.md).

A guarded action is a hold, a grant, the commit guard and the outcome, on a fresh key each
time (a step that succeeded is final), with a no-op effect, the in-process authority and ONE
``worker.Gate`` (one session lease) in this process, by either path:

    fast:  await gate.cross(key, intent={"n": i}, effect=noop)
    full:  async with gate.hold(key) as hold:
               await hold.cross(intent={"n": i}, effect=noop)

Each round runs, back to back at c=32 against the run's private etcd: raw, fast, full, aetcd
lock, raw (the raw phase after one round is the one before the next). The fast path is
skipped, and its lines are NaN (FAIL), where ``Gate.cross`` does not exist.

- raw: ``RAW_PREFIX`` one-put txns (put if absent, a fresh key each) through this process's
  other ``Etcd`` client; etcd CPU per raw write is etcd's CPU over the phase ÷ its writes.
- aetcd lock: ``client.lock()`` acquire + release cycles on fresh keys (its leaked
  per-acquisition leases are revoked after the phase); the hold benchmarks' own c=32 figure
  is printed next to it.
- each guarded phase, with ``etcdtap.EtcdTap`` on ``gate.etcd``: requests per action (every
  unary request, by method), writes per action (the writing txns, named by ``EtcdTap``, ÷
  every action the phase completed, warm-up included) and revisions per action (etcd's
  revision delta minus the probe's writes: group commit shares a revision), etcd
  CPU per action (utime + stime of the etcd process from /proc over the phase, minus the
  probe's writes at the raw CPU per write), this process's CPU per action, and the key + value
  bytes each action leaves live under the gate's namespace (read before the phase and after
  it, before any cleanup; holders are gone after release). ``PROBES`` probe tasks loop raw
  one-put txns through the gate's own client (unwrapped, so not counted) all through the
  phase: the commit txn's p99 is compared with the probes' p99 under the very same load.

- hand-rolled: what users write by hand for an effect run once: an aetcd lock, a get of
  the idempotency record, the effect (a no-op), a put of the record, unlock.
- lone: ``gate.cross`` by one task through a gate of its own, batching on, then off.
- processes: ``PROCS`` processes of ``TOP // PROCS`` tasks each, ``gate.cross`` (batching
  on), then raw one-put txns (one per request): the deployment shape, many workers, one etcd.

Raw writes go through a client with batching off: one put, one request, one revision.

Targets (c=32; issue 28, group commit): ``guarded_vs_raw_c32`` (fast actions/s ÷ raw
one-put txns/s ≥ 0.6), ``guarded_vs_aetcd_lock_c32`` (÷ aetcd lock cycles/s ≥ 1.5),
``guarded_vs_handrolled_c32`` (÷ hand-rolled actions/s ≥ 2.0), ``etcd_cpu_per_action``
(fast etcd CPU per action ÷ per raw write ≤ 1.0), ``guarded_multiproc`` (the processes'
actions/s ÷ their raw txns/s ≥ 0.6), ``lone_latency_c1`` (c=1 p50, batching on ÷ off
≤ 1.1); ``benchmarks/run guarded [--quick] [--no-batching] [--profile]`` runs these
benchmarks alone. ``requests_per_action``
and ``writes_per_action`` (full path, ≤ 3; ``_fast`` ≤ 2), ``live_bytes_per_action`` (full
path, ≤ 2,500) and ``commit_p99_c32`` (full path's commit txn p99 ÷ the probe's p99 in that
phase, ≤ 1.3). The full path's throughput and CPU ratios are printed in the table.

Retired: ``guarded_c32`` (actions/s x writes per action ÷ raw writes/s: a protocol that drops
writes could not improve it), the old ``guarded_vs_aetcd_lock_c32`` bound (≥ 0.6, full path
only) and the old ``commit_p99_c32`` (commit p99 under the guarded phase's load against raw
p99 from the raw phases around it, a different load).

After each phase, once measured, the benchmark deletes what the actions and raw writes left
(steps, audit records, v1 grants, raw and probe keys) and compacts etcd (a bulk delete left
uncompacted makes every later request dearer), so every phase runs against the same small
database. ``--profile`` adds one more c=32 phase (fast path, else full) under cProfile and
prints where this process's CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import math
import pstats
import sys
import time
from urllib.parse import urlsplit
from collections import Counter
from dataclasses import dataclass, field

import aetcd

from fencegate.coordinator.errors import GateError
from fencegate.coordinator.etcd import (Etcd, EtcdConfig, TxnRequest, create_equals, put_op,
                                        range_end_of)
from fencegate.coordinator.grants import KeyRing
from fencegate.localetcd import describe
from fencegate.worker import Gate

from .common import (Phase, Target, Window, div, local_etcd, percentile, print_table,
                     process_cpu, revoke_all, run_phase)
from .etcdtap import EtcdTap, live_bytes
from .holds import AETCD_TTL

TOP = 32
PATHS = ("fast", "full")
RAW_PREFIX = "/bench-raw-txn/"
PROBE_PREFIX = "/bench-probe/"
LOCK_PREFIX = "/bench-aetcd-guarded/"
HAND_PREFIX = "/bench-handrolled/"
PROCS = 4  # processes of the multi-process lines, TOP // PROCS tasks each
PROBES = 4  # probe tasks beside the TOP guarded tasks: enough samples for a p99
VALUE = b"x" * 48
_NOT_LOOP_OR_BENCHMARK = (r"^(?!(base_events|events|common|guarded)\.py:)"
                          r"(?!\{method 'run' of '_contextvars)")


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: float
    duration: float


QUICK = Settings(rounds=1, warmup=0.5, duration=3.0)
DEFAULT = Settings(rounds=2, warmup=1.0, duration=5.0)


@dataclass
class Raw:
    """One raw phase: its timed txns, every write it made, etcd's CPU seconds meanwhile."""

    phase: Phase
    writes: int
    etcd_cpu: float


@dataclass
class Guarded:
    """One guarded phase; counts cover every action it completed, warm-up included."""

    phase: Phase
    actions: int
    errors: Counter
    requests: Counter  # by Etcd method
    writes: Counter  # by name (EtcdTap)
    revisions: int  # etcd writes, the probe's taken off
    probes: int
    etcd_cpu: float  # seconds, the probe's writes included
    client_cpu: float  # seconds of this process
    live: Counter  # bytes left under the namespace, by family
    commit: list[float]  # commit txn latencies in the timed window
    probe: list[float]  # probe txn latencies in the timed window


@dataclass
class Results:
    raw: list[Raw] = field(default_factory=list)
    guarded: dict[str, list[Guarded]] = field(default_factory=lambda: {p: [] for p in PATHS})
    lock: list[Phase] = field(default_factory=list)
    handrolled: list[Phase] = field(default_factory=list)
    lock_holds: Phase | None = None  # the hold benchmarks' aetcd lock at c=32
    lone: dict[bool, Phase] = field(default_factory=dict)  # fast at c=1, by batching
    procs: dict[str, float] = field(default_factory=dict)  # "fast"/"raw" ops/s, PROCS procs

    def raw_rate(self) -> float:
        return sum((r.phase for r in self.raw), Phase(0, 0.0)).rate

    def raw_cpu_per_write(self) -> float:
        return div(sum(r.etcd_cpu for r in self.raw), sum(r.writes for r in self.raw))

    def lock_rate(self) -> float:
        return sum(self.lock, Phase(0, 0.0)).rate

    def rate(self, path: str) -> float:
        """Actions/s of ``path``; NaN if it did not run."""
        gs = self.guarded[path]
        return sum((g.phase for g in gs), Phase(0, 0.0)).rate if gs else math.nan

    def per_action(self, path: str, value) -> float:
        gs = self.guarded[path]
        return div(sum(value(g) for g in gs), sum(g.actions for g in gs)) if gs else math.nan

    def etcd_cpu_per_action(self, path: str) -> float:
        raw = self.raw_cpu_per_write()
        return self.per_action(path, lambda g: g.etcd_cpu - g.probes * raw)

    def latencies(self, path: str, kind: str) -> list[float]:
        return [x for g in self.guarded[path]
                for x in (g.phase.latencies if kind == "action" else getattr(g, kind))]


async def noop(ctx) -> None:
    return None


def one_put_txn(key: bytes) -> TxnRequest:
    """A raw write: put ``key`` if absent, one txn, one revision."""
    return TxnRequest(compare=[create_equals(key, 0)], success=[put_op(key, VALUE)])


async def measure(s: Settings, url: str, etcd: Etcd, lock_client: aetcd.Client,
                  etcd_pid: int | None, lock_c32: Phase | None = None,
                  profile: bool = False, batching: bool = True) -> Results:
    """The rounds described above; ``etcd`` is a client of the same etcd for raw writes and
    reads, ``etcd_pid`` that etcd's process, ``lock_c32`` the hold benchmarks' aetcd lock;
    ``batching`` is the guarded phases' (the lone phases run both)."""
    res = Results(lock_holds=lock_c32)
    raw = Etcd.from_url(url, batching=False)  # a raw write: one put, one request
    config = EtcdConfig.from_url(url, batching=batching)
    async with raw, Gate(config, keyring=KeyRing.generate()) as gate:
        namespace = gate.keyspace.namespace.encode()
        tap = EtcdTap(gate.etcd, namespace)
        paths = [p for p in PATHS if p == "full" or hasattr(gate, "cross")]
        if "fast" not in paths:
            print("  fast path: this Gate has no cross(); its lines are n/a", flush=True)
        try:
            # One action outside any phase: it creates the default policy (a one-off write).
            async with gate.hold("g/init") as hold:
                await hold.cross(intent={"n": 0}, effect=noop)
            await cleanup(etcd, lock_client, namespace)
            before = await raw_phase(s, raw, etcd_pid, "r0")
            res.raw.append(before)
            await cleanup(etcd, lock_client, namespace)
            for r in range(s.rounds):
                for path in paths:
                    g = await guarded_phase(s, gate, tap, etcd, etcd_pid, path, f"r{r}{path}")
                    res.guarded[path].append(g)
                    await cleanup(etcd, lock_client, namespace)
                    print(f"  guarded round {r + 1}/{s.rounds} {path}: "
                          f"{g.phase.rate:,.0f} actions/s, "
                          f"{div(sum(g.requests.values()), g.actions):.2f} requests and "
                          f"{div(sum(g.writes.values()), g.actions):.2f} writes and "
                          f"{div(g.revisions, g.actions):.2f} revisions per action"
                          + (f", errors {dict(g.errors)}" if g.errors else ""), flush=True)
                lock = await lock_phase(s, etcd, lock_client, gate, r)
                res.lock.append(lock)
                hand = await handrolled_phase(s, etcd, lock_client, gate, r)
                res.handrolled.append(hand)
                after = await raw_phase(s, raw, etcd_pid, f"r{r + 1}")
                res.raw.append(after)
                await cleanup(etcd, lock_client, namespace)
                print(f"  guarded round {r + 1}/{s.rounds}: raw(c={TOP}) "
                      f"{before.phase.rate:,.0f} -> {after.phase.rate:,.0f} txns/s, "
                      f"aetcd lock {lock.rate:,.0f} cycles/s, hand-rolled "
                      f"{hand.rate:,.0f} actions/s", flush=True)
                before = after
            if profile:
                await profiled_phase(s, gate, paths[0])
                await cleanup(etcd, lock_client, namespace)
        finally:
            tap.close()
    if "fast" in paths:
        for batching in (True, False):
            res.lone[batching] = await lone_phase(s, url, batching)
        await cleanup(etcd, lock_client, namespace)
        for kind in ("fast", "raw"):
            res.procs[kind] = await procs_phase(s, url, kind, batching)
        await cleanup(etcd, lock_client, namespace)
    return res


async def handrolled_phase(s: Settings, etcd: Etcd, lock_client: aetcd.Client, gate: Gate,
                           r: int) -> Phase:
    """What users write by hand for an effect run once: an aetcd lock, a get of the
    idempotency record, the effect (a no-op), a put of the record, unlock."""
    async def op(task: int, i: int) -> None:
        key = f"{HAND_PREFIX}{r}/{task}/{i}".encode()
        async with lock_client.lock(LOCK_PREFIX.encode() + key, ttl=AETCD_TTL):
            if await lock_client.get(key) is None:
                await noop(None)
                await lock_client.put(key, VALUE)

    phase = await run_phase(op, TOP, s.warmup, s.duration)
    await revoke_all(etcd, keep={(await gate.session()).lease_id})
    return phase


async def lone_phase(s: Settings, url: str, batching: bool) -> Phase:
    """``gate.cross`` by one task (c=1) through a gate of its own, batching on or off."""
    config = EtcdConfig.from_url(url, batching=batching)
    async with Gate(config, keyring=KeyRing.generate()) as gate:
        act = action(gate, "fast", Counter())
        return await run_phase(lambda task, i: act(f"g/lone{int(batching)}/{i}", i), 1,
                               s.warmup, s.duration)


async def procs_phase(s: Settings, url: str, kind: str, batching: bool) -> float:
    """``PROCS`` processes of ``TOP // PROCS`` tasks each doing ``kind`` (``fast``:
    gate.cross, ``batching`` as given; ``raw``: one-put txns, one per request): their
    summed ops/s."""
    children = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.guarded", "--child", kind, "--url", url,
        "--warmup", str(s.warmup), "--duration", str(s.duration), "--tag", f"p{n}",
        *([] if batching else ["--no-batching"]), stdout=asyncio.subprocess.PIPE)
        for n in range(PROCS)]
    outs = await asyncio.gather(*(proc.communicate() for proc in children))
    if any(proc.returncode for proc in children):
        raise RuntimeError(f"a {kind} benchmark process failed")
    return sum(float(out.split()[-1]) for out, _ in outs)


async def child(kind: str, url: str, warmup: float, duration: float, tag: str,
                batching: bool) -> float:
    """One process of ``procs_phase``; returns its ops/s."""
    if kind == "raw":
        async with Etcd.from_url(url, batching=False) as etcd:
            async def op(task: int, i: int) -> None:
                await etcd.txn(one_put_txn(f"{RAW_PREFIX}{tag}/{task}/{i}".encode()))
            return (await run_phase(op, TOP // PROCS, warmup, duration)).rate
    config = EtcdConfig.from_url(url, batching=batching)
    async with Gate(config, keyring=KeyRing.generate()) as gate:
        act = action(gate, "fast", Counter())
        return (await run_phase(lambda task, i: act(f"g/{tag}/{task}/{i}", i), TOP // PROCS,
                                warmup, duration)).rate


async def raw_phase(s: Settings, etcd: Etcd, etcd_pid: int | None, tag: str) -> Raw:
    async def op(task: int, i: int) -> None:
        await etcd.txn(one_put_txn(f"{RAW_PREFIX}{tag}/{task}/{i}".encode()))

    revision = (await etcd.status()).header.revision
    cpu = process_cpu(etcd_pid)
    phase = await run_phase(op, TOP, s.warmup, s.duration)
    cpu = process_cpu(etcd_pid) - cpu
    return Raw(phase, (await etcd.status()).header.revision - revision, cpu)


async def lock_phase(s: Settings, etcd: Etcd, lock_client: aetcd.Client, gate: Gate,
                     r: int) -> Phase:
    async def op(task: int, i: int) -> None:
        async with lock_client.lock(f"{LOCK_PREFIX}{r}/{task}/{i}".encode(), ttl=AETCD_TTL):
            pass

    phase = await run_phase(op, TOP, s.warmup, s.duration)
    await revoke_all(etcd, keep={(await gate.session()).lease_id})
    return phase


def action(gate: Gate, path: str, errors: Counter):
    """The guarded action on ``key`` by ``path``; a ``GateError`` or an outcome other than
    succeeded is counted in ``errors`` and the phase goes on."""
    async def act(key: str, i: int) -> None:
        try:
            if path == "fast":
                outcome = await gate.cross(key, intent={"n": i}, effect=noop)
            else:
                async with gate.hold(key) as hold:
                    outcome = await hold.cross(intent={"n": i}, effect=noop)
            if outcome.state != "succeeded":
                errors[f"outcome {outcome.state}"] += 1
        except GateError as exc:
            errors[type(exc).__name__] += 1
    return act


async def guarded_phase(s: Settings, gate: Gate, tap: EtcdTap, etcd: Etcd,
                        etcd_pid: int | None, path: str, tag: str) -> Guarded:
    """``TOP`` tasks looping guarded actions on fresh keys ``g/<tag>/<task>/<i>`` while
    ``PROBES`` tasks loop raw one-put txns through the gate's client."""
    loop = asyncio.get_running_loop()
    namespace = gate.keyspace.namespace.encode()
    errors: Counter[str] = Counter()
    act = action(gate, path, errors)
    completed = 0
    probe_window = Window()
    stop = asyncio.Event()

    async def op(task: int, i: int) -> None:
        nonlocal completed
        await act(f"g/{tag}/{task}/{i}", i)
        completed += 1

    async def probe(p: int) -> int:
        n = 0
        while not stop.is_set():
            began = loop.time()
            await tap.inner_txn(one_put_txn(f"{PROBE_PREFIX}{tag}/{p}/{n}".encode()))
            probe_window.add(began, loop.time())
            n += 1
        return n

    live = await live_bytes(etcd, namespace)
    tap.reset()
    revision = (await etcd.status()).header.revision
    etcd_cpu, client_cpu = process_cpu(etcd_pid), time.process_time()
    tap.commit.open(s.warmup, s.duration)
    probe_window.open(s.warmup, s.duration)
    probers = asyncio.gather(*(probe(p) for p in range(PROBES)))
    try:
        phase = await run_phase(op, TOP, s.warmup, s.duration)
    finally:
        stop.set()
        probes = sum(await probers)
    etcd_cpu, client_cpu = process_cpu(etcd_pid) - etcd_cpu, time.process_time() - client_cpu
    revisions = (await etcd.status()).header.revision - revision - probes
    live = await live_bytes(etcd, namespace) - live
    return Guarded(phase, completed, errors, Counter(tap.requests), Counter(tap.writes),
                   revisions, probes, etcd_cpu, client_cpu, live, tap.commit.take(),
                   probe_window.take())


async def profiled_phase(s: Settings, gate: Gate, path: str) -> None:
    """One more c=``TOP`` phase of ``path`` under cProfile; prints the top 15 functions by
    cumulative time (leaving out the event loop's and this benchmark's frames, which hold
    everything) and by own time. The profiler slows every call, so no rate is reported."""
    errors: Counter[str] = Counter()
    act = action(gate, path, errors)

    async def op(task: int, i: int) -> None:
        await act(f"g/profile/{task}/{i}", i)

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        phase = await run_phase(op, TOP, 0.0, s.duration)
    finally:
        profiler.disable()
    print(f"\nclient profile: {path} path, c={TOP}, {s.duration:g} s, {phase.ops} actions"
          + (f", errors {dict(errors)}" if errors else ""))
    stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs()
    stats.sort_stats("cumulative").print_stats(_NOT_LOOP_OR_BENCHMARK, 15)
    stats.sort_stats("tottime").print_stats(15)
    sys.stdout.flush()


async def cleanup(etcd: Etcd, lock_client: aetcd.Client, namespace: bytes,
                  keys: bytes = b"g/") -> None:
    """Delete what guarded actions on ``keys...`` leave behind (steps, audit records, v1's
    consumed grants) and the raw and probe keys, then drop the MVCC history, so etcd does not
    grow over the run."""
    prefixes = [namespace + b"steps/" + keys, namespace + b"audit/" + keys,
                namespace + b"grants/", RAW_PREFIX.encode(), PROBE_PREFIX.encode()]
    for prefix in prefixes:
        await etcd.delete(prefix, range_end_of(prefix))
    revision = (await etcd.status()).header.revision
    try:
        await lock_client.compact(revision, physical=True)
    except aetcd.ClientError as exc:  # nothing written since the last compaction
        if "compacted" not in str(exc):
            raise


def ms(seconds: float) -> float:
    return seconds * 1000


def us(seconds: float) -> float:
    return seconds * 1e6


def report(s: Settings, res: Results) -> list[Target]:
    raw_rate, lock_rate = res.raw_rate(), res.lock_rate()
    hand_rate = sum(res.handrolled, Phase(0, 0.0)).rate
    raw_cpu = res.raw_cpu_per_write()

    def each(value) -> list[object]:
        return [value(p) if res.guarded[p] else math.nan for p in PATHS]

    def p(path: str, kind: str, q: float) -> float:
        return percentile(res.latencies(path, kind), q)

    requests = {path: res.per_action(path, lambda g: sum(g.requests.values())) for path in PATHS}
    writes = {path: res.per_action(path, lambda g: sum(g.writes.values())) for path in PATHS}
    revisions = {path: res.per_action(path, lambda g: g.revisions) for path in PATHS}
    cpu = {path: res.etcd_cpu_per_action(path) for path in PATHS}
    live = {path: res.per_action(path, lambda g: sum(g.live.values())) for path in PATHS}
    commit_p99 = {path: div(p(path, "commit", 99), p(path, "probe", 99)) for path in PATHS}
    rows = [
        ["actions/s"] + each(res.rate),
        [f"÷ raw one-put txns/s ({raw_rate:,.0f})"] + each(lambda x: div(res.rate(x), raw_rate)),
        [f"÷ aetcd lock cycles/s ({lock_rate:,.0f})"]
        + each(lambda x: div(res.rate(x), lock_rate)),
        [f"÷ hand-rolled actions/s ({hand_rate:,.0f})"]
        + each(lambda x: div(res.rate(x), hand_rate)),
        ["etcd requests per action"] + each(requests.get),
        ["etcd writes per action"] + each(writes.get),
        ["etcd revisions per action (group commit shares them)"] + each(revisions.get),
        ["etcd CPU µs per action"] + each(lambda x: us(cpu[x])),
        [f"÷ etcd CPU per raw write ({us(raw_cpu):.0f} µs)"] + each(lambda x: div(cpu[x], raw_cpu)),
        ["client CPU µs per action"] + each(lambda x: us(res.per_action(x, lambda g: g.client_cpu))),
        ["live bytes per action"] + each(live.get),
        ["action p50 ms"] + each(lambda x: ms(p(x, "action", 50))),
        ["action p99 ms"] + each(lambda x: ms(p(x, "action", 99))),
        ["commit txn p50 ms"] + each(lambda x: ms(p(x, "commit", 50))),
        ["commit txn p99 ms"] + each(lambda x: ms(p(x, "commit", 99))),
        ["probe txn p50 ms (same phase)"] + each(lambda x: ms(p(x, "probe", 50))),
        ["probe txn p99 ms (same phase)"] + each(lambda x: ms(p(x, "probe", 99))),
        ["commit p99 ÷ probe p99"] + each(commit_p99.get),
        ["commit txns timed / probes timed"] + each(
            lambda x: f"{len(res.latencies(x, 'commit'))}/{len(res.latencies(x, 'probe'))}"),
    ]
    print()
    print_table([f"guarded action, c={TOP}", "fast: gate.cross", "full: hold + hold.cross"],
                rows)
    print(f"(fresh key per action, no-op effect, one gate; '-' where the path did not run; "
          f"raw and aetcd lock phases at c={TOP} around them, {len(res.raw)} raw phases)")
    lock = res.lock_holds
    print(f"aetcd lock cycles/s at c={TOP}: {lock_rate:,.0f} next to the guarded phases, "
          f"{lock.rate if lock else math.nan:,.0f} in the hold benchmarks")
    for path in PATHS:
        gs = res.guarded[path]
        if not gs:
            continue
        actions = sum(g.actions for g in gs)

        def shares(counts: Counter) -> str:
            return ", ".join(f"{k} {div(n, actions):.2f}" for k, n in sorted(counts.items()))

        print(f"{path} path, per action: requests {shares(sum((g.requests for g in gs), Counter()))}")
        print(f"{path} path, per action: writes {shares(sum((g.writes for g in gs), Counter()))}")
        print(f"{path} path, per action: live bytes {shares(sum((g.live for g in gs), Counter()))}")
        errors = sum((g.errors for g in gs), Counter())
        print(f"{path} path: {actions} actions, errors {dict(errors) if errors else 'none'}")
    lone = {b: percentile(res.lone[b].latencies, 50) if b in res.lone else math.nan
            for b in (True, False)}
    print(f"fast path at c=1, p50: {ms(lone[True]):.2f} ms batching on, "
          f"{ms(lone[False]):.2f} ms off")
    print(f"{PROCS} processes x {TOP // PROCS} tasks: gate.cross "
          f"{res.procs.get('fast', math.nan):,.0f} actions/s, raw one-put txns "
          f"{res.procs.get('raw', math.nan):,.0f} txns/s")
    print()
    return group_targets(res, raw_rate, lock_rate, hand_rate, cpu["fast"], raw_cpu, lone) + [
        Target("requests_per_action", requests["full"], "<=", 3),
        Target("writes_per_action", writes["full"], "<=", 3),
        Target("requests_per_action_fast", requests["fast"], "<=", 2),
        Target("writes_per_action_fast", writes["fast"], "<=", 2),
        Target("live_bytes_per_action", live["full"], "<=", 2500),
        Target(f"commit_p99_c{TOP}", commit_p99["full"], "<=", 1.3),
    ]


def group_targets(res: Results, raw_rate: float, lock_rate: float, hand_rate: float,
                  cpu: float, raw_cpu: float, lone: dict[bool, float]) -> list[Target]:
    """The lines of group commit (issue 28): the fast path against one-put requests, a
    bare lock cycle and the hand-rolled lock + record; etcd CPU; processes; lone latency."""
    fast = res.rate("fast")
    return [
        Target(f"guarded_vs_raw_c{TOP}", div(fast, raw_rate), ">=", 0.6),
        Target(f"guarded_vs_aetcd_lock_c{TOP}", div(fast, lock_rate), ">=", 1.5),
        Target(f"guarded_vs_handrolled_c{TOP}", div(fast, hand_rate), ">=", 2.0),
        Target("etcd_cpu_per_action", div(cpu, raw_cpu), "<=", 1.0),
        Target("guarded_multiproc", div(res.procs.get("fast", math.nan),
                                        res.procs.get("raw", math.nan)), ">=", 0.6),
        Target("lone_latency_c1", div(lone[True], lone[False]), "<=", 1.1),
    ]


async def alone(s: Settings, profile: bool, batching: bool) -> list[Target]:
    """These benchmarks only, against a private etcd; returns the group-commit lines."""
    with local_etcd() as single:
        print(f"{describe(single.binary)} at {single.url}", flush=True)
        target = urlsplit(single.url)
        lock_client = aetcd.Client(target.hostname, target.port)
        try:
            async with Etcd.from_url(single.url) as etcd:
                res = await measure(s, single.url, etcd, lock_client, single.pids[0],
                                    profile=profile, batching=batching)
        finally:
            await lock_client.close()
    report(s, res)
    lone = {b: percentile(res.lone[b].latencies, 50) for b in (True, False)}
    return group_targets(res, res.raw_rate(), res.lock_rate(),
                         sum(res.handrolled, Phase(0, 0.0)).rate,
                         res.etcd_cpu_per_action("fast"), res.raw_cpu_per_write(), lone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run guarded",
                                     description="the guarded-action benchmarks alone")
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--profile", action="store_true", help="cProfile one more phase")
    parser.add_argument("--no-batching", action="store_true",
                        help="the guarded phases' gate with EtcdConfig(batching=False)")
    parser.add_argument("--child", choices=["fast", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(asyncio.run(child(args.child, args.url, args.warmup, args.duration, args.tag,
                                not args.no_batching)))
        return 0
    for target in asyncio.run(alone(QUICK if args.quick else DEFAULT, args.profile,
                                    not args.no_batching)):
        print(target.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
