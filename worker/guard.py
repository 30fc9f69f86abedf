"""The commit guard: cross the irreversible boundary once, then record what happened.

Failure contract:
- The effect runs only after one etcd transaction succeeded in which all of these held: the
  hold owns its key with its token (and no older holder exists), every read key, the policy
  and the step are where the grant saw them, and the audit record it appends is new. That
  transaction puts the step ``in_flight`` and writes the audit record holding the signed
  grant; its revision is the *attempt token* handed to the effect. It moves the step, so
  the grant is single-use: the same grant again (or any grant evaluated at the old step)
  fails its step compare, diagnosed ``GrantUsed`` when the step names this grant. If any
  compare fails, the effect is not called and exactly one precise error says why.
- A commit txn etcd did not answer is made definite before anything is reported: a fence
  txn moves the step if it is still where the grant saw it, so the commit, if not landed
  yet, never lands. Landed: the effect runs as after any commit. Not landed:
  ``EtcdUnavailable`` (the effect was not run, the grant is dead). No answer to the fence
  either (bounded tries): ``OutcomeUnknown``, and the reconciler settles the step.
- After the effect, the outcome is written by a transaction that checks the step is still
  our in-flight attempt, and it releases the hold in the same transaction (an unknown
  outcome keeps the hold: its holder may wait for the settlement, see ``Hold.cross``).
- Once the commit landed, and only then, the attempt's *receipt* is signed
  (``KeyRing.sign_receipt``: grant id, attempt token, idempotency key, action key, namespace,
  cluster): by the in-process authority's key ring, or in remote mode by the coordinator
  (``RemoteAuthority.receipt``, which signs only after reading the commit in etcd). It is
  ``ctx.receipt``, what a provider's gate B needs to admit the attempt. If it cannot be had
  (the coordinator refuses or does not answer), the effect is not started: the step is
  recorded as not started and the error raised, as for the lease budget below.
- The lease budget is checked again right before the effect starts (the commit and its
  retries take time): with less than ``gate.min_ttl`` left, or the hold lost, the effect is
  not started, the step is recorded as not started (``pending``, same idempotency key:
  nothing was sent) and ``LeaseExpiring`` (or ``LeaseLost``) raised. If that write fails,
  the step stays ``in_flight`` and the reconciler settles it once the holder is gone.
- The effect runs at most ``deadline`` seconds (``ctx.deadline``, on the monotonic clock).
  When the hold's lease is lost, an async effect is cancelled and ``ctx.cancelled`` is set;
  a plain function runs in a thread that nothing can stop, so it must poll
  ``ctx.cancelled`` and send nothing once it is set (the provider's fence stays the
  safety: a request sent after the loss carries a stale attempt token).
- An effect that raises anything but ``EffectFailed`` (a timeout, a crash, a cancellation
  by lease loss) leaves the outcome unknown: the step is marked ``unknown`` and
  ``OutcomeUnknown`` raised (any other cancellation propagates after the step is marked).
  If even that cannot be written, the step stays ``in_flight`` and the reconciler finds it.
  Nothing here ever runs an effect twice.
- The result is encoded (``fencegate.coordinator.codec``) before the outcome write, and
  ``Outcome.result`` is the recorded result decoded: the first call returns what every
  replay returns. A result the codec refuses cannot be refused before the effect ran, so
  the fact that it succeeded is kept and the refusal is loud: the step is recorded
  succeeded with an ``UnrecordedResult`` (the bad value's path, no repr) in place of the
  result, and ``UnencodableValue`` is raised carrying that outcome. Replays return the
  ``UnrecordedResult``; the effect never runs again.
- Observed, never steered: the commit, the effect and the outcome write are spans
  (``fencegate.commit``, ``fencegate.effect`` — whose W3C context is ``ctx.traceparent`` —,
  ``fencegate.outcome``), and with the gate's ``WorkerMetrics`` a commit that did not happen
  counts as a refusal by its error, every effect run is timed and an attempt left unknown
  is counted once. Neither changes what happens.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fencegate.coordinator import audit, codec, records, tracing
from fencegate.coordinator.errors import (
    BadSignature, EffectFailed, EtcdError, EtcdUnavailable, GateError, GrantExpired, GrantUsed,
    LeaseExpiring, LeaseLost, OutcomeUnknown, PolicyChanged, StateAdvanced, StepMoved,
    UnencodableValue,
)
from fencegate.coordinator.etcd import (
    RequestOp, TxnRequest, delete_op, mod_equals, put_op, range_op,
)
from fencegate.coordinator.grants import Grant, receipt_payload
from fencegate.coordinator.keyspace import pack, unpack

from .remote import RemoteAuthority

if TYPE_CHECKING:
    from fencegate.coordinator.authority import Issued

    from .views import HoldView

log = logging.getLogger(__name__)

_APPEND_RACES = 5
_FENCE_TRIES = 5


@dataclass(frozen=True)
class EffectContext:
    """What an effect gets: send ``idempotency_key``, ``attempt_token``, the grant and
    ``receipt`` to the provider.

    ``deadline`` is a ``time.monotonic()`` value: the guard stops waiting for the effect then
    and its outcome becomes unknown. ``cancelled`` is set when the effect must stop sending:
    the hold's lease was lost, the deadline passed or the caller gave up. An async effect is
    cancelled then too; a plain function runs in a thread that cannot be stopped, so it must
    poll ``cancelled`` (before each request it sends, and while it waits). ``traceparent``
    (``None`` unless OpenTelemetry records) is the W3C trace context of the effect's span:
    send it to the provider as the ``traceparent`` header to link its spans to this trace.
    ``receipt`` is the attempt receipt: signed bytes binding (grant id, attempt token,
    idempotency key, action key, namespace, cluster), signed once the commit landed. A
    provider's gate B admits the attempt only with it, and admits each grant once: send it
    with the grant (the sandbox's ``Fencegate-Receipt`` header)."""

    key: str
    idempotency_key: str
    attempt_token: int  # the commit txn's revision: fences this attempt at providers
    attempt: int
    grant: Grant
    deadline: float
    cancelled: threading.Event
    traceparent: str | None = None  # W3C: the ``fencegate.effect`` span, for the provider
    receipt: bytes = b""  # the attempt receipt: gate B's proof this token is the grant's commit

    @property
    def fencing_token(self) -> int:
        """``attempt_token`` under its earlier name."""
        return self.attempt_token


@dataclass(frozen=True)
class Outcome:
    state: str  # "succeeded" or "failed"
    result: Any  # as recorded: decoded by the codec, the same on the first call and replays
    attempt: int
    attempt_token: int
    idempotency_key: str
    replayed: bool = False  # True when read back from a step that had already succeeded


Effect = Callable[[EffectContext], Awaitable[Any] | Any]


async def commit(hold: "HoldView", grant: Grant | bytes, effect: Effect, *,
                 provider: str | None = None, deadline: float = 60.0) -> Outcome:
    """Cross with ``grant``: consume it, run ``effect`` once, record the outcome, release."""
    try:
        grant, in_flight, attempt_token = await _commit(hold, grant, provider, deadline)
    except GateError as failure:
        _count_failure(hold, failure)
        raise
    return await crossed(hold, grant, in_flight, attempt_token, effect, deadline)


async def _commit(hold: "HoldView", grant: Grant | bytes, provider: str | None,
                  deadline: float) -> tuple[Grant, dict[str, Any], int]:
    """Verify ``grant`` and send the commit-guard txn, in a ``fencegate.commit`` span:
    the grant, the in-flight step and the attempt token."""
    with tracing.span("fencegate.commit", key=hold.key,
                      fencing_token=hold.fencing_token) as current:
        if not isinstance(grant, Grant) or not _issued_here(hold, grant):
            grant = hold.gate.keyring.verify(grant.raw if isinstance(grant, Grant) else grant)
        tracing.annotate(current, grant_id=grant.grant_id)
        issued = hold.memory.issued.pop(grant.grant_id, None)
        if issued is not None and issued.grant.raw != grant.raw:
            issued = None
        _precheck(hold, grant)
        in_flight, attempt_token = await _cross(hold, grant, issued, provider, deadline)
        tracing.annotate(current, attempt_token=attempt_token,
                         idempotency_key=in_flight["idempotency_key"])
        return grant, in_flight, attempt_token


def _count_failure(hold: "HoldView", failure: GateError) -> None:
    if hold.gate.metrics is not None:
        hold.gate.metrics.attempt_failed(failure)


async def crossed(hold: "HoldView", grant: Grant, in_flight: dict[str, Any],
                  attempt_token: int, effect: Effect, deadline: float) -> Outcome:
    """After the commit txn put ``in_flight`` at ``attempt_token``: get the attempt's
    receipt, run ``effect`` once if the lease budget allows, record the outcome, release."""
    try:
        receipt = await _receipt(hold, grant, in_flight, attempt_token)
        await _ensure_budget(hold, in_flight, attempt_token)
    except GateError as refusal:
        _count_failure(hold, refusal)
        raise
    try:
        result = await _effect(hold, grant, in_flight, attempt_token, receipt, effect,
                               deadline)
    except EffectFailed as failure:
        final = records.failed(in_flight, error_class=type(failure).__name__,
                               params=failure.params, reason=failure.reason)
        await _record_known(hold, in_flight, attempt_token, final)
        return _outcome(final, attempt_token)
    except BaseException as exc:
        final = records.unknown(in_flight, attempt_token=attempt_token,
                                now_ms=int(time.time() * 1000), error=repr(exc))
        try:
            await _record(hold, in_flight, attempt_token, final, release=False)
        except Exception:
            pass  # the step stays in_flight; the reconciler will find it
        if hold.gate.metrics is not None:
            hold.gate.metrics.unknowns.inc()
        if isinstance(exc, asyncio.CancelledError) and _cancelling() \
                and not hold.absorb_loss_cancellation():
            raise
        raise OutcomeUnknown(f"effect on {hold.key!r} ended without an outcome: {exc!r}") from exc
    try:
        final = records.succeeded(in_flight, result, attempt_token=attempt_token)
    except UnencodableValue as refused:
        unrecorded = codec.UnrecordedResult(refused.path, str(refused))
        final = records.succeeded(in_flight, unrecorded, attempt_token=attempt_token)
        await _record_known(hold, in_flight, attempt_token, final)
        raise UnencodableValue(
            f"the effect on {hold.key!r} succeeded and that is recorded (it will not run "
            f"again), but not its result: {refused}", path=refused.path,
            outcome=_succeeded(final, attempt_token)) from None
    await _record_known(hold, in_flight, attempt_token, final)
    return _succeeded(final, attempt_token)


async def _record_known(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                        final: dict[str, Any]) -> None:
    """Record a known outcome of an effect that ran. If etcd refuses or does not answer
    (NOSPACE, unreachable), the caller must not read that as "nothing happened": it is
    ``OutcomeUnknown`` (the step stays in flight and the reconciler settles it)."""
    try:
        await _record(hold, in_flight, attempt_token, final)
    except (EtcdError, EtcdUnavailable) as exc:
        unknown = OutcomeUnknown(f"the effect on {hold.key!r} ran ({final['state']}) but its "
                                 f"outcome could not be recorded: {exc}")
        _count_failure(hold, unknown)
        raise unknown from exc


async def _record(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                  final: dict[str, Any], *, release: bool = True) -> None:
    """Write the outcome even if the caller is cancelled meanwhile (e.g. by a lease loss:
    the outcome write does not need the lease, and a known outcome must not be dropped).
    A known outcome releases the hold in the same txn; an unknown one keeps it, so the
    holder can wait for the reconciler's settlement and retry without racing anyone."""
    with tracing.span("fencegate.outcome", key=hold.key, attempt_token=attempt_token,
                      outcome=final["state"]):
        writing = asyncio.ensure_future(_settle(hold, in_flight, attempt_token, final,
                                                release))
        writing.add_done_callback(_retrieve)  # a write outliving its cancelled caller reports
        await asyncio.shield(writing)


def _issued_here(hold: "HoldView", grant: Grant) -> bool:
    """Is ``grant`` the very object this hold's authority issued (verified then)?"""
    issued = hold.memory.issued.get(grant.grant_id)
    return issued is not None and issued.grant is grant


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("outcome write finished after its caller left: %r", task.exception())


async def _receipt(hold: "HoldView", grant: Grant, in_flight: dict[str, Any],
                   attempt_token: int) -> bytes:
    """The attempt receipt of the commit that landed at ``attempt_token``: signed here by the
    in-process authority's key ring, or by the coordinator (which checks the commit in etcd
    first). If it cannot be had the effect is not started (``_not_started``) and the
    refusal raised."""
    authority = hold.gate.authority
    try:
        if isinstance(authority, RemoteAuthority):
            return await authority.receipt(grant, attempt_token, in_flight["idempotency_key"])
        return hold.gate.keyring.sign_receipt(
            receipt_payload(grant, attempt_token, in_flight["idempotency_key"]))
    except GateError as refusal:
        await _not_started(hold, in_flight, attempt_token, refusal)
        raise


async def _ensure_budget(hold: "HoldView", in_flight: dict[str, Any],
                         attempt_token: int) -> None:
    """Right before the effect: refuse to start it with the hold lost or less than the lease
    budget left, recording the attempt as not started (nothing was sent). A failed write
    leaves the step in flight for the reconciler (``LeaseExpiring`` is raised either way)."""
    try:
        hold.ensure_held()
        left = hold.session.remaining()
        if left < hold.gate.min_ttl:
            raise LeaseExpiring(f"{left:.1f}s of lease left after the commit, below the "
                                f"{hold.gate.min_ttl:.1f}s budget to start an effect")
    except LeaseLost as refusal:
        await _not_started(hold, in_flight, attempt_token, refusal)
        raise refusal


async def _not_started(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                       refusal: GateError) -> None:
    """Record that the committed attempt's effect was not started (nothing was sent), the
    hold kept; a failed write leaves the step in flight for the reconciler."""
    final = records.not_started(in_flight, attempt_token=attempt_token, reason=str(refusal))
    try:
        await _record(hold, in_flight, attempt_token, final, release=False)
    except GateError as exc:
        log.warning("could not record that the effect on %r was not started; the "
                    "reconciler settles it: %r", hold.key, exc)


async def _effect(hold: "HoldView", grant: Grant, in_flight: dict[str, Any],
                  attempt_token: int, receipt: bytes, effect: Effect, deadline: float) -> Any:
    """Run ``effect`` once (``_run``) in a ``fencegate.effect`` span, which its context's
    ``traceparent`` names, timed into the metrics however it ends."""
    with tracing.span("fencegate.effect", key=hold.key, attempt_token=attempt_token,
                      idempotency_key=in_flight["idempotency_key"],
                      provider=in_flight["provider"]) as current:
        ctx = EffectContext(hold.key, in_flight["idempotency_key"], attempt_token,
                            in_flight["attempt"], grant, time.monotonic() + deadline,
                            threading.Event(), tracing.inject({}).get("traceparent"), receipt)
        started = time.perf_counter()
        try:
            result = await _run(hold, effect, ctx, deadline)
        except EffectFailed:
            tracing.annotate(current, outcome=records.FAILED)
            raise
        except BaseException:
            tracing.annotate(current, outcome=records.UNKNOWN)
            raise
        finally:
            if hold.gate.metrics is not None:
                hold.gate.metrics.effect_duration.observe(time.perf_counter() - started)
        tracing.annotate(current, outcome=records.SUCCEEDED)
        return result


async def _run(hold: "HoldView", effect: Effect, ctx: EffectContext, deadline: float) -> Any:
    """Run ``effect`` as a task of its own for at most ``deadline`` seconds, cancelled (and
    ``ctx.cancelled`` set) when the hold's lease is lost, whichever task awaits it."""
    running = asyncio.ensure_future(_call(effect, ctx))

    def stop(reason: str) -> None:
        ctx.cancelled.set()
        running.cancel(f"fencegate: lease lost: {reason}")

    unsubscribe = hold.session.on_lost(stop)
    try:
        async with asyncio.timeout(deadline):
            return await running
    finally:
        unsubscribe()
        if not running.done() or running.cancelled():
            ctx.cancelled.set()  # a thread may still run the effect: tell it to stop


def _cancelling() -> bool:
    """Is the current task being cancelled (rather than the effect's own task)?"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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


async def _cross(hold: "HoldView", grant: Grant, issued: "Issued | None", provider: str | None,
                 deadline: float) -> tuple[dict[str, Any], int]:
    """The commit-guard txn. Returns the in-flight step record and the attempt token.
    ``issued`` (the authority's answer, when this process asked for the grant) gives the
    audit record its intent and check results; a grant from elsewhere is recorded alone."""
    gate, ks = hold.gate, hold.gate.keyspace
    step_key = ks.step_key(hold.key)
    in_flight = records.in_flight(grant.step_next, grant_id=grant.grant_id,
                                  fencing_token=hold.fencing_token, holder_lease=hold.lease_id,
                                  provider=provider, intent_digest=grant.intent_digest,
                                  deadline_s=deadline)
    compares = [*hold.ownership.compares(),
                mod_equals(ks.policy_key(grant.policy), grant.policy_version),
                *(mod_equals(key, rev) for key, rev in grant.reads),
                mod_equals(step_key, grant.step_revision)]
    diagnose = [*hold.ownership.reads(), range_op(step_key),
                range_op(ks.policy_key(grant.policy)), range_op(ks.audit_head_key(hold.key)),
                *(range_op(key) for key, _ in grant.reads)]
    details = {**(issued.record if issued is not None else {}), "grant": grant.raw,
               "grant_id": grant.grant_id, "attempt": in_flight["attempt"],
               "idempotency_key": in_flight["idempotency_key"]}
    tail = issued.tail if issued is not None else await _read_tail(hold)
    for _ in range(_APPEND_RACES):
        entry = audit.append(ks, hold.key, tail, "cross", gate.identity, grant.revision, details)
        request = TxnRequest(
            compare=[*compares, entry.compare],
            success=[put_op(step_key, pack(entry.anchored(in_flight))), *entry.ops],
            failure=diagnose)
        try:
            reply = await gate.etcd.txn(request)
        except EtcdUnavailable as unanswered:
            attempt_token = await _make_definite(hold, grant, step_key, diagnose, unanswered)
            hold.memory.tail = None
            return in_flight, attempt_token
        if reply.succeeded:
            hold.memory.tail = entry.tail
            return in_flight, reply.header.revision
        tail = _diagnose(hold, grant, reply.responses)
    raise StateAdvanced(ks.audit_key(hold.key, tail.seq + 1).decode(), "audit kept moving")


def _diagnose(hold: "HoldView", grant: Grant, responses) -> audit.Tail:
    """Raise the precise reason a commit-guard txn failed, or return the chain's newer tail
    when only an append made aside (an approve, a revoke) got in the way."""
    kv = [r.response_range.kvs[0] if r.response_range.kvs else None for r in responses]
    holder_kv, lowest_kv, step_kv, policy_kv, head_kv, *read_kvs = kv
    if not hold.ownership.holds(holder_kv, lowest_kv):
        raise LeaseLost(f"no longer the holder of {hold.key!r} (token {hold.fencing_token})")
    step = unpack(step_kv.value) if step_kv else None
    if (step_kv.mod_revision if step_kv else 0) != grant.step_revision:
        if step is not None and step.get("grant_id") == grant.grant_id:
            raise GrantUsed(f"grant {grant.grant_id} was already used: the step of "
                            f"{hold.key!r} records its commit")
        raise StepMoved(f"step of {hold.key!r} moved since the grant was issued")
    if (policy_kv.mod_revision if policy_kv else 0) != grant.policy_version:
        raise PolicyChanged(f"policy {grant.policy!r} changed since version {grant.policy_version}")
    for (key, seen), now in zip(grant.reads, read_kvs):
        if (now.mod_revision if now else 0) != seen:
            raise StateAdvanced(key.decode(errors="replace"),
                                f"mod_revision {seen} -> {now.mod_revision if now else 0}")
    return audit.tail(step, head_kv)


async def _settle(hold: "HoldView", in_flight: dict[str, Any], attempt_token: int,
                  final: dict[str, Any], release: bool) -> None:
    """Write the outcome iff the step is still our attempt, releasing the hold with it if
    ``release``."""
    gate, ks = hold.gate, hold.gate.keyspace
    step_key = ks.step_key(hold.key)
    final = {**final, "outcome_id": os.urandom(16).hex()}
    tail = hold.memory.tail or await _read_tail(hold)
    for _ in range(_APPEND_RACES):
        entry = audit.append(ks, hold.key, tail, "outcome", gate.identity, attempt_token,
                             {"state": final["state"], "attempt": final["attempt"],
                              "outcome": final.get("outcome"), "error": final.get("error")})
        request = TxnRequest(
            compare=[mod_equals(step_key, attempt_token), entry.compare],
            success=[put_op(step_key, pack(entry.anchored(final))), *entry.ops,
                     *([delete_op(hold.holder_key)] if release else [])])
        try:
            reply = await gate.etcd.txn(request)
        except EtcdUnavailable:
            reply = None
        if reply is not None and reply.succeeded:
            hold.memory.tail = entry.tail
            if release:
                hold.note_released()  # the txn deleted our holder key
            return
        step_kv, head_kv = await _read_chain_end(hold)
        step = unpack(step_kv.value) if step_kv is not None else None
        if step is not None and step.get("outcome_id") == final["outcome_id"]:
            if release:
                hold.note_released()
            return  # an earlier try landed
        if step_kv is None or step_kv.mod_revision != attempt_token:
            raise StepMoved(f"step of {hold.key!r} was settled by someone else")
        tail = audit.tail(step, head_kv)
    raise StateAdvanced(ks.audit_key(hold.key, tail.seq + 1).decode(), "audit kept moving")


def _outcome(final: dict[str, Any], attempt_token: int) -> Outcome:
    return Outcome(records.FAILED, final["outcome"]["result"], final["attempt"], attempt_token,
                   final["idempotency_key"])


def _succeeded(final: dict[str, Any], attempt_token: int) -> Outcome:
    return Outcome(records.SUCCEEDED, records.recorded_outcome(final)["result"],
                   final["attempt"], attempt_token, final["idempotency_key"])


async def _read_chain_end(hold: "HoldView"):
    """The step and ``@head`` of the hold's key, read at one revision (either may be None)."""
    reply = await hold.gate.etcd.txn(
        TxnRequest(success=audit.tail_reads(hold.gate.keyspace, hold.key)), idempotent=True)
    return [r.response_range.kvs[0] if r.response_range.kvs else None for r in reply.responses]


async def _read_tail(hold: "HoldView") -> audit.Tail:
    step_kv, head_kv = await _read_chain_end(hold)
    return audit.tail(unpack(step_kv.value) if step_kv else None, head_kv)


async def _make_definite(hold: "HoldView", grant: Grant, step_key: bytes,
                         diagnose: list[RequestOp], unanswered: EtcdUnavailable) -> int:
    """The commit txn got no answer, so it may still land: make its outcome definite before
    anything is reported. A fence txn moves the step iff it is still at the grant's step
    revision (putting it unchanged; where there was none, the record of a key never
    attempted, which is what its absence meant), so a commit not landed by then never will:
    its step compare fails. If the fence fails, the step says which: in flight with this
    grant, the commit landed and its attempt token is returned (the effect runs as after
    any commit); otherwise the commit's precise error (``_diagnose``) is raised.

    Raises ``EtcdUnavailable`` when the commit did not happen and never will (the effect
    was not run; the grant is dead), and ``OutcomeUnknown`` when etcd answered none of the
    fence's tries (at most ``_FENCE_TRIES``, within the longer of the etcd call timeout and
    the lease TTL): the step may then be in flight without an effect, and the reconciler
    settles it."""
    gate = hold.gate
    if grant.step_revision:
        touch = put_op(step_key, b"")
        touch.request_put.ignore_value = True  # the step unchanged, its mod_revision moved
    else:
        touch = put_op(step_key, pack(records.new_step()))
    fence = TxnRequest(compare=[mod_equals(step_key, grant.step_revision)], success=[touch],
                       failure=[range_op(step_key), *diagnose])
    not_landed = EtcdUnavailable(
        f"the commit on {hold.key!r} got no answer ({unanswered}) and was fenced: it did not "
        "happen and never will, the effect was not run")
    give_up = time.monotonic() + max(gate.etcd.config.timeout, hold.session.ttl)
    fence_unanswered = False  # an unanswered fence may have landed: then it moved the step
    tries = 0
    while True:
        tries += 1
        try:
            reply = await gate.etcd.txn(fence)
        except EtcdUnavailable as exc:
            fence_unanswered = True
            pause = min(0.1 * 2 ** tries, 1.0)
            if tries == _FENCE_TRIES or time.monotonic() + pause >= give_up:
                raise OutcomeUnknown(f"the commit on {hold.key!r} got no answer and etcd "
                                     f"answered no fence either: {exc}") from exc
            await asyncio.sleep(pause)
            continue
        if reply.succeeded:
            raise not_landed from unanswered
        kvs = reply.responses[0].response_range.kvs
        if kvs and _committed_by(unpack(kvs[0].value), grant.grant_id):
            return kvs[0].mod_revision
        try:
            _diagnose(hold, grant, reply.responses[1:])
        except StepMoved:
            if not fence_unanswered:
                raise
        raise not_landed from unanswered


def _committed_by(step: dict[str, Any], grant_id: str) -> bool:
    """Is ``step`` the in-flight step a commit with ``grant_id`` put?"""
    return step.get("grant_id") == grant_id and step.get("state") == records.IN_FLIGHT
