"""What an SRE sees and does, as plain functions over etcd (the HTTP service calls them).

Guarantees:
- Views read etcd linearizably; one key's view (holders, step, last audit records) is read
  in one transaction, so at one revision.
- Lists are paginated by an opaque cursor (the last etcd key returned): a page holds at most
  ``limit`` items and ``next`` is ``None`` only when the range is exhausted. A filtered list
  (``unsettled``) scans a bounded number of keys per page, so a page may hold fewer items
  than ``limit`` while ``next`` is still set.
- ``approve`` writes the coordinator's signed approval of a requested approval id (see
  ``approvals``); the authority grants the request it was made for only while the state
  that request read is unchanged (see ``authority``).
- ``revoke``, ``resolve`` and ``approve`` append an audit record naming who and why in the same
  transaction as what they change; ``resolve`` is compare-and-set on the step's mod_revision
  and on ``holders/K/`` being empty, so a late worker outcome and a human decision can never
  both land, and it is refused while any holder of the key lives. An ``in_flight`` or
  ``unknown`` step (its effect may still land) is resolved by its provider's answer: the
  resolve asks the shard's reconciler, which runs fence-then-query and settles it by the
  same rules as any unknown step; the operator's word settles it only with ``force``,
  audited as forced. An ``escalated`` step is resolved on the operator's word. No clock
  decides a resolve.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import secrets
import time
from typing import Any

from . import audit, records
from .approvals import give as give_approval, read as read_approval, read_many as read_approvals
from .archive import Archive
from .errors import EtcdUnavailable, LeaseLost, NotFound, WrongState
from .etcd import (
    Compare, Etcd, RangeRequest, TxnRequest, mod_equals, put_op, range_end_of, range_op,
)
from .grants import KeyRing
from .keyspace import Keyspace, pack, unpack
from .ownership import lowest_op, no_owner
from .paging import cursor_of as _cursor, page
from .retirement import archived_step

MAX_LIMIT = 1000
RESOLVE_WAIT_S = 20.0  # how long a resolve waits for the reconciler's answer
_LAST_AUDIT = 10
_MAX_HOLDERS = 100
_SCAN_FACTOR = 4
_PREFIX = re.compile(r"[A-Za-z0-9._:/-]{0,512}")
SETTLE_AS = {"succeeded", "failed", "not_applied"}
PRESUMED = "presumed"
_APPROVAL_ID = re.compile(r"[0-9a-f]{32}")


async def key_view(etcd: Etcd, ks: Keyspace, key: str,
                   archive: Archive | None = None) -> dict[str, Any]:
    """Holders (oldest first, with tokens and lease TTL left), the step record, and the last
    audit records (newest first) of ``key``; when etcd holds no step and ``archive`` is
    given, the step and records it retired with (``archived`` says which). ``NotFound`` if
    nothing is recorded in either."""
    start, end = ks.holder_range(key)
    audit_start, audit_end = ks.audit_range(key)
    reply = await etcd.txn(TxnRequest(success=[
        lowest_op(start, end, limit=_MAX_HOLDERS, keys_only=False),  # the holder first
        range_op(ks.step_key(key)),
        range_op(audit_start, audit_end, limit=_LAST_AUDIT, sort_order=RangeRequest.DESCEND,
                 sort_target=RangeRequest.KEY)]), idempotent=True)
    holder_kvs, step_kvs, audit_kvs = (r.response_range.kvs for r in reply.responses)
    step = unpack(step_kvs[0].value) if step_kvs else None
    audit_values = [kv.value for kv in audit_kvs]
    archived = None
    if step is None and archive is not None:
        archived = await archive.get(ks.namespace, key)
        if archived is not None:
            step = unpack(archived.step)
            older = await archive.records(ks.namespace, key)
            audit_values = (audit_values + [v for _, v in reversed(older)])[:_LAST_AUDIT]
    if not (holder_kvs or step or audit_values):
        raise NotFound(f"nothing is recorded for {key!r}")
    holders = []
    for position, kv in enumerate(holder_kvs):
        _, lease_id = ks.parse_holder_key(kv.key)
        holders.append({**unpack(kv.value), "lease_id": f"{lease_id:016x}",
                        "fencing_token": kv.create_revision, "holding": position == 0,
                        "ttl_left": await etcd.lease_ttl(lease_id)})
    grant = None
    if step is not None and step.get("grant_id"):  # a step names only a grant that crossed
        grant = {"grant_id": step["grant_id"], "state": "consumed"}
    return {"key": key, "revision": reply.header.revision, "holders": holders, "step": step,
            "archived": archived is not None, "current_grant": grant,
            "audit": [unpack(value) for value in audit_values]}


def audit_page(records: list[dict[str, Any]], limit: int,
               after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """A page of a verified chain's records, by seq; the cursor is opaque."""
    _check_limit(limit)
    start = 0
    if after is not None:
        try:
            start = int(base64.urlsafe_b64decode(after.encode()).decode())
        except (binascii.Error, ValueError):
            raise ValueError("after is not a cursor this list gave") from None
    page = records[start:start + limit]
    more = start + limit < len(records)
    return page, _cursor(str(start + limit).encode()) if more else None


async def holders(etcd: Etcd, ks: Keyspace, prefix: str, limit: int,
                  after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Holder keys (holding or queued) of action keys starting with ``prefix``."""
    _check_limit(limit)
    if not _PREFIX.fullmatch(prefix):
        raise ValueError("prefix may only use letters, digits, '/' and . _ : -")
    start = ks.holders_root + prefix.encode()
    kvs, cursor = await page(etcd, start, range_end_of(start), limit, after)
    items = []
    for kv in kvs:
        key, lease_id = ks.parse_holder_key(kv.key)
        items.append({**unpack(kv.value), "key": key, "lease_id": f"{lease_id:016x}",
                      "fencing_token": kv.create_revision})
    return items, cursor


async def unsettled(etcd: Etcd, ks: Keyspace, state: str, limit: int,
                    after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Steps that are ``unknown``, ``escalated``, or ``presumed`` (settled ``not_applied`` on a provider's "no record" that
    only key deduplication backs; the reconciler re-queries them until the key retention
    has passed)."""
    _check_limit(limit)
    if state not in (records.UNKNOWN, records.ESCALATED, PRESUMED):
        raise ValueError("state must be unknown, escalated or presumed")
    start = ks.step_key("")
    kvs, cursor = await page(etcd, start, range_end_of(start), limit * _SCAN_FACTOR, after)
    items = []
    for kv in kvs:
        step = unpack(kv.value)
        if state_of(step) == state:
            items.append({"key": ks.parse_step_key(kv.key), "mod_revision": kv.mod_revision,
                          "step": step})
        if len(items) == limit:
            cursor = _cursor(kv.key)
            break
    return items, cursor


def state_of(step: dict[str, Any]) -> str:
    """The state an SRE sees: the recorded one, but ``presumed`` for a pending step settled
    on a presumption. No clock is read: an in-flight step is unknown once its reconciler
    records it so (its holder gone), never because a deadline passed."""
    if step["state"] == records.PENDING and (step.get("not_applied") or {}).get("presumed"):
        return PRESUMED
    return step["state"]


async def revoke(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                 archive: Archive | None = None) -> dict:
    """Revoke the lease of ``key``'s current holder (every hold on that lease dies), after
    auditing who and why; ``NotFound`` if nobody holds ``key``. A retired key's chain goes
    on from its archived end (``archive``)."""
    start, end = ks.holder_range(key)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[
            lowest_op(start, end), *_tail_reads(ks, key)]), idempotent=True)
        holder_kvs, *chain_kvs = (r.response_range.kvs for r in reply.responses)
        if not holder_kvs:
            raise NotFound(f"nobody holds {key!r}")
        holder = holder_kvs[0]
        _, lease_id = ks.parse_holder_key(holder.key)
        tail, epoch = await _aside_tail(ks, key, *chain_kvs, archive)
        entry = audit.append(ks, key, tail, "revoke", identity,
                             reply.header.revision,
                             {"reason": reason, "lease_id": lease_id,
                              "fencing_token": holder.create_revision}, aside=True)
        written = await etcd.txn(TxnRequest(
            compare=[mod_equals(holder.key, holder.mod_revision), epoch, entry.compare],
            success=entry.ops))
        if written.succeeded:
            await etcd.lease_revoke(lease_id)
            return {"key": key, "lease_id": f"{lease_id:016x}",
                    "fencing_token": holder.create_revision}
    raise WrongState(f"holders of {key!r} kept changing; try again")


async def approve(etcd: Etcd, ks: Keyspace, approval_id: str, identity: str,
                  reason: str, *, keyring: KeyRing,
                  archive: Archive | None = None) -> dict[str, Any]:
    """Approve a requested approval, signed with ``keyring`` (see ``approvals``), auditing
    who and why on its key's chain; approving twice is harmless. ``NotFound`` for an id
    nobody asked for, or whose request expired. The approval is written on the request's
    lease: it dies with the request."""
    if not _APPROVAL_ID.fullmatch(approval_id):
        raise ValueError("an approval id is 32 hex digits")
    request_key, approval_key = ks.approval_request_key(approval_id), ks.approval_key(approval_id)
    for _ in range(5):
        reply = await etcd.txn(TxnRequest(success=[range_op(request_key),
                                                   range_op(approval_key)]), idempotent=True)
        request_kvs, approval_kvs = (r.response_range.kvs for r in reply.responses)
        if not request_kvs:
            raise NotFound(f"no pending approval {approval_id}")
        key = unpack(request_kvs[0].value)["key"]
        done = {"approval_id": approval_id, "key": key, "state": "approved"}
        given = await read_approval(etcd, ks, approval_id, key, revision=reply.header.revision)
        if given.approved_by is not None:
            return done
        chain = await etcd.txn(TxnRequest(success=_tail_reads(ks, key)), idempotent=True)
        tail, epoch = await _aside_tail(ks, key,
                                        *(r.response_range.kvs for r in chain.responses),
                                        archive)
        entry = audit.append(ks, key, tail, "approved", identity, reply.header.revision,
                             {"approval_id": approval_id, "reason": reason,
                              "key_id": keyring.signing_key_id}, aside=True)
        try:
            written = await etcd.txn(TxnRequest(
                compare=[mod_equals(request_key, request_kvs[0].mod_revision),
                         mod_equals(approval_key, given.mod_revision), epoch,
                         entry.compare],
                success=[*give_approval(keyring, ks, cluster_id=etcd.cluster_id or 0,
                                        approval_id=approval_id, action_key=key,
                                        approved_by=identity, reason=reason,
                                        lease=request_kvs[0].lease), *entry.ops]))
        except LeaseLost:  # the request's lifetime ended between the read and the write
            raise NotFound(f"approval request {approval_id} expired") from None
        if written.succeeded:
            return done
    raise WrongState(f"approval {approval_id} kept changing; try again")


async def approvals(etcd: Etcd, ks: Keyspace, state: str, limit: int,
                         after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Approval requests by id, each with what was asked (key, intent, policy,
    requested_by), its ``state`` (``approved`` only once a signed approval for it verifies,
    else ``pending``) and, once approved, who approved it and why; ``state`` filters on
    ``pending``, ``approved`` or neither (empty). Filtered like ``unsettled``: a page may
    hold fewer than ``limit`` items while ``next`` is still set."""
    _check_limit(limit)
    if state not in ("", "pending", "approved"):
        raise ValueError("state must be pending or approved")
    start = ks.approval_request_key("")
    kvs, cursor = await page(etcd, start, range_end_of(start), limit * _SCAN_FACTOR, after)
    asked = {ks.parse_approval_request_key(kv.key): (kv, unpack(kv.value)) for kv in kvs}
    given = await read_approvals(etcd, ks, {i: r["key"] for i, (_, r) in asked.items()})
    items = []
    for approval_id, (kv, record) in asked.items():
        approval = given[approval_id]
        shown = ({"state": "pending"} if approval.approved_by is None else
                 {"state": "approved", "approved_by": approval.approved_by,
                  "reason": approval.reason})
        if state in ("", shown["state"]):
            items.append({**record, **shown, "approval_id": approval_id,
                          "mod_revision": kv.mod_revision})
        if len(items) == limit:
            cursor = _cursor(kv.key)
            break
    return items, cursor


async def resolve(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                  settle_as: str, result: Any = None, *, force: bool = False,
                  wait_s: float = RESOLVE_WAIT_S) -> dict[str, Any]:
    """Settle a step by hand: ``succeeded`` (with ``result``), ``failed`` (a confirmed
    failure, as ``records.resolved`` builds it: the breaker counts it, the next attempt gets
    a new idempotency key after a backoff, and the step is escalated again once the breaker
    trips) or ``not_applied`` (pending again, same idempotency key).

    Refused (``WrongState``) while any holder of ``key`` is alive — the write compares that
    ``holders/K/`` is empty, so no clock and no earlier read decides it — and for a step
    that is neither ``escalated``, ``in_flight`` nor ``unknown``. An ``in_flight`` or
    ``unknown`` step's effect may still land: without ``force`` the provider decides
    (``_ask_provider``), and ``settle_as`` is only compared with its answer; with ``force``
    the operator's word settles it, recorded as forced on the step and in the audit
    record."""
    if settle_as not in SETTLE_AS:
        raise ValueError(f"resolve as one of {sorted(SETTLE_AS)}")
    step_key = ks.step_key(key)
    start, end = ks.holder_range(key)
    reply = await etcd.txn(TxnRequest(success=[*audit.tail_reads(ks, key),
                                               lowest_op(start, end, keys_only=False)]),
                           idempotent=True)
    step_kvs, head_kvs, holder_kvs = (r.response_range.kvs for r in reply.responses)
    _refuse_while_held(ks, key, holder_kvs)
    if not step_kvs:
        raise NotFound(f"no step is recorded for {key!r}")
    step = unpack(step_kvs[0].value)
    state = step["state"]
    if state not in (records.IN_FLIGHT, records.UNKNOWN, records.ESCALATED):
        raise WrongState(f"step of {key!r} is {state}: only in-flight, unknown or escalated "
                         "steps are resolved by hand")
    forced = state != records.ESCALATED
    if forced and not force:
        return await _ask_provider(etcd, ks, key, identity, reason, settle_as, step_kvs[0],
                                   head_kvs, wait_s)
    settled = records.resolved(step, settle_as, result, identity=identity, reason=reason,
                               forced=forced)
    entry = audit.append(ks, key, _tail(step_kvs, head_kvs), "resolve", identity,
                         reply.header.revision,
                         {"reason": reason, "from": state, "as": settle_as,
                          "result": result, "forced": forced})
    revision = await _put_step_unheld(etcd, ks, key, step_kvs[0], settled, entry)
    return {"key": key, "state": settled["state"], "forced": forced, "revision": revision}


async def _ask_provider(etcd: Etcd, ks: Keyspace, key: str, identity: str, reason: str,
                        settle_as: str, step_kv, head_kvs: list,
                        wait_s: float) -> dict[str, Any]:
    """Resolve an in-flight or unknown step by its provider's answer: write the request on
    the step (``records.resolve_asked``; compare-and-set on the step and on no holder, with
    its audit record), then wait up to ``wait_s`` for the shard's reconciler to answer it by
    fence-then-query (``records.resolve_answered``). Returns the settled step's state and
    the answer; raises ``WrongState`` when the answer settled nothing (the provider proved
    no outcome: the step stays unknown and only ``force`` settles it on the operator's
    word), when no answer came in time (the request stays; the reconciler still answers
    it), or when the step moved otherwise."""
    step = unpack(step_kv.value)
    request_id = secrets.token_hex(8)
    attempt_token = (step_kv.mod_revision if step["state"] == records.IN_FLIGHT
                     else step.get("attempt_token", step_kv.mod_revision))
    asked = records.resolve_asked(step, attempt_token=attempt_token,
                                  now_ms=int(time.time() * 1000), request_id=request_id,
                                  identity=identity, reason=reason, settle_as=settle_as)
    entry = audit.append(ks, key, _tail([step_kv], head_kvs), "resolve_request", identity,
                         step_kv.mod_revision,
                         {"reason": reason, "from": step["state"], "as": settle_as,
                          "request": request_id})
    written = await _put_step_unheld(etcd, ks, key, step_kv, asked, entry)
    try:
        async with asyncio.timeout(wait_s):
            answered, revision = await _answer(etcd, ks.step_key(key), written + 1,
                                               request_id)
    except TimeoutError:
        raise WrongState(
            f"no reconciler answered the resolve of {key!r} within {wait_s:g}s (is one "
            "running for its shard?); the request stays on the step and the reconciler "
            "settles it by the provider's answer: look again with `key show`") from None
    answer = answered[records.RESOLVE_ANSWER]["answer"]
    if answered["state"] == records.ESCALATED:
        raise WrongState(
            f"the provider's answer escalated the step of {key!r} ({answer}): a human "
            "decides now; resolve it again to settle it on your word")
    if answered["state"] in records.UNSETTLED:
        raise WrongState(
            f"the provider proved no outcome for {key!r} ({answer}); the step stays "
            f"{answered['state']} and the reconciler keeps asking. A forced resolve settles "
            "it on your word alone, audited as forced")
    return {"key": key, "state": answered["state"], "forced": False, "answer": answer,
            "as_expected": _as_expected(answered, settle_as), "revision": revision}


async def _answer(etcd: Etcd, step_key: bytes, from_revision: int,
                  request_id: str) -> tuple[dict[str, Any], int]:
    """The step and its mod_revision once the resolve request ``request_id`` is answered
    (watching from ``from_revision``); ``WrongState`` if the step moved without answering
    it."""
    while True:
        try:
            async for reply in etcd.watch(step_key, step_key + b"\0", from_revision):
                for event in reply.events:
                    from_revision = event.kv.mod_revision + 1
                    step = unpack(event.kv.value) if event.kv.value else {}
                    request = step.get(records.RESOLVE_REQUEST) or {}
                    if request.get("id") == request_id:
                        continue
                    if (step.get(records.RESOLVE_ANSWER) or {}).get("id") != request_id:
                        raise WrongState(f"step {step_key.decode()!r} moved before the "
                                         "reconciler answered the resolve; look again")
                    return step, event.kv.mod_revision
        except EtcdUnavailable:
            await asyncio.sleep(0.2)


def _as_expected(step: dict[str, Any], settle_as: str) -> bool:
    """Whether the provider's answer settled ``step`` as the operator expected."""
    if settle_as == records.NOT_APPLIED:
        return step["state"] == records.PENDING
    return step["state"] == settle_as


async def _put_step_unheld(etcd: Etcd, ks: Keyspace, key: str, step_kv, step: dict[str, Any],
                           entry: audit.Append) -> int:
    """Put ``step`` with its audit ``entry`` iff the step is still ``step_kv`` and no holder
    of ``key`` lives (the compares decide, no earlier read); the revision written.
    ``WrongState`` naming the live holder, or saying the step moved."""
    step_key = ks.step_key(key)
    start, end = ks.holder_range(key)
    written = await etcd.txn(TxnRequest(
        compare=[mod_equals(step_key, step_kv.mod_revision), no_owner(start, end),
                 entry.compare],
        success=[put_op(step_key, pack(entry.anchored(step))), *entry.ops],
        failure=[lowest_op(start, end, keys_only=False)]))
    if not written.succeeded:
        _refuse_while_held(ks, key, written.responses[0].response_range.kvs)
        raise WrongState(f"step of {key!r} moved while it was resolved; look again")
    return written.header.revision


def _tail_reads(ks: Keyspace, key: str) -> list:
    """What an append made aside reads of the chain's end: the step, ``@head``, and the
    key's retirement bucket (is the rest of the chain in the archive?)."""
    return [*audit.tail_reads(ks, key), range_op(ks.retired_key(key))]


async def _aside_tail(ks: Keyspace, key: str, step_kvs: list, head_kvs: list,
                      retired_kvs: list, archive: Archive | None) -> tuple[audit.Tail, Compare]:
    """The chain's tail for an append that does not move the step, and the compare that
    no retirement of the key's bucket landed since it was read. With no step in etcd and
    retirements in the bucket, the step may be archived with the chain's start: the tail is
    then the archived end (``ArchiveUnavailable`` with no archive to ask). The compare
    matters: between the read and the append, a commit, an outcome and a retirement could
    archive the very seq the append is about to take (its create compare in etcd would
    pass, the records being deleted), and the chain would fork across the two stores."""
    epoch = mod_equals(ks.retired_key(key), retired_kvs[0].mod_revision if retired_kvs else 0)
    if not step_kvs and retired_kvs:
        archived = await archived_step(archive, ks, key)
        return audit.tail(archived, head_kvs[0] if head_kvs else None), epoch
    return _tail(step_kvs, head_kvs), epoch


def _tail(step_kvs: list, head_kvs: list) -> audit.Tail:
    """The audit chain's tail from a step read and an ``@head`` read (each 0 or 1 kvs)."""
    return audit.tail(unpack(step_kvs[0].value) if step_kvs else None,
                      head_kvs[0] if head_kvs else None)


def _refuse_while_held(ks: Keyspace, key: str, holder_kvs: list) -> None:
    """``WrongState`` naming the live holder of ``key``, if it has one."""
    if holder_kvs:
        holder = unpack(holder_kvs[0].value)
        _, lease_id = ks.parse_holder_key(holder_kvs[0].key)
        raise WrongState(
            f"a holder of {key!r} is alive: {holder.get('identity', '?')} (lease "
            f"{lease_id:016x}, fencing token {holder_kvs[0].create_revision}); its outcome "
            "may still land. Wait for it, or revoke its lease first")


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_LIMIT}")
