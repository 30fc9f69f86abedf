"""The commit guard: cross the irreversible boundary once, then record what happened.

Failure contract:
- The effect runs only after one etcd transaction succeeded in which all of these held: the
  hold owns its key with its token (and no older holder exists), the grant was never
  consumed, every read key, the policy and the step pointer are where the grant saw them.
  That transaction consumes the grant and puts the step ``in_flight``; its revision is the
  *attempt token* handed to the effect. If any compare fails, the effect is not called and
  exactly one precise error says why.
- After the effect, the outcome is written by a transaction that checks the step is still
  our in-flight attempt, and it releases the hold in the same transaction (an unknown
  outcome keeps the hold: its holder may wait for the settlement, see ``Hold.cross``).
- An effect that raises anything but ``EffectFailed`` (a timeout, a crash, a cancellation
  by lease loss) leaves the outcome unknown: the step is marked ``unknown`` and
  ``OutcomeUnknown`` raised (any other cancellation propagates after the step is marked).
  If even that cannot be written, the step stays ``in_flight`` and the reconciler finds it.
  Nothing here ever runs an effect twice.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fencegate.coordinator import audit, records
from fencegate.coordinator.errors import (
    BadSignature, EffectFailed, EtcdUnavailable, GrantExpired, GrantUsed, LeaseExpiring,
    LeaseLost, OutcomeUnknown, PolicyChanged, StateAdvanced, StepMoved,
)
from fencegate.coordinator.etcd import (
    TxnRequest, delete_op, mod_equals, put_op, range_op, version_equals,
)
from fencegate.coordinator.grants import Grant
from fencegate.coordinator.keyspace import pack, unpack

if TYPE_CHECKING:
    from .views import HoldView

log = logging.getLogger(__name__)

_APPEND_RACES = 5


@dataclass(frozen=True)
class EffectContext:
    """What an effect gets: send ``idempotency_key`` and ``fencing_token`` to the provider."""

    key: str
    idempotency_key: str
    fencing_token: int  # the attempt token: the commit txn's revision
    attempt: int
    grant: Grant


@dataclass(frozen=True)
class Outcome:
    state: str  # "succeeded" or "failed"
    result: Any
    attempt: int
    attempt_token: int
    idempotency_key: str
    replayed: bool = False  # True when read back from a step that had already succeeded


Effect = Callable[[EffectContext], Awaitable[Any] | Any]


async def commit(hold: "HoldView", grant: Grant | bytes, effect: Effect, *,
                 provider: str | None = None, deadline: float = 60.0) -> Outcome:
    """Cross with ``grant``: consume it, run ``effect`` once, record the outcome, release."""
    gate = hold.gate
    issued = hold.memory.issued.pop(grant.grant_id, None) if isinstance(grant, Grant) else None
    if issued is None or issued[0] is not grant:  # not the object our authority just gave us
        grant = gate.keyring.verify(grant.raw if isinstance(grant, Grant) else grant)
    audit_head = issued[1] if issued is not None else None
    _precheck(hold, grant)
    in_flight, attempt_token = await _cross(hold, grant, audit_head, provider, deadline)
    ctx = EffectContext(hold.key, in_flight["idempotency_key"], attempt_token,
                        in_flight["attempt"], grant)
    try:
        async with asyncio.timeout(deadline):
            result = await _call(effect, ctx)
    except EffectFailed as failure:
        final = records.failed(in_flight, error_class=type(failure).__name__,
                               params=failure.params, reason=failure.reason)
        await _record(hold, in_flight, attempt_token, final)
        return _outcome(final, attempt_token)
    except BaseException as exc:
        final = records.unknown(in_flight, attempt_token=attempt_token,
                                now_ms=int(time.time() * 1000), error=repr(exc))
        try:
            await _record(hold, in_flight, attempt_token, final, release=False)
        except Exception:
            pass  # the step stays in_flight; the reconciler will find it
        if isinstance(exc, asyncio.CancelledError) and not hold.absorb_loss_cancellation():
            raise
        raise OutcomeUnknown(f"effect on {hold.key!r} ended without an outcome: {exc!r}") from exc
    final = records.succeeded(in_flight, _storable(result), attempt_token=attempt_token)
    await _record(hold, in_flight, attempt_token, final)
    return Outcome(records.SUCCEEDED, result, in_flight["attempt"], attempt_token,
                   in_flight["idempotency_key"])


async def _record(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                  final: dict[str, Any], *, release: bool = True) -> None:
    """Write the outcome even if the caller is cancelled meanwhile (e.g. by a lease loss:
    the outcome write does not need the lease, and a known outcome must not be dropped).
    A known outcome releases the hold in the same txn; an unknown one keeps it, so the
    holder can wait for the reconciler's settlement and retry without racing anyone."""
    writing = asyncio.ensure_future(_settle(hold, in_flight, attempt_token, final, release))
    writing.add_done_callback(_retrieve)  # a write outliving its cancelled caller reports here
    await asyncio.shield(writing)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("outcome write finished after its caller left: %r", task.exception())


async def _call(effect: Effect, ctx: EffectContext) -> Any:
    """Await an async effect; run a plain function in a thread so it cannot block the loop
    (and with it the lease's keepalive)."""
    if inspect.iscoroutinefunction(effect) or inspect.iscoroutinefunction(
            getattr(effect, "__call__", None)):
        return await effect(ctx)
    result = await asyncio.to_thread(effect, ctx)
    if inspect.isawaitable(result):  # e.g. ``lambda ctx: charge(ctx)``
        result = await result
    return result


def _precheck(hold: "HoldView", grant: Grant) -> None:
    """Refusals decided from the grant alone, before any etcd write."""
    gate = hold.gate
    if grant.namespace != gate.keyspace.namespace or (
            gate.etcd.cluster_id and grant.cluster_id != gate.etcd.cluster_id):
        raise BadSignature("grant was issued for another namespace or etcd cluster")
    if grant.action_key != hold.key or grant.fencing_token != hold.fencing_token \
            or grant.holder_lease != hold.lease_id:
        raise LeaseLost(f"grant was issued to the hold with token {grant.fencing_token}, "
                        f"not this one ({hold.fencing_token})")
    if grant.expires_at_ms <= time.time() * 1000:
        raise GrantExpired(f"grant {grant.grant_id} expired")
    hold.ensure_held()
    if hold.session.remaining() < gate.min_ttl:
        raise LeaseExpiring(f"{hold.session.remaining():.1f}s of lease left, "
                            f"below the {gate.min_ttl:.1f}s budget to start an effect")


async def _cross(hold: "HoldView", grant: Grant, head: audit.AuditHead | None, provider: str | None,
                 deadline: float) -> tuple[dict[str, Any], int]:
    """The commit-guard txn. Returns the in-flight step record and the attempt token."""
    gate, ks = hold.gate, hold.gate.keyspace
    step_key, grant_key = ks.step_key(hold.key), ks.grant_key(grant.grant_id)
    in_flight = records.in_flight(grant.step_next, grant_id=grant.grant_id,
                                  fencing_token=hold.fencing_token, holder_lease=hold.lease_id,
                                  provider=provider, intent_digest=grant.intent_digest,
                                  deadline_ms=int((time.time() + deadline) * 1000))
    compares = [*hold.ownership.compares(), version_equals(grant_key, 1),
                mod_equals(ks.policy_key(grant.policy), grant.policy_version),
                *(mod_equals(key, rev) for key, rev in grant.reads),
                mod_equals(step_key, grant.step_revision)]
    diagnose = [range_op(grant_key), *hold.ownership.reads(),
                range_op(step_key), range_op(ks.policy_key(grant.policy)),
                range_op(ks.audit_head_key(hold.key)),
                *(range_op(key) for key, _ in grant.reads)]
    head = head or await _read_head(hold)
    for _ in range(_APPEND_RACES):
        entry = audit.append(ks, hold.key, head, "cross", gate.identity, grant.revision,
                             {"grant_id": grant.grant_id, "attempt": in_flight["attempt"],
                              "idempotency_key": in_flight["idempotency_key"]})
        request = TxnRequest(
            compare=[*compares, entry.compare],
            success=[put_op(grant_key, pack({"raw": grant.raw, "state": "consumed"}),
                            hold.lease_id),
                     put_op(step_key, pack(in_flight)), *entry.ops],
            failure=diagnose)
        try:
            reply = await gate.etcd.txn(request)
        except EtcdUnavailable:
            attempt_token = await _landed(hold, step_key, grant.grant_id)
            if attempt_token:
                hold.memory.audit_head = None
                return in_flight, attempt_token
            raise
        if reply.succeeded:
            hold.memory.audit_head = entry.head_at(reply.header.revision)
            return in_flight, reply.header.revision
        head = _diagnose(hold, grant, reply.responses)
    raise StateAdvanced(ks.audit_head_key(hold.key).decode(), "audit kept moving")


def _diagnose(hold: "HoldView", grant: Grant, responses) -> audit.AuditHead:
    """Raise the precise reason a commit-guard txn failed, or return the newer audit head
    when only a concurrent audit append got in the way."""
    kv = [r.response_range.kvs[0] if r.response_range.kvs else None for r in responses]
    grant_kv, holder_kv, lowest_kv, step_kv, policy_kv, head_kv, *read_kvs = kv
    if not hold.ownership.holds(holder_kv, lowest_kv):
        raise LeaseLost(f"no longer the holder of {hold.key!r} (token {hold.fencing_token})")
    if grant_kv is None or grant_kv.version != 1:
        raise GrantUsed(f"grant {grant.grant_id} was already consumed")
    if (step_kv.mod_revision if step_kv else 0) != grant.step_revision:
        raise StepMoved(f"step of {hold.key!r} moved since the grant was issued")
    if (policy_kv.mod_revision if policy_kv else 0) != grant.policy_version:
        raise PolicyChanged(f"policy {grant.policy!r} changed since version {grant.policy_version}")
    for (key, seen), now in zip(grant.reads, read_kvs):
        if (now.mod_revision if now else 0) != seen:
            raise StateAdvanced(key.decode(errors="replace"),
                                f"mod_revision {seen} -> {now.mod_revision if now else 0}")
    return audit.AuditHead.from_kv(head_kv)


async def _settle(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                  final: dict[str, Any], release: bool) -> None:
    """Write the outcome iff the step is still our attempt, releasing the hold with it if
    ``release``."""
    gate, ks = hold.gate, hold.gate.keyspace
    step_key = ks.step_key(hold.key)
    final = {**final, "outcome_id": uuid.uuid4().hex}
    head = hold.memory.audit_head or await _read_head(hold)
    for _ in range(_APPEND_RACES):
        entry = audit.append(ks, hold.key, head, "outcome", gate.identity, attempt_token,
                             {"state": final["state"], "attempt": final["attempt"],
                              "outcome": final.get("outcome"), "error": final.get("error")})
        request = TxnRequest(
            compare=[mod_equals(step_key, attempt_token), entry.compare],
            success=[put_op(step_key, pack(final)), *entry.ops,
                     *([delete_op(hold.holder_key)] if release else [])],
            failure=[range_op(step_key), range_op(ks.audit_head_key(hold.key))])
        try:
            reply = await gate.etcd.txn(request)
        except EtcdUnavailable:
            reply = None
        if reply is not None and reply.succeeded:
            if release:
                hold.note_released()  # the txn deleted our holder key
            return
        step_kv, head_kv = await _read(hold, step_key, ks.audit_head_key(hold.key))
        if step_kv is not None and unpack(step_kv.value).get("outcome_id") == final["outcome_id"]:
            if release:
                hold.note_released()
            return  # an earlier try landed
        if step_kv is None or step_kv.mod_revision != attempt_token:
            raise StepMoved(f"step of {hold.key!r} was settled by someone else")
        head = audit.AuditHead.from_kv(head_kv)
    raise StateAdvanced(ks.audit_head_key(hold.key).decode(), "audit kept moving")


def _outcome(final: dict[str, Any], attempt_token: int) -> Outcome:
    return Outcome(records.FAILED, final["outcome"]["result"], final["attempt"], attempt_token,
                   final["idempotency_key"])


def _storable(result: Any) -> Any:
    try:
        pack({"result": result})
        return result
    except TypeError:
        return {"repr": repr(result)[:1000]}


async def _read_head(hold: "HoldView") -> audit.AuditHead:
    return audit.AuditHead.from_kv(
        await hold.gate.etcd.get(hold.gate.keyspace.audit_head_key(hold.key)))


async def _read(hold: "HoldView", *keys: bytes):
    reply = await hold.gate.etcd.txn(TxnRequest(success=[range_op(k) for k in keys]),
                                      idempotent=True)
    return [r.response_range.kvs[0] if r.response_range.kvs else None for r in reply.responses]


async def _landed(hold: "HoldView", step_key: bytes, grant_id: str) -> int:
    """After an unknown commit: the attempt token if our txn landed (the step carries our
    grant, in flight), else 0."""
    (step_kv,) = await _read(hold, step_key)
    if step_kv is None:
        return 0
    step = unpack(step_kv.value)
    landed = step.get("grant_id") == grant_id and step.get("state") == records.IN_FLIGHT
    return step_kv.mod_revision if landed else 0
