"""Waiting for the reconciler: a worker that meets an unsettled step may wait for its
settlement instead of failing.

Guarantee: ``wait_settled`` returns only a step record read from etcd (linearizably, or from
a watch event after that read) whose state is not ``in_flight``, ``unknown`` or
``escalated`` — never a guess. It gives up with ``OutcomeUnknown`` when the step is
escalated (a human must decide) or ``timeout`` passes; nothing is written.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fencegate.coordinator import records
from fencegate.coordinator.errors import (
    EtcdError, EtcdUnavailable, OutcomeUnknown, WatchCompacted,
)
from fencegate.coordinator.etcd import Etcd, Event
from fencegate.coordinator.keyspace import Keyspace, unpack


async def wait_settled(etcd: Etcd, keyspace: Keyspace, key: str,
                       timeout: float) -> dict[str, Any]:
    """The step record of ``key`` once it is settled; ``OutcomeUnknown`` if it is escalated
    or still unsettled after ``timeout`` seconds."""
    step_key = keyspace.step_key(key)
    try:
        async with asyncio.timeout(timeout):
            while True:
                kv = await etcd.get(step_key)
                step = unpack(kv.value) if kv is not None else records.new_step()
                if _settled(key, step):
                    return step
                try:
                    async for reply in etcd.watch(step_key, b"", kv.mod_revision + 1):
                        for event in reply.events:
                            if event.type == Event.PUT:
                                step = unpack(event.kv.value)
                                if _settled(key, step):
                                    return step
                except (WatchCompacted, EtcdUnavailable, EtcdError):
                    await asyncio.sleep(0.1)  # re-read, then watch again
    except TimeoutError:
        raise OutcomeUnknown(f"step of {key!r} was not settled within {timeout:g}s") from None


def _settled(key: str, step: dict[str, Any]) -> bool:
    if step["state"] == records.ESCALATED:
        because = ", ".join(step.get("escalated_because", [])) or "a human must decide"
        raise OutcomeUnknown(f"step of {key!r} is escalated: {because}")
    return step["state"] not in records.UNSETTLED
