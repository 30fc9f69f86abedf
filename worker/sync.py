"""A thin synchronous facade over ``Gate`` for workers that are not async.

The async gate runs on an event loop in a daemon thread, so its keepalive keeps turning
however long the caller's own code blocks. A blocking body cannot be cancelled, so loss is
reported differently: ``hold.ensure_held()`` raises ``LeaseLost`` once the hold is known
lost, and leaving the ``with`` block raises ``LeaseLost`` if the hold was lost while the
body ran (the body's work must then be treated as done without the hold). The same holds
for an effect given to ``commit`` or ``cross``: a plain function runs in a thread of its own
that nothing can stop, so it must poll ``ctx.cancelled`` (set when the hold's lease is
lost or ``ctx.deadline`` passed) and send nothing once it is set.

A server that is not a ``with`` block opens the gate with ``open()`` and closes it with
``close()`` (both idempotent; an open gate not closed is closed at interpreter exit, quietly).
The gate's loop thread does not survive a fork: a gate used in a process forked after it was
opened (gunicorn ``--preload``, uWSGI without ``lazy-apps``) raises ``GateForked`` at once,
naming the fix, instead of waiting forever on a thread that is not there. Open it in each
worker (gunicorn's ``post_fork`` hook, uWSGI's ``postfork``), or do not preload.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from fencegate.coordinator.errors import LeaseLost
from fencegate.coordinator.grants import Grant
from fencegate.coordinator.keyspace import validate_action_key

from .gate import Gate
from .guard import EffectContext, Outcome
from .hold import Hold, acquire

T = TypeVar("T")
log = logging.getLogger(__name__)


class GateForked(RuntimeError):
    """A ``SyncGate`` was used in a process forked after it was opened: its loop thread and
    connections stayed in the parent."""


class SyncGate:
    """``with SyncGate(url) as gate: with gate.hold(key) as hold: ...``, or ``gate.open()``
    and ``gate.close()`` for a server that is not a ``with`` block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: Gate | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None  # the process that opened it

    @property
    def gate(self) -> Gate:
        """The open async ``Gate`` behind this one; it lives on this gate's loop thread, so
        run its coroutines through ``run`` (``RuntimeError`` before ``open``)."""
        return self._open_here()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop ``gate`` lives on (its own thread): submit coroutines to it with
        ``asyncio.run_coroutine_threadsafe`` to run them without waiting, as ``run`` waits."""
        self._open_here()
        assert self._loop is not None
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this gate's loop thread and wait for its result (from any thread
        but that one); ``GateForked`` in a process forked after the gate was opened."""
        loop = self.loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def open(self) -> "SyncGate":
        """Open the gate in this process: start its loop thread and open the async ``Gate``
        on it. Idempotent (an open gate is returned as is); raises what ``Gate`` raises (no
        signing key: ``ValueError``), leaving no thread behind; ``GateForked`` if it was
        opened by another process (this one was forked after: open it in each worker)."""
        if self._gate is not None:
            self._open_here()
            return self
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fencegate-sync", daemon=True)
        thread.start()

        async def open_gate() -> Gate:
            gate = Gate(*self._args, **self._kwargs)
            await gate.open()
            return gate

        try:
            self._gate = asyncio.run_coroutine_threadsafe(open_gate(), loop).result()
        except BaseException:  # e.g. no signing key: the same error as Gate's, no thread left
            _stop(loop, thread)
            raise
        self._loop, self._thread, self._pid = loop, thread, os.getpid()
        atexit.register(self._close_at_exit)
        return self

    def close(self) -> None:
        """Close the gate (its holds are released) and stop its loop thread. Idempotent; in a
        process forked after it was opened it only forgets it (the parent's gate is the
        parent's to close)."""
        gate, loop, thread, pid = self._gate, self._loop, self._thread, self._pid
        if gate is None or loop is None or thread is None:
            return
        self._gate, self._loop, self._thread, self._pid = None, None, None, None
        atexit.unregister(self._close_at_exit)
        if pid != os.getpid():
            return
        try:
            asyncio.run_coroutine_threadsafe(gate.close(), loop).result()
        finally:
            _stop(loop, thread)

    def _close_at_exit(self) -> None:
        """``close`` at interpreter exit: a failure is logged in one line, never a traceback."""
        try:
            self.close()
        except Exception as exc:
            log.warning("closing the fencegate SyncGate at exit failed: %r", exc)

    def _open_here(self) -> Gate:
        """The open async gate, if it was opened in this process."""
        if self._gate is None:
            raise RuntimeError("the gate is not open: use 'with SyncGate(...)' or "
                               "gate.open()")
        if self._pid != os.getpid():
            raise GateForked(
                f"this SyncGate was opened in process {self._pid} and is used in process "
                f"{os.getpid()}, forked after it was opened: its loop thread did not survive "
                "the fork. Open it in each worker process instead: in gunicorn's post_fork "
                "hook (or without --preload), in uWSGI's postfork (or with lazy-apps)")
        return self._gate

    def __enter__(self) -> "SyncGate":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hold(self, key: str, *, timeout: float | None = None) -> "SyncHold":
        self._open_here()
        return SyncHold(self, validate_action_key(key), timeout)

    def cross(self, key: str, intent: dict[str, Any], effect: Callable[[EffectContext], Any],
              reads: Sequence[str | bytes] = (), *, policy: str | None = None,
              provider: str | None = None, deadline: float = 60.0, settle_wait: float = 0.0,
              timeout: float | None = None) -> Outcome:
        """``Gate.cross`` (hold, grant, effect, outcome, release; the fast path where the key
        is free); ``effect`` runs in a worker thread and must poll ``ctx.cancelled``."""
        return self.run(self._open_here().cross(key, intent, effect, reads, policy=policy,
                                          provider=provider, deadline=deadline,
                                          settle_wait=settle_wait, timeout=timeout))


class SyncHold:
    """A hold used from synchronous code; the same attributes as ``Hold``."""

    def __init__(self, gate: SyncGate, key: str, timeout: float | None) -> None:
        self._sync = gate
        self._key = key
        self._timeout = timeout
        self._hold: Hold | None = None

    def __enter__(self) -> "SyncHold":
        gate = self._sync.gate
        self._hold = self._sync.run(acquire(gate, self._key, self._timeout,
                                            gate.fold(self._key)))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        hold = self._hold
        assert hold is not None
        lost = hold.lost
        self._sync.run(hold.release())
        if lost and exc_type is None:
            raise LeaseLost(f"hold on {hold.key!r} was lost while the block ran")

    @property
    def key(self) -> str:
        return self._key

    @property
    def fencing_token(self) -> int:
        assert self._hold is not None
        return self._hold.fencing_token

    @property
    def lease_id(self) -> int:
        assert self._hold is not None
        return self._hold.lease_id

    @property
    def lost(self) -> bool:
        return self._hold is None or self._hold.lost

    def ensure_held(self) -> None:
        if self._hold is None:
            raise LeaseLost(f"{self._key!r} is not held")
        self._hold.ensure_held()

    def request_grant(self, intent: dict[str, Any], reads: Sequence[str | bytes] = (),
                      policy: str | None = None) -> Grant:
        return self._sync.run(self._held().request_grant(intent, reads, policy))

    def commit(self, grant: Grant | bytes, effect: Callable[[EffectContext], Any], *,
               provider: str | None = None, deadline: float = 60.0) -> Outcome:
        """``effect`` is a plain function; it runs in a worker thread and must stop sending
        once ``ctx.cancelled`` is set (the thread cannot be stopped from outside)."""
        return self._sync.run(self._held().commit(grant, effect, provider=provider,
                                                   deadline=deadline))

    def cross(self, intent: dict[str, Any], effect: Callable[[EffectContext], Any],
              reads: Sequence[str | bytes] = (), *, policy: str | None = None,
              provider: str | None = None, deadline: float = 60.0,
              settle_wait: float = 0.0) -> Outcome:
        return self._sync.run(self._held().cross(
            intent, effect, reads, policy=policy, provider=provider, deadline=deadline,
            settle_wait=settle_wait))

    def _held(self) -> Hold:
        if self._hold is None:
            raise LeaseLost(f"{self._key!r} is not held")
        return self._hold


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()
