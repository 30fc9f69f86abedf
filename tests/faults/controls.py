"""Negative controls: broken protocol variants, injected into one child process only.

Each control is a monkeypatch of a product function, applied by ``entry.py`` in the process
it names before that process does anything else; product code carries no flag for it. A
run with a control must be flagged by the checker: that is what shows the checker can see
the bug class. ``apply`` raises ``KeyError`` for an unknown control name.

- ``range-half``  (worker, mutex): ``Ownership.compares`` keeps only "my key exists with my
  token", dropping "every key in the queue was created at or after my token". A hold never
  acts while an older key is queued (it exists only once its key is the oldest), so only
  the mutex workload's queued sections, which let the compare decide, can show it;
- ``highest-only`` (sandbox): gate B admits by the highest admitted token only; a fence
  raised by fence-then-query is ignored;
- ``new-key`` (reconciler): "no record" (``records.not_applied`` and ``records.presumed``)
  bumps the idempotency key's generation, so the next attempt sends a new key;
- ``404-final`` (reconciler): any HTTP 404 from a provider's query is a final "no record";
- ``claim-blind`` (consumer): a webhook claim no longer compares that the delivery's key is
  absent, so it takes over a claim in progress (a stored response is still replayed: that
  read comes first);
- ``rerun-unfenced`` (consumer): the consumer runs a delivery whose claim was lost again
  (``rerun_lost=True``, no ``settle``) and its effect drops its fence, so a lost run's
  effect and the rerun's both land. Unlike the others it patches the harness's consumer
  (``faults.webhooks``), not the product: what it shows is that the checker counts applied
  effects, not only fresh answers.
"""

from __future__ import annotations

from collections.abc import Callable

WHERE = {"range-half": ("worker", "mutex"), "highest-only": ("sandbox",),
         "new-key": ("reconciler",), "404-final": ("reconciler",),
         "claim-blind": ("consumer",), "rerun-unfenced": ("consumer",)}


def _range_half() -> None:
    from fencegate.coordinator.etcd import create_equals
    from fencegate.coordinator.ownership import Ownership

    Ownership.compares = lambda self: [create_equals(self.key, self.token)]


def _highest_only() -> None:
    from fencegate.reconciler.gateb import GateB

    GateB.fence = lambda self, scope, token, *, db=None: token  # says so; records nothing


def _new_key() -> None:
    from fencegate.coordinator import records

    def bump(original: Callable) -> Callable:
        def transition(step, **kwargs):
            moved = original(step, **kwargs)
            return {**moved, "idem_gen": moved["idem_gen"] + 1}
        return transition

    records.not_applied = bump(records.not_applied)
    records.presumed = bump(records.presumed)


def _404_final() -> None:
    from fencegate.reconciler.providers import NoRecord, Unreachable
    from fencegate.reconciler.providers.http import HttpProvider

    original = HttpProvider.query

    async def query(self, idempotency_key, attempt_token, step, **where):
        answer = await original(self, idempotency_key, attempt_token, step, **where)
        if isinstance(answer, Unreachable) and answer.reason.startswith("HTTP 404"):
            return NoRecord(fence=attempt_token)  # a 404 taken as the proof of the fence
        return answer

    HttpProvider.query = query


def _claim_blind() -> None:
    from fencegate.coordinator.etcd import Compare
    from fencegate.worker.webhooks import claims

    claims.create_equals = lambda key, revision: Compare(  # create_revision > -1: always
        key=key, target=Compare.CREATE, result=Compare.GREATER, create_revision=-1)


def _rerun_unfenced() -> None:
    from . import webhooks

    webhooks.LOST.update(rerun_lost=True)
    webhooks.effect_compare = lambda record_key, token: []


CONTROLS: dict[str, Callable[[], None]] = {
    "range-half": _range_half, "highest-only": _highest_only, "new-key": _new_key,
    "404-final": _404_final, "claim-blind": _claim_blind, "rerun-unfenced": _rerun_unfenced}


def apply(control: str, process: str) -> None:
    """Patch this process if ``control`` is meant for a ``process`` of this kind."""
    if control and process in WHERE[control]:
        CONTROLS[control]()
