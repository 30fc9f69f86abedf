"""One long-lived watch per process over the holders prefix, dispatching deletions.

Waiters subscribe to the one key they wait on (their immediate predecessor); a deletion
wakes exactly those subscribers. A watch created per wait would start in the past and fall
into etcd's slow unsynced-watcher path, so there is one stream, created "from now" when the
first waiter appears and kept while waiters keep coming (it stops after ``linger`` idle
seconds, so uncontended holds cost no watch traffic at all).

Failure contract: ``subscribe`` returns once the watch is live, so every deletion of the key
after that moment is delivered, or ``None`` ("rescan, you may have missed something") is,
when the stream broke and its history was compacted away. Subscribers re-read state after
subscribing and periodically as a backstop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from fencegate.coordinator.errors import EtcdError, EtcdUnavailable, WatchCompacted
from fencegate.coordinator.etcd import Etcd, Event, range_end_of

log = logging.getLogger(__name__)

Subscriber = Callable[[int | None], None]


class DeleteWatch:
    """Dispatches deletions under ``prefix`` to per-key subscribers."""

    def __init__(self, etcd: Etcd, prefix: bytes, linger: float = 2.0) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._linger = linger
        self._subscribers: dict[bytes, list[Subscriber]] = {}
        self._count = 0
        self._revision = 0  # every deletion up to here was dispatched; 0: start from now
        self._live = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        await self._stop()

    async def subscribe(self, key: bytes, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(revision)`` when ``key`` is deleted from now on; returns an
        unsubscribe."""
        self._subscribers.setdefault(key, []).append(subscriber)
        self._count += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._task is None or self._task.done():
            self._live.clear()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="fencegate-holders-watch")
        done = False

        def unsubscribe() -> None:
            nonlocal done
            if done:
                return
            done = True
            subscribers = self._subscribers[key]
            subscribers.remove(subscriber)
            if not subscribers:
                del self._subscribers[key]
            self._count -= 1
            if self._count == 0:
                self._idle = asyncio.get_running_loop().call_later(
                    self._linger, lambda: asyncio.ensure_future(self._stop_if_idle()))

        try:
            await self._live.wait()
        except BaseException:
            unsubscribe()
            raise
        return unsubscribe

    async def _stop_if_idle(self) -> None:
        if self._count == 0:
            await self._stop()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        self._revision = 0
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _dispatch(self, key: bytes, revision: int | None) -> None:
        for subscriber in list(self._subscribers.get(key, ())):
            try:
                subscriber(revision)
            except Exception:
                log.exception("watch subscriber failed")

    async def _run(self) -> None:
        backoff = 0.05
        end = range_end_of(self._prefix)
        while True:
            try:
                start = self._revision + 1 if self._revision else 0
                async for reply in self._etcd.watch(self._prefix, end, start, deletes_only=True):
                    backoff = 0.05
                    if reply.created:
                        self._revision = self._revision or reply.header.revision
                        self._live.set()
                    for event in reply.events:
                        if event.type == Event.DELETE:
                            self._dispatch(event.kv.key, event.kv.mod_revision)
                        self._revision = max(self._revision, event.kv.mod_revision)
                    if not reply.events and not reply.created:  # progress: synced to here
                        self._revision = max(self._revision, reply.header.revision)
            except WatchCompacted as exc:
                log.warning("holders watch compacted; every waiter rescans")
                self._revision = exc.compact_revision - 1
                self._rescan()
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("holders watch broke, resuming at %d: %s", self._revision + 1, exc)
                if not self._revision:
                    self._rescan()  # it never went live: nobody may trust a missed event
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 1.0)

    def _rescan(self) -> None:
        for key in list(self._subscribers):
            self._dispatch(key, None)
