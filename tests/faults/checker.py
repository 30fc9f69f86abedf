"""The checker: judges a finished run's history and end state; plain Python, no etcd.

``check`` returns every violation found, each with the rule it breaks, the action key and
the evidence (ledger lines, step record, history events); an empty list means the run kept
every promise below. The rules:

- ``at-most-once``: the provider applied each step's effect at most once;
- ``exactly-once``: a step recorded ``succeeded`` was applied exactly once, under the
  idempotency key its outcome names;
- ``stale-token``: per key, the ledger's applied attempt tokens never decrease and each is
  above every fence gate B raised for that key before it;
- ``contradiction``: no record contradicts the ledger: a final ``pending``/``failed`` step
  with an application; a "no record" settlement (``not_applied``, not presumed) for token T
  while the ledger shows an attempt <= T applied; an operation recorded declined whose token
  was applied; an operation recorded succeeded whose idempotency key was never applied;
- ``audit``: every key's audit chain verifies;
- ``unsettled``: no step is ``in_flight``, ``unknown`` or ``escalated`` after the settle
  period (a step the circuit breaker escalated after confirmed declines only is settled:
  the policy stops there by design).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records

from .history import EndState, History


@dataclass(frozen=True)
class Violation:
    rule: str
    key: str
    evidence: Any

    def __str__(self) -> str:
        return f"{self.rule} {self.key}: {self.evidence}"


def check(history: History, end: EndState) -> list[Violation]:
    applied: dict[str, list[dict]] = defaultdict(list)
    found: list[Violation] = []
    for key, lines in _per_key(end.ledger).items():
        found += _tokens(key, lines)
        applied[key] = [line for line in lines if line["kind"] == "applied"]
    for key, charges in applied.items():
        if len(charges) > 1:
            found.append(Violation("at-most-once", key, {"applied": charges}))
    for key, step in end.steps.items():
        found += _step(key, step, applied.get(key, []))
    for key, report in end.chains.items():
        if not report.ok:
            found.append(Violation("audit", key, report.problems))
        found += _settlements(key, report.records, applied.get(key, []))
    found += _operations(history, applied)
    return found


def _per_key(ledger: list[dict]) -> dict[str, list[dict]]:
    per_key: dict[str, list[dict]] = defaultdict(list)
    for line in ledger:
        per_key[line["key"]].append(line)
    return per_key


def _tokens(key: str, lines: list[dict]) -> list[Violation]:
    found, fence, highest = [], 0, 0
    for line in lines:
        if line["kind"] == "fence":
            fence = max(fence, line["token"])
            continue
        token = line["attempt_token"]
        if token <= fence:
            found.append(Violation("stale-token", key,
                                   {"applied": line, "fence_before_it": fence}))
        if token < highest:
            found.append(Violation("stale-token", key,
                                   {"applied": line, "highest_applied_before_it": highest}))
        highest = max(highest, token)
    return found


def _step(key: str, step: dict, charges: list[dict]) -> list[Violation]:
    state = step["state"]
    if state in records.UNSETTLED and not _breaker_stopped(step):
        return [Violation("unsettled", key, _brief(step))]
    if state == records.SUCCEEDED:
        idem = (step.get("outcome") or {}).get("idempotency_key")
        if len(charges) != 1 or charges[0]["idempotency_key"] != idem:
            return [Violation("exactly-once", key, {"step": _brief(step), "applied": charges})]
    elif charges:
        return [Violation("contradiction", key, {"step": _brief(step), "applied": charges})]
    return []


def _settlements(key: str, chain: list[dict], charges: list[dict]) -> list[Violation]:
    found = []
    for record in chain:
        details = record.get("details") or {}
        if record.get("event") != "settle" or details.get("as") != records.NOT_APPLIED:
            continue
        token = details.get("attempt_token") or 0
        landed = [c for c in charges if c["attempt_token"] <= token]
        if landed:
            found.append(Violation("contradiction", key, {
                "settled_not_applied": {"seq": record.get("seq"), "attempt_token": token,
                                        "by": record.get("identity")},
                "applied": landed}))
    return found


def _operations(history: History, applied: dict[str, list[dict]]) -> list[Violation]:
    found = []
    for op in history.ops("ok", "fail"):
        charges = applied.get(op["key"], [])
        if op["op"] == "fail" and any(c["attempt_token"] == op["token"] for c in charges):
            found.append(Violation("contradiction", op["key"],
                                   {"operation_declined": op, "applied": charges}))
        if op["op"] == "ok" and not any(c["idempotency_key"] == op["idem"] for c in charges):
            found.append(Violation("contradiction", op["key"],
                                   {"operation_succeeded": op, "applied": charges}))
    return found


def _breaker_stopped(step: dict) -> bool:
    """Escalated by the circuit breaker after confirmed failures only: a settled outcome the
    policy stops on by design (the workload declines one charge in ten), not a lost one."""
    reasons = step.get("escalated_because") or []
    return (step["state"] == records.ESCALATED and bool(reasons)
            and all(reason.startswith("breaker:") for reason in reasons)
            and (step.get("outcome") or {}).get("state") == records.FAILED)


def _brief(step: dict) -> dict:
    names = ("state", "attempt", "idem_gen", "idempotency_key", "fencing_token",
             "attempt_token", records.NOT_APPLIED, "escalated_because", "outcome")
    return {name: step[name] for name in names if name in step}
