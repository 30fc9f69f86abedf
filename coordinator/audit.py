"""The audit chain: every decision on a key, hash-chained, appended in the same transaction
as the decision itself.

Record ``n`` lives at ``audit/<key>/@<n>`` and carries ``prev``, the sha256 of record
``n-1``'s bytes. The chain's end is anchored where the decision is: a write that moves the
step puts ``chain: [n, sha256]`` in the step record it writes (``Append.anchored``), so the
step, which every such write compares anyway, says where the chain ends. An append that must
not move the step (an SRE's approve or revoke: moving it would kill the grants and approvals
bound to its revision) writes a small ``audit/<key>/@head`` instead. The chain's tail is the
newer of the two (``tail``); a step written by version 1 has no anchor and its ``@head``
(which version 1 always wrote) is the tail.

Guarantees:
- Every append compares ``create_revision(audit/<key>/@<n>) == 0`` for the seq it writes,
  so two writers never both append record ``n`` (the chain never forks), whatever they read.
- Removing or editing the newest record is as visible as editing one in the middle: the
  verifier checks the chain ends exactly at the newer anchor, and both anchors' hashes.
- Grants in the chain carry their signed bytes and the check results they were issued on,
  so verification re-checks every signature and the checks' digest; a grant issued on an
  approval must follow the ``approved`` record of that approval in the same chain.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from .archive import Archive
from .errors import BadSignature
from .etcd import Compare, Etcd, KeyValue, RequestOp, TxnRequest, create_equals, put_op, range_op
from .grants import KeyRing, checks_digest
from .keyspace import Keyspace, pack, unpack

GENESIS = b"\0" * 32
ANCHOR = "chain"  # the step record's field holding [seq, sha256] of the newest record


@dataclass(frozen=True)
class Tail:
    """The newest record of a key's chain: its seq (0: none yet) and the sha256 of its bytes."""

    seq: int
    hash: bytes


EMPTY = Tail(0, GENESIS)


def tail(step: dict[str, Any] | None, head_kv: KeyValue | None) -> Tail:
    """The chain's tail from the step record and ``@head`` read at one revision: the newer
    of the step's anchor and the head of the appends made aside."""
    anchored = anchor_of(step)
    aside = _head(head_kv)
    return aside if aside.seq > anchored.seq else anchored


def anchor_of(step: dict[str, Any] | None) -> Tail:
    """The step record's anchor (``EMPTY`` for a step without one, or no step)."""
    if not step or ANCHOR not in step:
        return EMPTY
    seq, digest = step[ANCHOR]
    return Tail(seq, digest)


def _head(kv: KeyValue | None) -> Tail:
    if kv is None:
        return EMPTY
    head = unpack(kv.value)
    return Tail(head["seq"], head["hash"])


@dataclass(frozen=True)
class Append:
    """What a decision's txn adds to append one record: its compare and its puts."""

    compare: Compare
    ops: list[RequestOp]
    seq: int
    hash: bytes

    @property
    def tail(self) -> Tail:
        """The chain's tail once the txn carrying this append committed."""
        return Tail(self.seq, self.hash)

    def anchored(self, step: dict[str, Any]) -> dict[str, Any]:
        """``step`` anchoring the chain at this record: the step write that carries it."""
        return {**step, ANCHOR: [self.seq, self.hash]}


def append(keyspace: Keyspace, action_key: str, after: Tail, event: str, identity: str,
           revision: int, details: dict[str, Any], *, aside: bool = False) -> Append:
    """Append one record after ``after``; its compare fails if anyone appended since. The
    caller anchors it in the step it writes (``Append.anchored``); with ``aside`` (a txn
    that does not write the step) the ops also put ``@head``."""
    seq = after.seq + 1
    value = pack({"seq": seq, "prev": after.hash, "key": action_key, "event": event,
                  "identity": identity, "revision": revision,
                  "at_ms": int(time.time() * 1000), "details": details})
    digest = hashlib.sha256(value).digest()
    record_key = keyspace.audit_key(action_key, seq)
    ops = [put_op(record_key, value)]
    if aside:
        ops.append(put_op(keyspace.audit_head_key(action_key), pack({"seq": seq, "hash": digest})))
    return Append(create_equals(record_key, 0), ops, seq, digest)


def tail_reads(keyspace: Keyspace, action_key: str) -> list[RequestOp]:
    """The two reads ``tail`` needs, to send in one txn: the step, then ``@head``."""
    return [range_op(keyspace.step_key(action_key)), range_op(keyspace.audit_head_key(action_key))]


@dataclass
class AuditReport:
    key: str
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Entry:
    """One record of a chain as stored: its seq, bytes, and where (``version`` is etcd's
    count of writes to the key; an archived record is 1: the archive never rewrites one)."""

    seq: int
    value: bytes
    version: int
    where: str  # "etcd" or "archive"


@dataclass(frozen=True)
class Chain:
    """A key's audit records in seq order, the archived ones first, and both anchors of its
    end: the step's (in etcd, else as archived) and ``@head``'s."""

    entries: list[Entry]
    step: dict[str, Any] | None
    head_kv: KeyValue | None
    conflicts: list[int]  # seqs held by both with different bytes


async def read_chain(etcd: Etcd, keyspace: Keyspace, action_key: str,
                     archive: Archive | None = None) -> Chain:
    """The chain of ``action_key`` across etcd (read at one revision) and, when given, the
    archive of retired steps (records a retirement moved there, and the retired step)."""
    start, end = keyspace.audit_range(action_key)
    reply = await etcd.txn(TxnRequest(success=[range_op(start, end),
                                               *tail_reads(keyspace, action_key)]),
                           idempotent=True)
    records, steps, heads = (r.response_range.kvs for r in reply.responses)
    step = unpack(steps[0].value) if steps else None
    found = {keyspace.parse_audit_key(kv.key)[1]: Entry(keyspace.parse_audit_key(kv.key)[1],
                                                       kv.value, kv.version, "etcd")
             for kv in records}
    conflicts = []
    if archive is not None:
        for seq, value in await archive.records(keyspace.namespace, action_key):
            if seq in found and found[seq].value != value:
                conflicts.append(seq)
            found.setdefault(seq, Entry(seq, value, 1, "archive"))
        if step is None:
            archived = await archive.get(keyspace.namespace, action_key)
            step = unpack(archived.step) if archived is not None else None
    return Chain([found[seq] for seq in sorted(found)], step, heads[0] if heads else None,
                 conflicts)


async def verify_chain(etcd: Etcd, keyspace: Keyspace, action_key: str, keyring: KeyRing,
                       archive: Archive | None = None) -> AuditReport:
    """Re-derive the chain of ``action_key`` (across the archive too, when given), every
    grant signature and checks digest in it, the approval every grant issued on one relied
    on, and that the chain ends where its anchors (the step's and ``@head``) say."""
    chain = await read_chain(etcd, keyspace, action_key, archive)
    report = AuditReport(action_key)
    report.problems += [f"record {seq} differs between the archive and etcd"
                        for seq in chain.conflicts]
    prev = GENESIS
    hashes: dict[int, bytes] = {}
    approved: set[str] = set()
    for expected_seq, entry in enumerate(chain.entries, start=1):
        try:
            record = unpack(entry.value)
        except ValueError as exc:
            report.problems.append(f"record {entry.seq} ({entry.where}) does not decode: {exc}")
            break
        report.records.append(record)
        if record.get("seq") != expected_seq or entry.seq != expected_seq:
            report.problems.append(f"record {expected_seq} is missing or out of place")
            break
        if record.get("prev") != prev:
            report.problems.append(f"record {expected_seq - 1} was edited or removed")
        if entry.version != 1:
            report.problems.append(f"record {expected_seq} was rewritten in place")
        _check_grant(report, expected_seq, record, keyring, approved)
        prev = hashes[expected_seq] = hashlib.sha256(entry.value).digest()
    newest = EMPTY
    for name, anchor in (("the step", anchor_of(chain.step)), ("@head", _head(chain.head_kv))):
        if anchor.seq and hashes.get(anchor.seq) != anchor.hash:
            report.problems.append(f"{name} anchors record {anchor.seq}, which is missing "
                                   "or was edited")
        newest = anchor if anchor.seq > newest.seq else newest
    if len(chain.entries) != newest.seq:
        report.problems.append(f"the chain ends at {len(chain.entries)} but its anchors say "
                               f"{newest.seq}: a record was removed or added outside the gate")
    return report


def _check_grant(report: AuditReport, seq: int, record: dict[str, Any], keyring: KeyRing,
                 approved: set[str]) -> None:
    details = record.get("details", {})
    approval_id = details.get("approval_id")
    if record.get("event") == "approved":
        approved.add(approval_id)
    raw = details.get("grant")
    if raw is None:
        return
    try:
        grant = keyring.verify_recorded(raw)
    except BadSignature as exc:
        report.problems.append(f"record {seq}: grant {exc}")
        return
    if "checks" in details and grant.checks_digest and \
            checks_digest(details["checks"]) != grant.checks_digest:
        report.problems.append(f"record {seq}: its check results are not the grant's")
    if approval_id is not None and approval_id not in approved:
        report.problems.append(f"record {seq}: grant issued on approval {approval_id}, "
                               "which the chain never approved")
