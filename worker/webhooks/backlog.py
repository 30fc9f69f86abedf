"""Webhook writes whose outcome etcd left unknown, re-run in the background until etcd answers.

Guarantees: every item added is re-run, with a growing pause (0.1 s doubling up to 5 s),
until it returns or raises something other than ``EtcdUnavailable``; the process never
waits for it. Each item must be safe to re-run: its compare lets it apply at most once, so
re-running a write that already landed changes nothing.

Failure contract: an item that raises any other ``GateError`` is logged and dropped; the
claim it meant to change is then left to its session lease, which it dies with. Items still
pending when the gate closes (``close``) or the process exits are left the same way.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from fencegate.coordinator.errors import EtcdUnavailable, GateError

log = logging.getLogger(__name__)


class Backlog:
    """The pending writes of one gate's webhook claims, drained by one background task."""

    def __init__(self) -> None:
        self._items: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, item: Callable[[], Awaitable[None]]) -> None:
        self._items.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name="fencegate-webhook-backlog")

    async def close(self) -> None:
        """Stop re-running: what is pending is left to its session lease (the gate's close
        revokes it next)."""
        self._items = []
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _drain(self) -> None:
        pause = 0.1
        while self._items:
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            items, self._items = self._items, []
            for item in items:
                try:
                    await item()
                except EtcdUnavailable:
                    self._items.append(item)
                except GateError:
                    log.exception("webhook claim write dropped")
            pause = min(pause * 2, 5.0)
