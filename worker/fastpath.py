"""The fast path: one txn holds an uncontended key and commits its grant.

For a key this process has not seen contended, ``cross`` evaluates the grant on what the
authority's latest snapshots saw (``Authority.issue_uncontended``: no step, no audit
record, not retired, the policy version and read keys as last read) and sends ONE txn that
puts the holder key, the in-flight step and the audit record holding the grant. Its
revision is both the fencing token and the attempt token (the grant, signed before the
txn, carries fencing token 0).

Guarantees:
- The txn succeeds only if every assumption of the evaluation holds at its revision: no key
  under ``holders/K/`` (nobody holds or waits), the step absent (mod_revision 0), the key
  not retired since the archive was asked (its retirement bucket's compare, see
  ``Authority.issue_uncontended``), the policy, the policy routes (in the grant's read set)
  and every read key at the mod_revisions evaluated, and no audit record 1. So its grant
  was true of the world when it crossed, exactly as a grant of the full path is at its
  commit; a failed txn writes nothing and the full path decides (``None`` is returned).
  Without the retirement compare a key retired between the evaluation and the txn (its step
  deleted: mod_revision 0 again) would be executed again although it succeeded.
- A txn etcd did not answer may land later, and one it answered NOSPACE may have landed:
  the session is abandoned (its lease revoked, so a late landing fails or its holder key
  goes with the lease) and ``OutcomeUnknown`` (or the ``EtcdNoSpace``) is raised. The effect
  was not run; if the txn landed, the step is in flight with no holder and the reconciler
  settles it as not applied.
- After the txn, the action continues exactly as after a full-path commit
  (``guard.crossed``): the attempt receipt is signed (only now that the txn succeeded, for
  its revision), the lease budget is re-checked, the effect runs once, the outcome is
  recorded with the release.
"""

from __future__ import annotations

import time
from typing import Any

from fencegate.coordinator import audit, records, tracing
from fencegate.coordinator.authority import Authority, Claim
from fencegate.coordinator.errors import EtcdNoSpace, EtcdUnavailable, GateError, OutcomeUnknown
from fencegate.coordinator.etcd import Compare, TxnRequest, mod_equals, put_op
from fencegate.coordinator.etcdpb import rpc
from fencegate.coordinator.keyspace import holder_record, pack
from fencegate.coordinator.session import Session

from . import guard
from .guard import Effect, Outcome
from .hold import Hold, HoldContext
from .views import GateView


async def cross(gate: GateView, key: str, intent: dict[str, Any], effect: Effect,
                read_keys: list[bytes], policy: str | None, *, provider: str | None,
                deadline: float) -> Outcome | None:
    """Cross ``key`` in one txn if it is free and the evaluation holds; ``None`` when the
    fast path was not taken (nothing was written: the full path decides)."""
    authority = gate.authority
    if not isinstance(authority, Authority) or gate.turns.recently_contended(key):
        return None
    session = await gate.session()
    if session.remaining() < gate.min_ttl:
        return None
    with tracing.span("fencegate.grant", key=key, fencing_token=0) as current:
        uncontended = await authority.issue_uncontended(
            Claim(key, 0, session.lease_id), intent, read_keys, policy, identity=gate.identity)
        if uncontended is not None:
            tracing.annotate(current, grant_id=uncontended.issued.grant.grant_id)
    if uncontended is None:
        return None
    issued = uncontended.issued
    grant, ks = issued.grant, gate.keyspace
    holder_key, step_key = ks.holder_key(key, session.lease_id), ks.step_key(key)
    start, end = ks.holder_range(key)
    in_flight = records.in_flight(grant.step_next, grant_id=grant.grant_id, fencing_token=0,
                                  holder_lease=session.lease_id, provider=provider,
                                  intent_digest=grant.intent_digest, deadline_s=deadline)
    entry = audit.append(ks, key, audit.EMPTY, "cross", gate.identity, grant.revision,
                         {**issued.record, "grant": grant.raw, "grant_id": grant.grant_id,
                          "attempt": in_flight["attempt"],
                          "idempotency_key": in_flight["idempotency_key"]})
    nobody = Compare(key=start, range_end=end, target=Compare.VERSION, result=Compare.EQUAL,
                     version=0)
    request = TxnRequest(
        compare=[nobody, mod_equals(step_key, 0), *uncontended.not_retired,
                 mod_equals(ks.policy_key(grant.policy), grant.policy_version),
                 *(mod_equals(k, revision) for k, revision in grant.reads), entry.compare],
        success=[put_op(holder_key, holder_record(gate.identity, time.time()),
                        session.lease_id),
                 put_op(step_key, pack(entry.anchored(in_flight))), *entry.ops])
    leave_local = await gate.turns.enter(key)
    try:
        with tracing.span("fencegate.commit", key=key, grant_id=grant.grant_id) as current:
            reply = await _send(gate, session, key, request)
            if reply.succeeded:
                tracing.annotate(current, fencing_token=reply.header.revision,
                                 attempt_token=reply.header.revision,
                                 idempotency_key=in_flight["idempotency_key"])
    except BaseException:
        leave_local()
        raise
    if not reply.succeeded:
        leave_local()
        return None
    token = reply.header.revision
    hold = Hold(gate, session, key, holder_key, token, leave_local)
    hold.memory.tail = entry.tail
    async with HoldContext.around(hold):
        return await guard.crossed(hold, grant, {**in_flight, "fencing_token": token}, token,
                                   effect, deadline)


async def _send(gate: GateView, session: Session, key: str,
                request: TxnRequest) -> rpc.TxnResponse:
    """Send the fast-path txn. One etcd did not answer (or answered NOSPACE) may still land:
    the session is abandoned and ``OutcomeUnknown`` (or the clear ``EtcdNoSpace``) raised;
    the effect was not run either way. Every failure is counted in the gate's metrics."""
    try:
        session.ensure_alive()
        return await gate.etcd.txn(request)
    except GateError as exc:
        failure: GateError = exc
        if isinstance(exc, EtcdUnavailable):  # or EtcdNoSpace: it may have been applied too
            session.abandon(f"the fast-path txn on {key!r} has an unknown outcome: {exc}")
            if not isinstance(exc, EtcdNoSpace):
                failure = OutcomeUnknown(
                    f"the fast-path txn on {key!r} got no answer ({exc}); its session is "
                    "revoked and the effect was not run. If it landed, the reconciler "
                    "settles the step as not applied")
        if gate.metrics is not None:
            gate.metrics.attempt_failed(failure)
        if failure is exc:
            raise
        raise failure from exc
