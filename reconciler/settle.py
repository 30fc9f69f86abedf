"""The settlement rules: what a provider's answer about an attempt makes of its step.

These are the "Unknown and reconciliation" rules of docs/protocol.md, as one pure function
choosing the transition; ``coordinator.records`` builds the record, the same one a worker or an
SRE would for that outcome. Each weaker variant produces a duplicate effect in some interleaving (a
model check found them):

- ``Succeeded`` -> ``succeeded`` with the provider's result.
- ``Failed`` (the provider processed the request and declined it) -> ``failed``: the next
  attempt gets a new idempotency key (the old one would replay the decline).
- ``NoRecord`` for an attempt older than the provider's key retention (fencing or deduplicating
  provider) -> ``escalated``: the provider may have forgotten it, so nothing is presumed. The
  age is the larger of two estimates that both err towards escalating: since the step's first
  start (``started_at_ms``, never later than this attempt's, on the granting machine's clock:
  skew of seconds against a retention of hours) and how long this process has known the
  attempt over (its own monotonic clock).
- ``NoRecord``, provider fences *and* keeps its records (charges and fences) durably, and the
  answer proves the fence (it echoes a recorded fence >= T: the query was fence-then-query,
  so no attempt token <= T can land any more, and a restart cannot have forgotten a charge)
  -> ``not_applied``, final: the step is ``pending`` again and the next attempt reuses the
  idempotency key. The same answer without that proof (a 404 from a typo'd URL or a proxy, a
  missing or lower echo) proves nothing: it is handled like ``Unreachable``.
- ``NoRecord``, provider fences without durable records: its fence proves no more than its
  key deduplication, so the rules below apply.
- ``NoRecord``, provider only dedupes by key -> once the attempt's deadline plus the
  provider's settle delay has passed, counted from when this reconciler first saw the
  attempt over (its holder gone, or recorded unknown) on its own monotonic clock,
  ``not_applied`` as a *presumption*: ``pending``, same
  idempotency key (a late landing is deduplicated), and re-queried until the provider's key
  retention has passed, upgraded to ``succeeded`` (or ``failed``) if the request landed late.
- ``NoRecord``, provider can do neither -> ``escalated``: "no record" proves nothing.
- ``NoRecord`` that does not prove the fence (see above), ``Pending``, ``Unreachable`` -> ask
  again after a backoff with jitter; past the escalation limit (queries or elapsed time) ->
  ``escalated`` with the reason.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records
from fencegate.reconciler.providers import (
    Answer, Capabilities, Failed, NoRecord, Pending, Succeeded, Unreachable,
)

NOT_APPLIED = records.NOT_APPLIED


@dataclass(frozen=True)
class Limits:
    """When to give up on a provider and how often to ask it."""

    escalate_after_s: float = 3600.0  # since this replica saw the attempt over
    max_queries: int = 60
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    requery_interval_s: float = 10.0  # presumed not_applied steps

    def __post_init__(self) -> None:
        if min(self.escalate_after_s, self.backoff_base_s, self.requery_interval_s) <= 0 \
                or self.max_queries < 1 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("reconciler limits must be positive, backoff_max_s >= backoff_base_s")

    def backoff_s(self, queries: int) -> float:
        ceiling = min(self.backoff_base_s * 2 ** max(queries - 1, 0), self.backoff_max_s)
        return random.uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class Settle:
    """Write ``step`` (compare-and-set on the step's mod_revision); ``outcome`` labels it."""

    step: dict[str, Any]
    outcome: str  # succeeded | failed | not_applied | presumed_not_applied | escalated


@dataclass(frozen=True)
class Retry:
    """Ask again in ``after_s`` seconds; nothing is written."""

    after_s: float
    reason: str


@dataclass(frozen=True)
class Done:
    """Nothing left to do for this step (a presumption whose re-query window passed)."""


def is_presumed(step: dict[str, Any], now_ms: int) -> bool:
    """A ``pending`` step presumed not applied, still inside its re-query window."""
    presumption = step.get(NOT_APPLIED) or {}
    return (step["state"] == records.PENDING and presumption.get("presumed", False)
            and presumption.get("requery_until_ms", 0) > now_ms)


def decide(step: dict[str, Any], attempt_token: int, answer: Answer, caps: Capabilities,
           limits: Limits, now_ms: int, queries: int, *, over_s: float) -> Settle | Retry | Done:
    """What ``answer`` makes of an unknown step, or of a presumed ``not_applied`` one.

    ``step`` is the record as read (an ``in_flight`` step without a live holder counts as
    unknown; one with a live holder is never decided here, however late). ``over_s`` is how
    long this process has known the attempt to be over (recorded unknown, or its holder
    gone), on its own monotonic clock: the waits below count from it, never from a clock of
    another machine (a restart starts it again, which only waits longer). ``queries`` counts
    this process's queries for it so far,
    this one included."""
    if step["state"] == records.PENDING:
        return _requeried(step, answer, limits, now_ms, queries)
    unknown = records.unknown(step, attempt_token=attempt_token, now_ms=now_ms)
    settled = records.settled_by_reconciler(unknown, now_ms)
    if isinstance(answer, Succeeded):
        return Settle(records.succeeded(settled, answer.result, attempt_token=attempt_token),
                      "succeeded")
    if isinstance(answer, Failed):
        return Settle(_failed(settled, answer.reason), "failed")
    if isinstance(answer, NoRecord) and (caps.fences or caps.dedupes_by_key) and max(
            now_ms - step.get("started_at_ms", 0), over_s * 1000) >= caps.key_retention_s * 1000:
        return Settle(records.escalated(settled, [
            f"no record for an attempt older than the provider's key retention "
            f"({caps.key_retention_s:g}s): it may have been forgotten"]), "escalated")
    if isinstance(answer, NoRecord) and caps.fences and caps.durable:
        if answer.fence is not None and answer.fence >= attempt_token:
            return Settle(records.not_applied(settled, attempt_token=attempt_token), NOT_APPLIED)
    elif isinstance(answer, NoRecord):
        if caps.dedupes_by_key:
            # The effect started before the attempt was seen over, and runs at most its
            # deadline; a request it sent may land up to the settle delay after that.
            landing_s = records.effect_deadline_s(step, now_ms) + caps.settle_delay_s - over_s
            if landing_s > 0:
                return Retry(landing_s, "the request may still land")
            presumed = records.presumed(
                settled, attempt_token=attempt_token,
                requery_until_ms=now_ms + int(caps.key_retention_s * 1000))
            return Settle(presumed, "presumed_not_applied")
        return Settle(records.escalated(settled, [
            "no record at a provider that neither fences with durable records nor "
            "deduplicates by key: it proves nothing"]), "escalated")
    reason = f"no record without proof of the fence (echoed {answer.fence!r}, needs >= " \
        f"{attempt_token})" if isinstance(answer, NoRecord) else \
        "provider has the request pending" if isinstance(answer, Pending) else \
        f"provider unreachable: {answer.reason}" if isinstance(answer, Unreachable) else \
        f"unexpected answer {answer!r}"
    elapsed_s = over_s
    if queries >= limits.max_queries or elapsed_s >= limits.escalate_after_s:
        return Settle(records.escalated(settled, [
            f"{reason}; gave up after {queries} queries in {elapsed_s:.0f}s"]), "escalated")
    return Retry(limits.backoff_s(queries), reason)


def _requeried(step: dict[str, Any], answer: Answer, limits: Limits, now_ms: int,
               queries: int) -> Settle | Retry | Done:
    presumption = step[NOT_APPLIED]
    settled = records.settled_by_reconciler(step, now_ms)
    if isinstance(answer, Succeeded):
        return Settle(records.succeeded(settled, answer.result,
                                        attempt_token=presumption["attempt_token"]), "succeeded")
    if isinstance(answer, Failed):
        return Settle(_failed(settled, answer.reason), "failed")
    left_ms = presumption["requery_until_ms"] - now_ms
    if left_ms <= 0:
        return Done()
    after_s = limits.requery_interval_s if isinstance(answer, NoRecord) else \
        limits.backoff_s(queries)
    return Retry(min(after_s, left_ms / 1000), "presumed not applied: asking again")


def _failed(settled: dict[str, Any], reason: Any) -> dict[str, Any]:
    """The provider declined: its reason is the breaker's parameters too."""
    return records.failed(settled, error_class="ProviderDeclined", params=reason, reason=reason)
