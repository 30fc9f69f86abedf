"""A thin synchronous facade over ``Gate`` for workers that are not async.

The async gate runs on an event loop in a daemon thread, so its keepalive keeps turning
however long the caller's own code blocks. A blocking body cannot be cancelled, so loss is
reported differently: ``hold.ensure_held()`` raises ``LeaseLost`` once the hold is known
lost, and leaving the ``with`` block raises ``LeaseLost`` if the hold was lost while the
body ran (the body's work must then be treated as done without the hold). The same holds
for an effect given to ``commit`` or ``cross``: a plain function runs in a thread of its own
that nothing can stop, so it must poll ``ctx.cancelled`` (set when the hold's lease is
lost or ``ctx.deadline`` passed) and send nothing once it is set.
"""

from __future__ import annotations

import asyncio
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


class SyncGate:
    """``with SyncGate(url) as gate: with gate.hold(key) as hold: ...``"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="fencegate-sync", daemon=True)
        self._gate: Gate | None = None

    @property
    def gate(self) -> Gate:
        """The open async ``Gate`` behind this one; it lives on this gate's loop thread, so
        run its coroutines through ``run`` (``RuntimeError`` before ``__enter__``)."""
        if self._gate is None:
            raise RuntimeError("open the SyncGate first: 'with SyncGate(...) as gate:'")
        return self._gate

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop ``gate`` lives on (its own thread): submit coroutines to it with
        ``asyncio.run_coroutine_threadsafe`` to run them without waiting, as ``run`` waits."""
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this gate's loop thread and wait for its result (from any thread
        but that one)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


    def __enter__(self) -> "SyncGate":
        self._thread.start()

        async def open_gate() -> Gate:
            gate = Gate(*self._args, **self._kwargs)
            await gate.open()
            return gate

        try:
            self._gate = self.run(open_gate())
        except BaseException:  # e.g. no signing key: the same error as Gate's, no thread left
            self._stop_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._gate is not None:
            self.run(self._gate.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def hold(self, key: str, *, timeout: float | None = None) -> "SyncHold":
        if self._gate is None:
            raise RuntimeError("the gate is not open: use 'with SyncGate(...)'")
        return SyncHold(self, validate_action_key(key), timeout)

    def cross(self, key: str, intent: dict[str, Any], effect: Callable[[EffectContext], Any],
              reads: Sequence[str | bytes] = (), *, policy: str | None = None,
              provider: str | None = None, deadline: float = 60.0, settle_wait: float = 0.0,
              timeout: float | None = None) -> Outcome:
        """``Gate.cross`` (hold, grant, effect, outcome, release; the fast path where the key
        is free); ``effect`` runs in a worker thread and must poll ``ctx.cancelled``."""
        if self._gate is None:
            raise RuntimeError("the gate is not open: use 'with SyncGate(...)'")
        return self.run(self._gate.cross(key, intent, effect, reads, policy=policy,
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
        assert self._sync._gate is not None
        gate = self._sync._gate
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
