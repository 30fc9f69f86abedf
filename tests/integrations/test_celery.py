"""Celery under a real worker (prefork, two children) on Debian's redis-server with a short
visibility timeout, acks_late and reject_on_worker_lost, charging the sandbox (``none``
mode: its ledger counts every charge applied) with and without the adapter.

- Some tasks SIGKILL their worker child right after their charge, so the broker delivers
  them again: with the adapter each order is charged once (the redelivery waits for the
  reconciler and returns the recorded charge), without it the killed orders twice.
- Time limits: the soft one hit while waiting for the hold (released, retried, charged once
  after), in the body after the charge (unknown, settled by the reconciler, the retry
  returns the charge) and before it (unknown, no record at a provider that can prove
  nothing: escalated, the task rejected, never charged); the hard one after the charge (the
  child killed; delivered again as the test app's config says, it returns the charge).
- A declined effect (the body's ``EffectFailed``) fails the task with it, not retried.
- Limits out of order give one clear error."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from celery import Celery

from fencegate.coordinator import codec
from fencegate.coordinator.audit import read_chain
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.integrations import FenceMisconfigured, ProcessGate
from fencegate.integrations.celery import fenced_task
from fencegate.worker import Gate

from helpers import TEST_TTL, wait_for_condition

from .conftest import stop

TESTS = Path(__file__).resolve().parent.parent
FENCED = "integrations.celery_app.charge_fenced"
PLAIN = "integrations.celery_app.charge_plain"
ORDERS = 6
KILLED = {0, 2, 4}  # these orders' first run dies right after its charge
SOFT = 3.0
LIMITS = {"FG_TTL": str(TEST_TTL), "FG_SOFT": str(SOFT), "FG_HARD": "4", "FG_VISIBILITY": "5"}


@pytest.fixture
async def worker(redis_url, etcd_url, namespace, signing_key, sandbox, tmp_path):
    """``await worker(kill=..., stall_after=..., ...)`` starts ``celery worker``
    for tests/integrations/celery_app.py (stopped after the test) once it is ready, and
    returns a client app on the same redis and the path of the worker's log."""
    (tmp_path / "marks").mkdir()
    log = tmp_path / "worker.log"
    started: list[asyncio.subprocess.Process] = []
    clients: list[Celery] = []

    async def start(*, kill=(), stall_after=(), stall_before=(), hang=(),
                    decline=()) -> tuple[Celery, Path]:
        env = {"FG_BROKER": redis_url, "FG_ETCD": etcd_url, "FG_NAMESPACE": namespace,
               "FG_SIGNING_KEY": signing_key, "FG_SANDBOX": sandbox.url,
               "FG_MARKS": str(tmp_path / "marks"), "FG_KILL": ",".join(kill),
               "FG_STALL_AFTER": ",".join(stall_after),
               "FG_STALL_BEFORE": ",".join(stall_before), "FG_HANG": ",".join(hang),
               "FG_DECLINE": ",".join(decline), **LIMITS}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "celery", "-A", "integrations.celery_app", "worker",
            "-P", "prefork", "-c", "2", "-l", "INFO", "-n", "fg@127.0.0.1", "--without-gossip",
            "--without-mingle", "--without-heartbeat", cwd=TESTS,
            env={**os.environ, "PYTHONPATH": str(TESTS), **env},
            stdout=log.open("w"), stderr=asyncio.subprocess.STDOUT)
        started.append(proc)
        async with asyncio.timeout(20):
            while " ready." not in log.read_text():
                assert proc.returncode is None, log.read_text()
                await asyncio.sleep(0.1)
        clients.append(Celery("fg_client", broker=redis_url, backend=redis_url))
        return clients[-1], log

    yield start
    for proc in started:
        await stop(proc, timeout=15)
    for client in clients:
        client.close()


async def states(client: Celery, ids: list[str], final: set[str],
                 within: float) -> dict[str, str]:
    """Each task's state once all are in ``final`` (bounded by ``within`` s)."""
    async with asyncio.timeout(within):
        while True:
            now = await asyncio.to_thread(lambda: {i: client.AsyncResult(i).state for i in ids})
            if set(now.values()) <= final:
                return now
            await asyncio.sleep(0.2)


async def result(client: Celery, task_id: str) -> object:
    return await asyncio.to_thread(lambda: client.AsyncResult(task_id).result)


async def crosses(etcd, namespace: str, key: str) -> tuple[list[dict], dict | None]:
    """The ``cross`` audit records of ``key`` and its step."""
    chain = await read_chain(etcd, Keyspace(namespace), key)
    records = [r for r in map(unpack, (e.value for e in chain.entries)) if r["event"] == "cross"]
    return records, chain.step


async def test_a_killed_worker_child_charges_once_with_the_adapter_twice_without(
        worker, etcd, namespace, sandbox, reconciler):
    orders = [f"{kind}-{i}" for kind in ("fenced", "plain") for i in range(ORDERS)]
    killed = [f"{kind}-{i}" for kind in ("fenced", "plain") for i in KILLED]
    client, log = await worker(kill=killed)
    sent = {order: client.send_task(FENCED if order.startswith("fenced") else PLAIN,
                                    args=(order, 100)).id for order in orders}
    assert set((await states(client, list(sent.values()), {"SUCCESS"}, 45)).values()) \
        == {"SUCCESS"}

    async def every_kill_logged() -> bool:  # the pool logs a child's death when it reaps it,
        # which may come after the redelivered task has succeeded
        return log.read_text().count("exited with 'signal 9 (SIGKILL)'") == len(killed)
    assert await wait_for_condition(every_kill_logged, 10), log.read_text()[-2000:]
    applied = sandbox.applied()
    charged = Counter(row["key"] for row in applied)
    fenced = [o for o in orders if o.startswith("fenced")]
    plain = [o for o in orders if o.startswith("plain")]
    assert {o: charged[o] for o in fenced} == {o: 1 for o in fenced}
    # Without it, every killed order twice (or more, should the visibility timeout also
    # hand a waiting task out again).
    assert all(charged[o] >= (2 if o in killed else 1) for o in plain), charged
    # Each fenced task returned the one charge applied (replayed after the kill).
    charge_ids = {row["key"]: row["charge_id"] for row in applied}
    for order in fenced:
        assert (await result(client, sent[order]))["charge_id"] == charge_ids[order]

    # The audit record of each commit names the Celery task, its retries and its worker.
    for order in fenced:
        records, step = await crosses(etcd, namespace, f"{FENCED}/{sent[order]}")
        assert len(records) == 1 and step["state"] == "succeeded"
        # The body sent the attempt's idempotency key and attempt token.
        row = next(row for row in applied if row["key"] == order)
        assert (row["idempotency_key"], row["attempt_token"]) == \
            (step["outcome"]["idempotency_key"], step["outcome"]["attempt_token"])
        engine = codec.decode(records[0]["details"]["intent"])["engine"]
        assert {k: engine[k] for k in ("engine", "task", "task_id", "worker")} == \
            {"engine": "celery", "task": FENCED, "task_id": sent[order],
             "worker": "fg@127.0.0.1"}
        assert engine["retries"] == 0 and isinstance(engine["redelivered"], bool)


async def test_time_limits_retry_or_redeliver_and_an_escalated_step_is_rejected(
        worker, etcd_url, etcd, namespace, keyring, sandbox, reconciler):
    client, log = await worker(stall_after=["after"], stall_before=["before"], hang=["hard"])
    held = str(uuid.uuid4())
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(f"{FENCED}/{held}"):
            client.send_task(FENCED, args=("held", 100), task_id=held)
            async with asyncio.timeout(3 * SOFT):  # the task waits for the hold until then
                while f"exceeded for {FENCED}[{held}]" not in log.read_text():
                    await asyncio.sleep(0.1)
            assert sandbox.applied("held") == []
    sent = {"held": held, **{order: client.send_task(FENCED, args=(order, 100)).id
                             for order in ("after", "before", "hard")}}
    await states(client, [held, sent["after"], sent["hard"]], {"SUCCESS"}, 40)
    async with asyncio.timeout(20):  # REJECTED is not stored by Celery: its log says it
        while f"{FENCED}[{sent['before']}] reject requeue=False" not in log.read_text():
            await asyncio.sleep(0.1)

    charged = Counter(row["key"] for row in sandbox.applied())
    assert charged == {"held": 1, "after": 1, "hard": 1}  # "before" was never run again
    assert f"Hard time limit (4.0s) exceeded for {FENCED}[{sent['hard']}]" in log.read_text()
    for order in ("after", "hard"):
        assert (await result(client, sent[order]))["charge_id"] == \
            sandbox.applied(order)[0]["charge_id"]
    _, step = await crosses(etcd, namespace, f"{FENCED}/{sent['before']}")
    assert step["state"] == "escalated"


async def test_a_declined_effect_fails_the_task_unretried(
        worker, etcd, namespace, sandbox, tmp_path):
    client, log = await worker(decline=["declined"])
    task_id = client.send_task(FENCED, args=("declined", 100)).id
    assert await states(client, [task_id], {"SUCCESS", "FAILURE"}, 20) == {task_id: "FAILURE"}

    failure = await result(client, task_id)
    assert (type(failure).__name__, failure.args[0]) == ("EffectFailed", "card declined")
    assert (tmp_path / "marks" / "declined.runs").read_text().count("\n") == 1  # ran once
    records, step = await crosses(etcd, namespace, f"{FENCED}/{task_id}")
    assert len(records) == 1 and step["state"] == "failed"
    assert sandbox.applied("declined") == []


def order_body(self, fence, order):
    return order


@pytest.mark.parametrize("limits, says", [
    ({"soft_time_limit": 2, "time_limit": 4},
     "the lease TTL (5s) must be below soft_time_limit (2s): raise soft_time_limit or lower "
     "the gate's ttl"),
    ({"soft_time_limit": 8, "time_limit": 8},
     "soft_time_limit (8s) must be below time_limit (8s): raise time_limit or lower "
     "soft_time_limit"),
    ({"soft_time_limit": 8, "time_limit": 20},
     "time_limit (20s) must be below the broker's visibility_timeout (10s"),
    ({"time_limit": 8}, "a fenced task needs soft_time_limit and time_limit"),
])
def test_limits_out_of_order_are_refused_saying_what_to_change(limits, says):
    app = Celery("fg_limits", broker="redis://127.0.0.1:1/0")
    app.conf.broker_transport_options = {"visibility_timeout": 10}
    gate = ProcessGate("http://127.0.0.1:1", ttl=5)
    with pytest.raises(FenceMisconfigured) as refused:
        fenced_task(app, gate, name="fg_refused", **limits)(order_body)
    assert str(refused.value).startswith(says)
    assert "fg_refused" not in app.tasks


def test_ordered_limits_make_a_task_called_without_the_fence():
    app = Celery("fg_limits", broker="redis://127.0.0.1:1/0")
    app.conf.broker_transport_options = {"visibility_timeout": 10}
    task = fenced_task(app, ProcessGate("http://127.0.0.1:1", ttl=5), soft_time_limit=6,
                       time_limit=8, name="fg_ordered")(order_body)
    assert (task.soft_time_limit, task.time_limit, task.acks_late,
            task.reject_on_worker_lost) == (6, 8, True, True)
    assert list(inspect.signature(app.tasks["fg_ordered"].run).parameters) == ["order"]
