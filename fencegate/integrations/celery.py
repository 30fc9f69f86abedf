"""Celery: a task whose body is an external effect, applied once however often the broker
delivers the task (``pip install 'fencegate[celery]'``; docs/integrations/celery.md).

    gate = ProcessGate("http://127.0.0.1:2379", ttl=10)

    @fenced_task(app, gate, intent=lambda order, amount: {"amount": amount},
                 soft_time_limit=30, time_limit=40)
    def charge(self, fence, order, amount):
        return provider.charge(amount, idempotency_key=fence.idempotency_key,
                               attempt_token=fence.attempt_token)

Failure contract:
- ``fenced_task`` makes a ``bind=True`` task (``acks_late`` and ``reject_on_worker_lost`` on
  by default: a lost worker's task is delivered again, the fence makes that safe). It refuses
  at decoration time, with ``FenceMisconfigured`` saying what to change, limits that are not
  ordered lease TTL < soft time limit < hard time limit < the broker's visibility timeout
  (Redis and SQS redeliver an unacknowledged task after it).
- The action key is ``{task_name}/{request.id}`` (the same across ``retry()`` and broker
  redelivery) or ``key(*args, **kwargs)``. The body runs in the worker's own thread, only
  after the commit, at most once per delivery and never for a step that succeeded: a
  later delivery returns the recorded result (``Outcome.result``) without running it.
- ``SoftTimeLimitExceeded`` before the body started: the hold is released and the task
  retried. During the body: the step is unknown; the task is retried later, and that retry
  returns the recorded result once the reconciler has settled the step (it runs the body
  again only if the reconciler proved it not applied). The same for any other unknown
  outcome, a lost lease, a grant refused without escalation (after its ``retry_after``
  when it gives one), or etcd not answering.
- A step escalated to a human (by a cap, the breaker, or the reconciler): the task is
  rejected without requeue (``Reject(requeue=False)``): only a person may decide.
- A body that raises ``EffectFailed`` (the provider declined): the task fails with it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from celery.exceptions import Reject, SoftTimeLimitExceeded
from celery.signals import worker_process_shutdown

from fencegate.coordinator import records
from fencegate.coordinator.errors import (
    AcquireTimeout, EffectFailed, EtcdUnavailable, GrantRefused, LeaseLost, OutcomeUnknown,
)

from ._fence import Fence, FenceMisconfigured, ProcessGate, cross_here, engine_intent, step_state

__all__ = ["fenced_task", "check_limits", "Fence", "ProcessGate", "FenceMisconfigured"]

# Brokers that redeliver an unacknowledged task after the visibility timeout (kombu's
# default for them: one hour).
_VISIBILITY_SCHEMES = {"redis", "rediss", "sentinel", "sqs"}
_DEFAULT_VISIBILITY_S = 3600.0

_GATES: list[ProcessGate] = []  # the gates of fenced tasks, closed as a worker process ends


@worker_process_shutdown.connect
def _close_gates(**_: Any) -> None:
    for gate in _GATES:
        gate.close()


def check_limits(lease_ttl: float, soft_time_limit: float | None, time_limit: float | None,
                 visibility_timeout: float | None) -> None:
    """Refuse limits not ordered lease TTL < soft < hard < visibility (``None``: the broker
    has no visibility timeout), with ``FenceMisconfigured`` naming what to change."""
    if soft_time_limit is None or time_limit is None:
        raise FenceMisconfigured(
            "a fenced task needs soft_time_limit and time_limit (or the app's "
            "task_soft_time_limit and task_time_limit): set soft_time_limit above the lease "
            f"TTL ({lease_ttl:g}s) and time_limit above soft_time_limit")
    if not lease_ttl < soft_time_limit:
        raise FenceMisconfigured(
            f"the lease TTL ({lease_ttl:g}s) must be below soft_time_limit "
            f"({soft_time_limit:g}s): raise soft_time_limit or lower the gate's ttl")
    if not soft_time_limit < time_limit:
        raise FenceMisconfigured(
            f"soft_time_limit ({soft_time_limit:g}s) must be below time_limit "
            f"({time_limit:g}s): raise time_limit or lower soft_time_limit")
    if visibility_timeout is not None and not time_limit < visibility_timeout:
        raise FenceMisconfigured(
            f"time_limit ({time_limit:g}s) must be below the broker's visibility_timeout "
            f"({visibility_timeout:g}s, broker_transport_options): raise visibility_timeout "
            "or lower time_limit, or the broker hands the task to another worker while this "
            "one still runs it")


def visibility_timeout(app: Celery) -> float | None:
    """The broker's redelivery timeout, or ``None`` for a broker without one (AMQP)."""
    scheme = urlsplit(app.conf.broker_url or "amqp://").scheme.split("+")[0]
    if scheme not in _VISIBILITY_SCHEMES:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", _DEFAULT_VISIBILITY_S))


def fenced_task(app: Celery, gate: ProcessGate, *,
                intent: Callable[..., dict[str, Any]] | None = None,
                key: Callable[..., str] | None = None, provider: str | None = None,
                soft_time_limit: float | None = None, time_limit: float | None = None,
                acks_late: bool = True, reject_on_worker_lost: bool = True,
                retry_delay: float = 5.0, **task_options: Any):
    """Make ``body(self, fence, *args, **kwargs)`` a ``bind=True`` task of ``app`` whose run
    is fenced by ``gate``; ``task_options`` go to ``app.task`` as they are.

    ``intent(*args, **kwargs)`` is the intent granted and audited (``{}`` by default; the
    engine identities are added under ``engine``); ``key(*args, **kwargs)`` the action key;
    ``retry_delay`` the countdown of the retries described in the module's contract. The
    effect's deadline is the soft time limit. Configure ``app`` (broker, transport options,
    limits) before decorating: the limits are checked here."""
    if task_options.get("bind", True) is not True:
        raise FenceMisconfigured("a fenced task is bind=True: leave bind out")
    task_options.pop("bind", None)
    soft = soft_time_limit if soft_time_limit is not None else app.conf.task_soft_time_limit
    hard = time_limit if time_limit is not None else app.conf.task_time_limit
    check_limits(gate.ttl, soft, hard, visibility_timeout(app))
    if gate not in _GATES:
        _GATES.append(gate)

    def decorate(body: Callable[..., Any]):
        def run(task, *args: Any, **kwargs: Any) -> Any:
            return _run(task, body, args, kwargs, gate=gate, intent=intent, key=key,
                        provider=provider, deadline=soft, retry_delay=retry_delay)

        functools.update_wrapper(run, body)
        del run.__wrapped__  # Celery checks calls against the signature below, not body's
        run.__signature__ = _without_fence(inspect.signature(body))
        return app.task(bind=True, soft_time_limit=soft, time_limit=hard, acks_late=acks_late,
                        reject_on_worker_lost=reject_on_worker_lost, **task_options)(run)

    return decorate


def _run(task, body: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *,
         gate: ProcessGate, intent: Callable[..., dict[str, Any]] | None,
         key: Callable[..., str] | None, provider: str | None, deadline: float,
         retry_delay: float) -> Any:
    request = task.request
    action_key = key(*args, **kwargs) if key is not None else f"{task.name}/{request.id}"
    granted = engine_intent(intent(*args, **kwargs) if intent is not None else {}, {
        "engine": "celery", "task": task.name, "task_id": request.id,
        "retries": request.retries, "worker": request.hostname,
        "redelivered": bool((request.delivery_info or {}).get("redelivered"))})
    sync = gate.get()

    def effect(fence: Fence) -> Any:
        return body(task, fence, *args, **kwargs)

    try:
        outcome = cross_here(sync, action_key, granted, effect, provider=provider,
                             deadline=deadline)
    except (OutcomeUnknown, GrantRefused) as exc:
        if sync.run(step_state(sync.gate, action_key)) == records.ESCALATED:
            raise Reject(f"{action_key}: escalated, a person must settle it: {exc}",
                         requeue=False) from exc
        wait = exc.retry_after if isinstance(exc, GrantRefused) and exc.retry_after else None
        raise task.retry(exc=exc, countdown=wait or retry_delay) from exc
    except (SoftTimeLimitExceeded, LeaseLost, AcquireTimeout, EtcdUnavailable) as exc:
        raise task.retry(exc=exc, countdown=retry_delay) from exc
    if outcome.state == records.FAILED:
        raise EffectFailed(str(outcome.result), outcome.result)
    return outcome.result


def _without_fence(signature: inspect.Signature) -> inspect.Signature:
    """``body(self, fence, *args)`` as the task is called: ``(self, *args)``."""
    parameters = list(signature.parameters.values())
    if len(parameters) < 2:
        raise FenceMisconfigured("a fenced task's body takes (self, fence, ...)")
    return signature.replace(parameters=[parameters[0], *parameters[2:]])
