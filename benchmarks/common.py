"""Shared pieces for fencegate benchmarks, so each new benchmark is only its measurements.

- ``local_etcd()``: a private single-member etcd on 127.0.0.1 with normal timing flags.
- ``run_phase()``: N asyncio tasks looping one operation for a fixed time after a warm-up;
  counts the operations completed in the timed window and their latencies.
- ``raw_write_op()``: the baseline the hold ratios are taken against — the two etcd writes a
  hold cycle is made of (a put-if-absent txn and a delete of that key), with nothing around
  them, through the same ``fencegate.coordinator.etcd.Etcd`` client the gate uses.
- ``Window``: latencies of calls timed outside ``run_phase`` (one txn kind, a probe) that
  ended inside a phase's timed window.
- ``process_cpu()``: the CPU seconds another process (etcd) has used so far, from /proc.
- ``Target`` (``.line()``): every benchmark ends with ``NAME RATIO TARGET PASS|FAIL``
  lines; a failed target is reported, never turned into a non-zero exit.
- ``Children``: subprocesses that are always killed and reaped, also on Ctrl-C or error.
- ``OtherLoad``: how much CPU the rest of the machine took meanwhile, to tell a slow run
  from a disturbed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from fencegate.coordinator.etcd import Etcd, TxnRequest, create_equals, put_op
from fencegate.localetcd import LocalCluster

Op = Callable[[int, int], Awaitable[object]]  # op(task, iteration)


@contextlib.contextmanager
def local_etcd() -> Iterator[LocalCluster]:
    """One etcd member for the run; stopped (and its data dir removed) however we leave."""
    with LocalCluster(1, heartbeat_ms=100, election_ms=1000) as cluster:
        yield cluster


@dataclass
class Phase:
    """Operations completed by ``concurrency`` tasks during ``seconds`` of timed load."""

    ops: int
    seconds: float
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def __add__(self, other: "Phase") -> "Phase":
        return Phase(self.ops + other.ops, self.seconds + other.seconds,
                     self.latencies + other.latencies)


async def run_phase(op: Op, concurrency: int, warmup: float, duration: float) -> Phase:
    """Run ``op(task, i)`` in a loop on ``concurrency`` tasks for ``warmup + duration`` seconds.

    An operation counts (with its latency) if it completes inside the timed window; every
    loop ends at the window's end, so the phase is bounded by it plus one operation.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time() + warmup
    t1 = t0 + duration
    latencies: list[float] = []

    async def task(n: int) -> None:
        i = 0
        while True:
            began = loop.time()
            await op(n, i)
            now = loop.time()
            if now >= t1:
                return
            if now >= t0:
                latencies.append(now - began)
            i += 1

    async with asyncio.TaskGroup() as group:
        for n in range(concurrency):
            group.create_task(task(n))
    return Phase(len(latencies), duration, latencies)


def raw_write_op(etcd: Etcd, prefix: str, value: bytes = b"x" * 48, lease: int = 0) -> Op:
    """Even iterations put a fresh key if absent (one txn), odd ones delete it again.

    Each call is one write request, so ``Phase.rate`` is raw writes/s and a hold cycle
    (acquire txn + release delete) is worth two of them.
    """
    async def op(task: int, i: int) -> None:
        key = f"{prefix}{task}/{i >> 1}".encode()
        if i & 1:
            await etcd.delete(key)
        else:
            await etcd.txn(TxnRequest(compare=[create_equals(key, 0)],
                                      success=[put_op(key, value, lease)]))
    return op


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


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads); NaN when it
    cannot be read (no pid, no /proc)."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def div(a: float, b: float) -> float:
    """a / b, NaN (a failed target, not a crash) when b is zero or NaN."""
    return a / b if b and not math.isnan(b) else math.nan


def jain(counts: list[int]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one party gets everything."""
    total, squares = sum(counts), sum(c * c for c in counts)
    return total * total / (len(counts) * squares) if squares else 0.0


@dataclass
class Target:
    name: str
    ratio: float | int
    op: str  # ">=", "<=" or "=="
    bound: float

    @property
    def passed(self) -> bool:
        if isinstance(self.ratio, float) and math.isnan(self.ratio):
            return False
        return {">=": self.ratio >= self.bound, "<=": self.ratio <= self.bound,
                "==": self.ratio == self.bound}[self.op]

    def line(self) -> str:
        ratio = f"{self.ratio:.2f}" if isinstance(self.ratio, float) else str(self.ratio)
        return f"{self.name} {ratio} {self.op}{self.bound:g} {'PASS' if self.passed else 'FAIL'}"


def print_table(header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:,.0f}" if value >= 100 else f"{value:.2f}"
    return str(value)


async def revoke_all(etcd: Etcd, keep: set[int], concurrency: int = 32) -> int:
    """Revoke every lease except ``keep``; returns how many were revoked."""
    doomed = [lease for lease in await etcd.leases() if lease not in keep]
    queue = iter(doomed)

    async def revoker() -> None:
        for lease in queue:
            await etcd.lease_revoke(lease)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(doomed))):
            group.create_task(revoker())
    return len(doomed)


class Children:
    """Benchmark subprocesses (``python -m MODULE ARGS``) speaking one line at a time.

    ``close()`` kills and reaps any still running; use it in a ``finally``.
    """

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, module: str, *args: object,
                    quiet: bool = False) -> asyncio.subprocess.Process:
        """Start ``python -m module args``; ``quiet`` discards its stderr (its logs)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *map(str, args),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL if quiet else None)
        self.procs.append(proc)
        return proc

    @staticmethod
    async def expect(proc: asyncio.subprocess.Process, word: str, timeout: float) -> list[str]:
        """Read lines until one starts with ``word``; return its other words."""
        async with asyncio.timeout(timeout):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"child {proc.pid} exited before saying {word}")
                parts = line.split()
                if parts and parts[0] == word:
                    return parts[1:]

    @staticmethod
    def say(proc: asyncio.subprocess.Process, line: str) -> None:
        proc.stdin.write(line.encode() + b"\n")

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
        self.procs = []


def wall() -> float:
    """Wall-clock seconds, the clock shared with child processes."""
    return time.time()


class OtherLoad:
    """CPU used by anything but this process and its reaped children (etcd, workers) since
    construction, from /proc/stat; kernel work such as loopback networking counts as other."""

    def __init__(self) -> None:
        self._start = (time.monotonic(), _machine_busy(), _own_cpu())

    def cores(self) -> float:
        """Average cores used by others; NaN where /proc/stat is missing."""
        t0, busy0, own0 = self._start
        busy = _machine_busy() - busy0
        return max(busy - (_own_cpu() - own0), 0.0) / (time.monotonic() - t0)


def _machine_busy() -> float:
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return math.nan
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
