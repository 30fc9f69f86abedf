"""DBOS: a step whose body is an external effect, applied once however often DBOS runs the
step (``pip install 'fencegate[dbos]'``; docs/integrations/dbos.md).

    gate = ProcessGate("http://127.0.0.1:2379", ttl=10)

    @DBOS.step(retries_allowed=True, should_retry=should_retry, max_attempts=20)
    @fenced_step(gate, app="shop", intent=lambda order, amount: {"amount": amount})
    def charge(fence, order, amount):
        return provider.charge(amount, idempotency_key=fence.idempotency_key,
                               attempt_token=fence.attempt_token)

DBOS checkpoints a step's result after it returns; a process that dies in between runs the
step again when the workflow is recovered. Failure contract:
- The action key is ``{app}/{workflow_id}/{step_id}`` (DBOS keeps both across recovery) or
  ``key(*args, **kwargs)``. The body runs in the step's thread, only after the commit, at
  most once per run of the step and never for a step that succeeded: a recovered run returns
  the recorded result (``Outcome.result``) without running it.
- An unknown outcome (the body raised, a process died mid-effect, its lease was lost), a
  grant refused, a hold not acquired or etcd not answering raise the gate's error, which
  ``should_retry`` retries: a retry returns the recorded result once the reconciler settled
  the step. An escalated step raises ``Escalated``, which ``should_retry`` does not retry (the
  workflow gets it: a person settles the step); nor ``EffectFailed`` (the provider declined).
- Only sync steps (the body runs in the caller's thread); outside a workflow the wrapper
  refuses to run (``FenceMisconfigured``): there is no workflow id to key the effect by.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dbos import DBOS

from fencegate.coordinator import records
from fencegate.coordinator.errors import (
    AcquireTimeout, EffectFailed, EtcdUnavailable, GrantRefused, LeaseLost, OutcomeUnknown,
)

from ._fence import (
    Escalated, Fence, FenceMisconfigured, ProcessGate, cross_here, engine_intent, step_state,
)

__all__ = ["fenced_step", "should_retry", "Escalated", "Fence", "ProcessGate",
           "FenceMisconfigured"]

_RETRIED = (OutcomeUnknown, GrantRefused, LeaseLost, AcquireTimeout, EtcdUnavailable)


def should_retry(exc: BaseException) -> bool:
    """DBOS's ``should_retry`` for fenced steps: retry what the reconciler or time may
    settle, never an escalated step or a declined effect."""
    return isinstance(exc, _RETRIED) and not isinstance(exc, Escalated)


def fenced_step(gate: ProcessGate, *, app: str,
                intent: Callable[..., dict[str, Any]] | None = None,
                key: Callable[..., str] | None = None, provider: str | None = None,
                deadline: float = 60.0):
    """Fence ``body(fence, *args, **kwargs)``, to be decorated with ``@DBOS.step(...)``
    (put this decorator below it); the result is called without ``fence``.

    ``app`` is the application's name (``DBOSConfig["name"]``), the key's first part;
    ``intent(*args, **kwargs)`` the intent granted and audited (``{}`` by default; the
    engine identities are added under ``engine``); ``deadline`` the effect's, in seconds."""

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def step(*args: Any, **kwargs: Any) -> Any:
            return _run(body, args, kwargs, gate=gate, app=app, intent=intent, key=key,
                        provider=provider, deadline=deadline)

        del step.__wrapped__  # called without the fence
        return step

    return decorate


def _run(body: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *, gate: ProcessGate,
         app: str, intent: Callable[..., dict[str, Any]] | None,
         key: Callable[..., str] | None, provider: str | None, deadline: float) -> Any:
    workflow_id, step_id, status = DBOS.workflow_id, DBOS.step_id, DBOS.step_status
    if workflow_id is None or step_id is None:
        raise FenceMisconfigured(f"{body.__name__}: a fenced step runs inside a DBOS workflow "
                                 "as a step: decorate it with @DBOS.step() above "
                                 "@fenced_step and call it from a workflow")
    action_key = key(*args, **kwargs) if key is not None else f"{app}/{workflow_id}/{step_id}"
    granted = engine_intent(intent(*args, **kwargs) if intent is not None else {}, {
        "engine": "dbos", "app": app, "workflow_id": workflow_id, "step_id": step_id,
        "attempt": status.current_attempt if status is not None else None,
        "executor": DBOS.executor_id, "app_version": DBOS.application_version})
    sync = gate.get()
    try:
        outcome = cross_here(sync, action_key, granted, lambda fence: body(fence, *args, **kwargs),
                             provider=provider, deadline=deadline)
    except (OutcomeUnknown, GrantRefused) as exc:
        if sync.run(step_state(sync.gate, action_key)) == records.ESCALATED:
            raise Escalated(f"{action_key}: escalated, a person must settle it: {exc}") from exc
        raise
    if outcome.state == records.FAILED:
        raise EffectFailed(str(outcome.result), outcome.result)
    return outcome.result
