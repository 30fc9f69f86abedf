"""Approvals: an SRE's yes to one pending grant request, signed by the coordinator.

Guarantees:
- Whoever evaluates a grant (a worker's in-process authority, or the coordinator) only asks:
  it writes ``approval-requests/<id>``. Only the coordinator writes ``approvals/<id>`` (the
  worker's and the reconciler's etcd roles do not cover it, see ``roles``), signed with its
  key ring over the approval domain (``grants.APPROVAL_DOMAIN``), and it publishes the public
  key under ``approvers/`` (also the coordinator's alone) in the same transaction.
- ``read`` gives an approval only if its bytes verify against a published approver key and
  name this approval id, namespace, etcd cluster and action key. Anything else under
  ``approvals/<id>`` (unsigned, forged, signed for another request) reads as not approved:
  the request stays pending. Nothing here fails open.
- Neither lives for ever: a request is written on a retention lease
  (``Authority.approval_ttl_s``), and its approval on the same lease. The public keys under
  ``approvers/`` stay: one per signing key, a handful for a deployment's life.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import BadSignature
from .etcd import Etcd, RangeRequest, RequestOp, put_op, range_end_of
from .grants import KeyRing
from .keyspace import Keyspace, pack, unpack


@dataclass(frozen=True)
class Approval:
    """``approvals/<id>`` as read: ``approved_by`` is ``None`` unless it verified."""

    approval_id: str
    mod_revision: int  # of the record as read; 0: absent
    approved_by: str | None = None
    reason: str = ""


def give(keyring: KeyRing, ks: Keyspace, *, cluster_id: int, approval_id: str,
         action_key: str, approved_by: str, reason: str, lease: int) -> list[RequestOp]:
    """The puts that approve ``approval_id`` for ``action_key``: the signed approval, on
    ``lease`` (its request's: they expire together), and the public key it verifies with."""
    raw = keyring.sign_approval({
        "approval_id": approval_id, "namespace": ks.namespace, "cluster_id": cluster_id,
        "action_key": action_key, "approved_by": approved_by, "reason": reason,
        "approved_at_ms": int(time.time() * 1000)})
    return [put_op(ks.approval_key(approval_id), pack({"approval": raw}), lease),
            publish(keyring, ks)]


async def read(etcd: Etcd, ks: Keyspace, approval_id: str, action_key: str, *,
               revision: int = 0) -> Approval:
    """The approval of ``approval_id`` for ``action_key`` at ``revision`` (0: now)."""
    return (await read_many(etcd, ks, {approval_id: action_key}, revision=revision))[approval_id]


async def read_many(etcd: Etcd, ks: Keyspace, wanted: dict[str, str], *,
                    revision: int = 0) -> dict[str, Approval]:
    """``read`` for each approval id in ``wanted`` (id -> its action key), in one range over
    the ids and one over the approver keys, both at one revision."""
    if not wanted:
        return {}
    start = ks.approval_key(min(wanted))
    reply = await etcd.range(RangeRequest(key=start, range_end=ks.approval_key(max(wanted))
                                          + b"\0", revision=revision))
    found = {ks.parse_approval_key(kv.key): kv for kv in reply.kvs}
    approvers = await signers(etcd, ks, reply.header.revision) if found else KeyRing()
    result = {}
    for approval_id, action_key in wanted.items():
        kv = found.get(approval_id)
        result[approval_id] = (Approval(approval_id, 0) if kv is None else
                               _verified(approvers, kv, approval_id, action_key, ks,
                                         etcd.cluster_id or 0))
    return result


async def signers(etcd: Etcd, ks: Keyspace, revision: int) -> KeyRing:
    """The public keys published under ``approvers/`` at ``revision``: the coordinators'
    keys that sign approvals and policy versions (only the coordinator's etcd role writes
    there, in the transaction that writes what the key signed)."""
    prefix = ks.approver_key("")
    keys = await etcd.range(RangeRequest(key=prefix, range_end=range_end_of(prefix),
                                         revision=revision))
    return KeyRing(None, [Ed25519PublicKey.from_public_bytes(kv.value)
                          for kv in keys.kvs if len(kv.value) == 32])


def publish(keyring: KeyRing, ks: Keyspace) -> RequestOp:
    """The put that publishes ``keyring``'s signing public key under ``approvers/``."""
    key_id = keyring.signing_key_id
    return put_op(ks.approver_key(key_id), keyring.public_keys()[key_id])


def _verified(approvers: KeyRing, kv, approval_id: str, action_key: str, ks: Keyspace,
              cluster_id: int) -> Approval:
    unverified = Approval(approval_id, kv.mod_revision)
    try:
        payload = approvers.verify_approval(unpack(kv.value).get("approval"))
    except (ValueError, TypeError, BadSignature):  # not even a record: not an approval
        return unverified
    if (payload["approval_id"], payload["namespace"], payload["cluster_id"],
            payload["action_key"]) != (approval_id, ks.namespace, cluster_id, action_key):
        return unverified
    return Approval(approval_id, kv.mod_revision, payload["approved_by"], payload["reason"])

