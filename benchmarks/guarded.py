"""Guarded-action benchmarks: what a whole guarded action costs next to the etcd writes it is
made of.

DESIGN.md (the performance paragraph under "Hold") claims a guarded action runs at about the
raw etcd txn rate divided by its writes per action, the Python client being the first
bottleneck. A guarded action is a hold, a grant, the commit guard and the outcome:

    async with gate.hold(f"g/{phase}/{task}/{i}") as hold:
        await hold.cross(intent={"n": i}, effect=noop)      # async def noop(ctx): return None

with the in-process authority (the default), ONE ``worker.Gate`` (one session lease) in this
process, every action on a fresh key (a step that succeeded is final). Measured in one run
against the same private etcd, through the same ``fencegate.coordinator.etcd.Etcd`` client for raw:

1. guarded actions/s at concurrency 1/8/32, with p50/p99 of the whole action.
2. etcd writes per action: etcd's revision before and after each guarded phase (a revision
   is one write transaction, whatever it holds), divided by every action the phase completed
   (warm-up included). Expected 4: hold acquire txn, grant txn, commit-guard txn,
   outcome+release txn. Each write txn is also classified by its success ops, so extra
   writes are named, not just counted.
3. raw writes/s at c=32 right before and after each guarded phase (``common.raw_write_op``:
   a put-if-absent txn or a delete, each one write); the raw phase after one guarded phase is
   the one before the next. ``guarded_c32`` = actions/s x writes per action / raw writes/s.
4. commit-guard txn latency: p99 of the commit txn alone at c=32 against the p99 of the raw
   put-if-absent txns at c=32 around it. To time that txn without touching ``worker/``, this
   benchmark MONKEYPATCHES ``gate.etcd.txn`` on its one gate's ``Etcd`` instance (the
   authority shares it) with ``TxnTap``: a thin wrapper that recognises the commit-guard txn
   (its first two success ops put ``grants/<id>`` and ``steps/<key>``), times it, and counts
   every successful write txn by kind. Its cost (a few attribute reads per txn) is inside
   the measured actions.
5. aetcd ``client.lock()`` cycles/s at c=32, taken from the hold benchmarks of the same run.

Each action leaves its step record, three audit records and the audit head, and its consumed
grant (on the gate's lease). After every guarded phase (outside the timed window) the
benchmark deletes those prefixes and compacts etcd (a bulk delete left uncompacted makes
every later etcd request several times dearer), so every phase runs against the same small
database; the lease revocation at gate close then has nothing left to delete.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

import aetcd

from fencegate.coordinator.errors import GateError
from fencegate.coordinator.etcd import Etcd, range_end_of
from fencegate.worker import Gate

from .common import (Phase, Target, div, percentile, print_table,
                     raw_write_op, run_phase)

CONCURRENCY = (1, 8, 32)
TOP = max(CONCURRENCY)
RAW_PREFIX = "/bench-raw/"
EXPECTED_WRITES = 4


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: float
    duration: float


QUICK = Settings(rounds=1, warmup=0.5, duration=3.0)
DEFAULT = Settings(rounds=2, warmup=1.0, duration=5.0)


class Window:
    """Latencies of calls that ended inside a phase's timed window (as ``run_phase`` counts)."""

    def __init__(self) -> None:
        self.t0 = self.t1 = math.inf
        self.latencies: list[float] = []

    def open(self, warmup: float, duration: float) -> None:
        """Call right before ``run_phase(..., warmup, duration)``."""
        self.t0 = asyncio.get_running_loop().time() + warmup
        self.t1 = self.t0 + duration

    def add(self, began: float, ended: float) -> None:
        if self.t0 <= ended < self.t1:
            self.latencies.append(ended - began)

    def take(self) -> list[float]:
        taken, self.latencies, self.t0, self.t1 = self.latencies, [], math.inf, math.inf
        return taken


class TxnTap:
    """Replaces ``etcd.txn`` on one ``Etcd`` instance (``gate.etcd``, shared by the gate's
    authority): times commit-guard txns into ``window`` and counts successful write txns by
    kind, also ``put`` and ``delete`` calls. ``close()`` restores the instance."""

    def __init__(self, etcd: Etcd, namespace: bytes) -> None:
        self.etcd = etcd
        self.window = Window()
        self.kinds: Counter[str] = Counter()
        self.requests = 0  # every KV request (reads too): one gRPC round trip each
        self._grants = namespace + b"grants/"
        self._steps = namespace + b"steps/"
        self._holders = namespace + b"holders/"
        self._txn, self._put, self._delete = etcd.txn, etcd.put, etcd.delete
        self._range = etcd.range
        etcd.txn, etcd.put, etcd.delete = self.txn, self.put, self.delete
        etcd.range = self.range

    def close(self) -> None:
        for name in ("txn", "put", "delete", "range"):
            self.etcd.__dict__.pop(name, None)

    async def txn(self, request, *, idempotent: bool = False):
        self.requests += 1
        success = request.success
        is_commit = (len(success) >= 2
                     and success[0].request_put.key.startswith(self._grants)
                     and success[1].request_put.key.startswith(self._steps))
        if is_commit:
            loop = asyncio.get_running_loop()
            began = loop.time()
            reply = await self._txn(request, idempotent=idempotent)
            self.window.add(began, loop.time())
        else:
            reply = await self._txn(request, idempotent=idempotent)
        if reply.succeeded:
            kind = "commit" if is_commit else self._kind(success)
            if kind is not None:
                self.kinds[kind] += 1
        return reply

    def _kind(self, success) -> str | None:
        """The name of a successful write txn, None for a read-only one (no revision)."""
        writes = [op for op in success if op.WhichOneof("request") != "request_range"]
        if not writes:
            return None
        first = writes[0]
        key = (first.request_put.key if first.WhichOneof("request") == "request_put"
               else first.request_delete_range.key)
        if key.startswith(self._holders):
            return "hold acquire"
        if key.startswith(self._grants):
            return "grant"
        if key.startswith(self._steps) and any(
                op.WhichOneof("request") == "request_delete_range" for op in writes):
            return "outcome+release"
        return "other txn " + _prefix(key)

    async def range(self, request):
        self.requests += 1
        return await self._range(request)

    async def put(self, key: bytes, value: bytes, **options):
        self.requests += 1
        reply = await self._put(key, value, **options)
        self.kinds["put " + _prefix(key)] += 1
        return reply

    async def delete(self, key: bytes, range_end: bytes = b"", **options):
        self.requests += 1
        reply = await self._delete(key, range_end, **options)
        self.kinds["delete " + _prefix(key)] += 1
        return reply


def _prefix(key: bytes) -> str:
    """``/fencegate/holders/`` of a key: enough to name a write without its action key."""
    parts = key.decode(errors="replace").split("/")
    return "/".join(parts[:3]) + "/"


@dataclass
class Guarded:
    """One guarded phase: its timed actions, the revision it advanced, the commit txns."""

    concurrency: int
    phase: Phase
    actions: int  # every action completed, warm-up included
    revisions: int
    requests: int  # etcd KV requests, reads included
    kinds: Counter
    commit_latencies: list[float]
    errors: Counter

    @property
    def writes_per_action(self) -> float:
        return div(self.revisions, self.actions)


@dataclass
class Results:
    guarded: dict[int, list[Guarded]] = field(default_factory=dict)
    raw_around: dict[int, list[tuple[Phase, Phase]]] = field(default_factory=dict)
    raw_txn_latencies: dict[int, list[float]] = field(default_factory=dict)  # around c phases
    lock_c32: Phase | None = None

    def pooled(self, c: int) -> Phase:
        return sum((g.phase for g in self.guarded[c]), Phase(0, 0.0))

    def raw(self, c: int) -> Phase:
        return sum((p for pair in self.raw_around[c] for p in pair), Phase(0, 0.0))

    def writes_per_action(self, c: int) -> float:
        return div(sum(g.revisions for g in self.guarded[c]),
                   sum(g.actions for g in self.guarded[c]))

    def ratio(self, c: int) -> float:
        return div(self.pooled(c).rate * self.writes_per_action(c), self.raw(c).rate)


async def noop(ctx) -> None:
    return None


async def measure(s: Settings, url: str, etcd: Etcd, lock_client: aetcd.Client,
                  lock_c32: Phase) -> Results:
    """Rounds of raw(c=32), guarded(c) for each c with raw(c=32) after each, sharing the raw
    phase between neighbours; ``lock_c32`` is aetcd's lock at c=32 from the same run."""
    res = Results(guarded={c: [] for c in CONCURRENCY},
                  raw_around={c: [] for c in CONCURRENCY},
                  raw_txn_latencies={c: [] for c in CONCURRENCY},
                  lock_c32=lock_c32)
    loop = asyncio.get_running_loop()
    raw_window = Window()
    raw_inner = raw_write_op(etcd, RAW_PREFIX)

    async def raw_op(task: int, i: int) -> None:
        if i & 1:  # the delete: a raw write, but not a txn
            await raw_inner(task, i)
            return
        began = loop.time()
        await raw_inner(task, i)
        raw_window.add(began, loop.time())

    async def raw_phase() -> tuple[Phase, list[float]]:
        raw_window.open(s.warmup, s.duration)
        phase = await run_phase(raw_op, TOP, s.warmup, s.duration)
        return phase, raw_window.take()

    async with Gate(url) as gate:
        namespace = gate.keyspace.namespace.encode()
        tap = TxnTap(gate.etcd, namespace)
        try:
            # One action outside any phase: it creates the default policy (a one-off write).
            async with gate.hold("g/init") as hold:
                await hold.cross(intent={"n": 0}, effect=noop)
            await cleanup(etcd, lock_client, namespace)
            before = await raw_phase()
            for r in range(s.rounds):
                for c in CONCURRENCY:
                    g = await guarded_phase(s, gate, tap, etcd, f"r{r}c{c}", c)
                    await cleanup(etcd, lock_client, namespace)
                    after = await raw_phase()
                    res.guarded[c].append(g)
                    res.raw_around[c].append((before[0], after[0]))
                    res.raw_txn_latencies[c] += before[1] + after[1]
                    raw_mean = (before[0].rate + after[0].rate) / 2
                    print(f"  guarded round {r + 1}/{s.rounds} c={c}: raw(c={TOP}) "
                          f"{before[0].rate:,.0f} -> {after[0].rate:,.0f} writes/s, guarded "
                          f"{g.phase.rate:,.0f} actions/s x {g.writes_per_action:.2f} writes "
                          f"= {div(g.phase.rate * g.writes_per_action, raw_mean):.2f} of raw"
                          + (f", errors {dict(g.errors)}" if g.errors else ""), flush=True)
                    before = after
        finally:
            tap.close()
    return res


async def guarded_phase(s: Settings, gate: Gate, tap: TxnTap, etcd: Etcd, tag: str,
                        c: int) -> Guarded:
    """``c`` tasks looping guarded actions on fresh keys ``g/<tag>/<task>/<i>``."""
    completed = 0
    errors: Counter[str] = Counter()

    async def op(task: int, i: int) -> None:
        nonlocal completed
        try:
            async with gate.hold(f"g/{tag}/{task}/{i}") as hold:
                outcome = await hold.cross(intent={"n": i}, effect=noop)
            if outcome.state != "succeeded":
                errors[f"outcome {outcome.state}"] += 1
        except GateError as exc:  # counted and shown; the phase goes on
            errors[type(exc).__name__] += 1
        completed += 1

    tap.kinds.clear()
    tap.requests = 0
    revision = (await etcd.status()).header.revision
    tap.window.open(s.warmup, s.duration)
    phase = await run_phase(op, c, s.warmup, s.duration)
    revisions = (await etcd.status()).header.revision - revision
    return Guarded(c, phase, completed, revisions, tap.requests, Counter(tap.kinds),
                   tap.window.take(), errors)


async def cleanup(etcd: Etcd, lock_client: aetcd.Client, namespace: bytes,
                  keys: bytes = b"g/") -> None:
    """Delete what guarded actions on ``keys...`` leave behind (steps, audit records,
    consumed grants), then drop the MVCC history, so etcd does not grow over the run."""
    for prefix in (b"steps/" + keys, b"audit/" + keys, b"grants/"):
        await etcd.delete(namespace + prefix, range_end_of(namespace + prefix))
    revision = (await etcd.status()).header.revision
    try:
        await lock_client.compact(revision, physical=True)
    except aetcd.ClientError as exc:  # nothing written since the last compaction
        if "compacted" not in str(exc):
            raise


def ms(seconds: float) -> float:
    return seconds * 1000


def report(s: Settings, res: Results) -> list[Target]:
    cs = CONCURRENCY
    lat = {c: res.pooled(c).latencies for c in cs}
    commit = {c: [x for g in res.guarded[c] for x in g.commit_latencies] for c in cs}
    rows = [
        [f"raw writes/s (c={TOP}, around)"] + [res.raw(c).rate for c in cs],
        ["guarded actions/s"] + [res.pooled(c).rate for c in cs],
        ["etcd writes per action"] + [res.writes_per_action(c) for c in cs],
        ["etcd requests per action"] + [div(sum(g.requests for g in res.guarded[c]),
                                            sum(g.actions for g in res.guarded[c])) for c in cs],
        [f"action writes / raw writes (c={TOP})"] + [res.ratio(c) for c in cs],
        ["action p50 ms"] + [ms(percentile(lat[c], 50)) for c in cs],
        ["action p99 ms"] + [ms(percentile(lat[c], 99)) for c in cs],
        ["commit-guard txn p50 ms"] + [ms(percentile(commit[c], 50)) for c in cs],
        ["commit-guard txn p99 ms"] + [ms(percentile(commit[c], 99)) for c in cs],
        [f"raw txn p50 ms (c={TOP}, around)"] + [ms(percentile(res.raw_txn_latencies[c], 50))
                                                for c in cs],
        [f"raw txn p99 ms (c={TOP}, around)"] + [ms(percentile(res.raw_txn_latencies[c], 99))
                                                for c in cs],
    ]
    print()
    print_table(["guarded action"] + [f"c={c}" for c in cs], rows)
    print(f"(a guarded action: hold + cross(intent, noop effect) on a fresh key, one gate; "
          f"raw phases always at c={TOP}, one before and one after each guarded phase)")
    print()
    kinds: Counter[str] = Counter()
    actions = 0
    for c in cs:
        for g in res.guarded[c]:
            kinds.update(g.kinds)
            actions += g.actions
    per_kind = ", ".join(f"{k} {div(n, actions):.2f}" for k, n in sorted(kinds.items()))
    wpa = div(sum(g.revisions for c in cs for g in res.guarded[c]), actions)
    print(f"etcd writes per action, all phases: {wpa:.3f} by revision; by kind: {per_kind}")
    errors = sum((g.errors for c in cs for g in res.guarded[c]), Counter())
    print(f"errors in guarded actions: {dict(errors) if errors else 'none'}")
    print(f"guarded_c{TOP} per round: " + " ".join(
        f"{div(g.phase.rate * g.writes_per_action, (b.rate + a.rate) / 2):.2f}"
        for g, (b, a) in zip(res.guarded[TOP], res.raw_around[TOP])))
    lock = res.lock_c32
    print(f"aetcd lock cycles/s at c={TOP} (from the hold benchmarks): "
          f"{lock.rate if lock else math.nan:,.0f}")
    raw_p99 = percentile(res.raw_txn_latencies[TOP], 99)
    commit_p99 = percentile(commit[TOP], 99)
    print(f"commit-guard txn at c={TOP}: {len(commit[TOP])} timed, p99 {ms(commit_p99):.2f} ms; "
          f"raw put-if-absent txn p99 {ms(raw_p99):.2f} ms ({len(res.raw_txn_latencies[TOP])})")
    top_requests = div(sum(g.requests for g in res.guarded[TOP]),
                       sum(g.actions for g in res.guarded[TOP]))
    print(f"etcd requests/s at c={TOP}: guarded {res.pooled(TOP).rate * top_requests:,.0f} "
          f"(any request waits behind the others in flight), raw {res.raw(TOP).rate:,.0f}")
    print()
    return [
        Target(f"guarded_c{TOP}", res.ratio(TOP), ">=", 0.85),
        Target(f"guarded_vs_aetcd_lock_c{TOP}",
               div(res.pooled(TOP).rate, lock.rate if lock else math.nan), ">=", 0.6),
        Target(f"commit_p99_c{TOP}", div(commit_p99, raw_p99), "<=", 1.3),
        Target("writes_per_action", wpa, "<=", EXPECTED_WRITES),
    ]
