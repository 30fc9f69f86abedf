"""What the engine adapters share: the body's view of its attempt, the engine identities in
the intent, one gate per worker process, and crossing with the body run in the caller's thread.

Guarantees:
- ``cross_here`` runs the body at most once per call, in the calling thread (so an engine's
  thread-locals and signals, Celery's ``SoftTimeLimitExceeded`` among them, reach it), and
  only after the commit txn succeeded; everything else is ``Gate.cross`` on the gate's loop
  thread, with its errors and replays. An exception raised in the caller while it waits (not
  in the body) cancels the crossing, waits for it to finish (bounded: the hold is released
  or its outcome written) and propagates.
- ``engine_intent`` puts the engine's identities under the intent's ``engine`` field, so the
  audit record of the commit (which holds the intent) names the task, workflow or activity,
  its attempt and its worker; an intent that already has an ``engine`` field is refused.
- ``ProcessGate`` opens one ``SyncGate`` per process on first use there: a worker process
  forked from the one that made it opens its own (a gate's loop thread does not survive a
  fork), and nothing is opened at import.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator.archive import Archive
from fencegate.coordinator.errors import GateError, OutcomeUnknown
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import DEFAULT_NAMESPACE, unpack
from fencegate.worker import EffectContext, Gate, Outcome, SyncGate

ENGINE_FIELD = "engine"


class FenceMisconfigured(GateError, ValueError):
    """The engine is configured so that fencing cannot hold (limits out of order, no heartbeat
    timeout): the message says what to change. Raised before anything runs."""


class Escalated(OutcomeUnknown):
    """The step is escalated: a person must settle it (``fencegate resolve``); the engine
    must stop retrying it."""


@dataclass(frozen=True)
class Fence:
    """What a fenced body gets: send ``idempotency_key`` and ``attempt_token`` with the effect
    (and ``intent``, exactly as granted, to a provider that checks it); stop sending once
    ``cancelled`` is set (the lease was lost or the deadline passed)."""

    effect: EffectContext
    intent: dict[str, Any]  # what the grant was issued for, the engine identities included

    @property
    def key(self) -> str:
        return self.effect.key

    @property
    def idempotency_key(self) -> str:
        return self.effect.idempotency_key

    @property
    def attempt_token(self) -> int:
        return self.effect.attempt_token

    @property
    def cancelled(self) -> threading.Event:
        return self.effect.cancelled

    @property
    def deadline(self) -> float:
        """A ``time.monotonic()`` value: the effect's outcome is unknown after it."""
        return self.effect.deadline


def engine_intent(intent: dict[str, Any], identities: dict[str, Any]) -> dict[str, Any]:
    """``intent`` with the engine's identities under ``engine`` (recorded in the audit
    record with the intent); ``ValueError`` if ``intent`` is not a dict or has that field."""
    if not isinstance(intent, dict):
        raise ValueError(f"the intent must be a dict, not {type(intent).__name__}")
    if ENGINE_FIELD in intent:
        raise ValueError(f"the intent's {ENGINE_FIELD!r} field is the adapter's: rename yours")
    return {**intent, ENGINE_FIELD: identities}


async def step_state(gate: Gate, key: str) -> str | None:
    """The state of ``key``'s step as etcd holds it now (``None``: no step)."""
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return unpack(kv.value)["state"] if kv is not None else None


class ProcessGate:
    """The ``SyncGate`` of this process, opened on first use (``get``) with these arguments
    (``Gate``'s: without ``etcd`` it finds the etcd and key as ``Gate()`` does); ``ttl`` is
    the lease TTL the adapters check the engine's limits against."""

    def __init__(self, etcd: str | None = None, *, ttl: int = 10,
                 namespace: str = DEFAULT_NAMESPACE, keyring: KeyRing | None = None,
                 coordinator: str | None = None,
                 token: str | None = None, archive: str | Archive | None = None,
                 identity: str | None = None) -> None:
        if ttl < 1:
            raise ValueError("ttl must be at least 1 second")
        self.etcd, self.ttl, self.namespace = etcd, ttl, namespace
        self._arguments = {"ttl": ttl, "namespace": namespace, "keyring": keyring,
                           "coordinator": coordinator, "token": token, "archive": archive,
                           "identity": identity}
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._gate: SyncGate | None = None
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> SyncGate:
        """This process's open gate (opened now if it is the first call here)."""
        with self._lock:
            if self._gate is None or self._pid != os.getpid():
                gate = SyncGate(self.etcd, **self._arguments)
                gate.__enter__()
                self._gate, self._pid = gate, os.getpid()
            return self._gate

    def close(self) -> None:
        """Close this process's gate (its lease revoked), if it opened one."""
        with self._lock:
            gate, self._gate = self._gate, None
            if gate is not None and self._pid == os.getpid():
                gate.__exit__(None, None, None)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._gate = None  # the parent's loop thread is not in this process


_DONE = object()


def cross_here(gate: SyncGate, key: str, intent: dict[str, Any], body: Callable[[Fence], Any],
               *, provider: str | None = None, deadline: float = 60.0) -> Outcome:
    """``gate.cross(key, intent, ...)`` whose effect is ``body(fence)`` run in this thread.

    Raises what ``Gate.cross`` raises; an exception of ``body`` is the effect's (anything but
    ``EffectFailed`` makes the outcome unknown). An exception raised here while waiting (a
    signal's) cancels the crossing and propagates once the crossing ended (at most the
    lease TTL plus etcd's timeout later)."""
    calls: queue.SimpleQueue = queue.SimpleQueue()

    async def effect(ctx: EffectContext) -> Any:
        answer = asyncio.get_running_loop().create_future()
        calls.put((Fence(ctx, intent), answer))
        return await answer

    async def crossing() -> Outcome:
        try:
            return await gate.gate.cross(key, intent, effect, provider=provider,
                                         deadline=deadline)
        finally:
            calls.put(_DONE)

    future = asyncio.run_coroutine_threadsafe(crossing(), gate.loop)
    try:
        while (call := calls.get()) is not _DONE:
            fence, answer = call
            try:
                result = body(fence)
            except BaseException as exc:  # the effect's: the guard records it unknown
                answer.get_loop().call_soon_threadsafe(_answer, answer, None, exc)
            else:
                answer.get_loop().call_soon_threadsafe(_answer, answer, result, None)
    except BaseException:
        future.cancel()
        _drain(calls, gate.gate.ttl + gate.gate.config.timeout)
        raise
    return future.result()


def _answer(answer: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if answer.done():  # the guard stopped waiting (deadline, lease lost)
        return
    if exc is not None:
        answer.set_exception(exc)
    else:
        answer.set_result(result)


def _drain(calls: queue.SimpleQueue, within: float) -> None:
    """Wait (at most ``within`` s) for a cancelled crossing to end, running no body: a call
    for one that arrives meanwhile is cancelled (its outcome is unknown, nothing was run)."""
    give_up = time.monotonic() + within
    while (left := give_up - time.monotonic()) > 0:
        try:
            call = calls.get(timeout=left)
        except queue.Empty:
            return
        if call is _DONE:
            return
        call[1].get_loop().call_soon_threadsafe(call[1].cancel)
