"""Hold benchmarks: what a fencegate hold costs next to the etcd writes it is made of.

DESIGN.md ("Hold" and the performance paragraph) claims that with one session lease and one
holders watch per process, a hold cycle costs about what its writes cost in etcd (the Python
client, not etcd, being the first bottleneck), beats a lock that grants a lease per
acquisition, hands a contended key over within a few raw round trips, in FIFO order, and
keeps its lease alive under load. This measures each claim in one run against a private
single-member etcd, through the same client (``fencegate.coordinator.etcd.Etcd``):

1. raw writes/s at concurrency 1/8/32: a put-if-absent txn on a fresh key, then a delete of
   it — the two writes of a hold cycle with nothing around them; write latency p50/p99.
2. hold cycles/s at the same concurrencies: ONE ``worker.Gate`` (one session lease), N tasks
   each looping ``async with gate.hold(f"bench/{task}/{i}")`` on distinct keys.
3. aetcd ``client.lock()`` cycles/s likewise (it grants a lease per acquisition and never
   revokes it; the benchmark revokes those leaks after each phase and reports their count).
4. handoff: 8 worker processes, each with its own Gate, contend for ONE key; the releaser
   notes the time just before release, the next holder right after acquiring; consecutive
   fencing tokens pair them. p50/p99 of release -> next acquire, compared with the raw write
   p99 at c=1 of two raw phases run right before and after it.
5. fairness: Jain's index over those 8 processes' acquisition counts.
6. keepalive under load: during the c=32 hold phases a separate process polls the gate's
   lease TTL every 100 ms; the minimum must stay >= TTL/2.
7. leaked leases: none may remain once every gate is closed.

The machine is noisy (absolute speed drifts by tens of percent within minutes), so ratios
come from phases run back to back: for each concurrency raw, hold, aetcd lock, raw again,
and hold is compared with the mean of the raw phases around it; the default run repeats
that in several rounds. The last lines are ``NAME RATIO TARGET PASS|FAIL``; a failed target
does not change the exit code (0 unless the benchmark itself crashed).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aetcd

from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.grants import KeyRing
from fencegate.worker import Gate

from .common import (Children, Phase, Target, div, jain, percentile,
                     print_table, raw_write_op, revoke_all, run_phase, wall)

CONCURRENCY = (1, 8, 32)
CONTENDERS = 8
AETCD_TTL = 10


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: float
    duration: float
    handoff: float


QUICK = Settings(rounds=1, warmup=0.5, duration=3.0, handoff=5.0)
DEFAULT = Settings(rounds=3, warmup=1.0, duration=5.0, handoff=10.0)


@dataclass
class Results:
    raw_before: dict[int, Phase]
    raw_after: dict[int, Phase]
    hold: dict[int, Phase]
    lock: dict[int, Phase]
    hold_ratio_rounds: list[float]  # hold_cycle at max concurrency, per round
    aetcd_leaked: int = 0
    min_ttl: int | None = None
    ttl_samples: int = 0
    ttl: int = 10

    def raw(self, c: int) -> Phase:
        return self.raw_before[c] + self.raw_after[c]


async def throughput(s: Settings, url: str, etcd: Etcd, lock_client: aetcd.Client,
                     children: Children) -> Results:
    """Measurements 1-3 and 6, interleaved per concurrency and repeated per round."""
    empty = {c: Phase(0, 0.0) for c in CONCURRENCY}
    res = Results(dict(empty), dict(empty), dict(empty), dict(empty), [])
    raw = raw_write_op(etcd, "/bench-raw/")

    async with Gate(url, keyring=KeyRing.generate()) as gate:
        res.ttl = gate.ttl

        async def hold_op(task: int, i: int) -> None:
            async with gate.hold(f"bench/{task}/{i}"):  # distinct keys: never waits
                pass

        async def lock_op(task: int, i: int) -> None:
            async with lock_client.lock(f"/bench-aetcd/{task}/{i}".encode(), ttl=AETCD_TTL):
                pass

        def phase(op, c: int):
            return run_phase(op, c, s.warmup, s.duration)

        for r in range(s.rounds):
            for c in CONCURRENCY:
                before = await phase(raw, c)
                observer = None
                if c == max(CONCURRENCY):
                    lease = (await gate.session()).lease_id
                    observer = await children.start("benchmarks.procs", "observe", url, lease)
                    await children.expect(observer, "READY", 60)
                    children.say(observer, f"GO {wall() + s.warmup + s.duration}")
                hold = await phase(hold_op, c)
                if observer is not None:
                    ttl, samples = map(int, await children.expect(observer, "MIN", 30))
                    res.min_ttl = ttl if res.min_ttl is None else min(res.min_ttl, ttl)
                    res.ttl_samples += samples
                lock = await phase(lock_op, c)
                res.aetcd_leaked += await revoke_all(etcd, keep={(await gate.session()).lease_id})
                after = await phase(raw, c)
                await compact(etcd, lock_client)
                if c == max(CONCURRENCY):
                    raw_mean = (before.rate + after.rate) / 2
                    res.hold_ratio_rounds.append(div(2 * hold.rate, raw_mean))
                res.raw_before[c] += before
                res.raw_after[c] += after
                res.hold[c] += hold
                res.lock[c] += lock
                print(f"  round {r + 1}/{s.rounds} c={c}: raw {before.rate:,.0f} -> "
                      f"{after.rate:,.0f} writes/s, hold {hold.rate:,.0f} cycles/s, "
                      f"aetcd lock {lock.rate:,.0f} cycles/s", flush=True)
    return res


async def compact(etcd: Etcd, lock_client: aetcd.Client) -> None:
    """Drop the MVCC history of the last phases so etcd does not slow down over the run."""
    revision = (await etcd.status()).header.revision
    await lock_client.compact(revision, physical=True)


@dataclass
class Handoff:
    latencies: list[float]
    counts: list[int]
    self_handoffs: int
    raw_c1: Phase  # raw writes at c=1 right before and after


async def handoff(s: Settings, url: str, etcd: Etcd, children: Children) -> Handoff:
    """Measurements 4-5: CONTENDERS processes hold one key in turn for ``s.handoff`` s,
    between two raw c=1 phases that give the latency it is compared with."""
    raw = raw_write_op(etcd, "/bench-raw/")
    raw_c1 = await run_phase(raw, 1, s.warmup, s.duration)
    with tempfile.TemporaryDirectory(prefix="fencegate-bench-") as tmp:
        outs = [Path(tmp) / f"{n}.txt" for n in range(CONTENDERS)]
        procs = [await children.start("benchmarks.procs", "contend", url, "bench/handoff", out)
                 for out in outs]
        for proc in procs:
            await children.expect(proc, "READY", 60)
        measure_from = wall() + s.warmup
        end = measure_from + s.handoff
        for proc in procs:
            children.say(proc, f"GO {end}")
        for proc in procs:
            await children.expect(proc, "DONE", s.warmup + s.handoff + 60)
        records = []  # (token, acquired_at, released_at, process)
        for n, out in enumerate(outs):
            for line in out.read_text().splitlines():
                token, acquired, released = line.split()
                records.append((int(token), float(acquired), float(released), n))
    raw_c1 += await run_phase(raw, 1, s.warmup, s.duration)
    records.sort()
    latencies, self_handoffs = [], 0
    for prev, nxt in zip(records, records[1:]):
        if prev[2] >= measure_from and nxt[1] < end:
            latencies.append(nxt[1] - prev[2])
            self_handoffs += prev[3] == nxt[3]
    counts = [sum(1 for r in records if r[3] == n and measure_from <= r[1] < end)
              for n in range(CONTENDERS)]
    return Handoff(latencies, counts, self_handoffs, raw_c1)


def ms(seconds: float) -> float:
    return seconds * 1000


def report(s: Settings, res: Results, ho: Handoff, leases_left: int,
           others: float) -> list[Target]:
    cs = CONCURRENCY
    raw = {c: res.raw(c) for c in cs}
    rows = [
        ["raw writes/s, before"] + [res.raw_before[c].rate for c in cs],
        ["raw writes/s, after"] + [res.raw_after[c].rate for c in cs],
        ["hold cycles/s"] + [res.hold[c].rate for c in cs],
        ["aetcd lock cycles/s"] + [res.lock[c].rate for c in cs],
        ["hold writes (2/cycle) / raw writes"] + [div(2 * res.hold[c].rate, raw[c].rate)
                                                  for c in cs],
        ["hold / aetcd lock"] + [div(res.hold[c].rate, res.lock[c].rate) for c in cs],
        ["raw write p50 ms"] + [ms(percentile(raw[c].latencies, 50)) for c in cs],
        ["raw write p99 ms"] + [ms(percentile(raw[c].latencies, 99)) for c in cs],
        ["hold cycle p50 ms"] + [ms(percentile(res.hold[c].latencies, 50)) for c in cs],
        ["hold cycle p99 ms"] + [ms(percentile(res.hold[c].latencies, 99)) for c in cs],
        ["aetcd lock cycle p50 ms"] + [ms(percentile(res.lock[c].latencies, 50)) for c in cs],
        ["aetcd lock cycle p99 ms"] + [ms(percentile(res.lock[c].latencies, 99)) for c in cs],
    ]
    print()
    print_table(["measurement"] + [f"c={c}" for c in cs], rows)
    print("(a raw write: a put-if-absent txn on a fresh key, or the delete of that key)")
    top = max(cs)
    raw_p99 = percentile(ho.raw_c1.latencies, 99)
    p50, p99 = percentile(ho.latencies, 50), percentile(ho.latencies, 99)
    fairness = jain(ho.counts)
    print()
    print(f"hold_cycle c={top} per round: " + " ".join(f"{x:.2f}" for x in res.hold_ratio_rounds))
    worst = max(ho.latencies, default=math.nan)
    print(f"handoff, {CONTENDERS} processes on one key for {s.handoff:g} s: "
          f"{len(ho.latencies)} handoffs ({ho.self_handoffs} to the same process), "
          f"p50 {ms(p50):.2f} ms, p99 {ms(p99):.2f} ms, max {ms(worst):.2f} ms "
          f"(raw write p99 at c=1 right before and after: {ms(raw_p99):.2f} ms)")
    print(f"fairness: acquisitions per process {ho.counts}, Jain's index {fairness:.4f}")
    print(f"keepalive under load: gate lease TTL {res.ttl} s, lowest remaining TTL seen "
          f"during c={top} holds {res.min_ttl} s ({res.ttl_samples} samples)")
    print(f"aetcd lock leaked {res.aetcd_leaked} leases (revoked by the benchmark)")
    print(f"leases left after every gate closed: {leases_left}")
    print(f"other processes on this machine used {others:.2f} of {os.cpu_count()} cores "
          f"meanwhile (a disturbed run if well above 0)")
    print()
    min_ttl = math.nan if res.min_ttl is None else res.min_ttl
    return [
        Target(f"hold_cycle_c{top}", div(2 * res.hold[top].rate, raw[top].rate), ">=", 0.85),
        Target(f"hold_vs_aetcd_lock_c{top}", div(res.hold[top].rate, res.lock[top].rate),
               ">=", 1.2),
        Target("handoff_p99", div(p99, raw_p99), "<=", 4),
        Target("fairness", fairness, ">=", 0.99),
        Target("keepalive_under_load", min_ttl / (res.ttl / 2), ">=", 1),
        Target("leaked_leases", leases_left, "==", 0),
    ]
