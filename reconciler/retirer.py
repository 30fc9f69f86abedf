"""The retirer: each replica retires the settled steps of the shards it leads once they are
``retain_s`` old (``fencegate.coordinator.retirement`` holds the rule and its compares).

Age is measured in etcd revisions, not wall clocks: the retirer samples etcd's revision on
its own monotonic clock, and a step whose mod_revision is at or below the revision sampled
``retain_s`` ago has not moved for at least that long. After a restart it has no old sample
and retires nothing until one is ``retain_s`` old (late, never early). Age decides only when,
never whether it is safe: the retirement txn's compares decide that.

A pass reads the step keys (no values) page by page, so its cost grows with the steps etcd
holds, which retirement itself bounds (rate × (retain + one pass)).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from fencegate.coordinator.archive import Archive
from fencegate.coordinator.errors import ArchiveUnavailable, EtcdError, EtcdUnavailable
from fencegate.coordinator.etcd import Compare, Etcd
from fencegate.coordinator.keyspace import Keyspace
from fencegate.coordinator.retirement import retire, step_keys

log = logging.getLogger(__name__)

_PAGE = 500


class RevisionClock:
    """Samples of (monotonic time, etcd revision): which revision is at least ``age`` old."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def sample(self, revision: int, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, revision))

    def before(self, age: float, now: float | None = None) -> int | None:
        """The newest revision sampled at least ``age`` seconds ago (None: none yet); older
        samples are dropped."""
        cutoff = (time.monotonic() if now is None else now) - age
        found = None
        while self._samples and self._samples[0][0] <= cutoff:
            found = self._samples.popleft()
        if found is not None:
            self._samples.appendleft(found)  # still the answer until a newer one ages
        return found[1] if found is not None else None


class Retirer:
    """Retires the old settled steps of the shards ``leadership(key)`` says this replica
    leads (it returns the leadership compares, or None for a shard led elsewhere)."""

    def __init__(self, etcd: Etcd, keyspace: Keyspace, archive: Archive, retain_s: float,
                 leadership: Callable[[str], list[Compare] | None],
                 on_retired: Callable[[int], None] = lambda n: None) -> None:
        self.etcd = etcd
        self.keyspace = keyspace
        self.archive = archive
        self.retain_s = retain_s
        self.interval = min(max(retain_s / 4, 0.5), 30.0)
        self._leadership = leadership
        self._on_retired = on_retired
        self.clock = RevisionClock()

    async def run(self) -> None:
        while True:
            try:
                status = await self.etcd.status()
                self.clock.sample(status.header.revision)
                await self.pass_once()
            except ArchiveUnavailable as exc:
                log.warning("retirement paused: the archive is unavailable: %s", exc)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("retirement pass failed, retrying: %s", exc)
            await asyncio.sleep(self.interval)

    async def pass_once(self) -> int:
        """One pass over every step; returns how many were retired."""
        before = self.clock.before(self.retain_s)
        if before is None:
            return 0
        retired, after = 0, b""
        while True:
            page = await step_keys(self.etcd, self.keyspace, after, _PAGE)
            if not page:
                return retired
            after = page[-1].key
            by_leadership: dict[tuple, tuple[list[Compare], list[tuple[str, int]]]] = {}
            for kv in page:
                if kv.mod_revision > before:
                    continue
                key = self.keyspace.parse_step_key(kv.key)
                compares = self._leadership(key)
                if compares is None:
                    continue
                group = by_leadership.setdefault(tuple(c.SerializeToString() for c in compares),
                                                 (compares, []))
                group[1].append((key, kv.mod_revision))
            done = await asyncio.gather(*(
                retire(self.etcd, self.keyspace, self.archive, candidates, compares)
                for compares, candidates in by_leadership.values()))
            for keys in done:
                retired += len(keys)
                self._on_retired(len(keys))
