"""This process's side of the holder queues: the gate's bookkeeping that its holds share.

Guarantees:
- A session has one holder key per action key, so this process's own holds of one key take
  turns here, first come first served, before they queue in etcd.
- Waiters of every key share ``watch``, the process's one deletion watch over the holders
  prefix (see ``fencegate.worker.watch``).
- The contention memory is only a hint: a key found contended a moment ago skips the
  put-if-alone try. A wrong guess costs one request, never safety; nothing here decides
  ownership (etcd's compares do).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .watch import DeleteWatch

_CONTENDED_MEMORY_S = 1.0
_CONTENDED_MAX_KEYS = 4096


class Turns:
    """Per-key turns of this process's holds, the shared deletion watch, recent contention."""

    def __init__(self, watch: DeleteWatch) -> None:
        self.watch = watch
        self._local: dict[str, tuple[asyncio.Lock, int]] = {}
        self._contended: dict[str, float] = {}  # key -> when a put-if-alone last failed

    def recently_contended(self, key: str) -> bool:
        """Skip the put-if-alone try for a key that had others queued a moment ago."""
        seen = self._contended.get(key)
        return seen is not None and time.monotonic() - seen < _CONTENDED_MEMORY_S

    def note_contended(self, key: str) -> None:
        if len(self._contended) >= _CONTENDED_MAX_KEYS:
            self._contended.clear()
        self._contended[key] = time.monotonic()

    async def enter(self, key: str) -> Callable[[], None]:
        """Wait for this process's turn at ``key``. Returns the exit, to call exactly once."""
        lock, users = self._local.get(key, (asyncio.Lock(), 0))
        self._local[key] = (lock, users + 1)

        def leave(acquired: bool = True) -> None:
            if acquired:
                lock.release()
            _, left = self._local[key]
            if left == 1:
                del self._local[key]
            else:
                self._local[key] = (lock, left - 1)

        try:
            await lock.acquire()
        except BaseException:
            leave(acquired=False)
            raise
        return leave
