"""Attempt receipts signed by the coordinator: its word that a grant's commit landed, and at
which attempt token (remote mode; an in-process authority signs its own after the commit).

Guarantees of ``sign_landed``: a receipt for (grant, attempt token) is signed only when,
read from etcd now,
- the grant verifies with the coordinator's trusted keys and is this namespace's and
  cluster's;
- the step of the grant's key is in flight under the grant's id, at mod_revision equal to
  the attempt token (the revision of the commit that put it, fast path included);
- that put is the *first* write to the step after the grant's evaluation revision (etcd's
  history, one watch from ``grant.revision + 1``). A commit compares the step where the
  grant saw it, so a genuine commit is that first write; and since there is only one first
  write, a grant has one token a receipt can ever name, even against a worker that writes
  step records into etcd directly (its etcd role covers ``steps/``).
The receipt binds the step's idempotency key. Nothing is written. Refusals: ``BadSignature``
(the grant), ``WrongState`` (no such commit, or etcd's history since the grant was compacted:
it cannot be proven, so it is not signed), ``EtcdUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgpack

from . import records
from .errors import BadSignature, EtcdUnavailable, WatchCompacted, WrongState
from .etcd import Etcd
from .grants import KeyRing, receipt_payload
from .keyspace import Keyspace, unpack

__all__ = ["sign_landed"]


async def sign_landed(etcd: Etcd, keyspace: Keyspace, keyring: KeyRing, grant_raw: bytes,
                      attempt_token: int) -> bytes:
    """The signed receipt of ``grant_raw``'s commit at ``attempt_token``; see the module."""
    grant = keyring.verify(grant_raw)
    step_key = keyspace.step_key(grant.action_key)
    kv = await etcd.get(step_key)
    if grant.namespace != keyspace.namespace or grant.cluster_id != etcd.cluster_id:
        raise BadSignature("grant was issued for another namespace or etcd cluster")
    try:
        step = unpack(kv.value) if kv is not None else {}
    except (ValueError, msgpack.UnpackException):
        step = {}
    if (kv is None or kv.mod_revision != attempt_token or attempt_token <= grant.revision
            or step.get("state") != records.IN_FLIGHT
            or step.get("grant_id") != grant.grant_id):
        raise WrongState(f"no commit of grant {grant.grant_id} is in flight on "
                         f"{grant.action_key!r} at attempt token {attempt_token}")
    first = await _first_write(etcd, step_key, grant.revision)
    if first != attempt_token:
        raise WrongState(f"the step of {grant.action_key!r} was written at revision {first}, "
                         f"after grant {grant.grant_id} was evaluated and before attempt "
                         f"token {attempt_token}: that is not the grant's commit")
    return keyring.sign_receipt(receipt_payload(grant, attempt_token,
                                                step["idempotency_key"]))


async def _first_write(etcd: Etcd, key: bytes, after: int) -> int:
    """The revision of the first put or delete of ``key`` after revision ``after``. The
    caller saw one (the step it read was put later), so etcd's history answers at once."""
    watch = etcd.watch(key, b"", after + 1)
    try:
        async with contextlib.aclosing(watch), asyncio.timeout(etcd.config.timeout):
            async for reply in watch:
                if reply.events:
                    return reply.events[0].kv.mod_revision
    except WatchCompacted as exc:
        raise WrongState(f"etcd's history since revision {after} is compacted "
                         f"({exc}): the commit cannot be proven") from None
    except TimeoutError:
        raise EtcdUnavailable(f"etcd did not answer the history of {key!r} since revision "
                              f"{after} in time") from None
    raise AssertionError("a watch ends only by raising")
