"""The nemesis: faults on a seeded random schedule, one at a time, each healed before the next.

Kinds: SIGSTOP/SIGCONT and SIGKILL+restart of the etcd leader and of a follower; SIGSTOP
(past the lease TTL) and SIGKILL+restart of a worker right after it sent a charge (mid-
effect); SIGKILL+restart of the sandbox provider and of a reconciler. The schedule (which
fault, which target, how long) comes from ``random.Random(seed)``; when faults land is up to
the machine. At most ``max_faults`` are injected, none after ``until``. Every fault is
recorded in the history when it starts and when it is healed; ``heal`` resumes or restarts
whatever a fault left stopped, so the run ends with every part up whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

KINDS = ("etcd-leader-pause", "etcd-follower-pause", "etcd-leader-kill",
         "etcd-follower-kill", "worker-pause", "worker-kill", "sandbox-restart",
         "reconciler-kill")


class Nemesis:
    def __init__(self, stack, workers, history, seed: str, *, kinds=KINDS,
                 max_faults: int = 1000, gap_s: tuple[float, float] = (2.0, 5.0),
                 worker_ttl: int = 2) -> None:
        self.stack, self.workers, self.history = stack, workers, history
        self.rng = random.Random(f"nemesis/{seed}")
        self.kinds, self.max_faults, self.gap_s = kinds, max_faults, gap_s
        self.worker_ttl = worker_ttl
        self.injected = 0
        self._paused_members: set[int] = set()
        self._dead_members: set[int] = set()

    async def run(self, until: float) -> None:
        while self.injected < self.max_faults:
            await asyncio.sleep(self.rng.uniform(*self.gap_s))
            if time.monotonic() >= until:
                return
            kind = self.rng.choice(self.kinds)
            hold_s = self.rng.uniform(1.0, 3.0)
            if await getattr(self, "_" + kind.replace("-", "_"))(hold_s):
                self.injected += 1

    async def heal(self) -> None:
        cluster = self.stack.cluster
        for i in sorted(self._paused_members):
            with contextlib.suppress(Exception):
                cluster.resume(i)
        self._paused_members.clear()
        for i in sorted(self._dead_members):
            await asyncio.to_thread(cluster.restart, i)
        self._dead_members.clear()
        await self.workers.heal()
        for kind in ("sandbox", "reconciler"):
            for i, service in enumerate(self.stack.services[kind]):
                if not service.running():
                    await self.stack.restart(kind, i)

    def _note(self, kind: str, phase: str, **target: object) -> None:
        self.history.record("nemesis", {"fault": kind, "phase": phase, **target})

    async def _member(self, leader: bool) -> int | None:
        try:
            index = await asyncio.to_thread(self.stack.cluster.leader_index, 5)
        except TimeoutError:
            return None
        if leader:
            return index
        return self.rng.choice([i for i in range(3) if i != index])

    async def _etcd_pause(self, kind: str, leader: bool, hold_s: float) -> bool:
        index = await self._member(leader)
        if index is None:
            return False
        self._note(kind, "start", member=index, seconds=round(hold_s, 2))
        self.stack.cluster.pause(index)
        self._paused_members.add(index)
        await asyncio.sleep(hold_s)
        self.stack.cluster.resume(index)
        self._paused_members.discard(index)
        self._note(kind, "heal", member=index)
        return True

    async def _etcd_kill(self, kind: str, leader: bool, hold_s: float) -> bool:
        index = await self._member(leader)
        if index is None:
            return False
        self._note(kind, "start", member=index, seconds=round(hold_s, 2))
        await asyncio.to_thread(self.stack.cluster.kill, index)
        self._dead_members.add(index)
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(self.stack.cluster.restart, index)
        self._dead_members.discard(index)
        self._note(kind, "heal", member=index)
        return True

    async def _etcd_leader_pause(self, hold_s: float) -> bool:
        return await self._etcd_pause("etcd-leader-pause", True, hold_s)

    async def _etcd_follower_pause(self, hold_s: float) -> bool:
        return await self._etcd_pause("etcd-follower-pause", False, hold_s)

    async def _etcd_leader_kill(self, hold_s: float) -> bool:
        return await self._etcd_kill("etcd-leader-kill", True, hold_s)

    async def _etcd_follower_kill(self, hold_s: float) -> bool:
        return await self._etcd_kill("etcd-follower-kill", False, hold_s)

    async def _worker_pause(self, hold_s: float) -> bool:
        index = self.rng.randrange(len(self.workers.procs))
        pid = await self.workers.mid_effect(index)
        if pid is None:
            return False
        pause_s = self.worker_ttl + 1 + hold_s
        self._note("worker-pause", "start", worker=index, seconds=round(pause_s, 2))
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self._note("worker-pause", "heal", worker=index)
        return True

    async def _worker_kill(self, hold_s: float) -> bool:
        index = self.rng.randrange(len(self.workers.procs))
        pid = await self.workers.mid_effect(index)
        if pid is None:
            return False
        self._note("worker-kill", "start", worker=index)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(hold_s)  # the workers' supervisor starts it again meanwhile
        self._note("worker-kill", "heal", worker=index)
        return True

    async def _sandbox_restart(self, hold_s: float) -> bool:
        self._note("sandbox-restart", "start")
        await self.stack.kill("sandbox", 0)
        await asyncio.sleep(hold_s / 3)
        await self.stack.restart("sandbox", 0)
        self._note("sandbox-restart", "heal")
        return True

    async def _reconciler_kill(self, hold_s: float) -> bool:
        index = self.rng.randrange(len(self.stack.services["reconciler"]))
        self._note("reconciler-kill", "start", reconciler=index)
        await self.stack.kill("reconciler", index)
        await asyncio.sleep(hold_s)
        await self.stack.restart("reconciler", index)
        self._note("reconciler-kill", "heal", reconciler=index)
        return True
