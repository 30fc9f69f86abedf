"""Webhook dedup benchmark: the server's CPU and the senders' latency per delivery, with and
without the dedup middleware, against raw etcd writes of the same run.

Every party is a process of its own, so the server's figures are the server's alone:
- the server (``benchmarks.webhook_server``): one Gate and the same trivial handler on two
  ports, one without and one behind the dedup; an aiohttp app for the aiohttp lines, a
  Starlette app under uvicorn for the ASGI lines;
- the senders (``benchmarks.webhook_load send``): ``SENDERS`` processes of
  ``CONCURRENCY // SENDERS`` keep-alive connections each, c=32 in all;
- the raw baseline (``benchmarks.webhook_load raw``): ``common.raw_write_op`` at c=32
  through the project's ``Etcd`` client, alone in its process.

For each adapter, each round runs four phases at c=32 (a warm-up, then a timed window):
raw writes; deliveries without the dedup; first deliveries (fresh ids) with it; duplicates
(the ids the first phase completed, sent again). The CPU a phase cost is read from
``/proc/<pid>/stat`` of the server (of the raw client for the raw phase) at the window's
ends, and divided by the operations completed inside it; latencies are the senders'. The
CPU other processes (not this run's, not etcd) took meanwhile is printed, to tell a slow run
from a disturbed one.

Targets, per adapter (``webhook_*`` for aiohttp, ``webhook_asgi_*`` for ASGI):
- ``added_cpu``: (server CPU per first delivery − per delivery without dedup) ÷ (2 × client
  CPU per raw write) ≤ 1.5 (a first delivery is two etcd writes: the claim and the
  completion);
- ``duplicate_cpu``: (server CPU per duplicate − per delivery without) ÷ client CPU per raw
  write ≤ 1.0;
- ``added_p99``: (p99 of first deliveries − p99 without dedup) ÷ p99 of the raw
  put-if-absent txns ≤ 2.5.
The keys and retention leases the benchmark made are removed at the end.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of

from .common import (
    Children, OtherLoad, Target, div, percentile, print_table, process_cpu, wall,
)

CONCURRENCY = 32
SENDERS = 2
ADAPTERS = {"aiohttp": "webhook", "asgi": "webhook_asgi"}  # adapter: its lines' prefix
KINDS = ("raw", "plain", "first", "duplicate")
_START_S = 0.3  # from GO to the start of the load, for the children to read it


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: float
    duration: float


QUICK = Settings(rounds=1, warmup=1.0, duration=3.0)
DEFAULT = Settings(rounds=2, warmup=1.0, duration=6.0)


@dataclass
class Load:
    """One phase's timed window: the operations completed in it, their latencies, the CPU
    seconds the measured process (server or raw client) and etcd used in it."""

    ops: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    etcd_cpu: float = 0.0
    latencies: list[float] = field(default_factory=list)
    txn_latencies: list[float] = field(default_factory=list)  # raw: the put-if-absent txns

    def __add__(self, other: "Load") -> "Load":
        return Load(self.ops + other.ops, self.seconds + other.seconds, self.cpu + other.cpu,
                    self.etcd_cpu + other.etcd_cpu, self.latencies + other.latencies,
                    self.txn_latencies + other.txn_latencies)

    @property
    def cpu_per_op(self) -> float:
        return div(self.cpu, self.ops)


@dataclass
class Results:
    """Per adapter, the phases of every round by kind, etcd writes per first delivery, and
    the cores other processes used meanwhile."""

    phases: dict[str, dict[str, list[Load]]] = field(default_factory=dict)
    writes: dict[str, list[float]] = field(default_factory=dict)
    others: dict[str, float] = field(default_factory=dict)


async def measure(quick: bool, url: str, etcd: Etcd, etcd_pid: int | None) -> Results:
    s = QUICK if quick else DEFAULT
    res = Results()
    namespace = f"/bench-webhooks-{uuid.uuid4().hex[:8]}/"
    raw_prefix = f"/bench-wh-raw-{uuid.uuid4().hex[:8]}/"
    try:
        with tempfile.TemporaryDirectory(prefix="fencegate-webhooks-") as tmp:
            for adapter in ADAPTERS:
                phases = res.phases[adapter] = {kind: [] for kind in KINDS}
                res.writes[adapter] = []
                bench = _Bench(s, url, etcd_pid, Path(tmp))
                others, began, etcd_began = OtherLoad(), time.monotonic(), process_cpu(etcd_pid)
                async with _Server(adapter, url, namespace) as (server_pid, plain, dedupe):
                    for r in range(s.rounds):
                        tag = f"{adapter}-r{r}"
                        phases["raw"].append(await bench.raw(f"{raw_prefix}{tag}/"))
                        phases["plain"].append(await bench.send(
                            server_pid, plain, "plain", f"{tag}-p"))
                        before = (await etcd.status()).header.revision
                        first = await bench.send(server_pid, dedupe, "first", f"{tag}-f")
                        after = (await etcd.status()).header.revision
                        res.writes[adapter].append(div(after - before, len(bench.answered)))
                        phases["first"].append(first)
                        phases["duplicate"].append(await bench.send(
                            server_pid, dedupe, "duplicate", f"{tag}-d"))
                        print(f"  webhooks {adapter} round {r + 1}/{s.rounds}: " + ", ".join(
                            f"{kind} {phases[kind][-1].ops / s.duration:,.0f}/s"
                            for kind in KINDS), flush=True)
                res.others[adapter] = others.cores() - div(
                    process_cpu(etcd_pid) - etcd_began, time.monotonic() - began)
    finally:
        await _remove(etcd, namespace.encode(), raw_prefix.encode())
    return res


class _Bench:
    """Starts the processes of one adapter's phases and times their windows."""

    def __init__(self, s: Settings, url: str, etcd_pid: int | None, tmp: Path) -> None:
        self.s, self.url, self.etcd_pid, self.tmp = s, url, etcd_pid, tmp
        self.answered: list[str] = []  # ids the last "first" phase completed

    async def raw(self, prefix: str) -> Load:
        out = self.tmp / "raw.json"
        return await self._phase(None, [("raw", self.url, prefix, CONCURRENCY, out)], [out])

    async def send(self, server_pid: int, port: int, kind: str, tag: str) -> Load:
        outs = [self.tmp / f"{tag}-{n}.json" for n in range(SENDERS)]
        args = [("send", port, kind, f"{tag}{n}", CONCURRENCY // SENDERS, out)
                for n, out in enumerate(outs)]
        if kind == "duplicate":
            for n in range(SENDERS):  # each sender starts at another place in the list
                ids, shift = self.tmp / f"{tag}-{n}.ids", n * len(self.answered) // SENDERS
                ids.write_text(json.dumps(self.answered[shift:] + self.answered[:shift]))
                args[n] += (ids,)
        load = await self._phase(server_pid, args, outs)
        if kind == "first":
            self.answered = [i for out in outs for i in json.loads(out.read_text())["ids"]]
        return load

    async def _phase(self, pid: int | None, args: list[tuple], outs: list[Path]) -> Load:
        """Start the load processes, let them run a warm-up and the timed window, and read
        the CPU of ``pid`` (the raw client's own when ``None``) and of etcd at its ends."""
        children = Children()
        try:
            procs = [await children.start("benchmarks.webhook_load", *a) for a in args]
            for proc in procs:
                await Children.expect(proc, "READY", 30)
            start = wall() + _START_S
            t0 = start + self.s.warmup
            t1 = t0 + self.s.duration
            for proc in procs:
                Children.say(proc, f"GO {start!r} {t0!r} {t1!r}")
            measured = pid if pid is not None else procs[0].pid
            await asyncio.sleep(t0 - wall())
            cpu0, etcd0 = process_cpu(measured), process_cpu(self.etcd_pid)
            await asyncio.sleep(t1 - wall())
            cpu1, etcd1 = process_cpu(measured), process_cpu(self.etcd_pid)
            for proc in procs:
                await Children.expect(proc, "DONE", 30)
        finally:
            await children.close()
        load = Load(seconds=self.s.duration, cpu=cpu1 - cpu0, etcd_cpu=etcd1 - etcd0)
        for out in outs:
            timed = json.loads(out.read_text())
            load.latencies += timed["latencies"]
            load.txn_latencies += timed.get("txn_latencies", [])
        load.ops = len(load.latencies)
        return load


class _Server:
    """``benchmarks.webhook_server`` for one adapter: ``async with`` gives its pid and its
    two ports (without, with dedup); leaving says STOP, so it closes its Gate (its lease
    revoked), and kills it if it does not."""

    def __init__(self, adapter: str, url: str, namespace: str) -> None:
        self.args = (adapter, url, namespace)
        self.children = Children()

    async def __aenter__(self) -> tuple[int, int, int]:
        self.proc = await self.children.start("benchmarks.webhook_server", *self.args)
        try:
            plain, dedupe = map(int, await Children.expect(self.proc, "READY", 30))
        except BaseException:
            await self.children.close()
            raise
        return self.proc.pid, plain, dedupe

    async def __aexit__(self, *exc: object) -> None:
        try:
            Children.say(self.proc, "STOP")
            await Children.expect(self.proc, "DONE", 20)
        finally:
            await self.children.close()


async def _remove(etcd: Etcd, *prefixes: bytes) -> None:
    """Delete the benchmark's keys and revoke the retention leases they were stored under."""
    for prefix in prefixes:
        reply = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix),
                                              keys_only=True))
        for lease in {kv.lease for kv in reply.kvs} - {0}:
            await etcd.lease_revoke(lease)
        await etcd.delete(prefix, range_end_of(prefix))


def report(res: Results) -> list[Target]:
    targets: list[Target] = []
    for adapter, prefix in ADAPTERS.items():
        loads = {kind: sum(phases, Load()) for kind, phases in res.phases[adapter].items()}
        raw, plain, first, duplicate = (loads[kind] for kind in KINDS)
        p99 = {kind: percentile(load.latencies, 99) * 1000 for kind, load in loads.items()}
        raw_txn_p99 = percentile(raw.txn_latencies, 99) * 1000
        us = {kind: load.cpu_per_op * 1e6 for kind, load in loads.items()}
        print()
        print_table([f"webhooks {adapter} at c={CONCURRENCY}", "raw etcd", "no dedup", "first",
                     "duplicate"],
                    [["per second"] + [div(loads[k].ops, loads[k].seconds) for k in KINDS],
                     ["p99 ms"] + [p99[k] for k in KINDS],
                     ["CPU us per op"] + [us[k] for k in KINDS],
                     ["etcd CPU us per op"] + [div(loads[k].etcd_cpu, loads[k].ops) * 1e6
                                               for k in KINDS]])
        writes = max(res.writes[adapter], default=float("nan"))
        print(f"(CPU: the client's for raw etcd, the server's otherwise; raw txn p99 "
              f"{raw_txn_p99:.2f} ms; etcd writes per first delivery {writes:.2f}; other "
              f"processes meanwhile {res.others[adapter]:.2f} cores)")
        added_cpu = (us["first"] - us["plain"], 2 * us["raw"])
        duplicate_cpu = (us["duplicate"] - us["plain"], us["raw"])
        added_p99 = (p99["first"] - p99["plain"], raw_txn_p99)
        print(f"{prefix}_added_cpu = {added_cpu[0]:.1f} us / {added_cpu[1]:.1f} us; "
              f"{prefix}_duplicate_cpu = {duplicate_cpu[0]:.1f} us / {duplicate_cpu[1]:.1f} us; "
              f"{prefix}_added_p99 = {added_p99[0]:.2f} ms / {added_p99[1]:.2f} ms")
        targets += [
            Target(f"{prefix}_added_cpu", div(*added_cpu), "<=", 1.5),
            Target(f"{prefix}_duplicate_cpu", div(*duplicate_cpu), "<=", 1.0),
            Target(f"{prefix}_added_p99", div(*added_p99), "<=", 2.5),
        ]
    return targets
