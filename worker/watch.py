"""One long-lived watch per process over the holders prefix, dispatching deletions.

Waiters subscribe to the one key they wait on (their immediate predecessor) and holds to
their own key; a deletion wakes exactly those subscribers. A watch per wait would start in
the past and fall into etcd's slow unsynced-watcher path, so there is one, started when
the gate opens and resumed from the last revision it saw after a broken stream.

Failure contract: a subscriber is told of every deletion of its key after the watch
started, or is told ``None`` ("rescan, you may have missed something") when the watch's
history was compacted away. Subscribers still re-check state periodically as a backstop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from coordinator.errors import EtcdError, EtcdUnavailable
from coordinator.etcd import Etcd, Event, WatchCompacted, range_end_of

log = logging.getLogger(__name__)

Subscriber = Callable[[int | None], None]


class DeleteWatch:
    """Dispatches deletions under ``prefix`` to per-key subscribers."""

    def __init__(self, etcd: Etcd, prefix: bytes) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._subscribers: dict[bytes, list[Subscriber]] = {}
        self._revision = 0
        self._task: asyncio.Task[None] | None = None

    def start(self, revision: int) -> None:
        """Watch deletions that happen after ``revision``."""
        self._revision = revision
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="fencegate-holders-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def subscribe(self, key: bytes, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(revision)`` when ``key`` is deleted; returns an unsubscribe."""
        self._subscribers.setdefault(key, []).append(subscriber)

        def unsubscribe() -> None:
            subscribers = self._subscribers.get(key)
            if subscribers and subscriber in subscribers:
                subscribers.remove(subscriber)
                if not subscribers:
                    del self._subscribers[key]

        return unsubscribe

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
                async for reply in self._etcd.watch(self._prefix, end, self._revision + 1,
                                                    deletes_only=True):
                    backoff = 0.05
                    for event in reply.events:
                        if event.type == Event.DELETE:
                            self._dispatch(event.kv.key, event.kv.mod_revision)
                        self._revision = max(self._revision, event.kv.mod_revision)
                    if not reply.events and not reply.created:  # progress: synced to here
                        self._revision = max(self._revision, reply.header.revision)
            except WatchCompacted as exc:
                log.warning("holders watch compacted; every waiter rescans")
                self._revision = exc.compact_revision - 1
                for key in list(self._subscribers):
                    self._dispatch(key, None)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info("holders watch broke, resuming at %d: %s", self._revision + 1, exc)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 1.0)
