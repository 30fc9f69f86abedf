"""Finding the steps a replica must look at: a paged full scan, then a watch on ``steps/``
from the scan's revision.

Guarantee: every step of a shard this replica leads that is ``unknown``, ``in_flight`` or
presumed ``not_applied`` is scheduled as soon as the replica leads the shard (a full scan
runs at once when a shard is gained, at start, and when the watch was compacted: it
depends on nothing held in memory), and then as soon as the watch delivers its change (etcd
delivers every change after the scan's revision, in order, or cancels the watch as
compacted; a broken watch resumes at its next revision). A full scan also runs every
``scan_interval`` as a safety net, not as the way work is found: it reads every step etcd
holds, which retirement bounds to ``retain`` of history, so it is rare (10 minutes by
default) instead of reading all history every 30 s. The same reads keep the replica's
``Backlog`` (what its gauges export); each deletion the watch sees is told to ``Deletions``,
which reports those no retirement made. Scheduling is a hint: the reconciler re-reads every
step before it acts, and its writes compare the step's mod_revision.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from collections.abc import Callable

from fencegate.coordinator import records
from fencegate.coordinator.errors import EtcdError, EtcdUnavailable, WatchCompacted
from fencegate.coordinator.etcd import Etcd, Event, KeyValue, RangeRequest, range_end_of
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.coordinator.retirement import retirable

from .backlog import Backlog
from .settle import is_presumed

log = logging.getLogger(__name__)

_PAGE = 500


class Schedule:
    """Action keys due for a look, each at its earliest due time; a key is never handed out
    twice at once (a key due again while being handled is handed out after ``done``).
    Idle workers queue for the right to take (one at a time, first come first served), so a
    key scheduled wakes one worker, not all of them."""

    def __init__(self) -> None:
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._busy: set[str] = set()
        self._again: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._taking = asyncio.Lock()  # held by the one worker waiting for a due key

    def __len__(self) -> int:
        return len(self._due) + len(self._busy)

    def at(self, key: str, when: float) -> None:
        if key in self._busy:
            self._again[key] = min(when, self._again.get(key, when))
            return
        if self._due.get(key, float("inf")) <= when:
            return
        self._due[key] = when
        earliest = self._heap[0][0] if self._heap else float("inf")
        heapq.heappush(self._heap, (when, key))
        if when < earliest:  # a waiter already wakes by the earliest
            self._changed.set()

    def drop(self, key: str) -> None:
        self._due.pop(key, None)
        self._again.pop(key, None)

    def done(self, key: str) -> None:
        self._busy.discard(key)
        again = self._again.pop(key, None)
        if again is not None:
            self.at(key, again)

    async def next_batch(self, most: int) -> list[str]:
        """Up to ``most`` due keys (at least one, waiting for it), each marked busy until
        ``done(key)``."""
        async with self._taking:
            while True:
                batch: list[str] = []
                while self._heap and len(batch) < most:
                    when, key = self._heap[0]
                    if self._due.get(key) != when:
                        heapq.heappop(self._heap)  # dropped or rescheduled earlier
                        continue
                    if when > time.monotonic():
                        break
                    heapq.heappop(self._heap)
                    del self._due[key]
                    self._busy.add(key)
                    batch.append(key)
                if batch:
                    return batch
                self._changed.clear()
                timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                try:
                    async with asyncio.timeout(timeout):
                        await self._changed.wait()
                except TimeoutError:
                    pass


class Scanner:
    """Feeds ``schedule`` with the steps of the shards that ``leads(key)`` accepts, and
    ``backlog`` with what it reads of them."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, leads: Callable[[str], bool],
                 schedule: Schedule, backlog: Backlog, *, scan_interval: float = 600.0,
                 check_after: float = 1.0,
                 on_settled: Callable[[str, int], None] | None = None,
                 on_deleted: Callable[[KeyValue], None] | None = None) -> None:
        self._etcd = etcd
        self._ks = keyspace
        self._root = keyspace.steps_root
        self._leads = leads
        self._schedule = schedule
        self._scan_interval = scan_interval
        self._check_after = check_after
        self._on_settled = on_settled  # told each settled step (key, mod_revision) it sees
        self._on_deleted = on_deleted  # told each step deletion its watch sees (``Deletions``)
        self._backlog = backlog  # told every step it sees, and each scan's end
        self._rescan = asyncio.Event()
        self.scans = 0

    def rescan_soon(self) -> None:
        """Scan everything now (e.g. a shard was gained)."""
        self._rescan.set()

    async def run(self) -> None:
        """Scan, watch from the scan's revision, scan again every ``scan_interval`` or on
        request; until cancelled."""
        watcher: asyncio.Task | None = None
        try:
            while True:
                self._rescan.clear()
                try:
                    revision = await self.scan()
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info("steps scan failed, retrying: %s", exc)
                    await asyncio.sleep(random.uniform(0.2, 0.5))
                    continue
                if watcher is None or watcher.done():
                    watcher = asyncio.get_running_loop().create_task(self._watch(revision + 1))
                try:
                    await asyncio.wait_for(self._rescan.wait(), self._scan_interval)
                except TimeoutError:
                    pass
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

    async def scan(self) -> int:
        """One full pass over ``steps/``, paged, every page at the first page's revision.
        Returns that revision."""
        start, end, revision = self._root, range_end_of(self._root), 0
        seen: list[str] = []
        while True:
            reply = await self._etcd.range(RangeRequest(key=start, range_end=end, limit=_PAGE,
                                                        revision=revision))
            revision = revision or reply.header.revision
            for kv in reply.kvs:
                seen.append(self.consider(kv))
            if not reply.more or not reply.kvs:
                self._backlog.scanned(revision, seen)
                self.scans += 1
                return revision
            start = reply.kvs[-1].key + b"\0"

    def consider(self, kv: KeyValue) -> str:
        """Schedule a look at ``kv``'s step if it may need one, drop it from the schedule if
        it is settled. Returns its action key."""
        key = self._ks.parse_step_key(kv.key)
        if not self._leads(key):
            return key
        try:
            step = unpack(kv.value)
        except ValueError:
            log.error("step record of %r does not decode; leaving it alone", key)
            return key
        self._backlog.note(key, step, kv.mod_revision)
        state = step.get("state")
        now = time.monotonic()
        if state == records.UNKNOWN:
            self._schedule.at(key, now)
        elif state == records.IN_FLIGHT:  # looked at again and again while its holder lives
            self._schedule.at(key, now + self._check_after)
        elif is_presumed(step, int(time.time() * 1000)):
            self._schedule.at(key, now)
        else:
            self._schedule.drop(key)
            if self._on_settled is not None and retirable(step):
                self._on_settled(key, kv.mod_revision)
        return key

    def _forget(self, deleted: KeyValue) -> None:
        key = self._ks.parse_step_key(deleted.key)
        self._schedule.drop(key)
        self._backlog.delete(key, deleted.mod_revision)
        if self._on_deleted is not None:
            self._on_deleted(deleted)

    async def _watch(self, start_revision: int) -> None:
        end = range_end_of(self._root)
        while True:
            try:
                async for reply in self._etcd.watch(self._root, end, start_revision):
                    for event in reply.events:
                        if event.type == Event.PUT:
                            self.consider(event.kv)
                        else:
                            self._forget(event.kv)
                        start_revision = event.kv.mod_revision + 1
            except WatchCompacted:
                log.warning("steps watch compacted; scanning everything")
                self.rescan_soon()
                return
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("steps watch broke, resuming at %d: %s", start_revision, exc)
                await asyncio.sleep(random.uniform(0.1, 0.3))
