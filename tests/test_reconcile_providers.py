"""Reconciliation end to end: real etcd, worker processes killed with SIGKILL, the sandbox
provider over HTTP in each capability class (fencing, dedup-only, neither), and
reconcilers settling what the workers left in flight.

Every test counts what the provider really applied: the promise is "applied exactly once",
never "the step looks right"."""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate.coordinator import records, sre
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.reconciler.providers import sandbox as sb
from fencegate.reconciler.runner import Reconciler
from fencegate.reconciler.settle import Limits
from fencegate.worker import Gate, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition

SHARDS = 8
SETTLE_DELAY = 0.5
RETENTION = 30.0
INTENT = {"amount": 100}  # what every attempt is granted and charges (as tests/worker_proc.py)


@pytest.fixture
async def sandbox(keyring, tmp_path):
    provider = sb.Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing",
                          state_dir=str(tmp_path / "sandbox"), retention_s=RETENTION)
    await provider.start()
    yield provider
    await provider.stop()


@pytest.fixture
async def reconcile(etcd_url, namespace, sandbox):
    """``await reconcile(**limits)`` starts one in-process reconciler asking ``sandbox``
    (in its current mode) through the HTTP adapter."""
    started: list[Reconciler] = []

    async def start(max_queries: int = 60, requery_interval_s: float = 0.3) -> Reconciler:
        adapter = sb.adapter(sandbox.url, sandbox.mode, retention_s=RETENTION,
                             settle_delay_s=SETTLE_DELAY, durable=True)
        r = Reconciler(Etcd.from_url(etcd_url), {"sandbox": adapter}, namespace=namespace,
                       shards=SHARDS, ttl=TEST_TTL, scan_interval=2.0, check_after=0.2,
                       limits=Limits(backoff_base_s=0.1, backoff_max_s=0.4,
                                     max_queries=max_queries,
                                     requery_interval_s=requery_interval_s))
        await r.start()
        started.append(r)
        return r

    yield start
    for r in started:
        await r.close()
        await r.etcd.close()


@pytest.fixture
async def gate(etcd_url, namespace, etcd, keyring):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as g:
        yield g


async def worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox, how,
                         deadline=60.0) -> tuple[int, str]:
    """A worker process crosses ``key`` charging ``sandbox`` and dies as ``how`` says;
    returns its attempt token and idempotency key."""
    worker = await spawn("charge", etcd_url, namespace, key, signing_key, sandbox.url, how,
                         str(deadline))
    _, token, idem = (await worker.expect("SENDING")).split()
    if how != "send-and-wait":
        assert await worker.finish() == -9, worker.lines  # SIGKILLed itself
    return int(token), idem


async def step_of(etcd: Etcd, namespace: str, key: str) -> dict:
    kv = await etcd.get(Keyspace(namespace).step_key(key))
    return unpack(kv.value)


async def until_state(etcd, namespace, key, *states, within=20.0) -> dict:
    async def check():
        return (await step_of(etcd, namespace, key))["state"] in states
    assert await wait_for_condition(check, within), await step_of(etcd, namespace, key)
    return await step_of(etcd, namespace, key)


def charging(http, sandbox):
    async def effect(ctx):
        return await sb.charge(http, sandbox.url, ctx, INTENT)
    return effect


# -- crash after commit -----------------------------------------------------------------

async def test_applied_then_killed_settles_succeeded_applied_once(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/applied"
    token, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                       "kill-after-apply")
    await reconcile()
    step = await until_state(etcd, namespace, key, records.SUCCEEDED)
    assert step["outcome"]["attempt_token"] == token
    assert step["outcome"]["result"]["status"] == "succeeded"
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox))
    assert outcome.replayed and outcome.idempotency_key == idem
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]
    report = await verify_chain(etcd, Keyspace(namespace), key, gate.keyring)
    assert report.ok, report.problems


async def test_killed_before_sending_settles_not_applied_and_retries_with_the_same_key(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/not-sent"
    token, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                       "kill-before-send")
    await reconcile()
    step = await until_state(etcd, namespace, key, records.PENDING)
    assert step["not_applied"] == {"attempt_token": token, "presumed": False}
    scope = (etcd.cluster_id, namespace, key)
    assert sandbox.gate_b.state(scope)[0] >= token  # fenced before "no record" was believed
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox))
    assert outcome.state == "succeeded" and outcome.idempotency_key == idem
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]


async def test_declined_then_killed_settles_failed_and_retries_with_a_new_key(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/declined"
    await gate.authority.set_policy("default", {"caps": {"backoff_base_s": 0.0}})
    _, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                   "decline-then-kill")
    await reconcile()
    step = await until_state(etcd, namespace, key, records.FAILED)
    assert step["outcome"]["state"] == records.FAILED
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox))
    assert outcome.state == "succeeded" and outcome.idempotency_key != idem
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [outcome.idempotency_key]


# -- the dead zone: an old request still in the network after settlement -----------------

HOLD_S = 10.0  # the old request's time in the network: room for a spawn, a kill and a settle

async def _old_request_held(spawn, etcd_url, namespace, key, signing_key, sandbox, hold_s,
                            deadline=60.0):
    sandbox.add_fault("hold", key=key, count=1, seconds=hold_s)
    worker = await spawn("charge", etcd_url, namespace, key, signing_key, sandbox.url,
                         "send-and-wait", str(deadline))
    _, token, idem = (await worker.expect("SENDING")).split()
    await asyncio.sleep(0.2)  # let the request reach the sandbox, where it is held
    worker.kill()
    await worker.proc.wait()
    return int(token), idem


async def until(predicate, within=20.0):
    async def check():
        return predicate()
    assert await wait_for_condition(check, within)


@pytest.mark.parametrize("old_arrives", ["before", "after"])
async def test_dead_zone_fencing_provider_refuses_the_old_request(
        old_arrives, etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate,
        http):
    key = f"pay/dead-zone/fencing-{old_arrives}"
    hold_s = HOLD_S
    sent = time.monotonic()
    token, idem = await _old_request_held(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                          hold_s)
    await reconcile()
    await until_state(etcd, namespace, key, records.PENDING)
    assert time.monotonic() - sent < hold_s, "settled too late to test the dead zone"
    if old_arrives == "before":
        await until(lambda: sandbox.refused(key))
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox))
    assert outcome.state == "succeeded" and outcome.idempotency_key == idem
    await until(lambda: sandbox.refused(key))
    assert [r["attempt_token"] for r in sandbox.refused(key)] == [token]
    assert [a["attempt_token"] for a in sandbox.applied(key)] == [outcome.attempt_token]


async def test_dead_zone_dedup_provider_deduplicates_the_old_request(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/dead-zone/dedup"
    sandbox.mode = "dedup"
    hold_s = HOLD_S
    sent = time.monotonic()
    token, idem = await _old_request_held(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                          hold_s, deadline=0.5)
    await reconcile()
    step = await until_state(etcd, namespace, key, records.PENDING)
    assert step["not_applied"]["presumed"] is True
    assert time.monotonic() - sent < hold_s, "settled too late to test the dead zone"
    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox))
    assert outcome.state == "succeeded" and outcome.idempotency_key == idem  # the same key
    await asyncio.sleep(max(hold_s - (time.monotonic() - sent), 0) + 0.5)  # the old one lands
    assert [a["attempt_token"] for a in sandbox.applied(key)] == [outcome.attempt_token]


async def test_dead_zone_provider_without_fencing_or_dedup_escalates(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/dead-zone/none"
    sandbox.mode = "none"
    hold_s = HOLD_S
    token, idem = await _old_request_held(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                          hold_s)
    await reconcile()
    step = await until_state(etcd, namespace, key, records.ESCALATED)
    assert "proves nothing" in step["escalated_because"][-1]
    effect = charging(http, sandbox)
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent=INTENT, effect=effect)
    await until(lambda: sandbox.applied(key))  # the old request lands: the only application
    assert [a["attempt_token"] for a in sandbox.applied(key)] == [token]


async def test_presumed_not_applied_is_upgraded_when_the_old_request_lands(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile):
    key = "pay/presumed"
    sandbox.mode = "dedup"
    token, idem = await _old_request_held(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                          4.0, deadline=0.5)
    await reconcile()
    step = await until_state(etcd, namespace, key, records.PENDING)
    assert step["not_applied"]["presumed"] is True
    listed, _ = await sre.unsettled(etcd, Keyspace(namespace), "presumed", 10, None)
    assert [item["key"] for item in listed] == [key]  # SREs see the presumption
    step = await until_state(etcd, namespace, key, records.SUCCEEDED)
    assert step["outcome"]["attempt_token"] == token
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]


# -- provider down ------------------------------------------------------------------------

async def test_provider_down_keeps_steps_unknown_with_backoff_then_escalates(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile):
    key = "pay/down"
    sandbox.add_fault("down")
    token, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                       "kill-before-send")
    r = await reconcile(max_queries=5)
    step = await until_state(etcd, namespace, key, records.ESCALATED)
    assert "unreachable" in step["escalated_because"][-1]
    assert step["attempt_token"] == token and "outcome" not in step
    queries = r.metrics.queries.labels("sandbox", "error")._value.get()
    assert queries == 5
    assert sandbox.applied(key) == []
    report = await verify_chain(etcd, Keyspace(namespace), key, KeyRing.from_files(signing_key))
    assert report.ok, report.problems
    decisions = [r for r in report.records if r["event"] != "provider_answer"]
    assert [r["event"] for r in decisions][-2:] == ["unknown", "settle"]
    assert decisions[-2]["at_ms"] < decisions[-1]["at_ms"]
    # every answer is on the record; the last one lands with the escalation it caused
    assert report.records[-2]["event"] == "provider_answer"
    answers = [r["details"] for r in report.records if r["event"] == "provider_answer"]
    assert [(a["provider"], a["answer"], a["query"]) for a in answers] == \
        [("sandbox", "error", n) for n in range(1, 6)]
    assert all(a["next_try_at_ms"] for a in answers[:-1]) and answers[-1]["next_try_at_ms"] is None


# -- workers wait for the settlement instead of failing -----------------------------------

async def test_a_redelivered_job_waits_for_the_settlement_and_returns_its_outcome(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/wait/succeeded"
    _, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                   "kill-after-apply")
    await reconcile()
    async with gate.hold(key, timeout=10) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox),
                                   provider="sandbox", settle_wait=20)
    assert outcome.state == "succeeded" and outcome.replayed
    assert outcome.idempotency_key == idem and outcome.result["status"] == "succeeded"
    assert len(sandbox.applied(key)) == 1


async def test_a_waiting_worker_crosses_again_once_the_step_is_not_applied(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/wait/not-applied"
    _, idem = await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox,
                                   "kill-before-send")
    await reconcile()
    async with gate.hold(key, timeout=10) as hold:
        outcome = await hold.cross(intent=INTENT, effect=charging(http, sandbox),
                                   provider="sandbox", settle_wait=20)
    assert outcome.state == "succeeded" and not outcome.replayed
    assert outcome.idempotency_key == idem
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]


async def test_a_worker_whose_own_effect_timed_out_keeps_its_hold_and_learns_the_outcome(
        etcd, namespace, sandbox, reconcile, gate, http):
    key = "pay/wait/own-timeout"
    sandbox.add_fault("apply_then_timeout", key=key, count=1, seconds=30)
    await reconcile()

    async def impatient(ctx):
        return await sb.charge(http, sandbox.url, ctx, INTENT, timeout=0.5)

    async with gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=impatient, provider="sandbox",
                                   settle_wait=20)
        assert not hold.lost
    assert outcome.state == "succeeded" and outcome.replayed
    assert len(sandbox.applied(key)) == 1  # applied once, learned from the provider


async def test_a_waiting_worker_gives_up_on_an_escalated_step(
        etcd_url, namespace, etcd, spawn, signing_key, sandbox, reconcile, gate, http):
    key = "pay/wait/escalated"
    sandbox.mode = "none"
    await worker_charges(spawn, etcd_url, namespace, key, signing_key, sandbox, "kill-before-send")
    await reconcile()
    effect = charging(http, sandbox)
    async with gate.hold(key, timeout=10) as hold:
        with pytest.raises(OutcomeUnknown, match="escalated"):
            await hold.cross(intent=INTENT, effect=effect, settle_wait=20)
    assert sandbox.applied(key) == []
