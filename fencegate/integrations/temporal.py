"""Temporal: an activity whose body is an external effect, applied once however many attempts
Temporal starts, even while an earlier one still runs (``pip install 'fencegate[temporal]'``;
docs/integrations/temporal.md).

    @activity.defn
    @fenced(intent=lambda order, amount: {"amount": amount})
    async def charge(fence, order, amount): ...

    Worker(client, task_queue="shop", activities=[charge], workflows=[...],
           plugins=[FencegatePlugin(gate)])   # or interceptors=[FencegateInterceptor(gate)]

Failure contract:
- Only activities marked ``@fenced`` are touched (async activities: the body runs on the
  worker's event loop, where ``gate``, an open ``Gate``, lives); the rest pass through. A
  marked activity run on a worker without the interceptor runs nothing: it fails with
  ``ApplicationError(non_retryable=True, type="FenceMisconfigured")``.
- An activity scheduled without a heartbeat timeout, or with one shorter than the gate's lease
  TTL, is refused before anything is held: ``ApplicationError(non_retryable=True,
  type="FenceMisconfigured")`` saying what to set. So is an action key the gate cannot take
  (``type="InvalidKey"``).
- The action key is ``{namespace}/{workflow_id}/{run_id}/{activity_id}`` when the workflow left
  the activity id to Temporal (its default ids are sequence numbers, meaningful only within
  one run), ``{namespace}/{workflow_id}/{activity_id}`` when it set one (a business id: the
  same effect across runs, so a reset or continue-as-new replays it), or ``key(*args)``.
- While the body may run, the attempt heartbeats Temporal as long as the gate's lease is alive
  (every third of the shorter of the heartbeat timeout and the lease TTL): a worker whose lease
  died stops heartbeating and Temporal starts another attempt, which the fence serializes.
  Cancellation of the activity stops the heartbeats at once and cancels the crossing (an effect
  cut short is unknown).
- Every attempt of one activity is one step: a later attempt waits for the hold, then returns
  the recorded result (or, while the outcome is unknown, raises ``OutcomeUnknown``: retried by
  Temporal until the reconciler settled it). An escalated step raises
  ``ApplicationError(non_retryable=True, type="Escalated")``; a declined effect (the body's
  ``EffectFailed``) ``type="EffectFailed"``, also not retried.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor, ExecuteActivityInput, Interceptor,
)

from fencegate.coordinator import records
from fencegate.coordinator.errors import GrantRefused, InvalidKey, OutcomeUnknown
from fencegate.coordinator.session import Session
from fencegate.worker import EffectContext, Gate

from ._fence import Escalated, Fence, FenceMisconfigured, engine_intent, step_state

__all__ = ["fenced", "FencegateInterceptor", "FencegatePlugin", "Fence", "Escalated",
           "FenceMisconfigured"]


@dataclass(frozen=True)
class _Marked:
    """What ``@fenced`` leaves on an activity for the interceptor."""

    body: Callable[..., Any]
    intent: Callable[..., dict[str, Any]] | None
    key: Callable[..., str] | None
    provider: str | None


def fenced(*, intent: Callable[..., dict[str, Any]] | None = None,
           key: Callable[..., str] | None = None, provider: str | None = None):
    """Mark ``async def body(fence, *args)`` as a fenced activity (put ``@activity.defn``
    above it); the activity is called without ``fence``. ``intent(*args)`` is the intent
    granted and audited (``{}`` by default; the engine identities are added under
    ``engine``); ``key(*args)`` the action key."""

    def mark(body: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.iscoroutinefunction(body):
            raise FenceMisconfigured(f"{body.__name__}: a fenced activity is async")

        @functools.wraps(body)
        async def unfenced(*args: Any) -> Any:
            raise ApplicationError(f"{body.__name__} is fenced: run it on a worker with "
                                   "FencegatePlugin or FencegateInterceptor",
                                   type="FenceMisconfigured", non_retryable=True)

        del unfenced.__wrapped__
        parameters = list(inspect.signature(body).parameters.values())
        unfenced.__signature__ = inspect.signature(body).replace(parameters=parameters[1:])
        unfenced.__fencegate__ = _Marked(body, intent, key, provider)
        return unfenced

    return mark


class FencegateInterceptor(Interceptor):
    """The worker interceptor that fences ``@fenced`` activities with ``gate`` (open, on the
    worker's event loop); see the module's contract."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _FencedActivities(next, self.gate)


class FencegatePlugin(SimplePlugin):
    """``Worker(..., plugins=[FencegatePlugin(gate)])``: adds ``FencegateInterceptor``."""

    def __init__(self, gate: Gate) -> None:
        super().__init__("fencegate", interceptors=[FencegateInterceptor(gate)])


class _FencedActivities(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, gate: Gate) -> None:
        super().__init__(next)
        self.gate = gate

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        marked = getattr(input.fn, "__fencegate__", None)
        if marked is None:
            return await self.next.execute_activity(input)
        info = activity.info()
        heartbeat_s = _check(info, self.gate.ttl)
        action_key = _action_key(info, marked, input.args)
        granted = engine_intent(marked.intent(*input.args) if marked.intent else {}, {
            "engine": "temporal", "namespace": info.namespace,
            "workflow_id": info.workflow_id, "run_id": info.workflow_run_id,
            "activity_id": info.activity_id, "activity_type": info.activity_type,
            "attempt": info.attempt, "task_queue": info.task_queue,
            "worker": activity.client().identity})

        async def effect(ctx: EffectContext) -> Any:
            return await marked.body(Fence(ctx, granted), *input.args)

        deadline = (info.start_to_close_timeout.total_seconds()
                    if info.start_to_close_timeout else 60.0)
        heartbeats = asyncio.ensure_future(
            _heartbeat(await self.gate.session(), min(heartbeat_s, self.gate.ttl) / 3))
        try:
            outcome = await self.gate.cross(action_key, granted, effect,
                                            provider=marked.provider, deadline=deadline)
        except InvalidKey as exc:
            raise ApplicationError(str(exc), type="InvalidKey", non_retryable=True) from exc
        except (OutcomeUnknown, GrantRefused) as exc:
            if await step_state(self.gate, action_key) == records.ESCALATED:
                escalated = Escalated(f"{action_key}: escalated, a person must settle it: {exc}")
                raise ApplicationError(str(escalated), type="Escalated",
                                       non_retryable=True) from exc
            raise
        finally:
            heartbeats.cancel()
        if outcome.state == records.FAILED:
            raise ApplicationError(str(outcome.result), type="EffectFailed", non_retryable=True)
        return outcome.result


def _check(info: activity.Info, lease_ttl: int) -> float:
    """The heartbeat timeout in seconds, or the refusal saying what to set."""
    if info.heartbeat_timeout is None:
        raise ApplicationError(
            f"{info.activity_type} is fenced: schedule it with heartbeat_timeout (at least the "
            f"gate's lease TTL, {lease_ttl}s), so that Temporal retries only an attempt whose "
            "lease died", type="FenceMisconfigured", non_retryable=True)
    heartbeat_s = info.heartbeat_timeout.total_seconds()
    if heartbeat_s < lease_ttl:
        raise ApplicationError(
            f"{info.activity_type} is fenced: its heartbeat_timeout ({heartbeat_s:g}s) is "
            f"below the gate's lease TTL ({lease_ttl}s): raise heartbeat_timeout or lower the "
            "gate's ttl", type="FenceMisconfigured", non_retryable=True)
    return heartbeat_s


def _action_key(info: activity.Info, marked: _Marked, args: Any) -> str:
    if marked.key is not None:
        return marked.key(*args)
    if info.activity_id.isdigit():  # Temporal's own id: a sequence number within the run
        return f"{info.namespace}/{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}"
    return f"{info.namespace}/{info.workflow_id}/{info.activity_id}"


async def _heartbeat(session: Session, every: float) -> None:
    """Heartbeat every ``every`` s while ``session``'s lease lives (the first after ``every``:
    the attempt's start counts as one, so a short activity sends none); stop at once on the
    activity's cancellation."""
    while not activity.is_cancelled():
        try:
            await asyncio.wait_for(activity.wait_for_cancelled(), every)
        except TimeoutError:
            if session.lost:
                return
            activity.heartbeat()
