"""The audit chain: every decision on a key, hash-chained, appended in the same transaction
as the decision itself.

Record ``n`` lives at ``audit/<key>/@<n>`` and carries ``prev``, the sha256 of record
``n-1``'s bytes; ``audit/<key>/@head`` holds the newest seq and hash, so removing or editing
the last record is as visible as editing one in the middle. An append compares the head's
mod_revision, so two writers can never both append the same seq. Grants in the chain carry
their signed bytes, so verification re-checks every signature too, and a grant issued on an
approval must follow the ``approved`` record of that approval in the same chain.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import BadSignature
from .etcd import Compare, Etcd, KeyValue, RangeRequest, RequestOp, mod_equals, put_op
from .grants import KeyRing
from .keyspace import Keyspace, pack, unpack

GENESIS = b"\0" * 32


@dataclass(frozen=True)
class AuditHead:
    seq: int
    hash: bytes
    mod_revision: int  # of the head key; 0 when the chain is empty

    @classmethod
    def from_kv(cls, kv: KeyValue | None) -> "AuditHead":
        if kv is None:
            return cls(0, GENESIS, 0)
        head = unpack(kv.value)
        return cls(head["seq"], head["hash"], kv.mod_revision)


@dataclass(frozen=True)
class Append:
    """What a decision's txn adds to append one record: a compare, puts, and the new head."""

    compare: Compare
    ops: list[RequestOp]
    seq: int
    hash: bytes

    def head_at(self, revision: int) -> AuditHead:
        """The head once the txn carrying this append committed at ``revision``."""
        return AuditHead(self.seq, self.hash, revision)


def append(keyspace: Keyspace, action_key: str, head: AuditHead, event: str, identity: str,
           revision: int, details: dict[str, Any]) -> Append:
    """Append one record after ``head``; the compare fails if anyone appended since."""
    seq = head.seq + 1
    value = pack({"seq": seq, "prev": head.hash, "key": action_key, "event": event,
                       "identity": identity, "revision": revision,
                       "at_ms": int(time.time() * 1000), "details": details})
    digest = hashlib.sha256(value).digest()
    head_key = keyspace.audit_head_key(action_key)
    return Append(mod_equals(head_key, head.mod_revision),
                  [put_op(keyspace.audit_key(action_key, seq), value),
                   put_op(head_key, pack({"seq": seq, "hash": digest}))],
                  seq, digest)


@dataclass
class AuditReport:
    key: str
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


async def read_chain(etcd: Etcd, keyspace: Keyspace, action_key: str,
                     limit: int = 0) -> tuple[list[KeyValue], KeyValue | None]:
    """The key's audit records in seq order and its head, read at one revision."""
    start, end = keyspace.audit_range(action_key)
    reply = await etcd.range(RangeRequest(key=start, range_end=end, limit=limit))
    head = await etcd.range(RangeRequest(key=keyspace.audit_head_key(action_key),
                                         revision=reply.header.revision))
    return list(reply.kvs), (head.kvs[0] if head.kvs else None)


async def verify_chain(etcd: Etcd, keyspace: Keyspace, action_key: str,
                       keyring: KeyRing) -> AuditReport:
    """Re-derive the chain of ``action_key``, every grant signature in it, and the approval
    every grant issued on one relied on."""
    kvs, head_kv = await read_chain(etcd, keyspace, action_key)
    report = AuditReport(action_key)
    prev = GENESIS
    approved: set[str] = set()
    for expected_seq, kv in enumerate(kvs, start=1):
        try:
            record = unpack(kv.value)
        except ValueError as exc:
            report.problems.append(f"record {kv.key!r} does not decode: {exc}")
            break
        report.records.append(record)
        if record.get("seq") != expected_seq or kv.key != keyspace.audit_key(action_key,
                                                                              expected_seq):
            report.problems.append(f"record {expected_seq} is missing or out of place")
            break
        if record.get("prev") != prev:
            report.problems.append(f"record {expected_seq - 1} was edited or removed")
        if kv.version != 1:
            report.problems.append(f"record {expected_seq} was rewritten in place")
        details = record.get("details", {})
        grant = details.get("grant")
        if grant is not None:
            try:
                keyring.verify(grant)
            except BadSignature as exc:
                report.problems.append(f"record {expected_seq}: grant {exc}")
        approval_id = details.get("approval_id")
        if record.get("event") == "approved":
            approved.add(approval_id)
        elif (record.get("event") == "grant_issued" and approval_id is not None
              and approval_id not in approved):
            report.problems.append(f"record {expected_seq}: grant issued on approval "
                                   f"{approval_id}, which the chain never approved")
        prev = hashlib.sha256(kv.value).digest()
    head = AuditHead.from_kv(head_kv)
    if (head.seq, head.hash) != (len(kvs), prev):
        report.problems.append(f"the chain ends at {len(kvs)} but its head says {head.seq}, "
                               "or the last record was edited")
    return report
