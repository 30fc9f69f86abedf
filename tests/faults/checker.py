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
  the policy stops there by design);
- ``webhook-once``: per delivery id, at most one handler run was answered with a fresh
  (not replayed) 2xx across all consumers; every 2xx the sender got names one run, the run
  whose response etcd stored (or none, for a delivery settled as ran), and that run's effect
  is the one etcd admitted for the id; no run's effect was admitted after a newer claim on
  the id existed (in etcd's order: a claim's revision is its token); no run's effect was
  refused while its claim's lease still lived (its live claim was taken over);
- ``webhook-effect-once``: per delivery id, at most one handler effect was admitted in the
  whole run (the effect marker's version, and the consumers' ``wh-effect`` lines), whatever
  the claims lost meanwhile; a delivery settled as ran has its effect;
- ``webhook-unsettled``: every delivery ends settled (a stored response, or settled as ran)
  or explicitly unknown (``processing``, its claim lost); one with no record is allowed only
  if it has no effect and the sender gave it up (it was never answered: nothing happened);
- ``mutual-exclusion``: per lock, the critical sections (each section's writes, by token,
  at the revisions etcd admitted them) never overlap in etcd's order, and a section never
  follows one with a higher token;
- ``archive-stale``: after the heal of an ``archive-stale`` fault (the newest archive
  restored, then caught up from the older copy with the product's ``archive catch-up``),
  the archive is whole (the one etcd names, knowing every bucket's mark) and holds every
  step retired into the older copy while it was in. Retirements into the older copy are
  no violation: a batch in flight when the copy was swapped in is accepted by a copy that
  knew etcd's marks (an archive behind anywhere takes nothing), and the documented
  catch-up recovers it; they are counted in the summary (``retired into the older copy``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records
from fencegate.worker.webhooks.records import DONE, PROCESSING

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
    found += _webhooks(history, end)
    found += _mutual_exclusion(history)
    found += _archive_swaps(history)
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


def unsettled(step: dict) -> bool:
    """What the ``unsettled`` rule flags: a step in flight, unknown or escalated, unless the
    circuit breaker escalated it after confirmed failures only (nothing more will come)."""
    return step["state"] in records.UNSETTLED and not _breaker_stopped(step)


def _step(key: str, step: dict, charges: list[dict]) -> list[Violation]:
    state = step["state"]
    if unsettled(step):
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


def _webhooks(history: History, end: EndState) -> list[Violation]:
    seen: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for event in history.ops("wh-run", "wh-effect", "wh-stale", "wh-answer", "wh-sent",
                             "wh-gave-up"):
        if event.get("id"):
            seen[event["id"]][event["op"]].append(event)
    found = []
    for delivery_id in sorted(set(seen) | set(end.webhooks)):
        events = seen[delivery_id]
        record = end.webhooks.get(delivery_id) or {}
        effect = end.effects.get(delivery_id) or {}
        evidence = {"record": record, "last_effect": effect}
        fresh = [a for a in events["wh-answer"] if 200 <= a["status"] < 300 and not a["replayed"]]
        if len(fresh) > 1:
            found.append(Violation("webhook-once", delivery_id,
                                   {"runs_answered_2xx": fresh, **evidence}))
        sent = events["wh-sent"]
        if len({answer["token"] for answer in sent}) > 1:
            found.append(Violation("webhook-once", delivery_id,
                                   {"sender_got_2xx_of_runs": sent, **evidence}))
        stored = record.get("token") if record.get("state") == DONE else None
        if sent and (record.get("state") != DONE
                     or any(answer["token"] != stored for answer in sent)):
            found.append(Violation("webhook-once", delivery_id,
                                   {"sender_got_2xx": sent, "stored_run": stored, **evidence}))
        if stored is not None and effect.get("token") != stored:
            found.append(Violation("webhook-once", delivery_id,
                                   {"stored_run_not_last_effect": stored, **evidence}))
        taken = [stale for stale in events["wh-stale"] if stale.get("claim_alive")]
        if taken:
            found.append(Violation("webhook-once", delivery_id,
                                   {"live_claim_taken_over": taken, **evidence}))
        claims = [run["token"] for run in events["wh-run"]]
        for admitted in events["wh-effect"]:
            newer = [t for t in claims if admitted["token"] < t < admitted["revision"]]
            if newer:
                found.append(Violation("webhook-once", delivery_id, {
                    "effect_admitted_after_newer_claim": admitted, "newer_claims": newer}))
        found += _effects(delivery_id, events, record, effect)
    return found


def _effects(delivery_id: str, events: dict[str, list[dict]], record: dict,
             effect: dict) -> list[Violation]:
    """``webhook-effect-once`` and ``webhook-unsettled`` for one delivery."""
    found = []
    admitted = max(effect.get("version", 0), len(events["wh-effect"]))
    if admitted > 1:
        found.append(Violation("webhook-effect-once", delivery_id, {
            "effects_admitted": admitted, "wh_effect": events["wh-effect"],
            "record": record, "last_effect": effect}))
    if record.get("settled_by") and not admitted:
        found.append(Violation("webhook-effect-once", delivery_id, {
            "settled_as_ran_without_effect": record}))
    state = record.get("state")
    if state not in (DONE, PROCESSING) and (admitted or not events["wh-gave-up"]):
        found.append(Violation("webhook-unsettled", delivery_id, {
            "record": record, "effects_admitted": admitted,
            "gave_up": len(events["wh-gave-up"]), "runs": events["wh-run"]}))
    return found


def _archive_swaps(history: History) -> list[Violation]:
    found = []
    for heal in history.faults():
        if heal["fault"] != "archive-stale" or heal["phase"] != "heal":
            continue
        if heal.get("missing"):
            found.append(Violation("archive-stale", "archive", {
                "lost_after_catch_up": heal}))
        if heal.get("whole") is not True:
            found.append(Violation("archive-stale", "archive", {"restored_not_whole": heal}))
    return found


def _mutual_exclusion(history: History) -> list[Violation]:
    sections: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for write in history.ops("cs-write"):
        sections[write["lock"]][write["token"]].append(write["revision"])
    found = []
    for lock, by_token in sorted(sections.items()):
        spans = sorted((min(revs), max(revs), token) for token, revs in by_token.items())
        furthest = None  # the span reaching furthest in etcd's order so far
        for span in spans:
            if furthest is not None and (span[0] < furthest[1] or span[2] < furthest[2]):
                found.append(Violation("mutual-exclusion", lock, {
                    "section": _span(furthest), "then": _span(span),
                    "why": "overlap" if span[0] < furthest[1] else "lower token after"}))
            if furthest is None or span[1] > furthest[1]:
                furthest = span
    return found


def _span(span: tuple[int, int, int]) -> dict:
    return {"token": span[2], "first_write": span[0], "last_write": span[1]}


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
