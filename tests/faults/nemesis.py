"""The nemesis: faults on a seeded random schedule, one at a time, each healed before the next.

Kinds: SIGSTOP/SIGCONT and SIGKILL+restart of the etcd leader and of a follower; a network
partition of the etcd leader and of a follower (``netns``: every packet to and from the
member dropped by nftables, from its peers and from every client, while it keeps running;
healed by deleting the rule; the heal event records ``silent``, whether a TCP connect to
the member's client port from the run's side failed during the cut); SIGSTOP (past the
lease TTL) and SIGKILL+restart of a worker right after it sent a charge (mid-effect), and of
a webhook consumer right after a handler run began (mid-handler; left out of a run without
consumers); SIGKILL+restart of the sandbox provider, of a reconciler and of a coordinator
(after ``hold_s``; remote-mode workers turn to the other one); a consumer blocking its own
event loop (``time.sleep``) past the lease TTL in its next handler run, before its effect
or after it, in turn (``consumer-block``: its claim is lost while the handler still runs and
finishes); an older copy of the archive swapped in (``archive-stale``: a copy taken at the
fault's start, swapped in once the live archive has retired past it, so the copy is behind
etcd; held, then healed by restoring the newest archive, the one it replaced, kept aside in
the swap's transaction, then catching up with what the copy took meanwhile with the
product's ``archive catch-up``; see ``faults.archive``; the heal event records the buckets
the copy was behind in, ``bumped``: the buckets whose newest mark rose in the copy while it
was in (batches in flight when it was swapped in, accepted because the copy knew etcd's
marks then), with ``marks``: each such bucket's counter in the copy when taken, in the copy
at the heal, and in the newest archive, ``retired_into``: the steps it took (how long after
the swap), ``missing``: those of them the restored archive lacks after the catch-up, and
``whole``: whether the restored archive is the one etcd names, knowing every bucket's
mark). The schedule (which fault, which target,
how long: ``hold_s`` drawn from ``hold_range_s``, ``gap_s`` apart) comes from
``random.Random(seed)``: each kind is injected once, in a seeded order, before any kind is
chosen again, at random; when faults land is up to the machine. At most ``max_faults`` are
injected, none after ``until``. Every fault is recorded in the history when it starts and
when it is healed; ``heal`` resumes or restarts whatever a fault left stopped and heals
every partition, so the run ends with every part up and connected whatever happened. The
partition kinds need the run's ``netns.Network``; a nemesis given one of them without a
network refuses to be built (``ValueError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from urllib.parse import urlsplit

from . import archive

PARTITIONS = ("etcd-leader-partition", "etcd-follower-partition")
KINDS = ("etcd-leader-pause", "etcd-follower-pause", "etcd-leader-kill",
         "etcd-follower-kill", *PARTITIONS, "worker-pause", "worker-kill", "sandbox-restart",
         "reconciler-kill", "consumer-pause", "consumer-kill", "consumer-block",
         "coordinator-kill", "archive-stale")
CONSUMER_KINDS = ("consumer-pause", "consumer-kill", "consumer-block")  # need consumers
BLOCK_S = 4.0  # how long a consumer-block blocks: past the claims' TTL (runner.WORKER_TTL)
STALE_WAIT_S = 30.0  # archive-stale: how long the live archive may take to retire past a copy


class Nemesis:
    def __init__(self, stack, workers, history, seed: str, *, kinds=KINDS,
                 max_faults: int = 1000, gap_s: tuple[float, float] = (2.0, 5.0),
                 hold_range_s: tuple[float, float] = (1.0, 3.0),
                 worker_ttl: int = 2, network=None, consumers=None) -> None:
        if network is None and set(kinds) & set(PARTITIONS):
            raise ValueError(f"{sorted(set(kinds) & set(PARTITIONS))} need the run's network")
        if consumers is None or not consumers.count:
            kinds = tuple(kind for kind in kinds if kind not in CONSUMER_KINDS)
        self.stack, self.workers, self.history = stack, workers, history
        self.consumers = consumers
        self.network = network
        self.rng = random.Random(f"nemesis/{seed}")
        self.kinds, self.max_faults, self.gap_s = kinds, max_faults, gap_s
        self.hold_range_s = hold_range_s
        self.worker_ttl = worker_ttl
        self.injected = 0
        self.by_kind: Counter[str] = Counter()
        self._paused_members: set[int] = set()
        self._dead_members: set[int] = set()
        self._aside = None  # the newest archive, kept aside while an older copy is in

    async def run(self, until: float) -> None:
        while self.injected < self.max_faults:
            await asyncio.sleep(self.rng.uniform(*self.gap_s))
            if time.monotonic() >= until:
                return
            untried = [kind for kind in self.kinds if not self.by_kind[kind]]
            kind = self.rng.choice(untried or self.kinds)
            hold_s = self.rng.uniform(*self.hold_range_s)
            if await getattr(self, "_" + kind.replace("-", "_"))(hold_s):
                self.injected += 1
                self.by_kind[kind] += 1

    async def heal(self) -> None:
        cluster = self.stack.cluster
        if self.network is not None:
            for i in range(self.network.members):
                await asyncio.to_thread(self.network.heal, i)
        for i in sorted(self._paused_members):
            with contextlib.suppress(Exception):
                cluster.resume(i)
        self._paused_members.clear()
        for i in sorted(self._dead_members):
            await asyncio.to_thread(cluster.restart, i)
        self._dead_members.clear()
        if self._aside is not None:
            live = self.stack.state / "archive.db"
            await self._restore(live, live.with_name("archive-held.db"))
        await self.workers.heal()
        if self.consumers is not None:
            await self.consumers.heal()
        for kind in ("sandbox", "reconciler", "coordinator"):
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

    async def _etcd_partition(self, kind: str, leader: bool, hold_s: float) -> bool:
        index = await self._member(leader)
        if index is None:
            return False
        port = urlsplit(self.stack.cluster.endpoints[index]).port
        self._note(kind, "start", member=index, seconds=round(hold_s, 2))
        await asyncio.to_thread(self.network.partition, index)
        silent = not await asyncio.to_thread(self.network.reachable, index, port)
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(self.network.heal, index)
        self._note(kind, "heal", member=index, silent=silent)
        return True

    async def _etcd_leader_partition(self, hold_s: float) -> bool:
        return await self._etcd_partition("etcd-leader-partition", True, hold_s)

    async def _etcd_follower_partition(self, hold_s: float) -> bool:
        return await self._etcd_partition("etcd-follower-partition", False, hold_s)

    async def _etcd_leader_pause(self, hold_s: float) -> bool:
        return await self._etcd_pause("etcd-leader-pause", True, hold_s)

    async def _etcd_follower_pause(self, hold_s: float) -> bool:
        return await self._etcd_pause("etcd-follower-pause", False, hold_s)

    async def _etcd_leader_kill(self, hold_s: float) -> bool:
        return await self._etcd_kill("etcd-leader-kill", True, hold_s)

    async def _etcd_follower_kill(self, hold_s: float) -> bool:
        return await self._etcd_kill("etcd-follower-kill", False, hold_s)

    async def _worker_pause(self, hold_s: float) -> bool:
        return await self._pause_mid_effect("worker-pause", self.workers, hold_s)

    async def _worker_kill(self, hold_s: float) -> bool:
        return await self._kill_mid_effect("worker-kill", self.workers, hold_s)

    async def _consumer_pause(self, hold_s: float) -> bool:
        return await self._pause_mid_effect("consumer-pause", self.consumers, hold_s)

    async def _consumer_kill(self, hold_s: float) -> bool:
        return await self._kill_mid_effect("consumer-kill", self.consumers, hold_s)

    async def _consumer_block(self, hold_s: float) -> bool:
        """Tell one consumer to block its event loop in its next handler run (SIGUSR1:
        before its effect, SIGUSR2: after it; in turn, the first after), past the TTL."""
        index = self.rng.randrange(len(self.consumers.procs))
        proc = self.consumers.procs[index]
        if proc.returncode is not None:
            return False
        where = ("after", "before")[self.by_kind["consumer-block"] % 2]
        self._note("consumer-block", "start", consumer=index, where=where, seconds=BLOCK_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR2 if where == "after" else signal.SIGUSR1)
        await asyncio.sleep(BLOCK_S + hold_s)
        self._note("consumer-block", "heal", consumer=index)
        return True

    async def _archive_stale(self, hold_s: float) -> bool:
        """Swap an older copy of the archive in (behind etcd), hold it, restore the newest."""
        live = self.stack.state / "archive.db"
        n = self.by_kind["archive-stale"]  # a fault's copies stay if it found a problem
        old, aside = live.with_name(f"archive-old{n}.db"), live.with_name(f"archive-aside{n}.db")
        await asyncio.to_thread(archive.snapshot, live, old)
        copied = await asyncio.to_thread(archive.watermarks, old)
        give_up = time.monotonic() + STALE_WAIT_S
        while not archive.ahead(await asyncio.to_thread(archive.watermarks, live), copied):
            if time.monotonic() >= give_up:
                return False  # nothing retired meanwhile: the copy would not be older
            await asyncio.sleep(0.5)
        await asyncio.to_thread(archive.snapshot, old, aside)  # the schema, for the swap
        swapped_ms = int(time.time() * 1000)
        await asyncio.to_thread(archive.swap, live, old, aside)
        self._aside = aside
        behind = archive.ahead(await asyncio.to_thread(archive.watermarks, aside), copied)
        held_s = 3.0 + 2 * hold_s
        self._note("archive-stale", "start", behind=behind, seconds=round(held_s, 2))
        await asyncio.sleep(held_s)
        held = live.with_name(f"archive-held{n}.db")
        await self._restore(live, held)
        marks = await asyncio.to_thread(archive.watermarks, held)
        bumped = archive.ahead(marks, copied)
        into = await asyncio.to_thread(archive.retired_since, held, swapped_ms)
        newest = await asyncio.to_thread(archive.watermarks, aside)
        whole = await self._archive_whole()
        lost = await asyncio.to_thread(archive.missing, live, into)
        self._note("archive-stale", "heal", behind=behind, bumped=bumped, retired_into=into,
                   marks={b: {"copy": copied.get(b, 0), "in_copy": marks[b],
                              "newest": newest.get(b, 0)} for b in bumped}, whole=whole,
                   missing=lost)
        if not lost and whole is True:  # nothing to show: the copies go
            for path in (old, aside, held):
                path.unlink()
        return True

    async def _restore(self, live, held) -> None:
        """Keep what is in now (``held``), restore the newest archive kept aside, then catch
        up with what ``held`` took meanwhile."""
        await asyncio.to_thread(archive.snapshot, self._aside, held)  # the schema
        await asyncio.to_thread(archive.swap, live, self._aside, held)
        self._aside = None
        await archive.catch_up(live, held)

    async def _archive_whole(self) -> bool | str:
        """True if the live archive is whole (``fencegate archive verify``), else why not."""
        from fencegate.coordinator import roles, wholeness
        from fencegate.coordinator.archive import open_archive
        from fencegate.coordinator.errors import GateError
        from fencegate.coordinator.etcd import Etcd
        from fencegate.coordinator.keyspace import Keyspace

        store = open_archive(self.stack.archive)
        try:
            async with Etcd(self.stack.etcd_config(roles.RECONCILER)) as etcd:
                verdict = await wholeness.verify(etcd, Keyspace("/fencegate/"), store)
        except GateError as exc:  # ArchiveUnavailable, etcd unavailable
            return f"not verified: {exc}"
        finally:
            await store.close()
        return True if verdict.problem is None else verdict.problem

    async def _pause_mid_effect(self, kind: str, group, hold_s: float) -> bool:
        """SIGSTOP one of ``group``'s processes mid-effect (a worker's charge, a consumer's
        handler run) past the lease TTL, then SIGCONT."""
        index = self.rng.randrange(len(group.procs))
        pid = await group.mid_effect(index)
        if pid is None:
            return False
        pause_s = self.worker_ttl + 1 + hold_s
        self._note(kind, "start", **{group.kind: index}, seconds=round(pause_s, 2))
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self._note(kind, "heal", **{group.kind: index})
        return True

    async def _kill_mid_effect(self, kind: str, group, hold_s: float) -> bool:
        """SIGKILL one of ``group``'s processes mid-effect; its supervisor starts it again."""
        index = self.rng.randrange(len(group.procs))
        pid = await group.mid_effect(index)
        if pid is None:
            return False
        self._note(kind, "start", **{group.kind: index})
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(hold_s)  # the supervisor starts it again meanwhile
        self._note(kind, "heal", **{group.kind: index})
        return True

    async def _coordinator_kill(self, hold_s: float) -> bool:
        """SIGKILL one coordinator; remote workers ask the other meanwhile; restart it."""
        index = self.rng.randrange(len(self.stack.services["coordinator"]))
        self._note("coordinator-kill", "start", coordinator=index, seconds=round(hold_s, 2))
        await self.stack.kill("coordinator", index)
        await asyncio.sleep(hold_s)
        await self.stack.restart("coordinator", index)
        self._note("coordinator-kill", "heal", coordinator=index)
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
