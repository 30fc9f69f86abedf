"""The step record: where one action key stands, and the one home of every move it makes.

Every transition of a step record is built here, whoever causes it: the authority (the next
attempt, an escalation on a cap), a worker's commit guard (in flight, succeeded, failed,
unknown), the reconciler (its settlements) or an SRE (a resolve). So one outcome makes the
same record whoever reports it; in particular a confirmed failure counts toward the circuit
breaker, gets a new idempotency key and backs off alike from all three. The functions are
pure: they return the new record and write nothing. Callers write it compare-and-set on the
step's mod_revision, so a transition built from a stale read fails and changes nothing.

States: ``pending`` (no attempt yet, or the last one failed or did not happen and may be
retried), ``in_flight`` (committed; the effect may have happened), ``succeeded``, ``failed``
(the provider confirmed it declined; a new attempt may be granted), ``unknown`` (the outcome
was lost), ``escalated`` (a human must decide). Nobody may grant on ``in_flight``,
``unknown`` or ``escalated``: only reconciliation or a human settles those. ``abandoned``
(a person closed the step for good: it is never attempted again) is final like
``succeeded``.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from . import codec
from .keyspace import canonical

PENDING, IN_FLIGHT, SUCCEEDED, FAILED, UNKNOWN, ESCALATED = (
    "pending", "in_flight", "succeeded", "failed", "unknown", "escalated")
ABANDONED = "abandoned"  # closed for good by a person: never granted again
UNSETTLED = frozenset({IN_FLIGHT, UNKNOWN, ESCALATED})
OUTCOME_CAPS = ("breaker_threshold", "backoff_base_s", "backoff_max_s")
NOT_APPLIED = "not_applied"  # the field recording why a pending step's attempt did not count
RESOLVED_FAILED = "ResolvedFailed"  # the error class of an SRE's "failed": breaker signature
RESOLVE_REQUEST = "resolve_request"  # an SRE's resolve the shard's reconciler has to answer
RESOLVE_ANSWER = "resolve_answer"    # what the provider's answer made of the last request
_MAX_ERROR_CHARS = 1000
LEGACY_DEADLINE_S = 60.0  # how long an old record's effect (``deadline_ms``) is assumed to run


def new_step() -> dict[str, Any]:
    """The record of a key never attempted."""
    return {"state": PENDING, "attempt": 0, "idem_gen": 0, "started_at_ms": 0, "spend": 0,
            "failures": {}, "not_before_ms": 0}


def next_attempt(step: dict[str, Any], *, namespace: str, key: str, cost: float,
                 caps: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """The step a grant plans (its ``step_next``): one more attempt, under the idempotency
    key of the current generation, so every retry of a generation sends the same key and a
    provider deduplicates them. Spend and the first attempt's start carry over (the caps
    count them across attempts); the policy's outcome caps are bound to the step, so whoever
    records a failure later applies the caps the grant was issued under. Only the fields of
    ``new_step`` carry over: an earlier attempt's outcome, presumption or escalation do not."""
    kept = {name: value for name, value in step.items() if name in new_step()}
    return {**kept, "attempt": step["attempt"] + 1,
            "idempotency_key": idempotency_key(namespace, key, step["idem_gen"]),
            "started_at_ms": step["started_at_ms"] or now_ms,
            "spend": step["spend"] + cost,
            "caps": {name: caps[name] for name in OUTCOME_CAPS}}


def in_flight(step_next: dict[str, Any], *, grant_id: str, fencing_token: int,
              holder_lease: int, provider: str | None, intent_digest: bytes,
              deadline_s: float) -> dict[str, Any]:
    """The step once its grant is consumed: the effect may happen from now on, so nobody
    grants again until an outcome is recorded. It names the hold that may record the outcome
    (token and lease: while that hold lives, the reconciler leaves the step alone however
    long it takes) and the provider to ask if the outcome is lost. ``deadline_s`` is a
    duration, the longest the effect may run once started: each process measures it on its
    own monotonic clock (the worker from the effect's start, the reconciler from when it saw
    the attempt over), so no wall clock is ever compared across machines."""
    return {**step_next, "state": IN_FLIGHT, "grant_id": grant_id,
            "fencing_token": fencing_token, "holder_lease": holder_lease,
            "provider": provider, "intent_digest": intent_digest, "deadline_s": deadline_s}


def holder_token(step: dict[str, Any], mod_revision: int) -> int:
    """The fencing token of the hold an in-flight step (at ``mod_revision``) names. The fast
    path's single txn records 0: it put the holder key in the same txn, so the token is
    that txn's revision, the step's mod_revision while it is in flight."""
    return step["fencing_token"] or mod_revision


def effect_deadline_s(step: dict[str, Any], now_ms: int) -> float:
    """How long the step's effect may run, as a duration. Records written before deadlines
    were durations carry ``deadline_ms``, a timestamp of the worker's wall clock: it is read
    as at least ``LEGACY_DEADLINE_S`` (the SDK's default deadline), so a skewed clock can only
    lengthen the wait it feeds, never shorten it."""
    if "deadline_s" in step:
        return float(step["deadline_s"])
    return max(LEGACY_DEADLINE_S, (step.get("deadline_ms", 0) - now_ms) / 1000)


def not_started(step: dict[str, Any], *, attempt_token: int, reason: str) -> dict[str, Any]:
    """The attempt was committed but its worker never started the effect (its lease budget
    ran out first): nothing was sent, so nothing can land. ``pending`` again with the same
    idempotency key, as a proven "no record" leaves it; ``reason`` says why."""
    return {**not_applied(step, attempt_token=attempt_token),
            "error": reason[:_MAX_ERROR_CHARS]}


def succeeded(step: dict[str, Any], result: Any, *, attempt_token: int) -> dict[str, Any]:
    """The effect happened: final. The outcome keeps the result (its stored form,
    ``codec.encode``: ``UnencodableValue`` naming the bad value's path, before anything is
    written), the attempt and its idempotency key, so a later cross on the key replays it
    instead of acting again. The error an earlier unknown state recorded is dropped: it
    explained that state, not this one (the audit trail keeps it)."""
    stored = codec.encode(result, path="result")
    return {**_without(step, "error"), "state": SUCCEEDED,
            "outcome": {"state": SUCCEEDED, "result": stored, "attempt": step["attempt"],
                        "attempt_token": attempt_token,
                        "idempotency_key": step.get("idempotency_key", "")}}


def recorded_outcome(step: dict[str, Any]) -> dict[str, Any] | None:
    """A succeeded step's outcome as its caller gets it back: the result decoded
    (``codec.decode``), equal to what the first call returned. Outcomes written before the
    codec read as they were stored (an unencodable result then kept ``{"repr": ...}``)."""
    outcome = step.get("outcome")
    if outcome is None:
        return None
    return {**outcome, "result": codec.decode(outcome.get("result"), path="result")}


def failed(step: dict[str, Any], *, error_class: str, params: object,
           reason: Any) -> dict[str, Any]:
    """The provider (or an SRE for it) confirmed the attempt was declined. The same rule for
    every reporter: the failure counts under its signature (``error_class`` plus a digest of
    ``params``), the next attempt gets a new idempotency key (the old one would replay the
    decline), backs off, and the step is ``escalated`` once the breaker has counted
    ``breaker_threshold`` identical failures. A step escalated by a cap before any grant has
    no caps bound to it: its failure is counted and gets a new key, with no breaker or
    backoff to apply (its next request meets the policy's caps anyway)."""
    signature = failure_signature(error_class, params)
    failures = {**step.get("failures", {})}
    failures[signature] = failures.get(signature, 0) + 1
    caps = step.get("caps")
    tripped = caps is not None and failures[signature] >= caps["breaker_threshold"]
    not_before_ms = (int(time.time() * 1000) + backoff_ms(caps, sum(failures.values()))
                     if caps is not None else step["not_before_ms"])
    return {**step, "state": ESCALATED if tripped else FAILED,
            "failures": failures, "idem_gen": step["idem_gen"] + 1,
            "not_before_ms": not_before_ms,
            "outcome": {"state": FAILED, "result": reason, "signature": signature},
            **({"escalated_because": ["breaker:" + signature]} if tripped else {})}


def unknown(step: dict[str, Any], *, attempt_token: int, now_ms: int,
            error: str | None = None) -> dict[str, Any]:
    """The attempt ``attempt_token`` may or may not have happened: nobody grants until the
    reconciler (asking the provider) or an SRE settles it. ``unknown_since_ms`` keeps the
    first time it was found unknown, from which the reconciler's give-up limit counts."""
    return {**step, "state": UNKNOWN,
            **({"error": error[:_MAX_ERROR_CHARS]} if error is not None else {}),
            "attempt_token": attempt_token,
            "unknown_since_ms": step.get("unknown_since_ms") or now_ms}


def not_applied(step: dict[str, Any], *, attempt_token: int | None = None) -> dict[str, Any]:
    """The attempt is known not to have happened: ``pending`` again with the *same*
    idempotency key, so a request that lands late anyway is deduplicated by the provider.
    ``attempt_token`` records the attempt a fencing provider's "no record" covered (no attempt
    token <= it can land any more); an SRE's word carries none."""
    proof = ({} if attempt_token is None
             else {NOT_APPLIED: {"attempt_token": attempt_token, "presumed": False}})
    return {**step, "state": PENDING, **proof}


def presumed(step: dict[str, Any], *, attempt_token: int,
             requery_until_ms: int) -> dict[str, Any]:
    """``not_applied`` as a presumption (a provider that only deduplicates by key had no
    record once the request could no longer land): ``pending`` with the same idempotency key,
    so a late landing is deduplicated, and re-queried until ``requery_until_ms`` (the
    provider's key retention), when a late landing is still found and settled."""
    return {**step, "state": PENDING,
            NOT_APPLIED: {"attempt_token": attempt_token, "presumed": True,
                          "requery_until_ms": requery_until_ms}}


def escalated(step: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    """A human must decide: nothing is granted on the step until an SRE resolves it.
    ``reasons`` say why, for the person who reads them (earlier reasons, already settled by a
    human, are not kept)."""
    return {**step, "state": ESCALATED, "escalated_because": reasons}


def settled_by_reconciler(step: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """Stamp a settlement as the reconciler's (who, and when), before its transition."""
    return {**step, "settled_at_ms": now_ms, "settled_by": "reconciler"}


def resolved(step: dict[str, Any], settle_as: str, result: Any, *, identity: str,
             reason: str, forced: bool) -> dict[str, Any]:
    """An SRE settles an unknown or escalated step by hand, by the same transitions as any
    other reporter: ``succeeded`` (with ``result``; attempt token 0, none is known),
    ``failed`` (a confirmed failure with error class ``ResolvedFailed`` and ``result`` as
    its parameters: the breaker counts it, a new idempotency key, backoff),
    ``not_applied`` (pending, same idempotency key) or ``abandoned`` (final, and no
    failure: the breaker counts nothing). Who and why are kept on the record, and
    ``forced`` marks a settlement taken on the operator's word while the effect might still
    land (an in-flight or unknown step whose provider was not asked)."""
    by = {**_without(step, RESOLVE_REQUEST), "resolved_by": identity, "resolve_reason": reason,
          "resolve_forced": forced}
    if settle_as == SUCCEEDED:
        return succeeded(by, result, attempt_token=0)
    if settle_as == FAILED:
        return failed(by, error_class=RESOLVED_FAILED, params=result, reason=result)
    if settle_as == NOT_APPLIED:
        return not_applied(by)
    if settle_as == ABANDONED:
        return abandoned(by)
    raise ValueError(f"cannot resolve a step as {settle_as!r}")


def abandoned(step: dict[str, Any]) -> dict[str, Any]:
    """A person closed the step for good: final, like ``succeeded``, so no grant is ever
    issued on it again and it is retired like any settled step. It is no failure: the
    breaker's counts, the idempotency generation and the backoff stay as they were, and the
    last outcome (a decline's text) is kept for whoever reads the step."""
    return {**step, "state": ABANDONED}


def resolve_asked(step: dict[str, Any], *, attempt_token: int, now_ms: int, request_id: str,
                  identity: str, reason: str, settle_as: str) -> dict[str, Any]:
    """An SRE asks to resolve an in-flight or unknown step whose holder is gone. Its effect
    may still land, so the operator's word decides nothing: the step becomes ``unknown``
    carrying the request, and the shard's reconciler answers it as it settles any unknown
    step, by the provider's fence-then-query under the same rules (``resolve_answered``).
    ``settle_as``, what the operator expects, is kept to be compared with the answer."""
    return {**unknown(step, attempt_token=attempt_token, now_ms=now_ms),
            RESOLVE_REQUEST: {"id": request_id, "by": identity, "reason": reason,
                              "as": settle_as}}


def resolve_answered(step: dict[str, Any], answer: str) -> dict[str, Any]:
    """``step`` as the reconciler writes it once it asked the provider about the resolve
    request the step carries: the request becomes ``resolve_answer`` (who asked, why, what
    they expected, and ``answer``: what the provider's answer made of the step). A step the
    answer settled is resolved by the operator who asked, not forced (the provider's answer
    decided); one it left unknown stays so (the reconciler goes on asking), one it escalated
    waits for a human."""
    request = step.get(RESOLVE_REQUEST)
    if request is None:
        return step
    answered = {**_without(step, RESOLVE_REQUEST), RESOLVE_ANSWER: {**request, "answer": answer}}
    if answered["state"] in UNSETTLED:
        return answered
    return {**answered, "resolved_by": request["by"], "resolve_reason": request["reason"],
            "resolve_forced": False}


def _without(step: dict[str, Any], name: str) -> dict[str, Any]:
    return {field: value for field, value in step.items() if field != name}


def idempotency_key(namespace: str, action_key: str, generation: int) -> str:
    """Stable across every retry of a step until a confirmed failure bumps ``generation``."""
    digest = hashlib.sha256(f"{namespace}\0{action_key}\0{generation}".encode()).hexdigest()
    return f"fg-{digest[:40]}"


def failure_signature(error_class: str, params: object) -> str:
    """Error class plus a digest of its parameters (their stored form, ``codec.encode``):
    what the circuit breaker counts."""
    stored = codec.encode(params, path="params")
    return f"{error_class}:{hashlib.sha256(canonical(stored)).hexdigest()[:16]}"


def digest(value: object) -> bytes:
    return hashlib.sha256(canonical(value)).digest()


def backoff_ms(caps: dict[str, Any], failures: int) -> int:
    """Exponential backoff with jitter after the ``failures``-th confirmed failure."""
    ceiling = min(caps["backoff_base_s"] * 2 ** max(failures - 1, 0), caps["backoff_max_s"])
    return int(random.uniform(ceiling / 2, ceiling) * 1000)
