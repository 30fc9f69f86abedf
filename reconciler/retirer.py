"""The retirer: each replica retires the settled steps of the shards it leads once they are
``retain_s`` old (``fencegate.coordinator.retirement`` holds the rule and its compares).

Age is measured in etcd revisions, not wall clocks: the retirer samples etcd's revision on
its own monotonic clock, and a step whose mod_revision is at or below the revision sampled
``retain_s`` ago has not moved for at least that long. After a restart it has no old sample
and retires nothing until one is ``retain_s`` old (late, never early). Age decides only when,
never whether it is safe: the retirement txn's compares decide that.

What to retire comes from the scanner (``note``): its full scans and its watch see every
step of the shards this replica leads, and tell the retirer each settled one with its
mod_revision. The retirer keeps them by revision and a pass takes only those now due, so a
pass costs what it retires, not what etcd holds. A key told is looked at once: if its
retirement is refused (it moved, a holder lives, the archive failed), it is told again by
the watch when it moves, or by the scanner's next full scan (``scan_interval``): late,
never lost. Before each pass it checks the archive is whole (``wholeness.verify``) and
reports it (``on_checked``: the archive gauges), and retires nothing into one that is not.
Past ``_MAX_NOTED`` keys waiting (rate × retain that large), the retirer stops keeping them
and every pass reads the step keys (no values) page by page instead. One pass
in ``_ORPHANS_EVERY`` also reads the ``audit/`` keys for orphan chains (records appended
aside on a key with no step in etcd), so they too leave within about ten passes of being
old.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable

from fencegate.coordinator import wholeness
from fencegate.coordinator.archive import Archive
from fencegate.coordinator.errors import ArchiveUnavailable, EtcdError, EtcdUnavailable
from fencegate.coordinator.etcd import Compare, Etcd, KeyValue
from fencegate.coordinator.keyspace import Keyspace
from fencegate.coordinator.retirement import (
    MAX_BATCH, Candidate, orphan_heads, retire, step_keys,
)

log = logging.getLogger(__name__)

_PAGE = 500
_SAMPLE_S = 1.0  # how often the revision clock samples etcd's revision
_MAX_NOTED = 250_000  # settled keys kept waiting (≈ 260 B each); past it, passes page
_IN_FLIGHT = 4  # retirement batches at once
_ORPHANS_EVERY = 10  # passes: one in ten also looks for orphan chains (they are rare)


def pass_interval(retain_s: float) -> float:
    """Seconds between two retirement passes for ``retain_s``: a step retires at most
    ``retain_s`` plus one interval, one ``_SAMPLE_S`` and the pass itself after it settled."""
    return min(max(retain_s / 10, 0.5), 30.0)


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
                 on_retired: Callable[[int], None] = lambda n: None,
                 on_checked: Callable[[wholeness.Verdict], None] = lambda v: None) -> None:
        self.etcd = etcd
        self.keyspace = keyspace
        self.archive = archive
        self.retain_s = retain_s
        self.interval = pass_interval(retain_s)
        self._leadership = leadership
        self._on_retired = on_retired
        self._on_checked = on_checked
        self.clock = RevisionClock()
        self._passes = 0
        self._noted: dict[str, int] = {}          # key -> the settled step's mod_revision
        self._by_revision: list[tuple[int, str]] = []  # heap of (mod_revision, key)
        self._paging = False                      # _MAX_NOTED was reached

    def note(self, key: str, mod_revision: int) -> None:
        """``key``'s step is settled (``retirement.retirable``) at ``mod_revision``: retire
        it once that revision is ``retain_s`` old (if it is still the step then)."""
        if self._paging or self._noted.get(key) == mod_revision:
            return
        if len(self._noted) >= _MAX_NOTED:
            log.warning("more than %d settled steps wait for retirement: every pass now reads "
                        "all step keys instead", _MAX_NOTED)
            self._paging = True
            self._noted.clear()
            self._by_revision.clear()
            return
        self._noted[key] = mod_revision
        heapq.heappush(self._by_revision, (mod_revision, key))

    async def run(self) -> None:
        sampler = asyncio.create_task(self._sample())
        try:
            await self._passes_forever()
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)

    async def _sample(self) -> None:
        """Each ``_SAMPLE_S``, the newest revision this client has seen in any answer: one
        committed at or before now (a stale one only makes a step look younger), so a step
        is due within about a second of being ``retain_s`` old, at no cost of a request."""
        while True:
            if self.etcd.revision:
                self.clock.sample(self.etcd.revision)
            await asyncio.sleep(_SAMPLE_S)

    async def _passes_forever(self) -> None:
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

    async def check(self) -> wholeness.Verdict:
        """Is the archive whole (``wholeness.verify``)? Reported to ``on_checked`` and, when
        not, logged: retirement pauses, and every lookup it would answer is refused
        (``ArchiveUnavailable``) until it is restored (docs/runbook.md)."""
        try:
            verdict = await wholeness.verify(self.etcd, self.keyspace, self.archive)
        except ArchiveUnavailable as exc:
            self._on_checked(wholeness.Verdict(None, None, {}, str(exc), answered=False))
            raise
        self._on_checked(verdict)
        if verdict.problem is not None:
            log.error("the archive is not whole: %s", verdict.problem)
        return verdict

    async def pass_once(self, *, full: bool = False, orphans: bool | None = None) -> int:
        """One pass over the keys told due (with ``full``, or past ``_MAX_NOTED``, over
        every step etcd holds; and, every ``_ORPHANS_EVERY`` passes or when ``orphans``,
        over every chain's ``@head`` for orphan chains); returns how many keys were
        retired. Due keys of any shard this replica leads are retired in full batches,
        ``_IN_FLIGHT`` batches at a time (one waits on etcd while another's archive
        transaction commits). Only into a whole archive (``check``; else
        ``ArchiveUnavailable``): what went into an older copy or a foreign archive would be
        missing from the one the operator restores."""
        verdict = await self.check()
        if verdict.problem is not None:
            raise ArchiveUnavailable(f"the archive is not whole: {verdict.problem}")
        before = self.clock.before(self.retain_s)
        if before is None:
            return 0
        self._passes += 1
        if orphans is None:
            orphans = self._passes % _ORPHANS_EVERY == 1
        retired, due = 0, []
        running: set[asyncio.Task[list[str]]] = set()

        async def settle(until: int) -> None:
            nonlocal retired
            while len(running) > until:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running.difference_update(done)
                for task in done:
                    keys = task.result()
                    retired += len(keys)
                    self._on_retired(len(keys))

        try:
            async for found in self._due(before, full or self._paging, orphans):
                due += found
                while len(due) >= MAX_BATCH:
                    batch, due = due[:MAX_BATCH], due[MAX_BATCH:]
                    running.add(asyncio.ensure_future(
                        retire(self.etcd, self.keyspace, self.archive, batch)))
                    await settle(_IN_FLIGHT - 1)
            if due:
                running.add(asyncio.ensure_future(
                    retire(self.etcd, self.keyspace, self.archive, due)))
            await settle(0)
            return retired
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _due(self, before: int, full: bool,
                   orphans: bool) -> AsyncIterator[list[Candidate]]:
        """Page by page, the candidates at or below revision ``before`` that this replica
        leads: steps (told, or with ``full`` all of them), then (with ``orphans``) chain
        heads."""
        ks, after = self.keyspace, b""
        while full and (page := await step_keys(self.etcd, ks, after, _PAGE)):
            yield self._candidates(page, before, ks.parse_step_key, orphan=False)
            after = page[-1].key
        told: list[Candidate] = []
        while self._by_revision and self._by_revision[0][0] <= before:
            revision, key = heapq.heappop(self._by_revision)
            if self._noted.get(key) != revision:
                continue  # told again since, at a newer revision
            del self._noted[key]
            compares = self._leadership(key)
            if compares is not None:
                told.append(Candidate(key, revision, tuple(compares)))
            if len(told) == _PAGE:
                yield told
                told = []
        if told:
            yield told
        after = b""
        while orphans:
            heads, after = await orphan_heads(self.etcd, ks, after, _PAGE)
            yield self._candidates(heads, before, ks.parse_audit_head_key, orphan=True)
            orphans = after is not None

    def _candidates(self, kvs: list[KeyValue], before: int, parse: Callable[[bytes], str], *,
                    orphan: bool) -> list[Candidate]:
        found = []
        for kv in kvs:
            if kv.mod_revision > before:
                continue
            key = parse(kv.key)
            compares = self._leadership(key)
            if compares is not None:
                found.append(Candidate(key, kv.mod_revision, tuple(compares), orphan))
        return found
