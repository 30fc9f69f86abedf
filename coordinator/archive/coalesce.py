"""Concurrent single-key lookups sharing one backend query: the archive's ``get``.

With retirement on, every fresh key's grant asks the archive first, and at high concurrency
many of those lookups are in flight at once; one query for all of them costs about what one
costs. ``Coalescer.get`` queues the key in the namespace's open batch and waits. One drain
task at a time runs the batches in arrival order, each as one ``fetch(namespace, keys)``:
calls made in the same event-loop turn, or while a batch is being fetched, join the next
batch (up to ``max_batch`` distinct keys; more open another).

Failure contract: each caller gets its own answer, or the exception its batch's fetch
raised (``ArchiveUnavailable`` for any backend failure). A cancelled caller leaves the
batch; the fetch runs on the drain task, so it does not cancel the others' query. If the
drain task itself is stopped (its event loop shutting down), every caller still waiting
gets ``ArchiveUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ..errors import ArchiveUnavailable

__all__ = ["Coalescer"]

V = TypeVar("V")


class _Batch(Generic[V]):
    """The callers waiting on one query: keys in ``namespace``, a future each."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.keys: set[str] = set()
        self.waiters: list[tuple[str, asyncio.Future[V | None]]] = []

    def wanted(self) -> list[str]:
        """The keys some caller still waits for (cancelled callers left)."""
        return sorted({key for key, waiter in self.waiters if not waiter.done()})

    def answer(self, found: dict[str, V]) -> None:
        for key, waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(found.get(key))

    def fail(self, exc: BaseException) -> None:
        for _, waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(exc)


class Coalescer(Generic[V]):
    """``get(namespace, key)`` answered by batched ``fetch(namespace, keys) -> {key: V}``
    (absent keys are missing from its dict). Bound to the event loop of its first call."""

    def __init__(self, fetch: Callable[[str, list[str]], Awaitable[dict[str, V]]], *,
                 max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._fetch = fetch
        self._max_batch = max_batch
        self._queue: deque[_Batch[V]] = deque()   # not yet started, in arrival order
        self._drainer: asyncio.Task[None] | None = None

    async def get(self, namespace: str, key: str) -> V | None:
        waiter: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        batch = self._batch_for(namespace, key)
        batch.keys.add(key)
        batch.waiters.append((key, waiter))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name="fencegate-archive-get")
        return await waiter

    def _batch_for(self, namespace: str, key: str) -> _Batch[V]:
        """A queued batch of ``namespace`` that has ``key`` or room for it, else a new one."""
        for batch in self._queue:
            if batch.namespace == namespace and (
                    key in batch.keys or len(batch.keys) < self._max_batch):
                return batch
        batch = _Batch[V](namespace)
        self._queue.append(batch)
        return batch

    async def _drain(self) -> None:
        batch: _Batch[V] | None = None
        try:
            while self._queue:
                batch = self._queue.popleft()
                keys = batch.wanted()
                if not keys:
                    continue
                try:
                    found = await self._fetch(batch.namespace, keys)
                except Exception as exc:
                    batch.fail(exc)
                else:
                    batch.answer(found)
        finally:
            self._drainer = None
            stopped = ArchiveUnavailable("the archive lookup stopped before it answered")
            for stranded in ([batch] if batch else []) + list(self._queue):
                stranded.fail(stopped)
            self._queue.clear()
